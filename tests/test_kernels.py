"""The Triton kernels' checks (tests/kernel_checks.py) in a process of their own under Triton's interpreter, on the
CPU: TRITON_INTERPRET is read when triton is first imported, and this process imported it long ago (and must
not interpret the compiled model's kernels on a GPU). The MLP's kernels here, the rest in test_kernels_head.py: two
files, so that two test workers take them side by side."""

import os
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("triton")

MLP_KERNELS = "relu2 or mlp or quantizer or scale_reduction or kernel_flag"  # a -k expression over kernel_checks.py


def run_kernel_checks(selection: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "kernel_checks.py", "-k",
                           selection], cwd=REPO / "tests", env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow  # a process of its own, and a few interpreted training steps
def test_the_mlp_kernels_under_the_interpreter_equal_the_torch_path():
    run_kernel_checks(MLP_KERNELS)
