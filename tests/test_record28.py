"""Record #28 lives on as a frozen snapshot, records/2026-11-25_record28/train_gpt.py: its tiny preset reproduces
its record (every logged loss, bit for bit on the record's kind of CPU), its own tests (the #28 spec in float64,
its masks, schedules and Newton-Schulz) pass against it, and compare.py shows the recipe change to a run of
today's file."""

import os
import subprocess
import sys

import pytest

from conftest import REPO
from test_first_contact import DRIFT, cpu_kind, logged_losses

RECORD = REPO / "records" / "2026-11-25_record28"
ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "4000000000", "MALLOC_TRIM_THRESHOLD_": "4000000000"}


@pytest.mark.slow
def test_the_snapshot_reproduces_its_tiny_record_bit_for_bit(tmp_path):
    run = subprocess.run([sys.executable, str(RECORD / "train_gpt.py"), "--preset=tiny", "--device=cpu",
                          f"--log_dir={tmp_path}", "--run_id=r28"], cwd=REPO, env=ENV, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    ours, record = logged_losses(tmp_path / "r28.jsonl"), logged_losses(RECORD / "record28_tiny_w1.jsonl")
    assert ours.keys() == record.keys() and len(ours) == 43  # 40 train losses, 3 validations
    if cpu_kind((tmp_path / "r28.txt").read_text()) == cpu_kind((RECORD / "record28_tiny_w1.txt").read_text()):
        assert ours == record
    else:  # another kind of CPU: the same run up to the kernels' rounding (test_first_contact)
        assert all(abs(loss - record[key]) <= DRIFT[key[1]] for key, loss in ours.items())
    # Today's tiny run against #28's: the recipe change, config and code.
    today = REPO / "records" / "2026-11-26_tiny_cpu_89" / "tiny_cpu_w1.txt"
    diff = subprocess.run([sys.executable, "records/compare.py", "diff", str(RECORD / "record28_tiny_w1.txt"),
                           str(today)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert diff.returncode == 0, diff.stderr
    assert "only in A's config" in diff.stdout and "line(s) removed" in diff.stdout


@pytest.mark.slow
def test_the_snapshots_own_tests_pass_against_it():
    # Its own process: the snapshot is `train_gpt` there, and registers the same torch.ops.speedrun ops.
    run = subprocess.run([sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider"], cwd=RECORD,
                         env=ENV, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout
