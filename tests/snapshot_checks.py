"""What every record snapshot under records/snapshots/ must show (tests/test_record28.py, test_record70.py,
test_record89.py): its tiny preset's first steps equal its tiny record's (bit for bit on the record's kind of CPU),
and its own tests pass against it, each in a process of its own where `import train_gpt` finds the snapshot; for
#70's and #89's, that their tiny records ran the snapshot's code, and what compare.py shows against today's file."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO
from test_first_contact import DRIFT, cpu_kind, logged_losses

ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "4000000000", "MALLOC_TRIM_THRESHOLD_": "4000000000"}
# The snapshots' own record path: torch's kernels, oneDNN and MKL held to AVX2 (their records' arithmetic; the file's
# record path has since left MKL out, see gpt_kernels.RecordMath).
SNAPSHOT_RECORD_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def rerun_tiny_record(snapshot: Path, record: Path, tmp_path: Path, run_id: str, steps: int = 6) -> bool:
    """Runs the snapshot's tiny preset on the record's CPU path, stops it with Ctrl-C once step `steps` is logged (it
    stops at a step boundary soon after: the same run as the record's so far, at a fifth of the CPU time), and checks
    every loss it logged against the tiny record (record: its log, any suffix): bit for bit on the record's kind of
    CPU (True), within the kernels' rounding on another (False). A record made on the record path (AVX2 kernels, fp32
    GEMMs) is rerun there, which every x86-64 CPU with AVX2 computes; one made natively (#28's and #70's, on AVX-512
    with bf16 GEMMs) is rerun natively, its bits only on its kind of CPU."""
    record_kind = cpu_kind(record.with_suffix(".txt").read_text())
    record_path = record_kind[2:] == ("AVX2", "fp32") and torch.cpu._is_avx2_supported()
    proc = subprocess.Popen([sys.executable, str(snapshot / "train_gpt.py"), "--preset=tiny", "--device=cpu",
                             *(["--cpu_bf16_gemm=fp32"] if record_path else []), f"--log_dir={tmp_path}",
                             f"--run_id={run_id}"], cwd=REPO, env={**ENV, **(SNAPSHOT_RECORD_ENV if record_path else {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith(f"step:{steps}/"):
            proc.send_signal(signal.SIGINT)
            break
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 130, err[-3000:]
    ours, theirs = logged_losses(tmp_path / f"{run_id}.jsonl"), logged_losses(record.with_suffix(".jsonl"))
    assert len(theirs) == 43 and ours.keys() <= theirs.keys()  # the record: 40 train losses, 3 validations
    assert {step for step, name in ours if name == "train_loss"} >= set(range(1, steps + 1))
    same_cpu = cpu_kind((tmp_path / f"{run_id}.txt").read_text()) == record_kind
    if same_cpu:
        assert ours == {key: theirs[key] for key in ours}
    else:  # another kind of CPU: the same run up to the kernels' rounding (test_first_contact)
        assert all(abs(loss - theirs[key]) <= DRIFT[key[1]] for key, loss in ours.items())
    return same_cpu


def sections(report: str) -> dict[str, list[str]]:
    """compare.py diff's report by section: the lines under each '== name' heading ('' for the ones above)."""
    out, name = {"": []}, ""
    for line in report.splitlines():
        if line.startswith("== "):
            name = line[3:]
            out[name] = []
        elif line:
            out[name].append(line)
    return out


def compare_diff(a: Path, b: Path) -> dict[str, list[str]]:
    """tools/compare.py diff a b, by section, after checking that it ran."""
    diff = subprocess.run([sys.executable, "tools/compare.py", "diff", str(a), str(b)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert diff.returncode == 0, diff.stderr
    return sections(diff.stdout)


def check_the_tiny_records_ran_the_snapshots_code(snapshot: Path, runs: tuple[str, ...]) -> None:
    # Each log opens with the source that ran it, then a line of 100 '=' (tools/compare.py's split).
    source = (snapshot / "train_gpt.py").read_text()
    for run in runs:
        assert (snapshot / f"{run}.txt").read_text().startswith(f"{source}\n{'=' * 100}\n"), run


def check_the_first_6_steps_equal_the_tiny_record(snapshot: Path, tiny_record: Path, tmp_path: Path, run_id: str
                                                  ) -> None:
    # Stopped at step 6 (of 40); on another kind of CPU the losses are compared within rounding instead.
    same_cpu = rerun_tiny_record(snapshot, tiny_record, tmp_path, run_id)
    log = (tmp_path / f"{run_id}.txt").read_text()
    assert log.startswith((snapshot / "train_gpt.py").read_text())  # the snapshot ran, not the repository's file
    if same_cpu:
        report = compare_diff(tiny_record.with_suffix(".txt"), tmp_path / f"{run_id}.txt")
        assert report[""][0].startswith("verdict: equal on the steps both cover, ")  # the rerun stopped early
        assert report["config (A -> B)"] == ["(no differences)"] and report["code (A -> B)"] == ["(identical)"]


def check_compare_shows_the_recipe_change(tiny_record: Path, today: Path) -> None:
    if not today.exists():
        pytest.skip(f"today's tiny record {today.relative_to(REPO)} is not made yet (the tiny preset of the "
                    f"repository's train_gpt.py, run once it holds its new recipe)")
    report = compare_diff(tiny_record.with_suffix(".txt"), today)
    assert report[""][0].startswith("verdict: not reproduced: ")  # another recipe: other losses
    config, code = report["config (A -> B)"], report["code (A -> B)"]
    assert config and config != ["(no differences)"], config  # fields changed, added or dropped
    # Per file: train_gpt.py changed; gpt_kernels.py, which today's logs hold too, only in today's.
    assert code[0].startswith("train_gpt.py: ") and code[0].endswith(" added"), code
    assert code[1:] == ["gpt_kernels.py: only in B", "(--code shows the hunks)"], code


def run_own_tests(snapshot: Path) -> dict[str, int]:
    """The snapshot's tests/ in its own process (the snapshot is `train_gpt` there, and registers the same
    torch.ops.speedrun ops), after checking that pytest exited 0: the counts of its summary line, e.g.
    {"passed": 52} or {"passed": 50, "skipped": 2} (no "failed", "error" or "xpassed" key where it passed)."""
    run = subprocess.run([sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider"], cwd=snapshot,
                         env=ENV, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:]
    summary = run.stdout.strip().splitlines()[-1]  # "52 passed in 40.1s", "50 passed, 2 skipped in ..."
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", summary.split(" in ")[0]) if word != "warnings"}
    assert counts.get("passed", 0) > 0 and not {"failed", "error", "errors"} & counts.keys(), summary
    return counts
