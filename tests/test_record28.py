"""Record #28 lives on as a frozen snapshot, records/snapshots/2026-11-25_record28/train_gpt.py: the first 6 steps
of its tiny preset equal its tiny record's (every logged loss, bit for bit on the record's kind of CPU; within rounding
on another), its own tests (the #28 spec in float64, its masks, schedules and Newton-Schulz) all pass against it, and
compare.py shows the recipe change to a run of today's file."""

import subprocess
import sys

import pytest

from conftest import REPO
from snapshot_checks import rerun_tiny_record, run_own_tests

RECORD = REPO / "records" / "snapshots" / "2026-11-25_record28"


@pytest.mark.slow
def test_the_snapshots_first_6_steps_equal_its_tiny_record_bit_for_bit_on_the_records_kind_of_cpu(tmp_path):
    # Stopped at step 6 (of 40); on another kind of CPU the losses are compared within rounding instead.
    rerun_tiny_record(RECORD, RECORD / "record28_tiny_w1.txt", tmp_path, "r28")
    # Today's tiny run against #28's: the recipe change, config and code.
    today = REPO / "records" / "2026-11-28_tiny_cpu_head" / "tiny_cpu_w1.txt"
    diff = subprocess.run([sys.executable, "tools/compare.py", "diff", str(RECORD / "record28_tiny_w1.txt"),
                           str(today)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert diff.returncode == 0, diff.stderr
    assert "only in A's config" in diff.stdout and "line(s) removed" in diff.stdout


@pytest.mark.slow
def test_the_snapshots_own_tests_all_run_and_pass_against_it():
    assert run_own_tests(RECORD) == {"passed": 21}  # its tests/ holds 21 (frozen with it): none skipped or failed
