"""The compiled model against the eager one on the CPU (tests/test_compiled.py's rehearsal says why): one graph across
window and YaRN changes, and FlexAttention's compiled forward against the dense model. A file of its own, so that a
second test worker takes it beside the rehearsal."""

import pytest
import torch

import train_gpt as T
import test_compiled
from test_compiled import model_graphs

pytestmark = test_compiled.pytestmark
_fresh_dynamo_after = test_compiled._fresh_dynamo_after  # the fixture, here too

CFG = T.parse_config(["--preset=tiny", "--num_heads=4", "--head_dim=32", "--fp8_mlp=true"])
WINDOWS = torch.tensor([[1, 0], [2, 1], [3, 1]], dtype=torch.int32)  # (long, short) per call


def model_and_compiled_twin(twin_flex: bool) -> tuple[T.GPT, T.GPT, torch.nn.Module]:
    """A dense-attention model with every parameter off its init, a twin with the same weights (FlexAttention or
    dense) and the twin compiled with fullgraph, on a fresh dynamo cache."""
    torch.manual_seed(0)
    model = T.GPT(CFG, use_flex=False, fp8_head=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.quantize_mlp_(bootstrap_down=True)  # the FP8 MLP's weights, as after a step
    twin = T.GPT(CFG, use_flex=twin_flex, fp8_head=True)
    twin.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    return model, twin, torch.compile(twin, dynamic=False, fullgraph=True)


def sample_tokens(seed: int) -> torch.Tensor:
    tokens = torch.randint(0, 50000, (CFG.train_seq_len + 1,), generator=torch.Generator().manual_seed(seed))
    tokens[[0, 100, 300, 301]] = T.BOS_ID  # documents that cross block edges, one of a single token
    return tokens


def test_compiled_model_equals_eager_across_windows_and_yarn_with_one_graph():
    eager, twin, compiled = model_and_compiled_twin(twin_flex=False)
    tokens = sample_tokens(1)
    for i, windows in enumerate(WINDOWS):
        for model in (eager, twin):  # YaRN at each window change rewrites RoPE's tables and q's gain in place
            model.apply_yarn(tuple(int(w) for w in WINDOWS[: i + 1, 0]))
            model.tie_embedding(i < 2)  # the embedding unties in place (a device flag) at the last window
        knobs = (windows, torch.tensor([1.0, 0.5, 0.25 * (2 - i)]))  # multi-token weights, a device row per step
        for model in (eager, compiled):
            model.zero_grad()
            model(tokens[:-1], tokens[1:].long(), *knobs).backward()
        # Fused kernels round bf16 intermediates once where eager rounds after each op: the loss agrees to
        # ~1e-4 (the FP8 MLP's e4m3 inputs flip with them), each matrix's gradient to ~1-2% (the e5m2 head gradient
        # included).
        loss_e = eager(tokens[:-1], tokens[1:].long(), *knobs)
        loss_c = compiled(tokens[:-1], tokens[1:].long(), *knobs)
        assert loss_c.item() == pytest.approx(loss_e.item(), rel=3e-4)
        for (name, a), b in zip(twin.named_parameters(), eager.parameters()):
            if not name.endswith(("scalars", "lambdas", "_mudd_gate_scale")):  # sums of cancelling terms (the gates'
                # shared scale: over every gate of every token): relative error means little there. The smear's
                # one-row gate and the MUDD MLPs (the gate network's too) sum over every position too, through the
                # FP8 head's e5m2 gradient: 20% (measured up to 10.5% with bf16 activations).
                # The gate network's biases: 26% measured, from the x0 gates' slots, each a sum over every token and
                # channel of the gradient times x0 (#89's x0 lambdas, excluded above, were the same sum).
                tol = 0.35 if name == "mudd_gate_b2" else 0.2 if name.startswith(("smear_gate", "mudd_")) else 0.05
                assert (a.grad.float() - b.grad.float()).norm() <= tol * b.grad.float().norm(), name  # tied: 0
    assert model_graphs() == 1  # windows, YaRN, MTP weights, the tie: tensors, no recompile (eval: the run's test)


def test_compiled_flex_model_forward_equals_the_dense_model_in_one_graph_per_mode():
    # The CUDA model builds BlockMasks inside its compiled graph; on the CPU that graph runs forward only
    # (no flex backward), which is enough to see that it compiles whole and computes the dense model's loss
    # (with the paired-head layer's third block mask, over the interleaved 2T positions).
    dense, flex, compiled = model_and_compiled_twin(twin_flex=True)
    tokens = sample_tokens(2)
    with torch.no_grad():
        for training in (True, False):
            dense.train(training)
            flex.train(training)
            for windows in WINDOWS:
                args = tokens[:-1], tokens[1:].long(), windows
                # (the FP8 MLP's e4m3 inputs flip with fused bf16 rounding: ~2e-4 measured)
                assert compiled(*args).item() == pytest.approx(dense(*args).item(), rel=4e-4)
    assert model_graphs() == 2
