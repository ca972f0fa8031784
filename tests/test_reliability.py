"""Nothing lost, nothing silently wrong: a reused run id, SIGTERM and repeated Ctrl-C, hard kills, corrupted or
swapped checkpoint files, corpora of long documents, diverging runs, bad log folders. Each test reproduces a
failure a user met before it was fixed. (A full disk: test_checkpoint.py.)"""

import hashlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt as T
from conftest import REPO, SMALL, fail_in_step_2, main_in_process, tiny_args
from tokenize_text import write_shard


def digest(folder: Path, run_id: str) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob(f"{run_id}.*")}


def test_a_reused_run_id_is_refused_and_the_earlier_run_kept(tmp_path, monkeypatch, capsys):
    T.run(tiny_args(tmp_path, run_id="same", num_steps=1, **SMALL))
    logs = tmp_path / "logs"
    before = digest(logs, "same")
    assert sorted(before) == ["same.json", "same.jsonl", "same.txt"]
    for extra in ([], ["--train_files=nowhere/*.bin"]):  # also a run that would fail at start-up
        code, _, err = main_in_process(tiny_args(tmp_path, run_id="same", num_steps=1, **SMALL) + extra,
                                       monkeypatch, capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert digest(logs, "same") == before
    code, _, err = main_in_process(tiny_args(tmp_path, run_id="same", num_steps=1, **SMALL), monkeypatch, capsys)
    assert code == 2 and err.strip() == (f"error: run same already has same.txt, same.jsonl, same.json in {logs}: use "
                                         f"another --run_id, --resume=auto to continue that run, or delete or move "
                                         f"those files"), err
    assert sorted(p.name for p in logs.iterdir()) == ["same.json", "same.jsonl", "same.txt"]  # nothing written
    for name in ("same.txt", "same.jsonl"):  # any one of the three refuses the id: here the summary alone
        (logs / name).rename(tmp_path / name)
    code, _, err = main_in_process(tiny_args(tmp_path, run_id="same", num_steps=1, **SMALL), monkeypatch, capsys)
    assert code == 2 and f"run same already has same.json in {logs}:" in err, err
    assert digest(logs, "same") == {"same.json": before["same.json"]}
    (logs / "same.json").rename(tmp_path / "same.json")  # all three moved away: the id runs again
    T.run(tiny_args(tmp_path, run_id="same", num_steps=2, **SMALL))
    assert json.loads((logs / "same.json").read_text())["steps"] == 2
    assert all(hashlib.sha256((tmp_path / n).read_bytes()).hexdigest() == h for n, h in before.items())


@pytest.mark.parametrize("where, message", [
    (lambda tmp: tmp / "a_file", "cannot create it"),  # a path through a file
    (lambda tmp: tmp / "a_file" / "logs", "cannot create it"),
])
def test_a_bad_log_dir_is_one_line(tmp_path, monkeypatch, capsys, where, message):
    (tmp_path / "a_file").write_text("not a folder")
    code, _, err = main_in_process(tiny_args(tmp_path, log_dir=where(tmp_path), num_steps=1, **SMALL), monkeypatch,
                                   capsys)
    assert code == 2 and err.startswith(f"error: --log_dir={where(tmp_path)}: {message}") and err.count("\n") == 1


def start(tmp_path: Path, args: list[str], launcher: list[str] | None = None) -> subprocess.Popen:
    cmd = (launcher or [sys.executable]) + [str(REPO / "train_gpt.py"), *args]
    return subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_for(proc: subprocess.Popen, prefix: str) -> list[str]:
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(prefix):
            return seen
    raise AssertionError(f"no line starting with {prefix!r}: {''.join(seen)[-2000:]} {proc.stderr.read()[-2000:]}")


def assert_complete_or_refused(run_dir: Path) -> None:
    """No half-written file anywhere; each checkpoint folder complete, or without meta.json (a rank stopped
    before it reached that save), which --resume refuses."""
    assert not list(run_dir.rglob("*.tmp"))
    for folder in run_dir.glob("ckpt_*"):
        if (folder / T.CKPT_META).exists():
            T.read_checkpoint_meta(folder)
        else:
            with pytest.raises(T.UsageError, match="is incomplete: no meta.json"):
                T.read_checkpoint_meta(folder)


@pytest.mark.slow
def test_sigterm_stops_like_ctrl_c_finishing_the_checkpoint_in_flight(tmp_path):
    proc = start(tmp_path, tiny_args(tmp_path, run_id="term", num_steps=200, save_every=1, **SMALL))
    wait_for(proc, "checkpoint:")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and err.strip().splitlines() == ["terminated"], err
    assert_complete_or_refused(tmp_path / "logs" / "term")
    assert (tmp_path / "logs" / "term.txt").read_text().rstrip().endswith("\nterminated")


@pytest.mark.slow
def test_sigterm_under_torchrun_stops_every_rank_cleanly(tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = start(tmp_path, tiny_args(tmp_path, run_id="term2", num_steps=200, save_every=1, device="cpu", **SMALL),
                 launcher)
    wait_for(proc, "checkpoint:")
    proc.send_signal(signal.SIGTERM)  # torchrun passes it to both ranks
    _, err = proc.communicate(timeout=180)
    assert proc.returncode != 0
    assert_complete_or_refused(tmp_path / "logs" / "term2")
    assert (tmp_path / "logs" / "term2.txt").read_text().rstrip().endswith("\nterminated")
    # The ranks print one line and no traceback (torchrun's own report of the signal is run.sh's to tidy).
    assert "\nterminated\n" in err and f'File "{REPO / "train_gpt.py"}"' not in err


def test_a_signal_during_a_validation_stops_at_once_with_143_and_the_log_ends_terminated(tmp_path, monkeypatch,
                                                                                       capsys):
    # A scheduler's SIGTERM gives ~30 s; a validation can take minutes (a loaded CPU, a long --val_tokens): the run
    # does not finish it (nor write a checkpoint there) but stops at the batch the signal came in.
    fields = dict(SMALL, num_steps=2, val_every=1, val_seq_len=256)  # 4 val batches a validation
    forward, evals = T.GPT.forward, []

    def sigterm_in_step_1s_validation(self, *args):
        if not self.training:
            evals.append(1)
            if len(evals) == 4 + 2:  # step 0's four batches, then step 1's second
                T.STOP(signal.SIGTERM, None)
        return forward(self, *args)

    monkeypatch.setattr(T.GPT, "forward", sigterm_in_step_1s_validation)
    code, out, err = main_in_process(tiny_args(tmp_path, run_id="cut", **fields), monkeypatch, capsys)
    assert code == 143 and err.strip().splitlines() == ["terminated"], err
    assert len(evals) == 6  # nothing validated after the signal
    assert "step:0/2 val_loss:" in out and "step:1/2 val_loss:" not in out
    logs = tmp_path / "logs"
    assert (logs / "cut.txt").read_text().rstrip().splitlines()[-1] == "terminated"
    assert not (logs / "cut").exists() and not (logs / "cut.json").exists()


def test_a_signal_between_adam_steps_stops_at_once(tmp_path, monkeypatch, capsys):
    forward, steps = T.GPT.forward, []

    def sigterm_in_step_3(self, *args):  # just past the Adam step after step 2: step 3 accumulates for step 4's
        if self.training:
            steps.append(1)
            if len(steps) == 2 * 2 + 1:  # two micro-steps a step (SMALL's two sequences, one rank)
                T.STOP(signal.SIGTERM, None)
        return forward(self, *args)

    monkeypatch.setattr(T.GPT, "forward", sigterm_in_step_3)
    code, out, err = main_in_process(tiny_args(tmp_path, run_id="adam", num_steps=6, val_every=0, adam_every=2,
                                               **SMALL), monkeypatch, capsys)
    assert code == 143 and err.strip().splitlines() == ["terminated"], err
    assert len(steps) == 5  # no micro-step after the signal's, not even to reach the end of the Adam step
    assert "step:2/6 train_loss:" in out and "step:3/6" not in out
    assert (tmp_path / "logs" / "adam.txt").read_text().rstrip().splitlines()[-1] == "terminated"


def test_a_failed_runs_logs_are_set_aside_and_a_rerun_with_its_id_starts_and_keeps_them(tmp_path, monkeypatch):
    fail_in_step_2(monkeypatch)
    with pytest.raises(RuntimeError, match="a bug in step 2") as failure:
        T.run(tiny_args(tmp_path, run_id="again", num_steps=4, val_every=0, **SMALL))
    logs = tmp_path / "logs"
    assert failure.value.__notes__ == [f"(its log is kept as {logs / 'again.failed.txt'}; the run id is free for a "
                                       f"rerun)"]
    kept = digest(logs, "again")
    assert sorted(kept) == ["again.failed.jsonl", "again.failed.txt"]
    assert (logs / "again.failed.txt").read_text().rstrip().splitlines()[-1] == "failed: RuntimeError: a bug in step 2"
    monkeypatch.undo()
    T.run(tiny_args(tmp_path, run_id="again", num_steps=2, val_every=0, **SMALL))  # not refused
    after = digest(logs, "again")
    assert sorted(after) == ["again.failed.jsonl", "again.failed.txt", "again.json", "again.jsonl", "again.txt"]
    assert {n: after[n] for n in kept} == kept  # the failure's logs untouched by the rerun


@pytest.mark.slow
def test_under_torchrun_the_other_ranks_wait_for_rank_0s_line_however_late_it_comes(tmp_path):
    # Bad input reaches every rank; rank 0 alone says why. Here rank 0 comes to it 8 s after rank 1 (a loaded or slow
    # node): rank 1 waits for rank 0's line, where a fixed pause (5 s) had it exit first and torchrun stop rank 0
    # before it printed anything.
    script = tmp_path / "late_rank0.py"
    script.write_text(f"""import os, sys, time
sys.path.insert(0, {str(REPO)!r})
import train_gpt as T
parse = T.parse_config
T.parse_config = lambda argv: (time.sleep(8 if os.environ["RANK"] == "0" else 0), parse(argv))[1]
T.main(cli=True)
""")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    run = subprocess.run([*launcher, "--bogus=1"], capture_output=True, text=True, timeout=300)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]  # torchrun's own report aside
    # Rank 0's line came, 8 s late. Once it has printed, the two ranks exit together: torchrun may stop the later one
    # in its teardown (exit code -15), so only the first one out is sure to report 2 (the code run.sh exits with).
    assert errors == ["error: unknown option --bogus (see --help)"], run.stderr
    assert re.search(r"Root Cause \(first observed failure\):\n\[0\]:\n(.*\n){2}\s*rank\s*: \d \(local_rank: \d\)\n"
                     r"\s*exitcode\s*: 2 ", run.stderr), run.stderr


@pytest.mark.slow
def test_a_rank_killed_under_torchrun_leaves_one_line_and_its_log_set_aside(tmp_path):
    # torchrun looks at its ranks every 5 s here (0.1 s by default): rank 0 notices the lost peer first, as it does
    # within a step's collectives; at 0.1 s torchrun's SIGTERM may come first (the README: then it says terminated).
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "--monitor-interval=5"]
    proc = start(tmp_path, tiny_args(tmp_path, run_id="lost", num_steps=200, device="cpu", **SMALL), launcher)
    wait_for(proc, "step:2/")
    ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    rank1 = next(pid for pid in ranks if b"\0RANK=1\0" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes())
    os.kill(int(rank1), signal.SIGKILL)
    _, err = proc.communicate(timeout=180)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]  # torchrun's own report aside
    assert len(errors) == 1 and errors[0].startswith("error: rank 0 lost the connection to another rank ("), err
    # What the README says a bare torchrun adds after that line (run.sh keeps it quiet): its report, exit code 1.
    assert proc.returncode == 1 and "ChildFailedError" in err.split(errors[0], 1)[1], err
    assert errors[0].endswith("): a rank stopped or died; its own output says why")
    assert f'File "{REPO / "train_gpt.py"}"' not in err and "[rank0]" not in err  # no traceback of rank 0's
    logs = tmp_path / "logs"
    assert not (logs / "lost.txt").exists()  # set aside as every failed run's, its last line the error
    assert (logs / "lost.failed.txt").read_text().rstrip().splitlines()[-1] == errors[0]


