import dataclasses
import os
import re
import shutil
import signal
import threading
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train_gpt as T
from conftest import REPO, SMALL, cli, main_in_process, run_world, spawn_world, tiny_args
from test_first_contact import logged_losses


def test_training_on_sample_lowers_val_loss(tmp_path):
    result = T.run(tiny_args(tmp_path, num_steps=30, val_every=15, **{**SMALL, "val_tokens": 4096}))
    losses = [loss for _, loss in result.val_losses]
    assert [s for s, _ in result.val_losses] == [0, 15, 30]
    assert losses[1] < losses[0] - 1.0 and losses[2] < losses[1]


@pytest.mark.slow
def test_world_size_one_and_two_take_the_same_steps(tmp_path):
    args = tiny_args(tmp_path, num_steps=4, val_every=2, **SMALL)
    one = T.run(args).val_losses
    two = run_world(2, args, tmp_path)
    assert [s for s, _ in one] == [s for s, _ in two] == [0, 2, 4]
    for (_, a), (_, b) in zip(one, two):
        assert a == pytest.approx(b, abs=2e-3)


@pytest.mark.slow
def test_a_finished_run_has_released_its_process_group_and_its_threads(tmp_path):
    # A group that outlives destroy_process_group keeps gloo's worker threads running into the interpreter's exit,
    # where one still dropping the last tensor of a finished collective needs the GIL and aborts the process
    # (SIGABRT, "terminate called without an active exception"): one W=2 run in a few, before this was pinned.
    for rank in spawn_world(2, tiny_args(tmp_path, num_steps=2, val_every=0, **SMALL), tmp_path):
        assert not [t for t in rank["threads"] if "gloo" in t or "tcpstore" in t], rank["threads"]


def test_the_run_id_is_printed_first_and_the_config_line_only_in_the_log(tmp_path, monkeypatch, capsys):
    code, out, _ = main_in_process(tiny_args(tmp_path, run_id="first", num_steps=1, val_every=0, **SMALL), monkeypatch,
                                   capsys)
    log = (tmp_path / "logs" / "first.txt").read_text()
    assert code == 0 and out.splitlines()[0] == f"run first seed 1, log {tmp_path / 'logs'}/first.txt"
    assert "\nconfig: {" in log and "config: {" not in out  # ~3,000 characters: the log's, not the terminal's
    assert max(map(len, out.splitlines())) < 300


