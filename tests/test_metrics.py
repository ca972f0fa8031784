"""Sync-free train metrics (class Metrics), the JSONL step log and the run summary."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import threading
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import train_gpt as T
from conftest import REPO, SMALL, free_port, tiny_args

SUMMARY_KEYS = {"run_id", "final_val_loss", "train_time_ms", "steps", "step_avg_ms", "tokens_per_s",
                "peak_memory_allocated_mib", "peak_memory_reserved_mib", "world_size", "gpu_names", "torch_version",
                "cuda_version", "git_commit", "seed", "config", "val_losses"}


def load_compare():
    """tools/compare.py, imported the way tests/test_records.py does."""
    if str(REPO / "tools") not in sys.path:
        sys.path.insert(0, str(REPO / "tools"))
    import compare
    return compare


def count_gathers(counter: dict[str, int]) -> None:
    """Wrap (in a spawned process) the all-gather entry points of torch.distributed, counting calls."""
    for name in ("all_gather_single", "all_gather_into_tensor"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapped(*args, _original=original, **kwargs):
            counter["gather"] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, wrapped)


# -- one collective per logging step ------------------------------------------------------------------

def _gather_rank(rank: int, world_size: int, ports: tuple[int, int], args: list[str], out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(ports[0]))
    torch.set_num_threads(1)
    counter = {"gather": 0}
    count_gathers(counter)

    # A 4-step training run logging every 2 steps: exactly one all-gather per logging step.
    T.run(args)
    gathers_in_training = counter["gather"]

    # The packed gather against one all-reduce per metric and reduction.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank, world_size=world_size)
    gen = torch.Generator().manual_seed(100 + rank)
    local = torch.randn(len(T.Metrics.RANK_STATS), generator=gen, dtype=torch.float64) * 10
    counter["gather"] = 0
    packed = T.Metrics.reduce_ranks(local, world_size)
    gathers_in_reduce = counter["gather"]
    separate = torch.empty_like(packed)
    for i in range(local.numel()):
        for row, op in ((1, dist.ReduceOp.SUM), (2, dist.ReduceOp.MIN), (3, dist.ReduceOp.MAX)):
            x = local[i].clone()
            dist.all_reduce(x, op=op)
            separate[row, i] = x
        separate[0, i] = separate[1, i] / world_size
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps({"packed": packed.tolist(), "separate": separate.tolist(),
                                         "gathers_in_training": gathers_in_training,
                                         "gathers_in_reduce": gathers_in_reduce}))


@pytest.mark.slow
def test_packed_gather_matches_separate_all_reduces_and_runs_once_per_logging_step(tmp_path):
    # The spawned world also profiles two steps: each rank writes its own trace (no collective of its own).
    args = tiny_args(tmp_path, num_steps=4, val_every=0, log_every=2, profile="0:2", run_id="gather", **SMALL)
    out = tmp_path / "gather.json"
    mp.spawn(_gather_rank, args=(2, (free_port(), free_port()), args, str(out)), nprocs=2, join=True)
    result = json.loads(out.read_text())
    assert result["gathers_in_reduce"] == 1
    # The sharded optimizer all-gathers each bucket once per step (the tied embedding's none); beyond those, steps 2
    # and 4 (logging) gather once each and steps 1 and 3 not at all.
    log = next((tmp_path / "logs").glob("*.txt")).read_text()
    buckets = int(re.search(r"\(2 ranks, (\d+) buckets\)", log).group(1))
    tied = sum(T.schedule(k, T.parse_config(args)).tied for k in range(4))  # steps the embedding's bucket sits out
    assert tied == 4 and result["gathers_in_training"] == 4 * buckets - tied + 2
    assert torch.allclose(torch.tensor(result["packed"]), torch.tensor(result["separate"]), rtol=1e-12, atol=0)
    sys.path.insert(0, str(REPO / "tools"))
    import trace_report
    for r in range(2):
        trace = trace_report.load_trace(tmp_path / "logs" / "gather" / f"trace_rank{r}.json.gz")
        assert sorted(trace_report.cpu_step_spans(trace)) == [0, 1]


def test_world_size_one_uses_no_collective(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("no collective at world size 1")

    for name in ("all_gather_single", "all_gather_into_tensor", "all_reduce"):
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, forbidden)
    local = torch.arange(len(T.Metrics.RANK_STATS), dtype=torch.float64)
    stats = T.Metrics.reduce_ranks(local, 1)
    assert stats.shape == (len(T.Metrics.STATS), local.numel())
    assert all(torch.equal(row, local) for row in stats)


# -- logging never changes training -------------------------------------------------------------------

def test_log_every_does_not_change_training(tmp_path):
    runs = {n: T.run(tiny_args(tmp_path, num_steps=12, val_every=6, log_every=n, run_id=f"every{n}", **SMALL))
            for n in (1, 10)}
    assert runs[1].val_losses == runs[10].val_losses
    for a, b in zip(runs[1].model.parameters(), runs[10].model.parameters()):
        assert torch.equal(a, b)
    compare = load_compare()
    for n, logged in ((1, list(range(1, 13))), (10, [10, 12])):
        text = (tmp_path / "logs" / f"every{n}.txt").read_text().split(T.SEPARATOR)[-1]
        lines = [compare.parse_step_line(x) for x in text.splitlines() if x.startswith("step:")]
        assert [s.step for s in lines if s.train_loss is not None] == logged
    # log_every=1 prints each step's own mean loss; log_every=10's line at step 10 is the mean of steps 1..10.
    per_step = [json.loads(x) for x in (tmp_path / "logs" / "every1.jsonl").read_text().splitlines()]
    per_ten = [json.loads(x) for x in (tmp_path / "logs" / "every10.jsonl").read_text().splitlines()]
    losses = {e["step"]: e["train_loss"] for e in per_step if "train_loss" in e}
    ten = next(e for e in per_ten if e.get("train_loss") is not None and e["step"] == 10)
    assert ten["train_loss"] == pytest.approx(sum(losses[s] for s in range(1, 11)) / 10, rel=1e-9)
    assert ten["steps"] == 10 and ten["tokens"] == 10 * 2 * 128


# -- no host sync between logging steps ----------------------------------------------------------------

# Tensor calls that copy device data to the host (and so wait for the device on a GPU).
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


def test_no_host_sync_on_non_logging_steps(tmp_path, monkeypatch):
    state = {"active": False, "excluded": False, "calls": [], "all_calls": 0, "quiet_steps": 0}

    def counting(name, original):
        def wrapped(self, *args, **kwargs):
            state["all_calls"] += 1
            if state["active"] and not state["excluded"] and threading.current_thread() is threading.main_thread():
                state["calls"].append(name)
            return original(self, *args, **kwargs)
        return wrapped

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))

    # The window opens when a non-logging step begins and closes after that step's end_step returns,
    # so it covers the loader, forward/backward, the optimizer and the per-step metrics path.
    begin, end = T.Metrics.begin_step, T.Metrics.end_step

    def begin_step(self, step):
        state["active"] = not self.logs_at(step)
        state["quiet_steps"] += state["active"]
        return begin(self, step)

    def end_step(self, *args, **kwargs):
        try:
            return end(self, *args, **kwargs)
        finally:
            state["active"] = False

    monkeypatch.setattr(T.Metrics, "begin_step", begin_step)
    monkeypatch.setattr(T.Metrics, "end_step", end_step)

    # The data loader's host-side work is excluded explicitly: cutting shards into host buffers (on the
    # prefetch thread, or in the main thread with --prefetch_depth=0) reads no device memory, whatever
    # Tensor calls it makes on host tensors.
    fill = T.TrainBatches.fill

    def loader_fill(self, out):
        state["excluded"] = threading.current_thread() is threading.main_thread()
        try:
            return fill(self, out)
        finally:
            state["excluded"] = False

    monkeypatch.setattr(T.TrainBatches, "fill", loader_fill)
    # sqrt32's correctly rounded sqrt goes through numpy on the CPU only (torch's on a GPU): no device read.
    sqrt32 = T.sqrt32

    def cpu_sqrt32(x):
        state["excluded"] = x.device.type == "cpu"
        try:
            return sqrt32(x)
        finally:
            state["excluded"] = False

    monkeypatch.setattr(T, "sqrt32", cpu_sqrt32)

    T.run(tiny_args(tmp_path, num_steps=6, val_every=0, log_every=3, **SMALL))
    assert state["quiet_steps"] == 4  # steps 1, 2, 4, 5
    assert state["calls"] == []
    assert state["all_calls"] > 0  # the counters work: validation reads its loss with .item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_cuda_sync_on_steady_state_non_logging_steps(tmp_path, monkeypatch):
    begin, end = T.Metrics.begin_step, T.Metrics.end_step
    checked = []

    def begin_step(self, step):
        begin(self, step)
        if step > 3 and not self.logs_at(step):  # steady state: past the first steps' allocations
            checked.append(step)
            torch.cuda.set_sync_debug_mode("error")

    def end_step(self, *args, **kwargs):
        try:
            return end(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(T.Metrics, "begin_step", begin_step)
    monkeypatch.setattr(T.Metrics, "end_step", end_step)
    T.run(tiny_args(tmp_path, num_steps=12, val_every=0, log_every=5, warmup_steps=2, device="cuda", **SMALL))
    assert checked == [4, 6, 7, 8, 9, 11]


# -- step lines, JSONL and summary ---------------------------------------------------------------------

def test_run_writes_step_lines_jsonl_and_summary(tmp_path):
    result = T.run(tiny_args(tmp_path, num_steps=4, val_every=2, log_every=1, peak_tflops=1.0, run_id="r1",
                             **SMALL))
    logs = tmp_path / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["r1.json", "r1.jsonl", "r1.txt"]  # no temp file left

    text = (logs / "r1.txt").read_text().split(T.SEPARATOR)[-1]
    train_lines = [x for x in text.splitlines() if x.startswith("step:") and "train_loss:" in x]
    assert len(train_lines) == 4
    for line in train_lines:
        assert " tok/s:" in line and " mfu:" in line and "% eta:" in line and " step_avg:" in line
    assert "step:2/4 val_loss:" in text

    entries = [json.loads(x) for x in (logs / "r1.jsonl").read_text().splitlines()]
    assert [(e["step"], "val_loss" in e) for e in entries] == [
        (0, True), (1, False), (2, False), (2, True), (3, False), (4, False), (4, True)]
    cfg = T.parse_config(tiny_args(tmp_path, num_steps=4, **SMALL))
    model = T.GPT(cfg, use_flex=False, fp8_head=False)
    for e in entries:
        if "train_loss" in e:
            # the summed loss: weights 1 and 0.5 (mtp_start) and the prefix token's 0.25, each CE below 11.5
            assert 0 < e["train_loss"] < 11.5 * 1.75 and e["tokens"] == 256 and e["tokens_per_s"] > 0
            s = T.schedule(e["step"] - 1, cfg)  # the logged step trained with the schedule of step - 1 (0-based)
            assert e["window_tokens"] == s.long_window * cfg.block_size and e["lr_mult"] == s.lr_mult
            flops = T.flops_per_token(model, s)
            assert e["mfu_pct"] == pytest.approx(100 * flops * e["tokens_per_s"] / 1e12)
            assert e["train_loss_rank_min"] == e["train_loss_rank_max"] == pytest.approx(e["train_loss"])
    assert [e["val_loss"] for e in entries if "val_loss" in e] == [loss for _, loss in result.val_losses]

    summary = json.loads((logs / "r1.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary == result.summary
    assert summary["run_id"] == "r1" and summary["steps"] == 4 and summary["world_size"] == 1
    assert summary["final_val_loss"] == result.val_losses[-1][1]
    assert [(s, v) for s, v, _ in summary["val_losses"]] == result.val_losses
    assert summary["val_losses"][-1][2] == summary["train_time_ms"] == result.train_time_ms
    assert summary["gpu_names"] == [] and summary["seed"] == 1 and summary["config"]["log_every"] == 1
    assert summary["torch_version"] == torch.__version__
    # The checkout's HEAD, as git names it here; None only where this is no git checkout (or git is missing).
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True) \
        if shutil.which("git") else None
    assert summary["git_commit"] == (head.stdout.strip() if head is not None and head.returncode == 0 else None)

    run = load_compare().load_run(logs / "r1.txt")
    assert run.has_summary and run.final_val_loss == summary["final_val_loss"] and run.tokens_per_s > 0


def test_git_commit_is_none_outside_a_checkout(tmp_path):
    assert T.git_commit(tmp_path) is None
    assert T.git_commit(tmp_path / "missing") is None


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_commit_is_the_checkouts_head(tmp_path):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f").write_text("x")
    subprocess.run([*git, "add", "f"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "c"], cwd=tmp_path, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert len(head.stdout.strip()) == 40 and T.git_commit(tmp_path) == head.stdout.strip()
    (tmp_path / "sub").mkdir()  # any folder inside the checkout names the same commit
    assert T.git_commit(tmp_path / "sub") == head.stdout.strip()


# -- pieces ---------------------------------------------------------------------------------------------

def test_flop_model_counts_the_models_own_matmul_weights_and_windows():
    cfg = T.parse_config(["--preset=tiny", "--paired_layers="])  # paired layers: test_recipe_model.py
    model = T.GPT(cfg, use_flex=False, fp8_head=False)
    named = dict(model.named_parameters())
    counted = sum(p.numel() for n, p in named.items()
                  if n.endswith("_bank") or n.startswith(("mudd_w", "mudd_gate_w", "lm_head", "smear_gate")))
    assert T.matmul_weights(model) == counted  # the banks, the gates, the MUDD MLPs, the head; no table, no scalar
    # Windows covering the whole sequence on every attention layer: T_eff = (T + 1) / 2.
    full = cfg.train_seq_len // cfg.block_size
    whole = T.StepSchedule(1.0, 0.9, long_window=full, short_window=full, adam_step=True, seq_len=cfg.train_seq_len,
                           micro_len=cfg.train_seq_len,
                           max_doc_len=2048, yarn_windows=(full,), mtp_weights=(1.0,), prefix_weight=0.0, tied=True)
    attn_layers = sum(c != "-" for c in cfg.attn_pattern)
    dc = 12 * cfg.num_heads * cfg.head_dim * T.mean_keys_per_query(T.DC_WINDOW, cfg.train_seq_len)  # the last layer's
    expected = 6 * counted + 12 * cfg.num_heads * cfg.head_dim * attn_layers * (cfg.train_seq_len + 1) / 2 + dc
    assert T.flops_per_token(model, whole) == pytest.approx(expected)
    assert T.mean_keys_per_query(1, 10) == 1 and T.mean_keys_per_query(2, 4) == pytest.approx(7 / 4)
    # One block for every layer (short windows 0 and 1 both mean the diagonal block).
    one = 6 * counted + 12 * cfg.num_heads * cfg.head_dim * attn_layers * T.mean_keys_per_query(cfg.block_size,
                                                                                                 cfg.train_seq_len) + dc
    one_block = dataclasses.replace(whole, long_window=1, short_window=0)
    assert T.flops_per_token(model, one_block) == pytest.approx(one)
    # A change to the model is counted without a second edit: a wider MLP adds its weights' 6 FLOPs each.
    wider = T.GPT(T.parse_config(["--preset=tiny", "--paired_layers=", "--mlp_ratio=8"]), use_flex=False,
                  fp8_head=False)
    extra = 2 * cfg.num_layers * cfg.model_dim * 4 * cfg.model_dim
    assert T.flops_per_token(wider, whole) == pytest.approx(expected + 6 * extra)


def test_peak_flops_table_and_override():
    assert T.peak_tflops_for("NVIDIA H100 80GB HBM3") == 989
    assert T.peak_tflops_for("NVIDIA H100 PCIe") == 756
    assert T.peak_tflops_for("NVIDIA H200") == 989
    assert T.peak_tflops_for("NVIDIA A100-SXM4-80GB") == 312
    assert T.peak_tflops_for("NVIDIA L40S") == 362 and T.peak_tflops_for("NVIDIA L4") == 121
    assert T.peak_tflops_for("Some Future GPU") is None
    assert T.peak_flops(torch.device("cpu")) is None
    assert T.peak_flops(torch.device("cpu"), 100.0) == 1e14


def test_format_eta_and_log_every_validation():
    assert T.format_eta(0) == "0m00s" and T.format_eta(83.4) == "1m23s" and T.format_eta(3725) == "1h02m05s"
    with pytest.raises(T.UsageError, match="--log_every must be > 0"):
        T.validate_config(T.parse_config(["--log_every=0"]), 1)


def test_print0_prints_on_rank_0_only(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    T.print0("hidden")
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    T.print0("visible")
    assert capsys.readouterr().out == "visible\n"