@pytest.mark.slow
def test_repeated_ctrl_c_prints_its_stop_once(tmp_path):
    proc = start(tmp_path, tiny_args(tmp_path, num_steps=200, save_every=1, **SMALL))
    wait_for(proc, "step:2/")
    for _ in range(3):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.strip().splitlines() == ["interrupted"], err


@pytest.mark.slow
def test_a_hard_kill_loses_no_printed_line(tmp_path):
    proc = start(tmp_path, tiny_args(tmp_path, run_id="killed", num_steps=200, save_every=2, val_every=0, **SMALL))
    seen = wait_for(proc, "checkpoint:")
    seen += wait_for(proc, "step:")  # a step line after the checkpoint line
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    log = (tmp_path / "logs" / "killed.txt").read_text()
    for line in seen:
        assert line in log, line  # every line printed (train, val, checkpoint) is on disk
    folder = Path(seen[[s.startswith("checkpoint:") for s in seen].index(True)].split()[1])
    T.read_checkpoint_meta(folder)  # and the checkpoint it names is complete


def test_a_checkpoint_file_from_another_step_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    T.run(tiny_args(tmp_path, run_id="src", num_steps=4, save_every=2, val_every=0, **SMALL))
    run_dir = tmp_path / "logs" / "src"
    shutil.copy(run_dir / "ckpt_2" / "model.pt", run_dir / "ckpt_4" / "model.pt")  # same size, other weights
    before = sorted((tmp_path / "logs").rglob("*"))
    code, _, err = main_in_process(tiny_args(tmp_path, run_id="again", num_steps=6, resume=run_dir / "ckpt_4",
                                             **SMALL), monkeypatch, capsys)
    assert code == 2 and err.strip() == (f"error: checkpoint file {run_dir / 'ckpt_4' / 'model.pt'} does not match "
                                         f"its checksum in meta.json: corrupt or from another checkpoint; use another "
                                         f"checkpoint")
    assert sorted((tmp_path / "logs").rglob("*")) == before  # checked at start-up: no log, not even a .failed one


