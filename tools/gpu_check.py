"""The GPU check: run it first on a machine with a new GPU (or torch), before any measurement.

    python tools/gpu_check.py [--out DIR] [--skip_bench]

One command, at most ten minutes on one H100 from a cold compile cache, from the repo root's checkout with a
corpus for the benchmarks: shards in the git-ignored data/proxy/ (proxy_train_*.bin, proxy_val_*.bin) or FineWeb
in data/fineweb10B/ (python data/cached_fineweb10B.py 1). Four stages, in order of what a first run trips on
first, each under its own time limit:

1. kernels: FA3 (#89's attention, from the kernels package) against FlexAttention at the recipe's shapes first,
   then the Triton kernels in bf16 at the recipe's shapes (autotuned on the GPU) and the FP8 ops (opcheck,
   saturation, the head at the recipe's shape), through cuBLAS; the CPU suite's FP8 tests; DC attention's kernels
   (bf16, 16,384 tokens, 64 cu_seqlens slots) against their torch path, forward and backward, with the measured
   differences, and two backward runs bit for bit.
2. model: the rest of tests/test_cuda.py (compiled FlexAttention against dense attention, the prefetch loader
   against a slowed stream, the compiled GPT's graphs, the model's matmuls and attention in bf16, a tiny run
   with checkpoints, the recipe compiled) and the no-host-sync test. Without a GPU the CUDA tests are skipped with
   their reason and the CPU rehearsal of the compiled path (tests/test_compiled.py) runs instead.
3. bench: train_gpt.py --bench at the recipe's last stage's real shape (8 micro-steps of 49,152 tokens, paired
   FlexAttention over 2T = 98,304 positions, the bigram table, the multi-token loss, the Triton kernels), its peak
   memory against tools/memory_estimate.py's estimate for one GPU (PASS within 15% above it). Without a GPU it
   runs the tiny preset's last stage compiled with the FP8 head on the CPU, and the memory check is skipped.

A stage killed at its limit keeps the outcome of every test that finished (read from pytest's verbose log).
Every check prints PASS, FAIL or SKIP with its figures, and the script goes on past a failure (exit code 1 if
any failed). Ctrl-C or SIGTERM stops it, the running stage's processes with it (exit code 130 or 143). The folder (default records/<date>_gpu_check/) receives the tests' log and junit XML, the bench's
run log, summary and report (its trace stays in logs/, git-ignored there), and the table as check.md and
check.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The benchmark's corpus, the first one present: a proxy corpus, or FineWeb (the trainer's default).
CORPORA = [("data/proxy/proxy_train_*.bin", "data/proxy/proxy_val_*.bin"),
           ("data/fineweb10B/fineweb_train_*.bin", "data/fineweb10B/fineweb_val_*.bin")]
# The kernels and FP8 ops first: each is quick, and a first run on a new GPU or torch trips there first.
KERNEL_TESTS = ["tests/test_cuda.py::test_cuda_environment",
                "tests/test_cuda.py::test_fa3_follows_flex_attention_at_the_recipes_shapes",
                "tests/test_model.py::test_fp8_ops_pass_opcheck",
                "tests/test_model.py::test_fp8_head_saturates_values_beyond_each_formats_range",
                "tests/test_model.py::test_fp8_head_gradients_quantize_like_the_records_unscaled_loss",
                "tests/test_cuda.py::test_relu2_mlp_kernel_in_bf16_at_the_recipes_shape_follows_the_torch_mlp",
                "tests/test_cuda.py::test_fp8_mlp_kernels_at_the_recipes_shape_follow_the_torch_path_and_the_quantizers"
                "_is_bit_exact",
                "tests/test_cuda.py::test_fused_head_at_the_recipes_shape_follows_the_fp8_head_and_cuts_the_logits"
                "_memory", "tests/test_cuda.py::test_fp8_ops_pass_opcheck_on_cuda",
                "tests/test_cuda.py::test_fp8_head_saturates_on_cuda",
                "tests/test_cuda.py::test_fp8_mlp_at_the_recipes_shape_follows_its_cpu_path_and_the_quantizer_matches",
                "tests/test_cuda.py::test_fp8_head_matches_bf16_matmul_at_the_recipe_shape_eager_and_compiled",
                "tests/test_cuda.py::test_polar_express_kernels_at_the_recipes_shapes_follow_the_torch_path",
                "tests/test_cuda.py::test_transpose_copy_at_the_fp8_heads_shapes_is_an_exact_copy",
                "tests/test_cuda_dc.py::test_dc_attention_kernels_at_the_recipes_shape_follow_the_torch_path_and_their"
                "_backward_is_deterministic"]
MODEL_TESTS = ["tests/test_recipe_model.py::test_compiled_flex_attention_with_token_windows_equals_sdpa_with_fa3s_"
               "rule",
               "tests/test_metrics.py::test_no_cuda_sync_on_steady_state_non_logging_steps", "tests/test_cuda.py",
               *(f"--deselect={t}" for t in KERNEL_TESTS if t.startswith("tests/test_cuda.py"))]
REHEARSAL_TESTS = ["tests/test_compiled.py"]
# Seconds per stage: with start-up, the memory estimate (~40 s on the host) and the report, inside ten minutes on a
# cold cache.
LIMITS_S = {"kernels": 110, "model": 180, "bench": 140}
MEMORY_MARGIN = 1.15  # measured peak allocated over the estimate that still passes
STOP_GRACE_S = 10  # after the check is stopped, how long a stage has to stop on the forwarded signal before a kill
BENCH_FIGURES = [("ms_per_step_median", "ms/step", "{:.1f}"), ("tokens_per_s", "tok/s", "{:,.0f}"),
                 ("mfu_pct", "MFU", "{:.1f}%"), ("peak_memory_allocated_mib", "peak alloc MiB", "{:,.0f}"),
                 ("peak_memory_reserved_mib", "peak reserved MiB", "{:,.0f}"), ("gpu_idle_frac", "GPU idle", "{:.2%}"),
                 ("h2d_overlap_frac", "H2D overlapped", "{:.0%}")]


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop): handled as Ctrl-C is."""


def raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def end_group(proc: subprocess.Popen, signum: int) -> None:
    """A stage's process group, in a session of its own that no Ctrl-C reaches, when the check is stopped: signum
    forwarded (pytest stops where it is), then the group killed (compile workers), at the latest after STOP_GRACE_S."""
    try:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_GRACE_S)
    finally:  # a second Ctrl-C during the grace included
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_logged(cmd: list[str], log: Path, limit_s: float) -> tuple[int | None, float]:
    """Run cmd from the repo root, its output shown and appended to log; (exit code, or None if it ran past
    limit_s and was killed with its whole process group, inductor's compile workers included; seconds). Stopped
    itself (Ctrl-C, SIGTERM), it ends cmd's process group first."""
    t0 = time.monotonic()
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        expired = threading.Event()

        def kill() -> None:
            expired.set()
            os.killpg(proc.pid, signal.SIGKILL)

        watchdog = threading.Timer(limit_s, kill)
        watchdog.start()
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                f.write(line)
            proc.wait()
        except KeyboardInterrupt as stop:
            end_group(proc, signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT)
            raise
        finally:
            watchdog.cancel()
        if expired.is_set():  # on a line of its own: the last one may be a test's id still waiting for its outcome
            print(f"\nkilled after {limit_s:.0f} s", flush=True)
            f.write(f"\nkilled after {limit_s:.0f} s\n")
            return None, time.monotonic() - t0
    return proc.returncode, time.monotonic() - t0


def test_rows(xml_path: Path) -> list[dict]:
    """One row per test case of a junit XML: name, PASS/FAIL/SKIP, seconds, the reason and the figures."""
    rows = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        row = {"check": f"{module}.py::{case.get('name')}", "result": "PASS", "seconds": float(case.get("time", 0)),
               "note": "", "figures": {p.get("name"): p.get("value") for p in case.iter("property")}}
        for tag, result in (("failure", "FAIL"), ("error", "FAIL"), ("skipped", "SKIP")):
            element = case.find(tag)
            if element is not None:
                message = element.get("message") or (element.text or "").strip()
                row.update(result=result, note=message.splitlines()[0][:200] if message else tag)
                break
        rows.append(row)
    return rows


# pytest -v writes a test's id, then its outcome on the same line once it ends: a killed run's log keeps every
# finished test's outcome, and the id of the one that was running with none.
VERBOSE_LINE = re.compile(r"^(\S+\.py::\S+)(?: (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b)?")
VERBOSE_RESULT = {"PASSED": "PASS", "XPASS": "PASS", "FAILED": "FAIL", "ERROR": "FAIL", "SKIPPED": "SKIP",
                  "XFAIL": "SKIP", None: "FAIL"}


