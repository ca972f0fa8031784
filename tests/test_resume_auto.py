"""Runs that survive their scheduler: --resume=auto carries a run on from its newest complete checkpoint, however
often it is stopped, to the uninterrupted run's losses; one launch per run id; a log that holds every source file it
ran (tools/compare.py code writes them back); ranks that do not share the log folder are refused at start-up."""

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

import train_gpt as T
from conftest import REPO, SMALL, free_port, main_in_process, tiny_args


def launch(tmp_path: Path, args: list[str], world_size: int = 1, trainer: str = "train_gpt.py") -> subprocess.Popen:
    """The command a job script runs: the trainer, or torchrun with it, in a session of its own (a kill takes all)."""
    launcher = [sys.executable] if world_size == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}"]
    return subprocess.Popen([*launcher, str(REPO / trainer), *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def records(path: Path) -> dict[tuple[int, str], list[float]]:
    """Every loss a run's .jsonl holds, by (step, kind): a step logged by several launches has several."""
    out: dict[tuple[int, str], list[float]] = {}
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # a line a kill cut short
            continue
        for kind in ("train_loss", "val_loss"):
            if kind in entry:
                out.setdefault((entry["step"], kind), []).append(entry[kind])
    return out


def lines(log: Path) -> str:
    """A log's text after the code it holds (which names the lines below too)."""
    return log.read_text().split(T.SEPARATOR, 1)[1]


def kill_launch(proc: subprocess.Popen) -> None:
    """kill -9 every process of a launch, as a lost node: torchrun's ranks too, each in a session of its own."""
    pids, todo = [proc.pid], [proc.pid]
    while todo:
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True,
                                                   text=True).stdout.split()]
        pids, todo = pids + children, todo + children
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    def alive(pid: int) -> bool:  # a rank is torchrun's child: once torchrun is gone, gone or a zombie
        with contextlib.suppress(OSError):
            return "zombie" not in Path(f"/proc/{pid}/status").read_text()
        return False

    while any(map(alive, pids[1:])):
        time.sleep(0.01)


def stop_inside_a_checkpoint_write(proc: subprocess.Popen, run_dir: Path) -> Path | None:
    """kill -9 the launch while a checkpoint folder has parts but no meta.json yet; the folder, or None if the run
    ended first."""
    while proc.poll() is None:
        for folder in run_dir.glob("*ckpt_*"):  # train_optim.py's several trials: trial<T>_ckpt_<step>
            if any(folder.iterdir()) and not (folder / T.CKPT_META).exists():
                kill_launch(proc)
                return None if (folder / T.CKPT_META).exists() else folder  # None: the write won the race
        time.sleep(0.002)
    return None


def stop_after_steps(proc: subprocess.Popen, steps: int, how: signal.Signals) -> None:
    """Send `how` once this launch has logged `steps` training steps (SIGTERM: to the launcher, which passes it on;
    SIGKILL: to every process of the launch)."""
    seen = 0
    for line in proc.stdout:
        seen += " train_loss:" in line
        if seen == steps:
            if how == signal.SIGKILL:
                kill_launch(proc)
            else:
                proc.send_signal(how)
            break
    proc.communicate(timeout=300)


@pytest.mark.slow  # ten launches of a short run, at two world sizes
@pytest.mark.parametrize("world_size", [1, 2])
def test_the_same_command_after_sigterm_and_kill_9_ends_with_the_uninterrupted_runs_losses(tmp_path, world_size):
    args = dict(num_steps=8, save_every=2, val_every=4, resume="auto", **SMALL)
    reference = launch(tmp_path, tiny_args(tmp_path, run_id="straight", **args), world_size)
    assert reference.wait(timeout=900) == 0, reference.stderr.read()[-3000:]
    command = tiny_args(tmp_path, run_id="preempted", **args)
    run_dir, rng = tmp_path / "logs" / "preempted", random.Random(world_size)
    stops = [("SIGTERM", rng.randint(1, 3)), ("SIGKILL", rng.randint(1, 3)), ("SIGKILL in a write", 0)]
    rng.shuffle(stops)
    cut = None
    for how, steps in stops:
        for _ in range(3 if how == "SIGKILL in a write" else 1):  # again where the write finished before the kill
            proc = launch(tmp_path, command, world_size)
            if how == "SIGKILL in a write":
                cut = cut or stop_inside_a_checkpoint_write(proc, run_dir)
            else:
                stop_after_steps(proc, steps, signal.Signals[how])
            assert proc.returncode != 0
            if cut or how != "SIGKILL in a write":
                break
    assert cut is not None  # a save was cut short: the next launch said so and took the one before
    final = launch(tmp_path, command, world_size)
    out, err = final.communicate(timeout=900)
    assert final.returncode == 0, err[-3000:]
    ours, theirs = records(tmp_path / "logs" / "preempted.jsonl"), records(tmp_path / "logs" / "straight.jsonl")
    assert ours.keys() == theirs.keys() and len(theirs) == 8 + 3  # 8 train losses, validations at 0, 4 and 8
    for key, losses in ours.items():  # every loss any launch logged, bit for bit the uninterrupted run's
        assert all(loss == theirs[key][0] for loss in losses), (key, losses, theirs[key])
    log = lines(tmp_path / "logs" / "preempted.txt")
    assert "# source: " not in log  # one header, then a segment per launch
    resumes = [line for line in log.splitlines() if line.startswith("resume: --resume=auto")]
    assert any(f"{cut} is incomplete: no meta.json" in line and ": removed, " in line
               for line in resumes), resumes
    assert "terminated" in log  # the SIGTERM'd launch said why it stopped; the killed ones could not
    again = launch(tmp_path, command, world_size)  # a requeue after the end: nothing to do
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0 and "has finished" in out