def test_resume_points_at_temporary_files_an_interrupted_save_left(tmp_path):
    T.run(tiny_args(tmp_path, run_id="src", num_steps=2, save_final=True, val_every=0, **SMALL))
    stale = tmp_path / "logs" / "src" / "ckpt_2" / "rank0.pt.tmp"
    stale.write_bytes(b"\0" * 2**20)
    T.run(tiny_args(tmp_path, run_id="again", num_steps=2, resume=stale.parent, val_every=0, **SMALL))
    log = (tmp_path / "logs" / "again.txt").read_text()
    assert f"holds 1 temporary file(s), 1 MiB, left by an interrupted save (e.g. {stale})" in log
    assert stale.exists()  # the run that left it may still be running: reported, not removed


def test_resume_from_a_file_says_it_wants_the_folder(tmp_path, monkeypatch, capsys):
    (tmp_path / "model.pt").write_bytes(b"x")
    code, _, err = main_in_process(tiny_args(tmp_path, resume=tmp_path / "model.pt", **SMALL), monkeypatch, capsys)
    assert code == 2 and "is a file: --resume takes a ckpt_<step> directory" in err


def test_resume_from_a_folder_that_is_no_checkpoint_says_so(tmp_path, monkeypatch, capsys):
    sample = REPO / "data" / "sample"  # the battery's: a folder of shards, not an incomplete checkpoint
    code, _, err = main_in_process(tiny_args(tmp_path, resume=sample, **SMALL), monkeypatch, capsys)
    assert code == 2 and err.strip() == (f"error: {sample} is not a checkpoint: --resume takes a ckpt_<step> "
                                         f"directory, as a run with --save_every or --save_final writes them "
                                         f"under <log_dir>/<run_id>/"), err
    assert not (tmp_path / "logs").exists()


