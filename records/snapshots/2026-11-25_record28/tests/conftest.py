"""Record #28's own tests, run against its frozen train_gpt.py (this folder's parent), not the repository's: the
suite runs them in a process of their own (tests/test_record28.py), where `import train_gpt` finds the snapshot."""

import sys
from pathlib import Path

import pytest
import torch

RECORD = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(RECORD))


@pytest.fixture(autouse=True)
def _cpu_threads():
    torch.set_num_threads(2)


@pytest.fixture(autouse=True, scope="session")
def _cpu_bf16_gemms():
    """The bf16 GEMM path a run takes on this CPU (fp32 GEMMs where it has no native bf16 GEMM)."""
    import train_gpt

    assert Path(train_gpt.__file__).resolve().parent == RECORD, "the snapshot, not the repository's train_gpt.py"
    with train_gpt.cpu_gemms(train_gpt.bf16_gemm_path("auto", cuda=False)):
        yield
