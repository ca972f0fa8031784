"""Checkpoints and resume on the CPU: exact continuation at W = 1 and 2 (gloo ranks), re-sharding a W = 2
checkpoint to W = 1, refusal of partial, corrupt or mismatched checkpoints (left untouched), and a
checkpoint at the last step complete on disk when the process exits."""

import errno
import hashlib
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import train_gpt as T
from conftest import ONE_ROW, REPO, SAMPLE_TRAIN, SMALL, cli, main_in_process, run_world, stage_flags, tiny_args

K = 3
# Schedules that do not depend on --num_steps (no lr or momentum cooldown, one next-token weight, fixed windows), so
# a K-step run resumed with --num_steps=2K continues exactly as the 2K-step run.
STEADY = dict(cooldown_frac=0.0, muon_momentum_cooldown_steps=0, val_every=K,
              **stage_flags(*[(*ONE_ROW[:4], 1, 1, 0.25, 0.25)] * 2))


def args(tmp_path: Path, run_id: str, **overrides: object) -> list[str]:
    return tiny_args(tmp_path, run_id=run_id, **{**SMALL, **STEADY, **overrides})


def ckpt(tmp_path: Path, run_id: str, step: int) -> Path:
    return tmp_path / "logs" / run_id / f"ckpt_{step}"


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_same_tensors(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k


def test_resume_at_world_size_one_is_exact(tmp_path):
    full = T.run(args(tmp_path, "full", num_steps=2 * K, save_every=K))
    first = T.run(args(tmp_path, "first", num_steps=K, save_final=True))
    second = T.run(args(tmp_path, "second", num_steps=2 * K, resume=ckpt(tmp_path, "first", K), warmup_steps=2))
    assert [s for s, _ in full.val_losses] == [0, K, 2 * K]
    assert first.val_losses == full.val_losses[:2]
    assert second.val_losses == full.val_losses[1:]  # step K (the loaded state), then 2K: bit for bit
    for a, b in zip(full.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)
    assert_same_tensors(load(ckpt(tmp_path, "full", K) / "model.pt"), load(ckpt(tmp_path, "first", K) / "model.pt"))
    assert second.summary["train_time_ms"] > first.summary["train_time_ms"]  # carried over, then added to
    log = (tmp_path / "logs" / "second.txt").read_text()
    assert f"resume: {ckpt(tmp_path, 'first', K)} at step {K} of run first" in log
    assert re.search(r"data from shard 0 token [\d,]+$", log, re.M) and f"num_steps {K} -> {2 * K}" in log
    assert re.search(r"^warmup: snapshot \d+\.\d ms, 2 steps \d+\.\d s, restore \d+\.\d ms "
                     r"\(untimed; state restored\)$", log, re.M)
    first_log = (tmp_path / "logs" / "first.txt").read_text()
    assert re.search(rf"^checkpoint: {re.escape(str(ckpt(tmp_path, 'first', K)))} \(step {K}: loop stall "
                     r"\d+\.\d+ ms, on disk \d+\.\d+ s later\)$", first_log, re.M)


def test_a_resume_with_other_stage_lengths_continues_the_stream_where_the_checkpoint_left_it(tmp_path):
    # The checkpoint saves the stream's exact position: new stage lengths apply to the data still to come, no
    # token is trained twice (re-deriving the position from the new lengths lands ~5k tokens back).
    staged = dict(train_seq_len=512, num_steps=6, val_every=0, **SMALL,
                  **stage_flags((256, 2048, "0/1", 1, 1, 1, 0.25, 0.25), (384, 2048, "1/2", 1, 1, 1, 0.25, 0),
                                (512, 2048, "1/3", 1, 1, 1, 0, 0), (512, 2048, "1/3", 1, 1, 1, 0, 0)))
    T.run(tiny_args(tmp_path, run_id="first", save_every=2, **staged))
    meta = T.read_checkpoint_meta(ckpt(tmp_path, "first", 2))

    def stream_after_two_steps(fields: dict) -> T.TrainTokenStream:
        cfg = T.parse_config(tiny_args(tmp_path, **fields))
        stream = T.TrainTokenStream(T.find_shards(SAMPLE_TRAIN), cfg.train_seq_len, cfg.global_batch_seqs,
                                    cfg.vocab_size, step_shape=T.step_shape(T.schedule_table(cfg)))
        for _ in range(2):
            stream.next_step()
        return stream

    consumed = stream_after_two_steps(staged)
    assert meta["data_position"] == [consumed.next_file, consumed.pos] and consumed.pos > 0
    changed = {**staged, "stage_seq_len": "128,256,512,512"}
    T.run(tiny_args(tmp_path, run_id="second", resume=ckpt(tmp_path, "first", 2), **changed))
    log = (tmp_path / "logs" / "second.txt").read_text()
    assert f"data from shard {consumed.next_file - 1} token {consumed.pos:,}" in log
    assert stream_after_two_steps(changed).pos < consumed.pos  # re-derived: those tokens would train twice


@pytest.mark.slow
def test_resume_at_world_size_two_is_exact_and_reshards_to_one(tmp_path):
    full = run_world(2, args(tmp_path, "full", num_steps=2 * K, save_every=K), tmp_path)
    saved = ckpt(tmp_path, "full", K)
    assert sorted(p.name for p in saved.iterdir()) == ["meta.json", "model.pt", "rank0.pt", "rank1.pt"]
    second = run_world(2, args(tmp_path, "second", num_steps=2 * K, resume=saved, save_final=True), tmp_path)
    assert second == full[1:]
    end_full, end_second = ckpt(tmp_path, "full", 2 * K), ckpt(tmp_path, "second", 2 * K)
    for name in ["model.pt", "rank0.pt", "rank1.pt"]:  # parameters and both optimizer shards
        assert_same_tensors(load(end_full / name), load(end_second / name))

    one = T.run(args(tmp_path, "one", num_steps=2 * K, resume=saved))  # W = 1 takes both ranks' shards
    assert "re-sharded from world size 2 to 1" in (tmp_path / "logs" / "one.txt").read_text()
    assert [s for s, _ in one.val_losses] == [K, 2 * K]
    for (_, a), (_, b) in zip(one.val_losses, full[1:]):
        assert a == pytest.approx(b, abs=2e-3)


@pytest.fixture(scope="module")
def final_ckpt(tmp_path_factory) -> Path:
    """A checkpoint requested at the last step of a run."""
    tmp = tmp_path_factory.mktemp("final")
    T.run(args(tmp, "src", num_steps=2, val_every=0, save_final=True))
    return ckpt(tmp, "src", 2)


@pytest.mark.slow
def test_a_checkpoint_at_the_last_step_is_complete_when_the_process_exits(tmp_path):
    proc = cli(args(tmp_path, "src", num_steps=2, val_every=0, save_final=True), tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    folder = ckpt(tmp_path, "src", 2)
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "model.pt", "rank0.pt"]  # no temporaries
    meta = T.read_checkpoint_meta(folder)  # raises unless complete
    assert meta["step"] == 2 and meta["world_size"] == 1 and meta["rolling"] is False
    assert meta["sources"] == {name: hashlib.sha256((REPO / name).read_bytes()).hexdigest()
                               for name in ("train_gpt.py", "gpt_kernels.py")}
    assert f"checkpoint: {folder} (step 2: loop stall" in proc.stdout


def fingerprint(folder: Path) -> dict[str, tuple[str, int]]:
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns) for p in folder.iterdir()}


