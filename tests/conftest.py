import socket
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SAMPLE_TRAIN = str(REPO / "data" / "sample" / "sample_train_*.bin")
SAMPLE_VAL = str(REPO / "data" / "sample" / "sample_val_*.bin")


def tiny_args(tmp_path: Path, **overrides: object) -> list[str]:
    """Arguments for a seconds-long tiny run on the bundled sample, logging under tmp_path."""
    fields = dict(preset="tiny", seed=1, train_files=SAMPLE_TRAIN, val_files=SAMPLE_VAL, log_dir=tmp_path / "logs",
                  train_seq_len=128, final_window_tokens=128, num_steps=6, val_every=3, val_tokens=2048,
                  warmup_steps=0)
    fields.update(overrides)
    return [f"--{k}={v}" for k, v in fields.items()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _cpu_threads():
    torch.set_num_threads(2)
