"""The rest of tests/kernel_checks.py under Triton's interpreter (test_kernels.py says why a process of its own): the
head's softcapped cross-entropy, Polar Express's symmetric GEMMs, the transpose and the kernel benchmark."""

import pytest

from test_kernels import MLP_KERNELS, run_kernel_checks

pytest.importorskip("triton")


@pytest.mark.slow  # a process of its own, and a few interpreted training steps
def test_the_head_and_optimizer_kernels_under_the_interpreter_equal_the_torch_path():
    run_kernel_checks(f"not ({MLP_KERNELS})")
