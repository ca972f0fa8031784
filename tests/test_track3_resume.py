"""train_optim.py --resume=auto: the same command, run again after any stop, carries the run on from its newest
complete checkpoint, in the right trial at the right step, to the uninterrupted run's losses bit for bit; what cannot
continue exactly is refused in one line; one launch per run id."""

import json
import signal
import sys
from pathlib import Path

import pytest

import train_gpt as T
import train_optim as O
from conftest import REPO
from test_resume_auto import launch, lines, stop_after_steps, stop_inside_a_checkpoint_write
from test_track3 import main_in_process, small_args

sys.path.insert(0, str(REPO / "tools"))
import compare  # noqa: E402


def losses(path: Path) -> dict[tuple[int, int, str], list[float]]:
    """Every loss a run's .jsonl holds, by (trial, step, kind): a step logged by several launches has several."""
    out: dict[tuple[int, int, str], list[float]] = {}
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # a line a kill cut short
            continue
        for kind in ("train_loss", "val_loss"):
            if kind in entry:
                out.setdefault((entry["trial"], entry["step"], kind), []).append(entry[kind])
    return out


def summary_losses(path: Path) -> list[list[tuple[int, float]]]:
    """Each trial's (step, val loss) in a run's summary."""
    return [[(step, loss) for step, loss, _ in t["val_losses"]] for t in json.loads(path.read_text())["trials"]]


@pytest.mark.slow  # five launches of a short run of two trials
def test_the_same_command_after_sigterm_and_kill_9_ends_with_the_uninterrupted_runs_losses(tmp_path):
    args = dict(trials=2, save_every=1, resume="auto")  # 6 steps a trial, validations at 0, 2, 4 and 6
    reference = launch(tmp_path, small_args(tmp_path, run_id="straight", **args), trainer="train_optim.py")
    assert reference.wait(timeout=600) == 0, reference.stderr.read()[-3000:]
    command = small_args(tmp_path, run_id="preempted", **args)
    run_dir, cut = tmp_path / "logs" / "preempted", None
    # In trial 1 (after 3 of its steps: its checkpoint at 2 complete), in the next checkpoint write (at 3 or later),
    # then 8 steps on, in trial 2 (from trial 1's checkpoint at 2 or later: at most 4 steps are trial 1's).
    for how, steps in [("SIGTERM", 3), ("SIGKILL in a write", 0), ("SIGKILL", 8)]:
        for _ in range(3 if how == "SIGKILL in a write" else 1):  # again where the write finished before the kill
            proc = launch(tmp_path, command, trainer="train_optim.py")
            if how == "SIGKILL in a write":
                cut = cut or stop_inside_a_checkpoint_write(proc, run_dir)
            else:
                stop_after_steps(proc, steps, signal.Signals[how])
            assert proc.returncode != 0
            if cut or how != "SIGKILL in a write":
                break
    assert cut is not None  # a save was cut short: the next launch said so and took the one before
    final = launch(tmp_path, command, trainer="train_optim.py")
    _, err = final.communicate(timeout=600)
    assert final.returncode == 0, err[-3000:]
    ours, theirs = losses(tmp_path / "logs" / "preempted.jsonl"), losses(tmp_path / "logs" / "straight.jsonl")
    assert ours.keys() == theirs.keys() and len(theirs) == 2 * (6 + 4)  # per trial 6 train losses, 4 validations
    for key, logged in ours.items():  # every loss any launch logged, bit for bit the uninterrupted run's
        assert all(loss == theirs[key][0] for loss in logged), (key, logged, theirs[key])
    assert summary_losses(run_dir.with_suffix(".json")) == summary_losses(tmp_path / "logs" / "straight.json")
    log = lines(tmp_path / "logs" / "preempted.txt")
    assert "# source: " not in log and "terminated" in log  # one header; the SIGTERM'd launch said why it stopped
    resumes = [line for line in log.splitlines() if line.startswith("resume: --resume=auto")]
    assert len(resumes) == 4 and any(f"{cut} is incomplete: no meta.json" in line and ": removed, " in line
                                     for line in resumes), resumes
    assert any(f"from {run_dir}/trial2_ckpt_" in line for line in resumes), resumes  # carried on inside trial 2
    again = launch(tmp_path, command, trainer="train_optim.py")  # a requeue after the end: nothing to do
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0 and "has finished" in out