def truncate(folder: Path) -> None:
    path = folder / "rank0.pt"
    os.truncate(path, path.stat().st_size // 2)


def scribble(folder: Path) -> None:  # same size, broken content
    with open(folder / "rank0.pt", "r+b") as f:
        f.write(b"\0" * 4096)


def garbage_meta(folder: Path) -> None:
    (folder / "meta.json").write_text("{this is not json")


@pytest.mark.parametrize("damage, overrides, message", [
    (truncate, {}, "rank0.pt has"),
    (lambda f: (f / "rank0.pt").unlink(), {}, "is incomplete: rank0.pt is missing"),
    (lambda f: (f / "meta.json").unlink(), {}, "is incomplete: no meta.json"),
    (garbage_meta, {}, "meta.json is unreadable"),
    (scribble, {}, "rank0.pt does not match its checksum in meta.json"),
    (None, {"model_dim": 32, "head_dim": 16}, "needs --model_dim=64 (this run: 32)"),
    (None, {"global_batch_seqs": 4}, "needs --global_batch_seqs=2 (this run: 4)"),
    (None, {"num_steps": 1}, "is at step 2, beyond --num_steps=1"),
], ids=["truncated", "missing-rank", "missing-meta", "garbage-meta", "corrupt-rank", "model-dim", "batch",
        "past-end"])
def test_a_bad_checkpoint_is_refused_and_left_untouched(tmp_path, final_ckpt, damage, overrides, message):
    folder = tmp_path / "copy" / "ckpt_2"
    shutil.copytree(final_ckpt, folder)
    if damage is not None:
        damage(folder)
    before = fingerprint(folder)
    with pytest.raises(T.UsageError, match=re.escape(message)):
        T.run(args(tmp_path, "again", resume=folder, save_every=1, **{"num_steps": 4, **overrides}))
    assert fingerprint(folder) == before
    assert not (tmp_path / "logs" / "again").exists()  # nothing saved


def test_a_resumed_run_needs_its_own_run_id(tmp_path, final_ckpt):
    folder = tmp_path / "logs" / "src" / "ckpt_2"
    shutil.copytree(final_ckpt, folder)
    before = fingerprint(folder)
    with pytest.raises(T.UsageError, match="a resumed run writes under its own --run_id"):
        T.run(args(tmp_path, "src", num_steps=4, resume=folder, save_final=True))
    with pytest.raises(T.UsageError, match="already holds checkpoints"):  # a reused run id never overwrites
        T.run(args(tmp_path, "src", num_steps=2, save_final=True))
    assert fingerprint(folder) == before and not (tmp_path / "logs" / "src.txt").exists()


def test_a_mismatch_stops_with_one_line(tmp_path, final_ckpt, monkeypatch, capsys):
    code, _, err = main_in_process(args(tmp_path, "again", resume=final_ckpt, num_layers=6, attn_pattern="SL-SSL",
                                        value_embeds="0---12"),
                                   monkeypatch, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: checkpoint ") and "needs --num_layers=5 (this run: 6)" in lines[0]


class FullDisk:
    """A file whose writes fail as on a full disk (ENOSPC), opened in place of train_gpt's checkpoint files."""

    def __init__(self, path, mode):
        self.file = open(path, mode)

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def test_a_full_disk_leaves_no_partial_file_training_goes_on_and_the_run_fails_at_the_end(tmp_path, monkeypatch,
                                                                                           capsys):
    monkeypatch.setattr(T, "open", lambda path, mode="r", *a, **k: FullDisk(path, mode) if "ckpt_" in str(path)
                        else open(path, mode, *a, **k), raising=False)
    with pytest.raises(T.UsageError, match=r"the run finished, but 1 requested checkpoint\(s\) failed: .*ckpt_2 "
                                           r"\(no space left on .*ckpt_2\)"):
        T.run(args(tmp_path, "full", num_steps=2, val_every=0, save_final=True))
    folder = ckpt(tmp_path, "full", 2)
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.failed"]  # no half-written file is left
    assert f"checkpoint: {folder} FAILED (no space left on {folder}); the run continues" in capsys.readouterr().err
    with pytest.raises(T.UsageError, match="is incomplete: no meta.json"):
        T.read_checkpoint_meta(folder)
    log = (tmp_path / "logs" / "full.txt").read_text()
    assert "step:2/2 val_loss:" in log and (tmp_path / "logs" / "full.json").exists()  # the run itself finished
    assert log.rstrip().endswith("requested checkpoint(s) failed: " + f"{folder} (no space left on {folder})")
