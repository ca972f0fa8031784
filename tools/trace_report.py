"""Trace and benchmark reports from a run folder: GPU idle time, copy and NCCL overlap, step timings.

    python tools/trace_report.py RUN_DIR

RUN_DIR is <log_dir>/<run_id>/ of a run with --profile or --bench: it holds one torch.profiler Chrome trace
per rank (trace_rank<R>.json.gz) and, after --bench, each rank's raw figures (bench_rank<R>.json: step
times, tokens per step, FLOPs per token, MFU per step, peak memory). The report gives the median ms/step,
tokens/s and MFU (from rank 0's timed steps), peak memory, and from the traces the share of the steps with
no kernel on the compute stream (GPU idle), and the shares of host-to-device copy time and of NCCL kernel
time during which a compute kernel runs; after --bench it is written to <log_dir>/<run_id>_bench.json
(train_gpt.py --bench runs this at its end). The analysis is pure functions over the traces' event lists
(times in microseconds), tested on synthetic traces. Bad input: one `error:` line, exit code 2.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from pathlib import Path
from typing import Callable

import numpy as np

STEP_MARK = "train_step#"  # the record_function name train_gpt.py gives each traced step
Interval = tuple[float, float]


def interval_union(intervals: list[Interval]) -> list[Interval]:
    """Sorted disjoint intervals covering the same points; empty intervals dropped, touching ones merged."""
    out: list[Interval] = []
    for s, e in sorted((float(s), float(e)) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def intervals_length(intervals: list[Interval]) -> float:
    return sum(e - s for s, e in interval_union(intervals))


def interval_intersection(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The points in both unions, as sorted disjoint intervals."""
    a, b = interval_union(a), interval_union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def overlap_fraction(a: list[Interval], b: list[Interval]) -> float | None:
    """Share of the time covered by a that b also covers; None when a covers nothing."""
    total = intervals_length(a)
    return intervals_length(interval_intersection(a, b)) / total if total > 0 else None


def idle_fraction(busy: list[Interval], window: Interval | list[Interval]) -> float | None:
    """Share of the window(s) that no busy interval covers; None for an empty window."""
    windows = [window] if window and isinstance(window[0], (int, float)) else list(window)
    total = intervals_length(windows)
    return 1.0 - intervals_length(interval_intersection(busy, windows)) / total if total > 0 else None