def long_documents(tmp_path: Path, doc_len: int, docs: int) -> str:
    rng = np.random.default_rng(0)
    tokens = np.concatenate([np.r_[T.BOS_ID, rng.integers(0, 50000, doc_len - 1)] for _ in range(docs)])
    write_shard(tmp_path / "long_train_000001.bin", tokens)
    return str(tmp_path / "long_train_*.bin")


def test_the_data_check_counts_what_the_stream_serves(tmp_path, monkeypatch, capsys):
    # Documents of 4 sequence lengths: the stream takes one sequence per document (and skips the rest), so the
    # tokens hold ~4x the steps it can serve. The check counts with the stream's rule: the run is refused up
    # front instead of dying mid-way ("training data exhausted").
    files = long_documents(tmp_path, doc_len=4 * 128, docs=60)
    cfg = T.parse_config(tiny_args(tmp_path, train_files=files, **SMALL))
    shape = lambda step: (cfg.train_seq_len, 2048)  # noqa: E731  (ONE_STAGE's, past the run's steps too)
    stream = T.TrainTokenStream(T.find_shards(files), cfg.train_seq_len, cfg.global_batch_seqs, cfg.vocab_size, shape)
    served = 0
    with pytest.raises(T.UsageError, match="training data exhausted"):
        while True:
            stream.next_step()
            served += 1
    supplied, _ = T.count_documents(cfg, T.find_shards(files), served + 5, shape)
    assert served == supplied and served < 60 // cfg.global_batch_seqs + 1
    tokens_allow = 60 * 4 * 128 // (cfg.global_batch_seqs * (cfg.train_seq_len + 1))
    assert tokens_allow > 3 * served  # what the token count alone would have let through
    args = tiny_args(tmp_path, train_files=files, num_steps=served + 1, **SMALL)
    code, _, err = main_in_process(args, monkeypatch, capsys)
    assert code == 2 and f"the run needs {served + 1} steps" in err and f"supply {served};" in err
    T.run(tiny_args(tmp_path, train_files=files, num_steps=served, val_every=0, **SMALL))  # exactly enough: runs


