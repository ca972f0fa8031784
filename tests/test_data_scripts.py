"""Tests for data/tokenize_text.py and data/cached_fineweb10B.py: CPU only, no network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cached_fineweb10B
import tokenize_text
import train_gpt
from conftest import REPO

needs_tokenizer = pytest.mark.skipif(
    not (REPO / "data" / "tokenizer").is_dir(), reason="no data/tokenizer/ in this checkout (the bundled GPT-2 BPE)")


def error_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


# -- tokenize_text.py -----------------------------------------------------------------------------

WORDS = "the quick brown fox jumps over the lazy dog while seven ravens count stars".split()


def make_corpus(root: Path) -> tuple[list[str], list[str]]:
    """Inputs (a folder and a file) and the documents they hold, in the order the script must read them."""
    folder = root / "folder"
    folder.mkdir()
    docs_a = ["Hello, world!\nSecond line, with  two spaces.\n"]
    (folder / "a.txt").write_text(docs_a[0], encoding="utf-8")
    docs_b = [f"Ünïcödé — 日本語 🚀 {i}: " + " ".join(WORDS[i % 5:]) for i in range(6)]
    docs_b.insert(2, "a document that contains <|endoftext|> literally, which stays plain text")
    docs_b.append(" ".join(WORDS * 12))  # ~180 tokens: longer than --shard_tokens, gets a shard of its own
    docs_b.append("after the long one")
    with open(folder / "b.jsonl", "w", encoding="utf-8") as f:
        for i, doc in enumerate(docs_b):
            f.write(json.dumps({"id": i, "text": doc}, ensure_ascii=i % 2 == 0) + "\n")
            if i == 3:
                f.write("\n")  # blank lines are skipped
    (folder / "notes.md").write_text("ignored: not .txt/.jsonl inside a folder")
    docs_c = ["last file\r\nkeeps its exact line endings\n"]
    (root / "c.txt").write_bytes(docs_c[0].encode("utf-8"))
    return [str(folder), str(root / "c.txt")], docs_a + docs_b + docs_c


def read_documents_back(out_dir: Path, name: str) -> tuple[list[Path], list[str]]:
    import tiktoken
    enc = tiktoken.get_encoding("r50k_base")
    shards = sorted(out_dir.glob(f"{name}_val_*.bin")) + sorted(out_dir.glob(f"{name}_train_*.bin"))
    docs: list[str] = []
    for path in shards:
        tokens = train_gpt.load_shard(path, 50257)
        assert tokens[0] == train_gpt.BOS_ID, f"{path.name} does not start with a document"
        bounds = list(np.flatnonzero(tokens == train_gpt.BOS_ID)) + [len(tokens)]
        docs += [enc.decode(tokens[s + 1:e].tolist()) for s, e in zip(bounds, bounds[1:])]
    return shards, docs


@needs_tokenizer
@pytest.mark.parametrize("workers", ["1", "2"])
def test_tokenize_round_trip(tmp_path: Path, workers: str, capsys: pytest.CaptureFixture[str]) -> None:
    inputs, expected = make_corpus(tmp_path)
    out = tmp_path / "out"
    tokenize_text.main([*inputs, "--out_dir", str(out), "--name", "demo", "--val_tokens", "40",
                        "--shard_tokens", "60", "--workers", workers])
    shards, docs = read_documents_back(out, "demo")
    assert docs == expected
    names = [p.name for p in shards]
    assert names[0] == "demo_val_000000.bin"
    assert names[1:] == [f"demo_train_{i:06d}.bin" for i in range(1, len(names))] and len(names) >= 4
    assert not list(out.glob("*.tmp"))
    counts = [train_gpt.shard_token_count(p) for p in shards]
    val_docs = train_gpt.load_shard(shards[0], 50257)
    last_doc = len(val_docs) - int(np.flatnonzero(val_docs == train_gpt.BOS_ID)[-1])
    assert counts[0] >= 40 and counts[0] - last_doc < 40  # whole documents, just enough of them
    for path, count in zip(shards[1:], counts[1:]):
        n_docs = int((train_gpt.load_shard(path, 50257) == train_gpt.BOS_ID).sum())
        assert count <= 60 or n_docs == 1, f"{path.name}: {count} tokens in {n_docs} documents"
    assert max(counts[1:]) > 60  # the long document got its own shard
    report = capsys.readouterr()
    assert f"{len(expected)} documents" in report.out and f"{len(shards)} shard(s)" in report.out
    assert "exceeds --shard_tokens" in report.err


@pytest.mark.slow
@needs_tokenizer
def test_tokenize_command_line_and_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "one.txt").write_text("one small document")
    out = tmp_path / "out"
    args = [str(tmp_path / "one.txt"), "--out_dir", str(out), "--val_tokens", "0"]
    run = subprocess.run([sys.executable, str(REPO / "data" / "tokenize_text.py"), *args], capture_output=True,
                         text=True, timeout=60)  # the command line itself, once
    assert run.returncode == 0, run.stderr
    assert [p.name for p in out.iterdir()] == ["text_train_000001.bin"] and "1 documents" in run.stdout
    with pytest.raises(SystemExit) as again:
        tokenize_text.main(args)
    assert again.value.code == 1
    lines = error_lines(capsys)
    assert "--overwrite" in lines[0] and len(lines) == 1
    (out / "text_train_000002.bin").write_bytes(b"stale")
    tokenize_text.main(args + ["--overwrite"])
    assert sorted(p.name for p in out.iterdir()) == ["text_train_000001.bin"]


@pytest.mark.parametrize("content, problem", [
    ('{"text": "fine"}\n{"body": "no text field"}\n', 'line 2: no "text" field'),
    ('{"text": "fine"}\nnot json\n', "line 2: invalid JSON"),
    ('{"text": 7}\n', 'line 1: "text" is int'),
])
@needs_tokenizer
def test_tokenize_bad_jsonl(tmp_path: Path, content: str, problem: str, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "docs.jsonl").write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        tokenize_text.main([str(tmp_path / "docs.jsonl"), "--out_dir", str(tmp_path / "out"), "--val_tokens", "0"])
    assert exit_info.value.code == 1
    lines = error_lines(capsys)
    assert len(lines) == 1 and "docs.jsonl" in lines[0] and problem in lines[0]
    assert not list(tmp_path.rglob("*.bin"))


def test_tokenize_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "data.csv").write_text("a,b\n")
    cases = [([str(tmp_path / "data.csv")], 1, "unknown extension '.csv'"),
             ([str(tmp_path / "missing.txt")], 1, "does not exist"),
             ([str(tmp_path)], 1, "no .txt or .jsonl files"),
             ([str(tmp_path / "data.csv"), "--shard_tokens", "0"], 2, "--shard_tokens must be positive")]
    for args, code, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            tokenize_text.main([*args, "--out_dir", str(tmp_path / "out")])
        lines = error_lines(capsys)
        assert exit_info.value.code == code and len(lines) == 1 and message in lines[0], (args, lines)


def test_tokenize_missing_tokenizer_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    tiktoken = pytest.importorskip("tiktoken")

    def unreachable(name: str) -> None:
        raise ConnectionError("Max retries exceeded")

    monkeypatch.setattr(tiktoken, "get_encoding", unreachable)
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(SystemExit) as exit_info:
        tokenize_text.main([str(tmp_path / "a.txt"), "--out_dir", str(tmp_path / "out")])
    lines = error_lines(capsys)
    assert exit_info.value.code == 1 and len(lines) == 1 and "from the bundled" in lines[0]
    assert "git checkout data/tokenizer" in lines[0]


def test_tokenize_uses_the_bundled_tokenizer_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    monkeypatch.setattr(tokenize_text, "_encoding", None)
    encoding = tokenize_text.load_encoding()
    assert encoding.encode("Hello world") == [15496, 995] and encoding.eot_token == train_gpt.BOS_ID


# -- cached_fineweb10B.py -------------------------------------------------------------------------

class FakeHub:
    """Stands in for hf_hub_download: writes a valid shard, or fails the way it is told to for some files."""

    def __init__(self, fail: dict[str, str] | None = None):
        self.fail = fail or {}
        self.calls: list[str] = []

    def __call__(self, repo_id: str, filename: str, *, repo_type: str, local_dir: str, **kwargs: object) -> str:
        assert (repo_id, repo_type) == ("kjj0/fineweb10B-gpt2", "dataset")
        self.calls.append(filename)
        target = Path(local_dir) / filename
        how = self.fail.get(filename, "")
        if how == "unreachable":
            from huggingface_hub.errors import LocalEntryNotFoundError
            raise LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub") \
                from ConnectionError("[Errno -2] Name or service not known")
        if how == "partial":  # what an interrupted transfer leaves behind
            hub_dir = Path(local_dir) / ".cache" / "huggingface" / "download"
            hub_dir.mkdir(parents=True, exist_ok=True)
            (hub_dir / "Zm9vYmFy.0123abcd.incomplete").write_bytes(b"\0" * 4096)
            (hub_dir / f"{filename}.lock").touch()
            target.write_bytes(b"\0" * 100)
            raise OSError("Connection reset by peer")
        if how == "garbage":
            target.write_bytes(b"<html>rate limited</html>")
        else:
            tokenize_text.write_shard(target, np.full(1000, 50256, dtype=np.uint16))
        return str(target)


def assert_no_partial_files(folder: Path) -> None:
    for path in folder.rglob("*"):
        assert not path.name.endswith((".incomplete", ".tmp", ".lock")), path
        if path.suffix == ".bin":
            train_gpt.shard_token_count(path)


def test_download_then_skip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hub = FakeHub()
    cached_fineweb10B.main(["3", "--dir", str(tmp_path)], download=hub)
    expected = ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in (1, 2, 3)]
    assert sorted(hub.calls) == sorted(expected)
    out = capsys.readouterr().out
    assert all(f"{name}  " in out and "ok" in out for name in expected)
    assert sorted(p.name for p in tmp_path.glob("*.bin")) == sorted(expected)

    (tmp_path / "fineweb_train_000002.bin").write_bytes(b"truncated")  # a damaged file is fetched again
    rerun = FakeHub()
    cached_fineweb10B.main(["3", "--dir", str(tmp_path)], download=rerun)
    assert rerun.calls == ["fineweb_train_000002.bin"]
    assert capsys.readouterr().out.count("skip (already present)") == 3
    assert_no_partial_files(tmp_path)


@pytest.mark.parametrize("how", ["unreachable", "partial"])
def test_download_hub_unreachable(tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]) -> None:
    hub = FakeHub(fail={"fineweb_train_000002.bin": how})
    with pytest.raises(SystemExit) as exit_info:
        cached_fineweb10B.main(["2", "--dir", str(tmp_path), "--workers", "1"], download=hub)
    assert exit_info.value.code == 1
    lines = error_lines(capsys)
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: cannot download fineweb_train_000002.bin from the Hugging Face hub")
    assert ("Name or service not known" if how == "unreachable" else "Connection reset by peer") in lines[0]
    assert "Traceback" not in lines[0]
    assert_no_partial_files(tmp_path)
    # the files that did arrive are kept, and a rerun fetches only the missing one
    assert sorted(p.name for p in tmp_path.glob("*.bin")) == ["fineweb_train_000001.bin", "fineweb_val_000000.bin"]
    rerun = FakeHub()
    cached_fineweb10B.main(["2", "--dir", str(tmp_path)], download=rerun)
    assert rerun.calls == ["fineweb_train_000002.bin"]


def test_download_invalid_file_removed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hub = FakeHub(fail={"fineweb_train_000001.bin": "garbage"})
    with pytest.raises(SystemExit) as exit_info:
        cached_fineweb10B.main(["1", "--dir", str(tmp_path)], download=hub)
    assert exit_info.value.code == 1
    lines = error_lines(capsys)
    assert len(lines) == 1 and "fineweb_train_000001.bin" in lines[0] and "removed" in lines[0]
    assert not (tmp_path / "fineweb_train_000001.bin").exists()
    assert (tmp_path / "fineweb_val_000000.bin").exists()


@pytest.mark.parametrize("n", ["0", "-3", "104", "two", "1.5"])
def test_download_bad_n(tmp_path: Path, n: str, capsys: pytest.CaptureFixture[str]) -> None:
    hub = FakeHub()
    with pytest.raises(SystemExit) as exit_info:
        cached_fineweb10B.main([n, "--dir", str(tmp_path / "fw")], download=hub)
    assert exit_info.value.code == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: N must be") and n in lines[0]
    assert hub.calls == [] and not (tmp_path / "fw").exists()


@pytest.mark.slow
def test_download_command_line_offline(tmp_path: Path) -> None:
    """The real hf_hub_download, told not to use the network: one line, exit 1, nothing partial left."""
    pytest.importorskip("huggingface_hub")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, str(REPO / "data" / "cached_fineweb10B.py"), "2", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1].startswith("error: cannot download fineweb_")
    assert "Traceback" not in run.stderr
    assert not list(tmp_path.glob("*.bin"))
    assert_no_partial_files(tmp_path)
    assert not (tmp_path / ".cache").exists()  # the hub's bookkeeping folder goes too


def test_download_fails_fast_when_the_hub_does_not_resolve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_ENDPOINT", "http://hub.invalid")  # a name that never resolves
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    target = tmp_path / "fineweb10B"
    with pytest.raises(SystemExit) as exit_info:
        cached_fineweb10B.main(["2", "--dir", str(target)])
    lines = error_lines(capsys)
    assert exit_info.value.code == 1 and len(lines) == 1
    assert lines[0].startswith("error: cannot reach the Hugging Face hub at http://hub.invalid (")
    assert not target.exists()  # nothing left behind