def load_trace(path: Path) -> list[dict]:
    """The event list of a Chrome trace file (.json or .json.gz; an object with traceEvents, or a bare list)."""
    with (gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _cat(e: dict) -> str:
    return str(e.get("cat", "")).lower()


def _span(e: dict) -> Interval:
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def _step_of(e: dict, mark: str) -> int | None:
    name = str(e.get("name", ""))
    return int(name[len(mark):]) if name.startswith(mark) and name[len(mark):].isdigit() else None


GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def cpu_step_spans(events: list[dict], mark: str = STEP_MARK) -> dict[int, Interval]:
    """step -> CPU-side span of its record_function annotation."""
    return {s: _span(e) for e in events if e.get("ph") == "X" and _cat(e) == "user_annotation"
            and (s := _step_of(e, mark)) is not None}


def gpu_step_spans(events: list[dict], mark: str = STEP_MARK) -> dict[int, Interval]:
    """step -> span of its GPU work (first start to last end).

    From the profiler's gpu_user_annotation events when every annotated step has one; otherwise each
    GPU event (kernel, memcpy, memset) is assigned, through its correlation id, to the step whose CPU
    annotation holds its launch (cuda_runtime / cuda_driver event).
    """
    cpu = cpu_step_spans(events, mark)
    gpu: dict[int, Interval] = {}
    for e in events:
        if e.get("ph") == "X" and _cat(e) == "gpu_user_annotation" and (s := _step_of(e, mark)) is not None:
            a, b = _span(e)
            gpu[s] = (min(a, gpu[s][0]), max(b, gpu[s][1])) if s in gpu else (a, b)
    if gpu and set(gpu) >= set(cpu):
        return gpu
    launches = {e["args"]["correlation"]: float(e["ts"]) for e in events
                if _cat(e) in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    order = sorted(cpu.items(), key=lambda kv: kv[1][0])
    starts = [span[0] for _, span in order]
    spans: dict[int, Interval] = {}
    for e in events:
        if e.get("ph") != "X" or _cat(e) not in GPU_CATS:
            continue
        t = launches.get(e.get("args", {}).get("correlation"))
        if t is None:
            continue
        i = int(np.searchsorted(starts, t, side="right")) - 1
        if i < 0 or t > order[i][1][1]:
            continue
        s, (a, b) = order[i][0], _span(e)
        spans[s] = (min(a, spans[s][0]), max(b, spans[s][1])) if s in spans else (a, b)
    return spans


def step_windows(spans: dict[int, Interval]) -> list[Interval]:
    """Start-to-start windows, in step order: a step runs from its first event to the next step's first
    (so the gap between steps counts against the step before it); the last step ends at its last event."""
    ordered = [spans[s] for s in sorted(spans)]
    return [(a, max(a, ordered[i + 1][0]) if i + 1 < len(ordered) else b) for i, (a, b) in enumerate(ordered)]


def trace_summary(events: list[dict], step_windows_: list[Interval] | None = None) -> dict:
    """GPU figures of the steps inside the windows (default: the GPU windows of the train_step# marks).

    compute kernels: the kernels, NCCL ones excepted, on the (device, stream) that runs the most of them
    (the default stream in the trainer); GPU idle fraction: the share of the windows with no compute
    kernel running; H2D overlap: the share of host-to-device memcpy time during which a compute kernel
    runs (also for the copies off the compute stream alone, the loader's); comm overlap: the same for
    NCCL kernels. Figures without events are None (a CPU trace).
    """
    events = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    gpu = [e for e in events if _cat(e) in GPU_CATS]
    if step_windows_ is None:
        step_windows_ = step_windows(gpu_step_spans(events) if gpu else cpu_step_spans(events))
    out: dict = {"steps": len(step_windows_), "trace_ms_per_step_median": None, "compute_stream": None,
                 "gpu_idle_frac": None, "h2d_overlap_frac": None, "h2d_off_stream_overlap_frac": None,
                 "comm_overlap_frac": None,
                 "compute_ms_per_step": None, "h2d_ms_per_step": None, "comm_ms_per_step": None}
    if not step_windows_:
        return out
    out["trace_ms_per_step_median"] = float(np.median([(b - a) / 1000 for a, b in step_windows_]))
    if not gpu:
        return out
    windows = interval_union(step_windows_)
    kernels = [e for e in gpu if _cat(e) == "kernel"]
    is_nccl = lambda e: "nccl" in str(e.get("name", "")).lower()  # noqa: E731
    nccl = [e for e in kernels if is_nccl(e)]
    busy: dict[tuple, list[Interval]] = {}
    for e in kernels:
        if not is_nccl(e):
            args = e.get("args", {})
            busy.setdefault((args.get("device"), args.get("stream")), []).append(_span(e))
    in_windows = lambda spans: interval_intersection(spans, windows)  # noqa: E731
    lengths = {key: intervals_length(in_windows(spans)) for key, spans in busy.items()}
    compute: list[Interval] = []
    key = None
    if lengths and max(lengths.values()) > 0:
        key = max(lengths, key=lengths.get)
        out["compute_stream"] = key[1]
        compute = in_windows(busy[key])
    copies = [e for e in gpu if _cat(e) == "gpu_memcpy" and "htod" in str(e.get("name", "")).lower()]
    h2d = in_windows([_span(e) for e in copies])
    # copies issued on the compute stream itself (e.g. small scalars) cannot overlap it; the loader's are off it
    off = in_windows([_span(e) for e in copies
                      if (e.get("args", {}).get("device"), e.get("args", {}).get("stream")) != key])
    comm = in_windows([_span(e) for e in nccl])
    n = len(step_windows_)
    out.update(gpu_idle_frac=idle_fraction(compute, windows), h2d_overlap_frac=overlap_fraction(h2d, compute),
               h2d_off_stream_overlap_frac=overlap_fraction(off, compute),
               comm_overlap_frac=overlap_fraction(comm, compute),
               compute_ms_per_step=intervals_length(compute) / 1000 / n,
               h2d_ms_per_step=intervals_length(h2d) / 1000 / n, comm_ms_per_step=intervals_length(comm) / 1000 / n)
    return out


def rank_figures(folder: Path) -> list[dict]:
    """Per rank (in rank order): its bench figures when the run was a --bench, and the trace summary."""
    traces = sorted(folder.glob("trace_rank*.json.gz"), key=lambda p: int(p.name[10:-8]))
    if not traces:
        raise ValueError(f"{folder} holds no trace_rank<R>.json.gz (a run with --profile or --bench writes them)")
    ranks = []
    for path in traces:
        rank = int(path.name[10:-8])
        bench = folder / f"bench_rank{rank}.json"
        figures = json.loads(bench.read_text()) if bench.exists() else {"rank": rank}
        ranks.append({**figures, "trace": str(path), **trace_summary(load_trace(path))})
    return ranks


def bench_report(folder: Path, print_line: Callable[[str], None] = print) -> dict:
    """The benchmark report of a --bench run folder: headline figures from rank 0's timings, the trace
    figures as the mean over ranks; printed line by line and written to <log_dir>/<run_id>_bench.json."""
    ranks = rank_figures(folder)
    first = ranks[0]
    if "step_ms" not in first:
        raise ValueError(f"{folder} holds no bench_rank0.json: it is not a --bench run (report on its traces "
                         f"with the same command, without the bench figures)")
    ms = float(np.median(first["step_ms"]))
    tok_s = first["tokens_per_step"] / (ms / 1000)
    mfus = [m for m in first["mfu_pct"] if m is not None]

    def mean(key: str) -> float | None:
        vals = [r[key] for r in ranks if r.get(key) is not None]
        return float(np.mean(vals)) if vals else None

    report = {
        "run_id": first["run_id"], "device": first["device"], "world_size": first["world_size"],
        "timed_steps": first["timed_steps"], "traced_steps": first["traced_steps"],
        "ms_per_step_median": ms, "ms_per_step_mean": float(np.mean(first["step_ms"])),
        "ms_per_step_traced_median": float(np.median(first["traced_step_ms"])),
        "tokens_per_step": first["tokens_per_step"], "tokens_per_s": tok_s,
        "flops_per_token": first["flops_per_token"], "peak_flops_per_gpu": first["peak_flops_per_gpu"],
        "mfu_pct": float(np.median(mfus)) if mfus else None,
        "peak_memory_allocated_mib": first["peak_memory_allocated_mib"],
        "peak_memory_reserved_mib": first["peak_memory_reserved_mib"],
        **{key: mean(key) for key in ("gpu_idle_frac", "h2d_overlap_frac", "h2d_off_stream_overlap_frac",
                                      "comm_overlap_frac")},
        "config": first["config"], "per_rank": ranks,
    }
    path = folder.parent / f"{folder.name}_bench.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)

    def pct(x: float | None, why: str) -> str:
        return f"{100 * x:.1f}%" if x is not None else f"n/a ({why})"

    cuda = report["peak_memory_allocated_mib"] is not None
    gpu_why = "no GPU kernels in the trace"
    mem = (f"{report['peak_memory_allocated_mib']:.0f} MiB allocated, {report['peak_memory_reserved_mib']:.0f} MiB "
           f"reserved" if cuda else "n/a (CPU run)")
    timed, traced = report["timed_steps"], report["traced_steps"]
    for name, value in [
        ("device", f"{report['device']} x {report['world_size']}"),
        ("steps", f"timed {timed[0]}..{timed[1]}, traced {traced[0]}..{traced[1]} "
                  f"({report['tokens_per_step']:,} tokens/step)"),
        ("ms/step", f"{ms:.2f} median, {report['ms_per_step_mean']:.2f} mean "
                    f"({report['ms_per_step_traced_median']:.2f} median under the profiler)"),
        ("tokens/s", f"{tok_s:,.0f}"),
        ("MFU", (f"{report['mfu_pct']:.1f}%" if report["mfu_pct"] is not None else
                 "n/a (no bf16 peak known for this device)")
         + f" at {report['flops_per_token'] / 1e6:.1f} MFLOP/token"),
        ("peak memory", mem),
        ("GPU idle", pct(report["gpu_idle_frac"], gpu_why)),
        ("H2D overlapped", pct(report["h2d_overlap_frac"], gpu_why if not cuda else "no H2D copies traced") +
                           (f" (copies off the compute stream: {pct(report['h2d_off_stream_overlap_frac'], '')})"
                            if report["h2d_off_stream_overlap_frac"] is not None else "")),
        ("comm overlapped", pct(report["comm_overlap_frac"], gpu_why if not cuda else "no NCCL kernels traced")),
        ("trace", f"{folder}/trace_rank<R>.json.gz"),
        ("json", str(path)),
    ]:
        print_line(f"bench: {name:<16}{value}")
    return report


def trace_report(folder: Path, print_line: Callable[[str], None] = print) -> list[dict]:
    """The trace figures of every rank of a --profile run folder, one line each."""
    ranks = rank_figures(folder)
    for r in ranks:
        figures = {k: r[k] for k in ("steps", "trace_ms_per_step_median", "gpu_idle_frac", "h2d_overlap_frac",
                                     "comm_overlap_frac", "compute_ms_per_step", "comm_ms_per_step")}
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())
        print_line(f"rank {r['rank']}: {shown}")
    return ranks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="<log_dir>/<run_id>/ of a run with --profile or --bench")
    args = parser.parse_args(argv)
    try:
        if not args.run_dir.is_dir():
            raise ValueError(f"{args.run_dir} is not a folder (give <log_dir>/<run_id>/)")
        if (args.run_dir / "bench_rank0.json").exists():
            bench_report(args.run_dir)
        else:
            trace_report(args.run_dir)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
