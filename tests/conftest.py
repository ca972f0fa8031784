import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "data"))  # tokenize_text.write_shard makes the tests' shards
# Record #89's references, written from its spec, live with its snapshot (and are pinned by its own tests there); the
# FP8 MLP, the kernels and upstream's reference still compare with them, from there.
RECORD89_TESTS = REPO / "records" / "snapshots" / "2026-11-28_record89" / "tests"
sys.path.append(str(RECORD89_TESTS))
if TYPE_CHECKING:  # the annotations' name; the tests import the file themselves, after this conftest
    import train_gpt as T

SAMPLE_TRAIN = str(REPO / "data" / "sample" / "sample_train_*.bin")
SAMPLE_VAL = str(REPO / "data" / "sample" / "sample_val_*.bin")
# Every aten op that multiplies matrices (the ones torch's CPU bf16 reference loop serves, and their relatives).
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "_addmm_activation"}
# Small runs (two sequences a step, a narrower model) keep a step well under a second on a shared 2-core machine.
SMALL = dict(global_batch_seqs=2, model_dim=64, head_dim=32, val_tokens=1024, val_seq_len=1024)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: spawns processes or compiles a model or a kernel; `pytest -m 'not slow'` "
                            "is the quick loop (where 4 tests compile a small function)")


STAGE_COLUMNS = ("seq_len", "doc_len", "windows", "lr_mul", "mtp_start", "mtp_end", "prefix_start", "prefix_end")


def stage_flags(*rows: tuple) -> dict[str, str]:
    """A stage table's flags (--stage_<column>=A,B,...) from its rows, the stages then the extension, each row's
    entries in STAGE_COLUMNS' order as the command line writes them."""
    return {f"stage_{column}": ",".join(str(row[i]) for row in rows) for i, column in enumerate(STAGE_COLUMNS)}


# The recipe at the tiny preset's shape in one stage, no extension and Adam every step: a run of any length from
# one step that can checkpoint at any step. The stages, the untie and the extension are tests/test_recipe.py's.
ONE_ROW = (128, 2048, "1/2", 1, "1/0.5", "1/0", 0.25, 0)
ONE_STAGE = dict(train_seq_len=128, **stage_flags(ONE_ROW, ONE_ROW), final_val_windows="1/2", extension_steps=0,
                 untie_stage=1, adam_every=1)


def tiny_args(tmp_path: Path, **overrides: object) -> list[str]:
    """Arguments for a seconds-long tiny run on the bundled sample, logging under tmp_path."""
    fields = dict(preset="tiny", seed=1, train_files=SAMPLE_TRAIN, val_files=SAMPLE_VAL, log_dir=tmp_path / "logs",
                  **ONE_STAGE, num_steps=6, val_every=3, val_tokens=2048, warmup_steps=0)
    fields.update(overrides)
    return [f"--{k}={v}" for k, v in fields.items()]


def config(**fields: object) -> "T.Config":
    """The Config the command line makes of these fields (--name=value each)."""
    import train_gpt as T
    return T.parse_config([f"--{k}={v}" for k, v in fields.items()])


# The recipe's layout at toy widths and lengths (one pair of 32-wide heads, 64-token sequences in three stages): the
# optimizer's and the collectives' tests add their layers and buckets.
TOY = dict(preset="tiny", model_dim=64, num_heads=2, head_dim=32, mlp_ratio=2, vocab_size=512, train_seq_len=64,
           stage_seq_len="64,64,64,64", val_seq_len=64, block_size=32, mudd_dim=8)


def cli(args: list[str], cwd: Path, env: dict | None = None, launcher: list[str] | None = None):
    """train_gpt.py run as a command (under launcher, e.g. torchrun, if given); env adds variables."""
    cmd = (launcher or [sys.executable]) + [str(REPO / "train_gpt.py"), *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def fail_in_step_2(monkeypatch) -> None:
    """GPT.forward raises "a bug in step 2" in step 2's first training micro-step (two micro-steps a step: step 1 is
    logged first)."""
    import train_gpt as T
    forward, calls = T.GPT.forward, [0]

    def failing_in_step_2(self, *args):
        if self.training and calls[0] == 2:
            raise RuntimeError("a bug in step 2")
        calls[0] += self.training
        return forward(self, *args)

    monkeypatch.setattr(T.GPT, "forward", failing_in_step_2)


def outputs_and_grads(fn, tensors: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    """[fn's output, then the gradient of each of tensors (leaves)] for fn(*tensors) and the output gradient grad."""
    for x in tensors:
        x.grad = None
    out = fn(*tensors)
    out.backward(grad)
    return [out.detach()] + [x.grad.clone() for x in tensors]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The relative error of a against b, in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def fresh_copy(dest: Path) -> Path:
    """The repository's files as a clone would have them (tracked, and new files git does not ignore)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def orthogonalizing(fn: Callable[[torch.Tensor], torch.Tensor]) -> "T.UpdateSteps":
    """The optimizer's eager functions with fn in place of Polar Express, after the file's Nesterov momentum."""
    import train_gpt as T
    return T.UpdateSteps(orthogonalize=lambda grad, buf, mu: fn(T.nesterov_(grad, buf, mu)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(ready: Callable[[], bool], proc: subprocess.Popen, timeout_s: float = 300) -> None:
    """Poll until ready() holds; fails if proc exits first or timeout_s passes (generous: a loaded machine is slow)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, f"exited {proc.returncode} first: {proc.communicate()}"
        assert time.monotonic() < deadline, f"not ready after {timeout_s} s"
        time.sleep(0.05)


def live_threads() -> list[str]:
    """The names of this process's threads, C++ ones (gloo's, the TCP store's) included: Linux's /proc."""
    return sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))


