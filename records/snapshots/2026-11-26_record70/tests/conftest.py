"""Record #70's own tests, run against its frozen train_gpt.py (this folder's parent), not the repository's: the
suite runs them in a process of their own (tests/test_record70.py), where `import train_gpt` finds the snapshot and
gpt_kernels.py beside it. The data is the repository's bundled sample (records/snapshots/ sits in the repository's root)."""

import sys
from pathlib import Path

import pytest
import torch

RECORD = Path(__file__).resolve().parents[1]
REPO = RECORD.parents[2]  # records/snapshots/<record>/ sits two folders under the root
sys.path.insert(0, str(RECORD))

SAMPLE_TRAIN = str(REPO / "data" / "sample" / "sample_train_*.bin")
SAMPLE_VAL = str(REPO / "data" / "sample" / "sample_val_*.bin")
# Small runs (two sequences a step, a narrower model) keep a step well under a second on a shared 2-core machine.
SMALL = dict(global_batch_seqs=2, model_dim=64, head_dim=32, val_tokens=1024, val_seq_len=1024)
# The recipe at the tiny preset's shape in one stage, no extension and Adam every step.
ONE_STAGE = dict(train_seq_len=128, seq_len_stages="128", window_stages="1/2", lr_stages="1", doc_len_stages="2048",
                 mtp_stages="1/0.5", final_val_windows="1/2", extension_steps=0, untie_stage=1, adam_every=1)


def tiny_args(tmp_path: Path, **overrides: object) -> list[str]:
    """Arguments for a seconds-long tiny run on the bundled sample, logging under tmp_path."""
    fields = dict(preset="tiny", seed=1, train_files=SAMPLE_TRAIN, val_files=SAMPLE_VAL, log_dir=tmp_path / "logs",
                  **ONE_STAGE, num_steps=6, val_every=3, val_tokens=2048, warmup_steps=0)
    fields.update(overrides)
    return [f"--{k}={v}" for k, v in fields.items()]


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
