"""A newcomer's first run, in a scratch copy of the repository with nothing beside it: ./run.sh on a CPU, the
tiny preset's fixed seed reproducing the bundled record, then records/compare.py diff against that record."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

RECORD = Path("records/2026-11-23_tiny_cpu/tiny_cpu_w1.txt")


def scratch_copy(tmp_path: Path) -> Path:
    """The tracked files (and the uncommitted edits to them) alone, as a clone would have them."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    copy = tmp_path / "speedrun"
    for name in files:
        if (REPO / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
    return copy


@pytest.mark.slow
def test_a_first_run_reproduces_the_bundled_record_and_compares_with_it(tmp_path):
    if not (REPO / ".git").exists():
        pytest.skip("needs the git checkout (the copy takes its tracked files)")
    repo = scratch_copy(tmp_path)
    assert not (repo.parent / "shared").exists()
    # The README's command, shortened: the first two steps do not depend on --num_steps (lr 1, window 1).
    run = subprocess.run([str(repo / "run.sh"), "--num_steps=4", "--val_every=0", "--run_id=first"], cwd=repo,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    ours = [json.loads(line) for line in (repo / "logs" / "first.jsonl").read_text().splitlines()]
    record = [json.loads(line) for line in (repo / RECORD.with_suffix(".jsonl")).read_text().splitlines()]
    for step in (1, 2):  # the preset's seed reproduces the record (summation order aside)
        a, b = (next(e["train_loss"] for e in entries if e["step"] == step and "train_loss" in e)
                for entries in (ours, record))
        assert a == pytest.approx(b, abs=1e-3), (step, a, b)
    diff = subprocess.run([sys.executable, "records/compare.py", "diff", str(RECORD), "logs/first.txt"], cwd=repo,
                          capture_output=True, text=True, timeout=120)
    assert diff.returncode == 0, diff.stderr
    assert "num_steps" in diff.stdout and "40" in diff.stdout and "4" in diff.stdout
