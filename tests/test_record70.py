"""Record #70 lives on as a frozen snapshot, records/snapshots/2026-11-26_record70/ (train_gpt.py and gpt_kernels.py
of commit b801279): its tiny records ran its code, the first 6 steps of its tiny preset equal theirs (every logged
loss, bit for bit on the record's kind of CPU; within rounding on another), its own tests (#70's exact arithmetic
against tests/reference70.py there, its forward against a float64 spec, its optimizer table and schedule) all pass
against it, and compare.py shows the recipe change to today's file's tiny record."""

import subprocess
import sys

import pytest

from conftest import REPO
from snapshot_checks import rerun_tiny_record, run_own_tests

RECORD = REPO / "records" / "snapshots" / "2026-11-26_record70"
TINY_RECORD = RECORD / "tiny_cpu_w1"  # the snapshot's tiny preset at W=1: .txt, .json, .jsonl
# Today's file's tiny record, against which the diff shows the recipe change from #70.
TODAY = REPO / "records" / "2026-11-28_tiny_cpu_head" / "tiny_cpu_w1.txt"


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


def test_the_tiny_records_ran_the_snapshots_code():
    # Each log opens with the source that ran it, then a line of 100 '=' (tools/compare.py's split).
    source = (RECORD / "train_gpt.py").read_text()
    for run in ("tiny_cpu_w1", "tiny_cpu_w2", "tiny_cpu_avx2"):
        assert (RECORD / f"{run}.txt").read_text().startswith(f"{source}\n{'=' * 100}\n"), run


@pytest.mark.slow
def test_the_snapshots_first_6_steps_equal_its_tiny_record_bit_for_bit_on_the_records_kind_of_cpu(tmp_path):
    # Stopped at step 6 (of 40); on another kind of CPU the losses are compared within rounding instead.
    same_cpu = rerun_tiny_record(RECORD, TINY_RECORD, tmp_path, "r70")
    log = (tmp_path / "r70.txt").read_text()
    assert log.startswith((RECORD / "train_gpt.py").read_text())  # the snapshot ran, not the repository's file
    if same_cpu:
        diff = subprocess.run([sys.executable, "tools/compare.py", "diff", str(TINY_RECORD.with_suffix(".txt")),
                               str(tmp_path / "r70.txt")], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert diff.returncode == 0, diff.stderr
        report = sections(diff.stdout)
        assert report[""][0].startswith("verdict: equal on the steps both cover, ")  # the rerun stopped early
        assert report["config (A -> B)"] == ["(no differences)"] and report["code (A -> B)"] == ["(identical)"]


@pytest.mark.slow
def test_compare_shows_the_recipe_change_from_record70_to_todays_tiny_record():
    if not TODAY.exists():
        pytest.skip(f"today's tiny record {TODAY.relative_to(REPO)} is not made yet (the tiny preset of the "
                    f"repository's train_gpt.py, run once it holds its new recipe)")
    diff = subprocess.run([sys.executable, "tools/compare.py", "diff", str(TINY_RECORD.with_suffix(".txt")),
                           str(TODAY)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert diff.returncode == 0, diff.stderr
    report = sections(diff.stdout)
    assert report[""][0].startswith("verdict: not reproduced: ")  # another recipe: other losses
    config, code = report["config (A -> B)"], report["code (A -> B)"]
    assert config and config != ["(no differences)"], config  # fields changed, added or dropped
    assert len(code) == 1 and code[0].endswith("added (--code shows the hunks)"), code


@pytest.mark.slow
def test_the_snapshots_own_tests_all_run_and_pass_against_it():
    # its tests/ holds 21 (frozen with it); it brings its own gpt_kernels: none skips
    assert run_own_tests(RECORD) == {"passed": 21}
