"""The GPU path rehearsed on the CPU: the training loop drives the compiled model (fullgraph, as on a GPU) with
the FP8 head's custom ops, the compiled Polar Express and the warmup, across attention-window changes. Only
the attention kernel differs (dense SDPA: FlexAttention has no CPU backward). This is where a wrong fake
kernel, a graph break or a recompile shows up without a GPU."""

import json
import re
from collections.abc import Callable

import pytest
import torch
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

import gpt_kernels as K
import train_gpt as T
from conftest import stage_flags, tiny_args

pytestmark = pytest.mark.slow  # inductor compiles on the CPU: about a minute each on a cold cache

# Sequences of 256 and then 512 tokens in 128-token blocks over three stages of the 6 steps (one training graph
# per length, each compiled in the warmup): the long window grows 1 -> 2 -> 3 blocks, the short window 0 -> 1 (window
# 0 is the case the CPU flex kernel crashed on); the multi-token weights fall and YaRN rescales at each change. Two
# micro-steps per step: the graphs are the same as with eight, at a quarter of the compute.
REHEARSAL = dict(compile="true", fp8_head="true", fp8_mlp="true", train_seq_len=512,
                 **stage_flags((256, 2048, "0/1", 1, "1/0.5/0.25", "1/0.5/0", 0.25, 0.25),
                               (512, 2048, "1/2", 1.5, "1/0.5", "1/0", 0.25, 0), (512, 2048, "1/3", 1.7, 1, 1, 0, 0),
                               (512, 2048, "1/3", 1.7, 1, 1, 0, 0)),
                 num_steps=6, global_batch_seqs=2, val_every=3, warmup_steps=1, val_tokens=2048)


@pytest.fixture(autouse=True)
def _fresh_dynamo_after():
    """Compiled variants (the FP8 op bodies' too) stay cached per process: leave none behind for later tests,
    which count their own against dynamo's recompile limit."""
    yield
    torch._dynamo.reset()


def model_graphs() -> int:
    """Compiled variants of GPT.forward so far: with fullgraph, each is one whole graph."""
    return len(_debug_get_cache_entry_list(T.GPT.forward.__code__))


def measured_after_warmup(monkeypatch, *measures: Callable[[], int]) -> list[list[int]]:
    """Per measure, a list to which each warmup the run does (T.warmup) appends the measure's value after it."""
    warmup, values = T.warmup, [[] for _ in measures]

    def counted_warmup(*args, **kwargs):
        warmup(*args, **kwargs)
        for measure, seen in zip(measures, values):
            seen.append(measure())

    monkeypatch.setattr(T, "warmup", counted_warmup)
    return values


def train_losses(tmp_path, run_id: str) -> list[float]:
    lines = (tmp_path / "logs" / f"{run_id}.jsonl").read_text().splitlines()
    return [e["train_loss"] for e in map(json.loads, lines) if "train_loss" in e]


def test_windows_of_the_rehearsal_cross_zero(tmp_path):
    cfg = T.parse_config(tiny_args(tmp_path, **REHEARSAL))
    steps = [T.schedule(s, cfg) for s in range(cfg.num_steps)]
    assert [s.long_window for s in steps] == [1, 1, 2, 2, 3, 3]
    assert [s.short_window for s in steps] == [0, 0, 1, 1, 1, 1]


# The tiny preset's model (#89's eleven layers' roles in five: a paired layer, the skip, the attention input layer,
# MUDD), compiled. Four heads: the paired layer attends as two (with one, CPU inductor fuses the kernel's output into
# the next op, which its CPU FlexAttention template does not support; the recipe pairs six heads into three).
def test_compiled_fp8_training_compiles_each_length_in_the_warmup_only_and_follows_eager(tmp_path, monkeypatch):
    graphs_after_warmup, adam_graphs_after_warmup = measured_after_warmup(
        monkeypatch, model_graphs, lambda: len(_debug_get_cache_entry_list(T.adam_step_.__code__)))
    # A limit below the plan's graphs (as dynamo's default 8 is below an 8-length plan's 9): the run raises it.
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    torch._dynamo.reset()
    compiled = T.run(tiny_args(tmp_path, run_id="compiled", **REHEARSAL))
    assert graphs_after_warmup == [2]  # one training graph per sequence length, all before the clock
    log = (tmp_path / "logs" / "compiled.txt").read_text()
    assert "fp8 head True, fp8 mlp True, compile True" in log and "warmup: snapshot" in log
    line = re.search(r"^compile: graphs per function: (.*) \(recompile limit", log, re.M).group(1)
    planned = {k: int(v) for k, v in (part.rsplit(" ", 1) for part in line.split(", "))}
    # + the eval graph; windows, YaRN, the multi-token weights and the untie recompiled nothing
    assert model_graphs() == 3 == planned["model"]
    # the optimizer's: a graph per shard shape (Adam's per shape, dtype and betas)
    functions = {"orthogonalize": T.momentum_polar_express, "normuon": T.normuon_,
                 "cautious update": T.cautious_update_, "adam": T.adam_step_}
    for name, fn in functions.items():
        assert len(_debug_get_cache_entry_list(fn.__code__)) == planned[name] >= 2, name
    assert adam_graphs_after_warmup == [planned["adam"]]  # the warmup's Adam step built them all, before the clock
    assert compiled.val_losses[-1][1] < compiled.val_losses[0][1] - 1.0  # it learns

    monkeypatch.undo()  # dynamo's own limit for the eager run's compiled FP8 op bodies
    eager = T.run(tiny_args(tmp_path, run_id="eager", **{**REHEARSAL, "compile": "false"}))
    assert [s for s, _ in compiled.val_losses] == [s for s, _ in eager.val_losses] == [0, 3, 6]
    ours, theirs = train_losses(tmp_path, "compiled"), train_losses(tmp_path, "eager")
    assert len(ours) == len(theirs) == 6
    # The first updates agree closely; then the early, large-lr steps amplify the ~1% gradient differences
    # of fused rounding (eager runs that differ only in summation order agree to ~1e-4; these drift ~0.1).
    assert ours[:2] == pytest.approx(theirs[:2], abs=5e-3)  # 2.1e-3 measured
    assert ours == pytest.approx(theirs, abs=0.15)
    for (_, a), (_, b) in zip(compiled.val_losses, eager.val_losses):
        assert a == pytest.approx(b, abs=0.15)


