"""DC attention's kernel checks (tests/dc_kernel_checks.py) in a process of their own under Triton's interpreter, as
tests/test_kernels.py runs tests/kernel_checks.py (it says why: TRITON_INTERPRET is read at triton's first import)."""

import os
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("triton")


@pytest.mark.slow  # a process of its own, interpreted kernels
def test_the_dc_attention_kernels_under_the_interpreter_follow_the_torch_path():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "dc_kernel_checks.py"],
                          cwd=REPO / "tests", env=env, capture_output=True, text=True, timeout=600)
    print(proc.stdout[-4000:])  # the measured differences of each case
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
