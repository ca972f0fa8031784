"""Record #89's own tests, run against its frozen train_gpt.py (this folder's parent), not the repository's: the
suite runs them in a process of their own (tests/test_record89.py), where `import train_gpt` finds the snapshot and
gpt_kernels.py beside it. The data is the repository's bundled sample (records/snapshots/ sits in the repository's root)."""

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

RECORD = Path(__file__).resolve().parents[1]
REPO = RECORD.parents[2]  # records/snapshots/<record>/ sits two folders under the root
sys.path.insert(0, str(RECORD))


def orthogonalizing(fn: Callable[[torch.Tensor], torch.Tensor]):
    """The optimizer's eager functions with fn in place of Polar Express, after the snapshot's Nesterov momentum."""
    import train_gpt as T
    return T.UpdateSteps(orthogonalize=lambda grad, buf, mu: fn(T.nesterov_(grad, buf, mu)))


@pytest.fixture(autouse=True)
def _cpu_threads():
    torch.set_num_threads(2)


@pytest.fixture(autouse=True, scope="session")
def _cpu_bf16_gemms():
    """The bf16 GEMM path a run takes on this CPU (fp32 GEMMs where it has no native bf16 GEMM)."""
    import gpt_kernels
    import train_gpt

    for module in (train_gpt, gpt_kernels):
        assert Path(module.__file__).resolve().parent == RECORD, f"the snapshot's {module.__name__}, not the repo's"
    with train_gpt.cpu_gemms(train_gpt.bf16_gemm_path("auto", cuda=False)):
        yield