def test_fp8_ops_take_any_token_count_and_scales_in_two_graphs():
    # Ten token counts and ten scales, as a process running many tests meets them: static graphs would fail hard
    # at dynamo's limit (8); shapes turn dynamic at the first change, the scales are graph inputs.
    torch._dynamo.reset()
    w = torch.randn(128, 64).bfloat16()
    for i in range(10):
        x, g = torch.randn(16 * (i + 1), 64).bfloat16(), torch.randn(16 * (i + 1), 128).bfloat16()
        scales = K._scales((0.01 * (i + 1), 2**-9 * (i + 1), 1 / 448), x)
        assert torch.equal(K._fp8_matmul(x, w, *scales[:2]), K._fp8_matmul.__wrapped__(x, w, *scales[:2]))
        for a, b in zip(K._fp8_matmul_grads(g, x, w, *scales), K._fp8_matmul_grads.__wrapped__(g, x, w, *scales)):
            assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)
    for fn in (K._fp8_matmul, K._fp8_matmul_grads):
        assert len(_debug_get_cache_entry_list(fn.__wrapped__.__code__)) <= 2, fn.__name__


# Muon's blocks as the file shapes them: wide (Q/K head pairs), tall (the MLP's) and tall past the 1024-row split
# (its two roundings), each with per-matrix lr multipliers; Adam's shards in bf16 (no master) and fp32.
MUON_SHAPES = [(3, 16, 40), (2, 40, 16), (1, 1040, 8)]


def test_compiled_optimizer_steps_equal_eager_bit_for_bit():
    # Polar Express with its momentum, NorMuon, the cautious step and Adam compiled (fullgraph, as compile_ns runs
    # them) against the same functions eager, over three steps of changing lrs and momenta. Written one rounding per
    # op (train_gpt's optimizer section says why), they agree in every bit; each shape compiles one graph per
    # function, and a new momentum, lr or step recompiles none.
    torch._dynamo.reset()
    eager, compiled = T.update_steps(compiled=False, kernels=False), T.update_steps(compiled=True, kernels=False)
    g = torch.Generator().manual_seed(0)
    for shape in MUON_SHAPES:
        p0, grads = 0.1 * torch.randn(shape, generator=g), [torch.randn(shape, generator=g) for _ in range(3)]
        lr_mul = torch.tensor([1.0, 2.0, 1.0][: shape[0]], dtype=torch.float64).view(-1, 1, 1)
        runs = []
        for steps in (eager, compiled):
            p, state = p0.clone(), {"momentum": torch.zeros(shape), "v": torch.zeros(T.normuon_state_shape(shape))}
            for k, grad in enumerate(grads):
                T.muon_update_(p, grad, state, 0.02 * (1 + k), 0.85 + 0.05 * k, 0.9, lr_mul, 1.2, steps)
            runs.append([p, state["momentum"], state["v"]])
        for a, b in zip(*runs):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), shape
    for dtype in (torch.bfloat16, torch.float32):
        p0 = torch.randn(1000, generator=g).to(dtype)
        grads = [torch.randn(1000, generator=g).to(dtype) for _ in range(3)]
        runs = []
        for steps in (eager, compiled):
            p, m, v = p0.clone(), torch.zeros(1000), torch.zeros(1000)
            for t, grad in enumerate(grads, 1):
                T.adam_update_(p, grad, m, v, t, 0.01 * t, 0.9, 0.95, 1e-10, 0.75, steps)
            runs.append([p.float(), m, v])
        for a, b in zip(*runs):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), dtype
    for fn in (T.momentum_polar_express, T.normuon_, T.cautious_update_):
        assert len(_debug_get_cache_entry_list(fn.__code__)) == len(MUON_SHAPES), fn.__name__
    assert len(_debug_get_cache_entry_list(T.adam_step_.__code__)) == 2