def test_a_diverging_run_stops_at_the_next_logging_step_and_its_logs_are_set_aside(tmp_path, monkeypatch, capsys):
    # The ranges refuse learning rates that would blow up (at most 10), so the scalars overflow by hand from the
    # fifth step's update on: a divergence as the metrics see one.
    adam_update, fp32_updates = T.adam_update_, itertools.count(1)

    def overflowing(p, *args, **kwargs):
        adam_update(p, *args, **kwargs)
        if p.dtype == torch.float32 and next(fp32_updates) > 8:  # the scalars and the x0 lambdas: two a step
            p.mul_(1e30).mul_(1e30)

    monkeypatch.setattr(T, "adam_update_", overflowing)
    args = tiny_args(tmp_path, run_id="nan", num_steps=30, val_every=0, **SMALL)
    code, out, err = main_in_process(args, monkeypatch, capsys)
    assert code == 2 and err.count("\n") == 2, err  # the error, then where its logs are kept
    assert err.splitlines()[1] == f"(its log is kept as {tmp_path / 'logs' / 'nan.failed.txt'}; the run id is free " \
                                  f"for a rerun)"
    step = int(err.split(" at step ")[1].split(":")[0])
    assert err.startswith("error: the train loss is nan at step") and "the run diverged" in err
    lines = [json.loads(x) for x in (tmp_path / "logs" / "nan.failed.jsonl").read_text().splitlines()]
    losses = {e["step"]: e["train_loss"] for e in lines if "train_loss" in e}
    assert math.isnan(losses[step]) and all(math.isfinite(v) for s, v in losses.items() if s < step)
    assert max(losses) <= step + 1  # stopped at the next logging step
    assert (tmp_path / "logs" / "nan.failed.txt").read_text().rstrip().splitlines()[-1] == err.splitlines()[0]