def test_a_run_of_two_trials_carries_on_in_its_second_trial_past_a_corrupt_checkpoint(tmp_path):
    """A stop in trial 2 after its checkpoint at step 4 was saved (here: the summary and that checkpoint's later
    steps undone, the checkpoint at 4 corrupted): the next launch skips it, says so, takes trial 2's at step 2, and
    the run ends with the uninterrupted run's val losses in its summary and every loss equal in its .jsonl."""
    command = small_args(tmp_path, trials=2, save_every=2, resume="auto", run_id="r")
    whole = O.run(command)
    logs, run_dir = tmp_path / "logs", tmp_path / "logs" / "r"
    assert sorted(p.name for p in run_dir.iterdir()) == [f"trial{t}_ckpt_{s}" for t in (1, 2) for s in (2, 4)]
    before = losses(logs / "r.jsonl")
    (logs / "r.json").unlink()
    with open(run_dir / "trial2_ckpt_4" / "rank0.pt", "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 8)
    again = O.run(command)
    assert [t.val_losses[-1][:2] for t in again] == [t.val_losses[-1][:2] for t in whole]
    assert summary_losses(logs / "r.json") == [[v[:2] for v in t.val_losses] for t in whole]
    resume = [line for line in lines(logs / "r.txt").splitlines() if line.startswith("resume: --resume=auto")][-1]
    assert f"from {run_dir / 'trial2_ckpt_2'}; checkpoint file {run_dir / 'trial2_ckpt_4' / 'rank0.pt'} does not " \
           f"match its checksum" in resume and resume.endswith(": removed, taking trial2_ckpt_2"), resume
    after = losses(logs / "r.jsonl")
    assert after.keys() == before.keys() and all(len(set(v)) == 1 for v in after.values())
    assert {k for k, v in after.items() if len(v) == 2} == {(1, s, "train_loss") for s in (3, 4, 5, 6)} | {
        (1, 4, "val_loss"), (1, 6, "val_loss")}  # trial 2's steps after 2 logged again, equal; nothing else
    read = compare.parse_trials((logs / "r.txt").read_text(), logs / "r.txt")  # the track's rule reads two trials
    assert [t.losses for t in read] == [{step: loss for step, loss, _ in t.val_losses} for t in whole]


def test_without_a_checkpoint_it_starts_the_run_and_a_finished_run_is_left_as_it_is(tmp_path, monkeypatch, capsys):
    command = small_args(tmp_path, train_steps=2, resume="auto", run_id="r")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "r.txt").write_text("# source: train_optim.py (99")  # a first launch killed in its header
    O.run(command)
    log = (tmp_path / "logs" / "r.txt").read_text()
    assert log.startswith("# source: ") and "(99" not in log  # the cut header began anew
    assert lines(tmp_path / "logs" / "r.txt").count("no checkpoint yet: from step 0") == 1
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "logs").iterdir())
    capsys.readouterr()
    code, out, err = main_in_process(command, monkeypatch, capsys)
    assert code == 0 and err == "" and out.startswith("run r has finished")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "logs").iterdir()) == before


def test_what_cannot_continue_exactly_is_refused_in_one_line_and_nothing_is_touched(tmp_path, monkeypatch, capsys):
    command = small_args(tmp_path, train_steps=3, save_every=2, resume="auto", run_id="r")
    O.run(command)
    logs = tmp_path / "logs"
    (logs / "r.json").unlink()  # as if stopped after its last step: a launch would carry it on
    capsys.readouterr()
    files = {p: p.read_bytes() for p in sorted(logs.rglob("*")) if p.is_file()}
    cases = [(small_args(tmp_path, train_steps=4, save_every=2, resume="auto", run_id="r"),
              f"--resume=auto: {logs / 'r.txt'} holds run r with --train_steps=3 (this launch: 4)"),
             (small_args(tmp_path, train_steps=3, resume="auto", run_id=""),
              "--resume=auto carries on the run named by --run_id")]
    for argv, expected in cases:
        code, out, err = main_in_process(argv, monkeypatch, capsys)
        assert code == 2 and out == "" and err.count("\n") == 1 and expected in err, err
    edited = T.source_digests  # gpt_kernels.py edited since: refused by the run's log, then (gone) by its checkpoint
    monkeypatch.setattr(T, "source_digests", lambda paths: {**edited(paths), "gpt_kernels.py": "0" * 64})
    for where in (logs / "r.txt", logs / "r" / "ckpt_2"):
        code, out, err = main_in_process(command, monkeypatch, capsys)
        assert code == 2 and err.count("\n") == 1 and f"{where} holds run r with other gpt_kernels.py" in err, err
        assert {p: p.read_bytes() for p in sorted(logs.rglob("*")) if p.is_file()} == files
        for log in (logs / "r.txt", logs / "r.jsonl"):  # its log gone, the checkpoint refuses it
            if files.pop(log, None) is not None:
                log.unlink()


def test_a_second_launch_of_a_running_run_is_refused(tmp_path, monkeypatch, capsys):
    command = small_args(tmp_path, train_steps=2, resume="auto", run_id="r")
    (tmp_path / "logs").mkdir()
    running = T.RunLog(tmp_path / "logs" / "r.txt", tmp_path / "logs" / "r.jsonl")  # holds the log's lock
    try:
        code, out, err = main_in_process(command, monkeypatch, capsys)
    finally:
        running.close()
    assert code == 2 and err.count("\n") == 1 and "run r is running in another process" in err, err
    assert (tmp_path / "logs" / "r.txt").read_text() == "" and not (tmp_path / "logs" / "r").exists()


def test_timed_checkpoints_keep_the_newest_two(tmp_path):
    # save_minutes of 0.00001 (0.6 ms): a checkpoint at every step from the first the ranks agree on a train time
    # (step 2: step 1's, read at step 2's line); older timed ones go (2, once 4 and 5 are there), --save_every's stay.
    O.run(small_args(tmp_path, resume="auto", run_id="r", save_minutes=0.00001, save_every=3))
    run_dir = tmp_path / "logs" / "r"
    assert sorted(p.name for p in run_dir.iterdir()) == ["ckpt_3", "ckpt_4", "ckpt_5"]
    assert [T.read_checkpoint_meta(run_dir / f"ckpt_{s}")["rolling"] for s in (3, 4, 5)] == [False, True, True]
