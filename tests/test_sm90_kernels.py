"""The Triton kernels compiled for the H100 (sm90) offline by Triton's own compiler and ptxas, no GPU needed:
every launch the recipe makes compiles, within sm90's shared memory and without spills (records/sm90_kernels.py)."""

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("triton")
TOOL = REPO / "records" / "sm90_kernels.py"


@pytest.mark.slow
def test_every_recipe_launch_compiles_for_sm90_within_shared_memory_and_without_spills(tmp_path):
    run = subprocess.run([sys.executable, str(TOOL), "--json", str(tmp_path / "sm90.json")], capture_output=True,
                         text=True, timeout=600)
    print(run.stdout)  # the table: shared memory and registers of each kernel
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    rows = json.loads((tmp_path / "sm90.json").read_text())
    assert {r["kernel"].split()[0] for r in rows} == {"relu2_mm", "softcap_ce"} and len(rows) == 5
    for r in rows:
        assert r["ok"] and 0 < r["registers"] <= 255 and r["shared_bytes"] <= 227 * 1024, r


@pytest.mark.slow
def test_the_sm90_check_fails_a_tile_beyond_shared_memory():
    # 256 x 256 tiles with K blocks of 256 in bf16, 4 stages: 2 MB of operands in flight, far over sm90's 227 KB.
    code = ("import sys, json; sys.path.insert(0, sys.argv[1]); import sm90_kernels as S, train_gpt as T; "
            "name, kernel, sig, const = S.cases(T.Config())[0]; S.DEFAULTS.update(num_stages=4, num_warps=8); "
            "print(json.dumps(S.check(name, kernel, sig, dict(const, BLOCK_M=256, BLOCK_N=256, BLOCK_K=256))))")
    run = subprocess.run([sys.executable, "-c", code, str(REPO / "records")], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    row = json.loads(run.stdout.strip().splitlines()[-1])
    assert not row["ok"] and "shared memory" in row["problem"], row