def test_warmup_leaves_no_trace_in_training(tmp_path):
    cold = T.run(tiny_args(tmp_path, num_steps=3, warmup_steps=0, **SMALL))
    warm = T.run(tiny_args(tmp_path, num_steps=3, warmup_steps=2, **SMALL))
    assert cold.val_losses == warm.val_losses
    for a, b in zip(cold.model.parameters(), warm.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_importing_has_no_side_effects(tmp_path):
    # Nor does it import dynamo (over a second of every rank's start-up): the FP8 ops compile when first called.
    code = "import sys; sys.path.insert(0, sys.argv[1]); import train_gpt, torch.distributed as d; " \
           "assert not d.is_initialized(); assert 'torch._dynamo' not in sys.modules, 'dynamo imported'"
    proc = subprocess.run([sys.executable, "-c", code, str(REPO)], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""
    assert list(tmp_path.iterdir()) == []


def run_sh(args: list[str], cwd: Path, nproc: int, env: dict | None = None, **popen) -> subprocess.Popen:
    """./run.sh on this CPU machine (it adds --preset=tiny --device=cpu) with NPROC processes; env adds variables."""
    return subprocess.Popen([str(REPO / "run.sh"), *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "NPROC": str(nproc), **(env or {})}, text=True, **popen)


@pytest.mark.slow
def test_run_sh_with_two_processes_finishes_with_a_val_line(tmp_path):
    proc = run_sh(tiny_args(tmp_path, num_steps=2, val_every=0, **SMALL), tmp_path, nproc=2)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert "step:2/2 val_loss:" in out
    logs = list((tmp_path / "logs").glob("*.txt"))
    assert len(logs) == 1  # rank 0 alone writes the log
    text = logs[0].read_text()
    source = (REPO / "train_gpt.py").read_text()
    assert text.startswith(f"# source: train_gpt.py ({len(source.encode())} bytes)\n{source}")  # its code first
    assert "world size 2" in text and "peak memory:" in text


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_run_sh_ends_with_the_ranks_one_line_and_its_exit_code(tmp_path, nproc):
    # torchrun's own report of a failed rank (~30 lines, exit code 1) used to bury the rank's line.
    # One process: on a PATH with python3 and no python (the GPU machines' image), which run.sh must find.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"} if nproc == 1 else {}
    assert nproc > 1 or shutil.which("python", path=env["PATH"]) is None
    proc = run_sh(["--bogus=1"], tmp_path, nproc, env)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "error: unknown option --bogus (see --help)"


def test_run_sh_asked_for_a_gpu_it_does_not_see_says_so_and_starts_nothing(tmp_path):
    proc = run_sh(["--device=cuda"], tmp_path, 1, {"CUDA_VISIBLE_DEVICES": ""})
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and err.strip() == ("error: --device=cuda but no CUDA GPU is visible; drop it to "
                                                    "run the tiny preset on the CPU"), err


@pytest.mark.slow
def test_run_sh_ctrl_c_on_two_processes_is_one_line_and_130(tmp_path):
    proc = run_sh(tiny_args(tmp_path, num_steps=90, **SMALL), tmp_path, 2, start_new_session=True)
    for line in proc.stdout:
        if line.startswith("step:2/"):
            break
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "interrupted"
    # Both ranks stopped at once; rank 0's log keeps its name (it recorded steps) and ends with the stop.
    logs = list((tmp_path / "logs").glob("*.txt"))
    assert len(logs) == 1 and ".failed" not in logs[0].name, logs
    assert logs[0].read_text().rstrip().endswith("\ninterrupted")


@pytest.mark.slow
def test_sigterm_after_a_save_every_checkpoint_resumes_to_the_uninterrupted_runs_losses_exactly(tmp_path):
    # Preemption (SLURM, Kubernetes: SIGTERM, then a kill): the run stops at once and exits 143; resumed from its last
    # complete --save_every checkpoint, it logs the uninterrupted run's later losses bit for bit.
    fields = dict(num_steps=12, val_every=6, save_every=3, **SMALL)
    T.run(tiny_args(tmp_path, run_id="full", **fields))
    proc = subprocess.Popen([sys.executable, str(REPO / "train_gpt.py"), *tiny_args(tmp_path, run_id="cut", **fields)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("checkpoint:"):
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143 and err.strip().splitlines() == ["terminated"], err
    logs = tmp_path / "logs"
    saved = max(int(p.name[5:]) for p in (logs / "cut").glob("ckpt_*") if (p / T.CKPT_META).exists())
    assert 3 <= saved < 12
    T.run(tiny_args(tmp_path, run_id="resumed", resume=logs / "cut" / f"ckpt_{saved}", **fields))
    full, again = (logged_losses(logs / f"{r}.jsonl") for r in ("full", "resumed"))
    assert {k for k in full if k[0] > saved} <= again.keys()
    assert again == {k: full[k] for k in again}  # bit for bit


@pytest.mark.parametrize("args, env, message", [
    (["--bogus=1"], {}, "unknown option --bogus (see --help)"),
    (["--num_step=3"], {}, "unknown option --num_step; did you mean --num_steps? (see --help)"),
    (["--num_steps=ten"], {}, "--num_steps expects int"),
    (["--preset=huge"], {}, "unknown preset 'huge'"),
    (["--num_steps=0"], {}, "--num_steps must be in [1, 100000], got 0"),
    (["--device=tpu"], {}, "--device must be auto, cuda or cpu"),
    ([], {"WORLD_SIZE": "3"}, "not divisible by the world size 3"),
    (["--train_files=nowhere/*.bin"], {}, "no files match 'nowhere/*.bin'"),
    (["--num_steps=100000"], {}, "the run needs 100000 steps of 8 sequences, each starting at a document"),
    (["--val_tokens=1048576", "--val_seq_len=1024"], {}, "validation needs 1048577 tokens"),
    (["--compile=maybe"], {}, "--compile expects true or false or auto, got 'maybe'"),
    (["--fp8_head=true", "--vocab_size=50260"], {}, "the FP8 head needs --model_dim, --train_seq_len, --vocab_size "
                                                    "divisible by 16 (torch._scaled_mm), got --vocab_size=50260"),
    (["--num_heads=3"], {}, "--num_heads=3 x --head_dim=64 must equal --model_dim=128"),
    (["--muon_lr=nan"], {}, "--muon_lr must be in (0, 10], got nan"),
    (["--muon_lr=-1"], {}, "--muon_lr must be in (0, 10], got -1.0"),
    (["--adam_beta2=1.5"], {}, "--adam_beta2 must be in [0, 1), got 1.5"),
    (["--cooldown_frac=inf"], {}, "--cooldown_frac must be in [0, 1], got inf"),
    (["--lr=0.01"], {}, "unknown option --lr; did you mean --muon_lr or --embed_lr or --head_lr or --scalar_lr"),
    (["--train_files=data/fineweb10B/fineweb_train_*.bin"], {}, "this run is on the CPU: try the tiny preset on the "
                                                                "bundled sample (--preset=tiny"),
])
def test_bad_input_stops_with_one_clear_line(tmp_path, monkeypatch, capsys, args, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    base = [a for a in tiny_args(tmp_path) if not a.startswith(tuple(x.split("=")[0] + "=" for x in args))]
    code, _, err = main_in_process(base + args, monkeypatch, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


@pytest.mark.slow
def test_the_command_line_exits_2_with_one_line_and_no_traceback(tmp_path):
    # In a process of its own: CUDA_VISIBLE_DEVICES is read when CUDA starts.
    proc = cli(tiny_args(tmp_path) + ["--device=cuda"], tmp_path, {"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "error: --device=cuda but no CUDA GPU is visible; use --device=cpu (or --preset=tiny)"
    assert not (tmp_path / "logs").exists()


def test_help_describes_every_field_in_its_group_and_the_presets(monkeypatch, capsys):
    code, out, _ = main_in_process(["--help"], monkeypatch, capsys)
    assert code == 0
    groups = [line[:-1] for line in out.splitlines() if line and " " not in line and line.endswith(":")]
    assert groups == ["data", "model", "optimizer", "schedule", "systems", "run"]
    flags = [f"--{f.name}" for f in dataclasses.fields(T.Config) if f.name != "stages"] + [f"--{c}" for c in
                                                                                           T.STAGE_FLAGS]
    assert "the stage table: a row per stage" in out  # the table itself, its columns as the flags that fill them
    for flag in flags:
        line = next(x for x in out.splitlines() if x.startswith(f"  {flag}="))
        described = line.split(maxsplit=1)[1:] or [out.splitlines()[out.splitlines().index(line) + 1].strip()]
        assert described[0], flag  # its comment, on the line or the next one
    assert "  --num_steps=1285" in out and "  --compile=auto" in out
    assert "  tiny: --seed=1337, --train_files=data/sample/sample_train_*.bin" in out


@pytest.mark.slow
def test_ctrl_c_stops_promptly_with_one_line(tmp_path):
    proc = subprocess.Popen([sys.executable, str(REPO / "train_gpt.py"), *tiny_args(tmp_path, num_steps=100)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("step:2/"):  # the prefetch thread and shard preloader are running
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["interrupted"], err
    steps = [int(s) for s in re.findall(r"^step:(\d+)/100 ", out, re.M)]
    assert max(steps, default=2) < 10, out[-1000:]  # at once: within the few steps run before the signal came


@pytest.mark.parametrize("flags, env, expected", [
    ([], {}, (False, False)),  # auto on the CPU: off
    (["--compile=auto", "--fp8_head=auto"], {}, (False, False)),
    (["--compile", "--fp8_head=true"], {}, (True, True)),  # the CPU rehearsal of the GPU path
    (["--compile=true", "--fp8_head=true"], {"DISABLE_FP8": "1"}, (True, False)),
])
def test_compile_and_fp8_switches_resolve_for_the_device(monkeypatch, flags, env, expected):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = T.parse_config(["--preset=tiny", "--device=cpu", *flags])
    T.setup_runtime(cfg)
    assert (cfg.compile, cfg.fp8_head) == expected  # the config (and the log's copy) says what the run does


def test_runtime_asks_for_expandable_cuda_segments_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    T.setup_runtime(T.parse_config(["--preset=tiny"]))  # --device=auto: CUDA would be initialised after this
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    T.setup_runtime(T.parse_config(["--preset=tiny"]))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


def test_threads_that_touch_the_device_bind_to_it_first(tmp_path, monkeypatch):
    # A new thread's current CUDA device is GPU 0: the prefetch and checkpoint-writer threads of a rank on
    # another GPU must select that rank's device before their first CUDA call.
    selected = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: selected.append((threading.current_thread().name, d)))
    T.bind_thread_to_device(torch.device("cuda", 3))
    assert selected == [(threading.current_thread().name, torch.device("cuda", 3))]
    bound = []
    bind = T.bind_thread_to_device
    monkeypatch.setattr(T, "bind_thread_to_device",
                        lambda d: (bound.append((threading.current_thread().name, d)), bind(d)))
    T.run(tiny_args(tmp_path, num_steps=2, val_every=0, save_every=1))
    names = {name.split("_")[0] for name, d in bound if d == torch.device("cpu")}
    assert names == {"prefetch", "ckpt-writer"}, bound


def test_the_file_alone_says_in_one_line_that_it_needs_gpt_kernels_and_writes_nothing(tmp_path):
    # train_gpt.py copied without gpt_kernels.py: one line at start-up naming the missing file, no log, no traceback.
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(REPO / "train_gpt.py", alone)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "train_gpt.py", *tiny_args(tmp_path, num_steps=2)], cwd=alone, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert run.stderr == "error: train_gpt.py needs gpt_kernels.py beside it: copy the two files together\n"
    assert not (tmp_path / "logs").exists() and sorted(p.name for p in alone.iterdir()) == ["train_gpt.py"]