def log_rows(log_text: str) -> list[dict]:
    """Rows from pytest -v's log, for a run killed before it wrote its XML: each finished test's outcome, and
    the test that was running as FAIL (no figures: those are in the XML only)."""
    rows = []
    for line in log_text.splitlines():
        m = VERBOSE_LINE.match(line)
        if m:
            rows.append({"check": m.group(1), "result": VERBOSE_RESULT[m.group(2)], "seconds": 0.0, "figures": {},
                         "note": "" if m.group(2) else "running when the stage was killed"})
    return rows


def run_tests(tests: list[str], out: Path, limit_s: float, stage: str = "tests") -> list[dict]:
    """pytest on `tests`, one row per test from its junit XML (or, if killed, from its log) and a FAIL row
    when it was killed or gave no results. Its log and XML are <stage>.log and <stage>.xml."""
    xml, log = out / f"{stage}.xml", out / f"{stage}.log"
    xml.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", *tests, "-v", "-rfEs", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
           f"--junitxml={xml}"]
    code, seconds = run_logged(cmd, log, limit_s)
    rows = test_rows(xml) if xml.exists() else log_rows(log.read_text())
    if code is None or not rows:
        why = f"killed after {limit_s:.0f} s" if code is None else f"pytest exited {code} with no results"
        rows.append({"check": stage, "result": "FAIL", "seconds": seconds, "note": f"{why}; see {log.name}",
                     "figures": {}})
    return rows


def last_stage_args(*flags: str) -> list[str]:
    """Flags that make the whole schedule of the recipe (with flags) its last stage (and the extension after it), so a
    short bench runs at its final, largest shape."""
    import train_gpt as T

    cfg = T.parse_config(list(flags))
    args = [f"--stage_{column}={T.column_text(cfg.stages[-2:], column)}" for column in T.STAGE_COLUMNS]
    # One stage now: the embedding stays tied (the graph and its cost are the untied one's).
    return [*args, "--untie_stage=1"]


def bench_run(out: Path, cuda: bool, stage: str = "bench") -> tuple[dict, dict | None]:
    """One --bench run at the recipe's last stage (GPU: its shape on the corpus; CPU: the tiny preset's): its row,
    figures from the report JSON and the warmup line of its log, and the report."""
    run_id = f"gpu_check_{stage}_{datetime.datetime.now():%Y%m%d_%H%M%S}"
    logs = out / "logs"
    if cuda:
        corpus = next(((t, v) for t, v in CORPORA if list(REPO.glob(t)) and list(REPO.glob(v))), None)
        name = f"{stage}: the recipe's last stage at its shape, {corpus[0].split('/')[1] if corpus else 'no'} corpus"
        if corpus is None:
            return {"check": name, "result": "FAIL", "seconds": 0.0, "figures": {},
                    "note": "no shards in data/proxy/ or data/fineweb10B/ (python data/cached_fineweb10B.py 1)"}, None
        # A bench needs data for its own ~43 steps; epochs let a small corpus supply them.
        args = [f"--train_files={corpus[0]}", f"--val_files={corpus[1]}", "--train_epochs=30", "--val_tokens=262144",
                *last_stage_args()]
    else:
        name = f"{stage}: tiny preset's last stage, CPU, compiled with the FP8 head and MLP"
        args = ["--preset=tiny", *last_stage_args("--preset=tiny"), "--device=cpu", "--compile=true",
                "--fp8_head=true", "--fp8_mlp=true", "--bench_steps=3", "--num_steps=10"]
    cmd = [sys.executable, "train_gpt.py", "--bench", *args, f"--run_id={run_id}", f"--log_dir={logs}"]
    code, seconds = run_logged(cmd, out / f"{stage}.log", LIMITS_S[stage])
    report_path = logs / f"{run_id}_bench.json"
    row = {"check": name, "result": "PASS", "seconds": seconds, "note": "", "figures": {}}
    if code != 0 or not report_path.exists():
        why = f"killed after {LIMITS_S[stage]} s" if code is None else f"exit code {code}"
        return {**row, "result": "FAIL", "note": f"{why}; see {stage}.log"}, None
    report = json.loads(report_path.read_text())
    for key, label, fmt in BENCH_FIGURES:
        if report.get(key) is not None:
            row["figures"][label] = fmt.format(report[key])
    warmup = re.search(r"^warmup: .*?, (\d+) steps ([\d.]+) s", (logs / f"{run_id}.txt").read_text(), re.M)
    if warmup:
        row["figures"]["compile+warmup s"] = warmup.group(2)
    for suffix in (".txt", ".json", ".jsonl", "_bench.json"):  # the record keeps these; the trace stays in logs/
        shutil.copy(logs / f"{run_id}{suffix}", out)
    return row, report