# The tokenizer with its last document hanging in a pool process: the interrupt lands inside the work, after a
# shard was written, however fast or loaded the machine (a large input raced it: CI once finished before the signal).
HANGING_TOKENIZER = """
import os, signal, sys, time
# Signals as an interactive shell starts a program: a suite launched as a background job (`cmd &`) ignores SIGINT,
# and exec passes an ignored signal on (Python then raises no KeyboardInterrupt).
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
sys.path.insert(0, os.environ["DATA_DIR"])
import tokenize_text

encode = tokenize_text.encode_document

def encode_or_hang(text):
    if text == "hang":
        open(os.environ["HANGING"], "w").close()
        time.sleep(600)
    return encode(text)

tokenize_text.encode_document = encode_or_hang
tokenize_text.main()
"""


def test_tokenize_text_ctrl_c_is_one_line_and_removes_the_shards_it_wrote(tmp_path):
    (tmp_path / "hanging_tokenizer.py").write_text(HANGING_TOKENIZER)
    # 64 documents of BOS + 3 tokens (the pool's first chunk of work), 32 to a shard, then the hanging one
    docs = ["a b c"] * 64 + ["hang"]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    out, hanging = tmp_path / "out", tmp_path / "hanging"
    proc = subprocess.Popen([sys.executable, str(tmp_path / "hanging_tokenizer.py"), str(tmp_path / "docs.jsonl"),
                             "--out_dir", str(out), "--val_tokens", "0", "--shard_tokens", "128", "--workers", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "DATA_DIR": str(REPO / "data"), "HANGING": str(hanging)})
    shard = out / "text_train_000001.bin"
    deadline = time.monotonic() + 120
    while not (hanging.exists() and shard.exists()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hanging.exists() and shard.exists(), proc.communicate()
    proc.send_signal(signal.SIGINT)
    stdout, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip() == "interrupted", err
    assert stdout.splitlines()[-1] == "removed the 1 shard(s) written before the error"
    assert list(out.iterdir()) == []


def test_no_space_for_the_log_is_one_line_and_a_rerun_with_its_run_id_is_not_refused(tmp_path, monkeypatch, capsys):
    from test_checkpoint import FullDisk

    def opener(file, mode="r", *a, **k):  # the log is opened on its locked descriptor
        path = os.readlink(f"/proc/self/fd/{file}") if isinstance(file, int) else str(file)
        return FullDisk(file, mode) if path.endswith(".txt") else open(file, mode, *a, **k)

    monkeypatch.setattr(T, "open", opener, raising=False)
    code, _, err = main_in_process(tiny_args(tmp_path, run_id="full", num_steps=1, **SMALL), monkeypatch, capsys)
    logs = tmp_path / "logs"
    assert code == 2 and err.strip().splitlines() == [
        f"error: cannot write the log {logs / 'full.txt'}: No space left on device",
        f"(its log is kept as {logs / 'full.failed.txt'}; the run id is free for a rerun)"]
    monkeypatch.undo()  # the disk has room again: the same run id runs (its partial log no longer blocks it)
    code, _, err = main_in_process(tiny_args(tmp_path, run_id="full", num_steps=1, **SMALL), monkeypatch, capsys)
    assert code == 0 and (logs / "full.json").exists(), err
