"""tools/trace_report.py: interval arithmetic and trace summaries on synthetic Kineto-style traces, and its
command line on a run folder. --bench runs it at its end (test_bench.py)."""

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
import trace_report as TR  # noqa: E402


# -----------------------------------------------------------------------------
# Interval arithmetic


def test_interval_union_merges_nested_overlapping_and_touching():
    assert TR.interval_union([(20, 30), (0, 10), (2, 5), (8, 12), (12, 15), (40, 40)]) == [(0, 15), (20, 30)]
    assert TR.intervals_length([(0, 10), (2, 5), (8, 12)]) == 12
    assert TR.interval_union([]) == []


def test_idle_and_overlap_known_answers():
    kernels = [(0, 10), (20, 30)]
    assert TR.idle_fraction(kernels, (0, 40)) == pytest.approx(0.5)
    assert TR.overlap_fraction([(5, 15)], kernels) == pytest.approx(0.5)
    # nested and overlapping kernels count once
    assert TR.idle_fraction([(0, 10), (2, 8), (5, 12), (20, 30)], (0, 40)) == pytest.approx(0.45)
    # several windows: the busy time outside them does not count
    assert TR.idle_fraction([(0, 10), (50, 60)], [(0, 20), (30, 40)]) == pytest.approx(2 / 3)
    assert TR.overlap_fraction([], kernels) is None
    assert TR.idle_fraction([], (5, 5)) is None
    assert TR.interval_intersection([(0, 10), (20, 30)], [(5, 25)]) == [(5, 10), (20, 25)]


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
    assert TR.gpu_step_spans(events) == {3: (10, 42), 4: (40, 60)}
    s = TR.trace_summary(events)
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
    assert TR.gpu_step_spans(events) == {3: (10, 42), 4: (40, 60)}
    s = TR.trace_summary(events)
    assert s["gpu_idle_frac"] == pytest.approx(17 / 50)
    assert s["h2d_overlap_frac"] == pytest.approx(8 / 11) and s["h2d_off_stream_overlap_frac"] == pytest.approx(0.8)
    # explicit windows override the marks
    assert TR.trace_summary(events, [(10, 30)])["gpu_idle_frac"] == pytest.approx(2 / 20)


def test_cpu_only_trace_has_no_gpu_figures():
    events = [X("user_annotation", "train_step#0", 0, 4000), X("user_annotation", "train_step#1", 5000, 8000),
              X("cpu_op", "aten::mm", 100, 200)]
    s = TR.trace_summary(events)
    assert s["steps"] == 2 and s["trace_ms_per_step_median"] == pytest.approx(4.0)  # 5 ms and 3 ms
    assert s["gpu_idle_frac"] is None and s["h2d_overlap_frac"] is None and s["comm_overlap_frac"] is None