def memory_row(report: dict | None, cuda: bool) -> dict:
    """The bench's measured peak allocated against tools/memory_estimate.py's figure for one GPU at the same shape."""
    row = {"check": "bench: peak memory within the estimate", "result": "SKIP", "seconds": 0.0, "figures": {},
           "note": "needs a CUDA GPU" if not cuda else "no bench report"}
    if not cuda or report is None or report.get("peak_memory_allocated_mib") is None:
        return row
    sys.path.insert(0, str(REPO / "tools"))
    import memory_estimate

    t0 = time.monotonic()
    estimates = memory_estimate.estimate("recipe", [])
    estimate = next(r for r in estimates if r["gpus"] == 1)["total"] / 2**20
    measured = report["peak_memory_allocated_mib"]
    ok = measured <= MEMORY_MARGIN * estimate
    return {**row, "result": "PASS" if ok else "FAIL", "seconds": time.monotonic() - t0,
            "figures": {"allocated MiB": f"{measured:,.0f}", "estimate MiB": f"{estimate:,.0f}"},
            "note": "" if ok else f"above {MEMORY_MARGIN:.2f}x the estimate: see tools/memory_estimate.py"}


def stages(out: Path, cuda: bool) -> list[dict]:
    rows = run_tests(KERNEL_TESTS, out, LIMITS_S["kernels"], "kernels")
    rows += run_tests(MODEL_TESTS + ([] if cuda else REHEARSAL_TESTS), out, LIMITS_S["model"], "model")
    return rows


def benches(out: Path, cuda: bool) -> list[dict]:
    row, report = bench_run(out, cuda)
    return [row, memory_row(report, cuda)]


def table(rows: list[dict]) -> str:
    lines = ["| check | result | s | figures / reason |", "|---|---|---|---|"]
    for r in rows:
        figures = ", ".join(f"{k}={v}" for k, v in r["figures"].items())
        detail = "; ".join(x for x in (r["note"], figures) if x)
        lines.append(f"| {r['check']} | {r['result']} | {r['seconds']:.1f} | {detail.replace('|', '/')} |")
    return "\n".join(lines)


def main() -> int:
    """The check; stopped by Ctrl-C or SIGTERM, it ends the running stage and exits 130 or 143, saying which."""
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        return check()
    except KeyboardInterrupt as stop:
        terminated = isinstance(stop, Terminated)
        print("terminated" if terminated else "interrupted", file=sys.stderr)
        return 143 if terminated else 130


def check() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "records" / f"{datetime.date.today()}_gpu_check")
    parser.add_argument("--skip_bench", action="store_true", help="the test stages alone (kernels, model)")
    opts = parser.parse_args()
    out = opts.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "logs" / ".gitignore").write_text("*\n")  # raw logs and traces: the record keeps copies of the small ones

    import torch  # after the argument check: --help needs no torch

    cuda = torch.cuda.is_available()
    device = f"{torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))})" \
        if cuda else "no CUDA GPU: CUDA checks are skipped, the CPU rehearsal runs instead"
    header = f"torch {torch.__version__}, CUDA {torch.version.cuda}, {device}"
    print(f"gpu_check: {header}\ngpu_check: writing to {out}", flush=True)
    rows = stages(out, cuda)
    if not opts.skip_bench:
        rows += benches(out, cuda)
    text = table(rows)
    failed = [r["check"] for r in rows if r["result"] == "FAIL"]
    summary = f"{len(rows)} checks: {sum(r['result'] == 'PASS' for r in rows)} passed, {len(failed)} failed, " \
              f"{sum(r['result'] == 'SKIP' for r in rows)} skipped"
    (out / "check.md").write_text(f"# GPU check, {datetime.datetime.now():%Y-%m-%d %H:%M}\n\n{header}\n\n{text}\n\n"
                                  f"{summary}\n")
    (out / "check.json").write_text(json.dumps({"environment": header, "rows": rows}, indent=2) + "\n")
    print(f"\n{text}\n\ngpu_check: {summary}; table in {out / 'check.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
