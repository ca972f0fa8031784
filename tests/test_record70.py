"""Record #70 lives on as a frozen snapshot, records/snapshots/2026-11-26_record70/ (train_gpt.py and gpt_kernels.py
of commit b801279): its tiny records ran its code, the first 6 steps of its tiny preset equal theirs (every logged
loss, bit for bit on the record's kind of CPU; within rounding on another), its own tests (#70's exact arithmetic
against tests/reference70.py there, its forward against a float64 spec, its optimizer table and schedule) all pass
against it, and compare.py shows the recipe change to today's file's tiny record."""

import pytest

from conftest import REPO
from snapshot_checks import (check_compare_shows_the_recipe_change, check_the_first_6_steps_equal_the_tiny_record,
                             check_the_tiny_records_ran_the_snapshots_code, run_own_tests)

RECORD = REPO / "records" / "snapshots" / "2026-11-26_record70"
TINY_RECORD = RECORD / "tiny_cpu_w1"  # the snapshot's tiny preset at W=1: .txt, .json, .jsonl
# Today's file's tiny record, against which the diff shows the recipe change from #70.
TODAY = REPO / "records" / "2026-11-28_tiny_cpu_head" / "tiny_cpu_w1.txt"


def test_the_tiny_records_ran_the_snapshots_code():
    check_the_tiny_records_ran_the_snapshots_code(RECORD, ("tiny_cpu_w1", "tiny_cpu_w2", "tiny_cpu_avx2"))


@pytest.mark.slow
def test_the_snapshots_first_6_steps_equal_its_tiny_record_bit_for_bit_on_the_records_kind_of_cpu(tmp_path):
    check_the_first_6_steps_equal_the_tiny_record(RECORD, TINY_RECORD, tmp_path, "r70")


@pytest.mark.slow
def test_compare_shows_the_recipe_change_from_record70_to_todays_tiny_record():
    check_compare_shows_the_recipe_change(TINY_RECORD, TODAY)


@pytest.mark.slow
def test_the_snapshots_own_tests_all_run_and_pass_against_it():
    # its tests/ holds 21 (frozen with it); it brings its own gpt_kernels: none skips
    assert run_own_tests(RECORD) == {"passed": 21}