@contextlib.contextmanager
def gloo_rank(rank: int, world_size: int, port: int) -> Iterator[None]:
    """This spawned process as rank `rank` of a gloo group on 127.0.0.1:port, one thread; the group destroyed after."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _run_rank(rank: int, world_size: int, port: int, args: list[str], out: str) -> None:
    import train_gpt

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    result = train_gpt.run(args)
    Path(f"{out}.{rank}").write_text(json.dumps({"val_losses": result.val_losses, "threads": live_threads()}))


def spawn_world(world_size: int, args: list[str], tmp_path: Path) -> list[dict]:
    """Run train_gpt.run(args) on world_size spawned gloo ranks; per rank, its val losses and the threads it still
    runs once run() returned."""
    out = tmp_path / f"world_{uuid.uuid4().hex}"
    mp.spawn(_run_rank, args=(world_size, free_port(), args, str(out)), nprocs=world_size, join=True)
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world_size)]


def run_world(world_size: int, args: list[str], tmp_path: Path) -> list[tuple[int, float]]:
    """Rank 0's val losses of spawn_world."""
    return [tuple(x) for x in spawn_world(world_size, args, tmp_path)[0]["val_losses"]]


@pytest.fixture(autouse=True)
def _cpu_threads():
    torch.set_num_threads(2)


def _single_thread():
    """Small matmuls (float64 references, toy models) run far faster on one thread of the shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# A module opts in with pytestmark = pytest.mark.usefixtures("one_thread"): each test on one thread, set after
# _cpu_threads' two; with one_thread_module too, its module-scoped fixtures.
@pytest.fixture
def one_thread(_cpu_threads):
    yield from _single_thread()


@pytest.fixture(scope="module")
def one_thread_module():
    yield from _single_thread()


def cpu_gemms():
    """The bf16 GEMM path a run takes on this CPU (train_gpt.run enters it itself): fp32 GEMMs where the CPU has no
    native bf16 GEMM, whose reference loop would make the suite many times slower. The whole session runs in it,
    and so does every spawned process that compares with it."""
    import train_gpt

    return train_gpt.cpu_math(train_gpt.bf16_gemm_path("auto", cuda=False))


@pytest.fixture(autouse=True, scope="session")
def _cpu_bf16_gemms():
    with cpu_gemms():
        yield


def main_in_process(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """train_gpt.main() as the command line runs it, in this process: (exit code, stdout, stderr)."""
    import train_gpt

    monkeypatch.setattr(sys, "argv", ["train_gpt.py", *argv])
    try:
        train_gpt.main()
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


# Compute capability -> (device name, GiB): the GPUs the resolution tests fake (fake_gpu).
GPUS = {(8, 0): ("NVIDIA A100-SXM4-80GB", 80), (8, 6): ("NVIDIA GeForce RTX 3090", 24),
        (8, 9): ("NVIDIA L40S", 48), (9, 0): ("NVIDIA H100 80GB HBM3", 80), (10, 0): ("NVIDIA B200", 180),
        (12, 0): ("NVIDIA GeForce RTX 5090", 32), (12, 1): ("NVIDIA GB10", 128)}


def fake_gpu(monkeypatch, capability: tuple[int, int]) -> None:
    """A CUDA GPU of this compute capability (a GPUS entry) to train_gpt's resolution, its FA3 loading faked."""
    import train_gpt as T

    name, gib = GPUS[capability]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(name=name, total_memory=gib * 2**30))
    fa3 = (lambda *args, **kwargs: None, "") if capability == (9, 0) else (None, "FA3 runs on Hopper GPUs (sm90) only")
    monkeypatch.setattr(T, "load_fa3", lambda: fa3)  # the hub kernel itself is not here: its loading, faked
    monkeypatch.delenv("DISABLE_FP8", raising=False)