def test_a_log_holds_every_source_file_and_compare_writes_them_back_byte_for_byte(tmp_path):
    T.run(tiny_args(tmp_path, run_id="src", num_steps=2, val_every=0, **SMALL))
    log = tmp_path / "logs" / "src.txt"
    out = subprocess.run([sys.executable, str(REPO / "tools" / "compare.py"), "code", str(log), str(tmp_path / "x")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    files = {p.name: p.read_bytes() for p in (tmp_path / "x").iterdir()}
    assert files == {name: (REPO / name).read_bytes() for name in ("train_gpt.py", "gpt_kernels.py")}
    assert log.read_text().startswith("# source: train_gpt.py (")  # the script first, as upstream's logs
    # The files written back run the same run: its first steps' losses, bit for bit.
    rerun = subprocess.run([sys.executable, str(tmp_path / "x" / "train_gpt.py"),
                            *tiny_args(tmp_path, run_id="rerun", num_steps=2, val_every=0, **SMALL)],
                           cwd=REPO, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert records(tmp_path / "logs" / "rerun.jsonl") == records(tmp_path / "logs" / "src.jsonl")
    again = subprocess.run([sys.executable, str(REPO / "tools" / "compare.py"), "code", str(log), str(tmp_path / "x")],
                           capture_output=True, text=True)
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "exists" in again.stderr  # nothing overwritten


def test_the_checkpoints_code_check_covers_every_source_file(tmp_path, monkeypatch, capsys):
    T.run(tiny_args(tmp_path, run_id="src", num_steps=2, save_final=True, val_every=0, **SMALL))
    meta = T.read_checkpoint_meta(tmp_path / "logs" / "src" / "ckpt_2")
    assert meta["sources"] == T.source_digests([REPO / "train_gpt.py", REPO / "gpt_kernels.py"])
    edited = T.source_digests  # gpt_kernels.py edited since: an explicit --resume says so, --resume=auto refuses
    monkeypatch.setattr(T, "source_digests", lambda files: {**edited(files), "gpt_kernels.py": "0" * 64})
    T.run(tiny_args(tmp_path, run_id="other", num_steps=2, resume=tmp_path / "logs" / "src" / "ckpt_2", **SMALL))
    assert "resume: the code differs from the checkpoint's in gpt_kernels.py" in (tmp_path / "logs" / "other.txt"
                                                                                    ).read_text()
    command = tiny_args(tmp_path, run_id="src", num_steps=2, save_final=True, val_every=0, resume="auto", **SMALL)
    for where in ("src.txt", "src/ckpt_2"):  # refused by the run's log, then (the log gone) by its checkpoint
        before = sorted((tmp_path / "logs").rglob("*"))
        code, _, err = main_in_process(command, monkeypatch, capsys)
        where = tmp_path / "logs" / where
        assert code == 2 and err.count("\n") == 1 and f"{where} holds run src with other gpt_kernels.py" in err
        assert sorted((tmp_path / "logs").rglob("*")) == before
        for suffix in (".txt", ".jsonl", ".json"):
            (tmp_path / "logs" / f"src{suffix}").unlink(missing_ok=True)


def test_resume_auto_refuses_another_recipe_and_needs_a_run_id(tmp_path, monkeypatch, capsys):
    T.run(tiny_args(tmp_path, run_id="r", num_steps=2, save_every=1, resume="auto", **SMALL))
    log = (tmp_path / "logs" / "r.txt").read_bytes()
    code, _, err = main_in_process(tiny_args(tmp_path, run_id="r", num_steps=3, save_every=1, resume="auto", **SMALL),
                                   monkeypatch, capsys)
    assert code == 2 and err.count("\n") == 1 and "--num_steps=2 (this launch: 3)" in err
    assert (tmp_path / "logs" / "r.txt").read_bytes() == log
    code, _, err = main_in_process(tiny_args(tmp_path, num_steps=2, resume="auto", **SMALL), monkeypatch, capsys)
    assert code == 2 and err.strip().startswith("error: --resume=auto carries on the run named by --run_id")


def test_resume_auto_without_a_checkpoint_starts_the_run_and_continues_its_log(tmp_path):
    args = tiny_args(tmp_path, run_id="r", num_steps=3, val_every=0, resume="auto", **SMALL)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "r.txt").write_text("# source: train_gpt.py (99")  # a first launch killed in its header
    first = T.run(args)
    log = (tmp_path / "logs" / "r.txt").read_text()
    assert log.startswith("# source: train_gpt.py (") and "(99" not in log  # the cut header began anew
    assert lines(tmp_path / "logs" / "r.txt").count("no checkpoint yet: from step 0") == 1
    (tmp_path / "logs" / "r.json").unlink()  # as if the run had been stopped after its last step
    second = T.run(args)
    log = lines(tmp_path / "logs" / "r.txt")
    assert "# source: " not in log and log.count("no checkpoint yet: from step 0") == 2
    assert second.val_losses == first.val_losses


def test_timed_checkpoints_of_resume_auto_keep_the_newest_two(tmp_path):
    # save_minutes of 0.00001 (0.6 ms): every Adam step from the first the ranks agree on (step 2: step 1's time,
    # read at step 2's line), by the train time every rank agrees on; older timed checkpoints go (2, once 4 and 5
    # are there), --save_every's stay (3, 6).
    T.run(tiny_args(tmp_path, run_id="r", num_steps=6, val_every=0, resume="auto", save_minutes=0.00001,
                    save_every=3, **SMALL))
    run_dir = tmp_path / "logs" / "r"
    assert sorted(p.name for p in run_dir.iterdir()) == ["ckpt_3", "ckpt_4", "ckpt_5", "ckpt_6"]  # ckpt_2 gone
    assert [T.read_checkpoint_meta(run_dir / f"ckpt_{s}")["rolling"] for s in (3, 4, 5, 6)] == [False, True, True, False]


@pytest.mark.slow  # two processes racing
@pytest.mark.parametrize("auto", [False, True])
def test_of_two_launches_of_one_run_id_exactly_one_runs(tmp_path, auto):
    args = tiny_args(tmp_path, run_id="twin", num_steps=4, val_every=0, **SMALL, **({"resume": "auto"} if auto else {}))
    procs = [launch(tmp_path, args) for _ in range(2)]
    results = [(p.wait(timeout=600), *p.communicate()) for p in procs]
    assert sorted(code for code, _, _ in results) == [0, 2], results
    loser = next(err for code, _, err in results if code == 2)
    assert loser.count("\n") == 1 and ("already has twin.txt" in loser or "is running in another process" in loser)
    log = lines(tmp_path / "logs" / "twin.txt")  # the winner's, whole and alone
    assert "# source: " not in log and log.count("step:4/4 train_loss") == 1
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["twin.json", "twin.jsonl", "twin.txt"]


def _node(rank: int, port: int, args: list[str], root: str) -> None:
    """A rank on a 'node' of its own: its own working folder, so --log_dir=logs is a folder only it sees."""
    os.chdir(Path(root) / f"node{rank}")
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        T.run(args)
    except T.UsageError as e:
        Path(f"../error{rank}").write_text(str(e))


@pytest.mark.slow  # spawned ranks
def test_ranks_that_do_not_share_the_log_folder_are_refused_at_start_up_when_they_checkpoint(tmp_path):
    for rank in range(2):
        (tmp_path / f"node{rank}").mkdir()
    args = tiny_args(tmp_path, run_id="apart", num_steps=4, save_every=2, log_dir="logs", **SMALL)
    mp.spawn(_node, args=(free_port(), args, str(tmp_path)), nprocs=2, join=True)
    errors = [(tmp_path / f"error{rank}").read_text() for rank in range(2)]
    assert errors[0] == errors[1] and errors[0].startswith("rank(s) 1 do not see rank 0's files in logs/apart")
    assert not list((tmp_path / "node0" / "logs" / "apart").glob("ckpt_*"))  # no step was trained
