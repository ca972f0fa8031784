"""Profiling and benchmark: trace analysis on synthetic traces, --profile/--bench on tiny CPU runs,
the load-balance count against the dense mask. No speed thresholds anywhere."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import train_gpt as T
from conftest import REPO, free_port, tiny_args

sys.path.insert(0, str(REPO / "records"))
import load_balance as LB  # noqa: E402


# -----------------------------------------------------------------------------
# Interval arithmetic


def test_interval_union_merges_nested_overlapping_and_touching():
    assert T.interval_union([(20, 30), (0, 10), (2, 5), (8, 12), (12, 15), (40, 40)]) == [(0, 15), (20, 30)]
    assert T.intervals_length([(0, 10), (2, 5), (8, 12)]) == 12
    assert T.interval_union([]) == []


def test_idle_and_overlap_known_answers():
    kernels = [(0, 10), (20, 30)]
    assert T.idle_fraction(kernels, (0, 40)) == pytest.approx(0.5)
    assert T.overlap_fraction([(5, 15)], kernels) == pytest.approx(0.5)
    # nested and overlapping kernels count once
    assert T.idle_fraction([(0, 10), (2, 8), (5, 12), (20, 30)], (0, 40)) == pytest.approx(0.45)
    # several windows: the busy time outside them does not count
    assert T.idle_fraction([(0, 10), (50, 60)], [(0, 20), (30, 40)]) == pytest.approx(2 / 3)
    assert T.overlap_fraction([], kernels) is None
    assert T.idle_fraction([], (5, 5)) is None
    assert T.interval_intersection([(0, 10), (20, 30)], [(5, 25)]) == [(5, 10), (20, 25)]


# -----------------------------------------------------------------------------
# Trace summaries on synthetic Kineto-style traces


def X(cat, name, ts, end, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": end - ts, "args": args}


def gpu_events(corr: bool = False):
    """Two steps on the GPU timeline: windows [10, 40] and [40, 60] (start to start, last to its end)."""
    k = lambda name, a, b, stream, c: X("kernel", name, a, b, device=0, stream=stream,  # noqa: E731
                                        **({"correlation": c} if corr else {}))
    step3 = [k("gemm", 10, 20, 7, 1), k("elementwise", 22, 30, 7, 2),
             X("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 15, 25, device=0, stream=20,
               **({"correlation": 3} if corr else {})),
             k("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 28, 42, 30, 4), k("small_side_stream", 31, 33, 40, 5),
             X("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 35, 36, device=0, stream=7,
               **({"correlation": 10} if corr else {}))]  # a scalar copy on the compute stream
    step4 = [k("gemm", 40, 50, 7, 6), k("nested", 42, 45, 7, 7), k("tail", 55, 60, 7, 8),
             X("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 50, 55, device=0, stream=7,
               **({"correlation": 9} if corr else {}))]
    return step3, step4


def test_trace_summary_from_gpu_annotations():
    step3, step4 = gpu_events()
    events = [X("user_annotation", "train_step#3", 0, 5), X("user_annotation", "train_step#4", 5, 9),
              X("gpu_user_annotation", "train_step#3", 10, 30, device=0, stream=7),
              X("gpu_user_annotation", "train_step#3", 15, 42, device=0, stream=30),  # per stream: merged
              X("gpu_user_annotation", "train_step#4", 40, 60, device=0, stream=7),
              *step3, *step4, X("kernel", "after_the_steps", 100, 110, device=0, stream=7),
              {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "python"}}]
    assert T.gpu_step_spans(events) == {3: (10, 42), 4: (40, 60)}
    s = T.trace_summary(events)
    assert s["steps"] == 2 and s["compute_stream"] == 7
    # compute on stream 7 inside [10, 60]: [10,20] [22,30] [40,50] [55,60] = 33 of 50
    assert s["gpu_idle_frac"] == pytest.approx(17 / 50)
    assert s["h2d_overlap_frac"] == pytest.approx(8 / 11)  # HtoD [15,25] under [10,20] and [22,30]; [35,36] idle
    assert s["h2d_off_stream_overlap_frac"] == pytest.approx(8 / 10)  # the copy-stream copy alone
    assert s["comm_overlap_frac"] == pytest.approx(4 / 14)  # NCCL [28,42]: [28,30] and [40,42]
    assert s["trace_ms_per_step_median"] == pytest.approx(0.025)
    assert s["compute_ms_per_step"] == pytest.approx(33 / 2 / 1000)


def test_trace_summary_by_correlation_without_gpu_annotations():
    step3, step4 = gpu_events(corr=True)
    launches = [X("cuda_runtime", "cudaLaunchKernel", t, t + 0.5, correlation=c)
                for c, t in [(1, 1), (2, 2), (3, 0.5), (4, 3), (5, 4), (10, 4.5)]]
    launches += [X("cuda_driver", "cuLaunchKernelEx", t, t + 0.5, correlation=c)
                 for c, t in [(6, 5.5), (7, 6), (8, 7), (9, 8)]]
    events = [X("user_annotation", "train_step#3", 0, 5), X("user_annotation", "train_step#4", 5, 9),
              *launches, *step3, *step4]
    assert T.gpu_step_spans(events) == {3: (10, 42), 4: (40, 60)}
    s = T.trace_summary(events)
    assert s["gpu_idle_frac"] == pytest.approx(17 / 50)
    assert s["h2d_overlap_frac"] == pytest.approx(8 / 11) and s["h2d_off_stream_overlap_frac"] == pytest.approx(0.8)
    # explicit windows override the marks
    assert T.trace_summary(events, [(10, 30)])["gpu_idle_frac"] == pytest.approx(2 / 20)


def test_cpu_only_trace_has_no_gpu_figures():
    events = [X("user_annotation", "train_step#0", 0, 4000), X("user_annotation", "train_step#1", 5000, 8000),
              X("cpu_op", "aten::mm", 100, 200)]
    s = T.trace_summary(events)
    assert s["steps"] == 2 and s["trace_ms_per_step_median"] == pytest.approx(4.0)  # 5 ms and 3 ms
    assert s["gpu_idle_frac"] is None and s["h2d_overlap_frac"] is None and s["comm_overlap_frac"] is None


def test_recipe_matmul_params():
    assert T.matmul_params(T.Config()) == 121_209_624  # the anchor's N, LM head included


# -----------------------------------------------------------------------------
# --profile and --bench on tiny CPU runs


def small(tmp_path, **kw):
    return tiny_args(tmp_path, **{"global_batch_seqs": 2, "val_every": 0, "val_tokens": 1024, **kw})


def trace_steps(path: Path) -> list[int]:
    return sorted(T.cpu_step_spans(T.load_trace(path)))


def test_profile_writes_one_trace_per_run(tmp_path, capsys):
    T.run(small(tmp_path, num_steps=3, profile="1:3", run_id="prof"))
    traces = sorted(p.name for p in (tmp_path / "logs" / "prof").iterdir())
    assert traces == ["trace_rank0.json.gz"]
    assert trace_steps(tmp_path / "logs" / "prof" / "trace_rank0.json.gz") == [1, 2]
    assert "profile: steps 1..2 traced to" in capsys.readouterr().out


def _profile_rank(rank: int, world_size: int, port: int, args: list[str]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    T.run(args)


def test_profile_two_ranks_write_a_trace_each(tmp_path):
    args = small(tmp_path, num_steps=2, profile="0:2", run_id="prof2")
    mp.spawn(_profile_rank, args=(2, free_port(), args), nprocs=2, join=True)
    for r in range(2):
        assert trace_steps(tmp_path / "logs" / "prof2" / f"trace_rank{r}.json.gz") == [0, 1]


def test_bench_prints_figures_and_writes_json(tmp_path, capsys):
    result = T.run(small(tmp_path, num_steps=6, bench=True, bench_steps=1, run_id="bench"))
    out = capsys.readouterr().out
    for label in ["bench: ms/step", "bench: tokens/s", "bench: MFU", "bench: peak memory", "bench: GPU idle",
                  "bench: H2D overlapped", "bench: comm overlapped"]:
        assert label in out
    assert "val_loss" not in out  # a benchmark does not validate
    assert "step:5/6" in out and "step:6/6" not in out  # settle 2 + timed 1 + profiler warmup 1 + traced 1
    report = json.loads((tmp_path / "logs" / "bench_bench.json").read_text())
    assert report == json.loads(json.dumps(result.bench))
    assert report["timed_steps"] == [2, 2] and report["traced_steps"] == [4, 4]
    assert report["ms_per_step_median"] > 0 and report["tokens_per_s"] > 0 and report["tokens_per_step"] == 256
    assert report["mfu"] is None and report["gpu_idle_frac"] is None and report["peak_memory_allocated_mib"] is None
    assert report["per_rank"][0]["steps"] == 1
    assert trace_steps(tmp_path / "logs" / "bench" / "trace_rank0.json.gz") == [4]


def test_bench_needs_data_for_its_own_steps_only(tmp_path):
    # The benchmark runs the first steps of a long schedule (the recipe's 1695 steps on a small corpus).
    args = small(tmp_path, num_steps=100_000, bench=True, bench_steps=1, run_id="long")
    with pytest.raises(T.UsageError, match="the run needs at least"):
        T.run([a for a in args if not a.startswith("--bench")])
    assert T.run(args).bench["traced_steps"] == [4, 4]


@pytest.mark.parametrize("flags, message", [
    (["--profile=5"], "--profile expects START:END"),
    (["--profile=9:3"], "needs 0 <= START < END"),
    (["--profile=a:b"], "--profile expects START:END"),
    (["--profile=2:7"], "END is beyond --num_steps=6"),
    (["--bench", "--profile=1:2"], "leave out --profile"),
    (["--bench", "--bench_steps=3"], "runs 9 steps but --num_steps is 6"),
    (["--bench", "--bench_steps=0"], "--bench_steps must be positive"),
])
def test_bad_profile_and_bench_values(tmp_path, flags, message):
    with pytest.raises(T.UsageError, match=message.replace("+", r"\+")) as err:
        T.validate_config(T.parse_config(tiny_args(tmp_path) + flags), 1)
    assert "\n" not in str(err.value)


def test_bad_profile_value_is_one_line_on_the_command_line(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "train_gpt.py"), *tiny_args(tmp_path), "--profile=9:3"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --profile=9:3"), proc.stderr


# -----------------------------------------------------------------------------
# Load balance


def synthetic_sequence(rng, length: int, n_bos: int, aligned: bool) -> np.ndarray:
    seq = rng.integers(0, 50000, length)
    seq[rng.choice(length, n_bos, replace=False)] = T.BOS_ID
    if aligned:
        seq[0] = T.BOS_ID
    return seq


def test_load_balance_count_equals_dense_mask_count():
    rng = np.random.default_rng(0)
    cases = [synthetic_sequence(rng, 512, n, aligned=n % 2 == 0) for n in (0, 1, 3, 9, 30)]
    long_doc = np.full(512, 7)
    long_doc[[0, 96, 100]] = T.BOS_ID  # documents ending inside and on block boundaries
    cases.append(long_doc)
    for seq in cases:
        for window in (0, 1, 2, 3, 5, 16):
            assert LB.attention_pairs(seq, 32, window) == LB.brute_force_pairs(seq, 32, window)


def test_load_balance_script_runs_on_the_sample(tmp_path, capsys):
    out = LB.main(["--train_files", str(REPO / "data" / "sample" / "sample_train_*.bin"), "--steps", "3",
                   "--world_size", "4", "--window_blocks", "4"])
    text = capsys.readouterr().out
    assert len(out["rows"]) == 3 and all(r["attn"] >= 1.0 for r in out["rows"])
    assert "implied slowdown" in text and "max/mean: mean" in text
    assert out["step_slowdown"] <= out["attn_slowdown"]
