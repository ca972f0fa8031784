"""The GPU path at the recipe's real shapes, traced on fake tensors (nothing computed): every matmul, attention
call and custom-op activation of a training micro-step (forward and backward) and of a validation step is bf16,
as the records run them. The model's parameters are real (built on the CPU, ~1.5 GB at the recipe's shape); the tokens
are fake, so every activation is a fake tensor. Fake CPU tensors: the dense SDPA path stands in for FlexAttention
(no CPU backward), with the same input dtypes."""

import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import train_gpt as T
from conftest import MATMULS, REPO

sys.path.insert(0, str(REPO / "tools"))
import memory_estimate as M  # noqa: E402  (its recipe_config: the config a GPU run resolves, real shapes)

ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math",
             "scaled_dot_product_attention", "flex_attention"}
# The activation argument of each custom op (the weights may stay fp32: the ops cast them).
CUSTOM_X = {"fp8_mm": 0, "fp8_mm_backward": 0, "mlp_relu2_forward": 0, "softcap_ce": 0, "mlp_fp8_forward": 0,
            "mlp_backward": 0}


class InputDtypes(TorchDispatchMode):
    """For each op that multiplies activations, the dtypes it was given: every input of a matmul, q/k/v of
    attention, the activation of a custom op."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__ if isinstance(func, torch._ops.OpOverload) else str(func)
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        if name in MATMULS:
            self.seen.append((name, tuple(t.dtype for t in tensors)))
        elif name in ATTENTION:
            self.seen.append((name, tuple(t.dtype for t in tensors[:3])))
        elif func.namespace == "speedrun" and name in CUSTOM_X:
            self.seen.append((name, (tensors[CUSTOM_X[name]].dtype,)))
        return func(*args, **(kwargs or {}))

    def not_bf16(self) -> list[tuple[str, tuple[torch.dtype, ...]]]:
        return [(name, dtypes) for name, dtypes in self.seen if set(dtypes) != {torch.bfloat16}]


def traced_dtypes(cfg: T.Config) -> dict[str, InputDtypes]:
    """One training micro-step at the last stage's sequence length (forward and backward) and one validation
    step, on fake tokens: the dtypes each met."""
    model = T.GPT(cfg, use_flex=False, fp8_head=cfg.fp8_head)
    last = T.schedule_table(cfg)[-2]  # the last training step's schedule (the table ends with the final one)
    windows = torch.tensor([last.long_window, last.short_window], dtype=torch.int32)
    mtp = torch.tensor(last.mtp_weights)
    steps = {}
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        tokens = fake.from_tensor(torch.zeros(max(last.seq_len, cfg.val_seq_len) + 1, dtype=torch.int32))
        with InputDtypes() as steps["train"]:
            loss = model(tokens[:last.seq_len], tokens[1:last.seq_len + 1].long(), windows, mtp)
            loss.backward()
        model.eval()
        with torch.no_grad(), InputDtypes() as steps["validation"]:
            model(tokens[:cfg.val_seq_len], tokens[1:cfg.val_seq_len + 1].long(), windows)
    return steps


@pytest.mark.slow
@pytest.mark.parametrize("args", M.PRESETS.values(), ids=M.PRESETS.keys())
def test_every_matmul_attention_and_kernel_input_is_bf16_at_the_real_shape(args):
    cfg = M.recipe_config(args)
    steps = traced_dtypes(cfg)
    for step, ops in steps.items():
        assert len(ops.seen) > 20, (step, ops.seen)
        assert not ops.not_bf16(), (step, sorted(set(ops.not_bf16())))
    names = {name for ops in steps.values() for name, _ in ops.seen}
    if cfg.fused_head:
        assert {"mlp_relu2_forward", "softcap_ce", "mlp_fp8_forward", "mlp_backward"} <= names, names
    else:
        assert "fp8_mm" in names, names


@pytest.mark.parametrize("args,tables", [([], 2), (["--paired_layers="], 1)], ids=["recipe", "unpaired"])
def test_rope_tables_are_one_per_length_and_built_on_their_device(args, tables):
    cfg = T.parse_config(args)
    with torch.device("meta"):  # the real shapes, nothing allocated
        model = T.GPT(cfg, use_flex=False, fp8_head=False)
    rotaries = [r for r in (model.rotary, model.rotary_paired) if r is not None]
    assert len(rotaries) == tables  # the paired layers rotate 2T positions: a second length
    for rotary in rotaries:
        assert rotary.cos.size(0) in (cfg.val_seq_len, 2 * cfg.val_seq_len)

    class HostTensors(TorchDispatchMode):  # any tensor of more than head_dim elements made off the tables' device
        def __init__(self):
            super().__init__()
            self.made: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel() > cfg.head_dim:
                    self.made.append(f"{func} {tuple(t.shape)} on {t.device}")
            return out

    with HostTensors() as host:  # a YaRN stage change rewrites the tables
        model.apply_yarn((1, 3, 5))
    assert not host.made, host.made[:3]


@pytest.mark.parametrize("args", [[], ["--preset=tiny"], ["--attention=fa3"], ["--preset=tiny", "--attention=fa3"]],
                         ids=["recipe", "tiny", "recipe-fa3", "tiny-fa3"])
@pytest.mark.parametrize("world_size", [1, 8])
def test_each_compiled_function_of_a_full_run_needs_a_handful_of_graphs(args, world_size):
    # From the schedule and the optimizer's buckets at the real shapes (meta device): the model's graphs (one
    # per training length and validation's; with FA3 one per training plan, 4, and per validation's, 4 in the
    # recipe: every stage's, and the last one's windows), Muon's three functions (one per shard shape), Adam's (one
    # per shard shape, dtype and betas, as #89's per parameter), the FP8 ops.
    cfg = T.parse_config(args)
    with torch.device("meta"):
        model = T.GPT(cfg, use_flex=False, fp8_head=True)
    cfg.fp8_head = True
    graphs = T.compiled_graphs(cfg, T.ShardedMuonAdam(model, cfg, 0, world_size, compile_ns=False))
    print(args[:1], world_size, graphs)
    assert set(graphs) == {"model", "orthogonalize", "normuon", "cautious update", "adam", "fp8 ops"}
    assert graphs["model"] >= 2 and graphs["orthogonalize"] == graphs["normuon"] == graphs["cautious update"] >= 2
    # Within dynamo's default recompile_limit (8) but Adam (10 shard shapes): a compiled run raises the limit to the
    # largest count (build_model), which tests/test_compiled.py checks against the graphs a run builds.
    assert max(n for k, n in graphs.items() if k != "adam") <= 8 and graphs["adam"] <= 12, graphs
