import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt as T
from tokenize_text import write_shard
from conftest import SAMPLE_TRAIN

CPU = torch.device("cpu")


def synthetic_shards(tmp_path: Path, n: int = 3, tokens: int = 10000, seed: int = 0) -> list[Path]:
    """Shards of random documents (lengths 1..300) that each start with BOS."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        docs, size = [], 0
        while size < tokens:
            doc = np.concatenate([[T.BOS_ID], rng.integers(0, 50000, rng.integers(1, 300))])
            docs.append(doc)
            size += len(doc)
        paths.append(tmp_path / f"syn_train_{i + 1:06d}.bin")
        write_shard(paths[-1], np.concatenate(docs))
    return paths


def stream(files: list[Path], seq_len: int = 128, epochs: int = 1, preload: bool = False, doc_len: int = 100
           ) -> T.TrainTokenStream:
    """8 sequences of seq_len + 1 tokens a step, documents cut at doc_len, at every step."""
    return T.TrainTokenStream(files, seq_len, 8, 50304, lambda step: (seq_len, doc_len), epochs, preload)


def global_batches(files: list[Path], world_size: int, depth: int, steps: int, seq_len: int = 128,
                   epochs: int = 1) -> list[torch.Tensor]:
    """Each step's sequences from every rank, gathered in (micro-step, rank) order."""
    loaders = [T.PrefetchLoader(T.TrainBatches(stream(files, seq_len, epochs, depth > 0), r, world_size), depth, CPU)
               for r in range(world_size)]
    try:
        batches = []
        for _ in range(steps):
            per_rank = [next(loader) for loader in loaders]
            batches.append(torch.stack([per_rank[r][m] for m in range(8 // world_size) for r in range(world_size)]))
        return batches
    finally:
        for loader in loaders:
            loader.close()


def packed_reference(shards: list[np.ndarray], shapes: list[tuple[int, int]], batch_seqs: int = 8
                     ) -> list[np.ndarray]:
    """The packing rule written out from the spec (record #70 §3.2): from document i on, each chunk is the
    document's first min(its length, max_doc_len, tokens still needed) tokens, until the sequence holds seq_len + 1;
    the next sequence starts at document i + 1 after its last chunk's document; a step that would need a document
    the shard does not have is dropped and built from the next shard's start."""
    shard, k, out = 0, 0, []
    for seq_len, max_doc_len in shapes:
        while True:
            tokens = shards[shard]
            bos = [i for i, t in enumerate(tokens) if t == T.BOS_ID]
            i, rows = k, []
            while len(rows) < batch_seqs and i < len(bos):
                row = []
                while len(row) < seq_len + 1 and i < len(bos):
                    doc_end = bos[i + 1] if i + 1 < len(bos) else len(tokens)
                    row += tokens[bos[i]:min(doc_end, bos[i] + max_doc_len, bos[i] + seq_len + 1 - len(row))].tolist()
                    i += 1
                if len(row) == seq_len + 1:
                    rows.append(row)
            if len(rows) == batch_seqs:
                out.append(np.array(rows, dtype=np.int32))
                k = i
                break
            shard, k = shard + 1, 0
    return out


def test_token_stream_equals_plain_reference_across_shards_and_epochs(tmp_path):
    files = synthetic_shards(tmp_path)
    expected = packed_reference([T.load_shard(f, 50304) for f in files] * 2, [(128, 100)] * 14)
    got = global_batches(files, world_size=1, depth=0, steps=14, epochs=2)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(torch.from_numpy(a), b)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_token_stream_is_identical_for_every_world_size_and_depth(tmp_path, world_size):
    files = synthetic_shards(tmp_path)
    reference = global_batches(files, 1, depth=0, steps=8)
    for depth in [0, 2]:
        for a, b in zip(reference, global_batches(files, world_size, depth, steps=8)):
            assert torch.equal(a, b)


def test_a_stream_seeked_to_a_saved_position_serves_what_the_uninterrupted_stream_serves_next(tmp_path):
    files = synthetic_shards(tmp_path)  # 6 steps of 8 x 129 tokens cross the first shard's end
    whole = stream(files)
    served = [whole.next_step() for _ in range(9)]
    for k in (0, 3, 6):
        resumed = stream(files)
        resumed.seek(k, whole.position(k))
        for step in range(k, 9):
            assert resumed.next_step() == served[step] and resumed.position(step + 1) == whole.position(step + 1)
    assert whole.position(9)[0] >= 2  # the saved positions span shards


def test_sample_sequences_start_documents_and_never_repeat():
    batches = global_batches(T.find_shards(SAMPLE_TRAIN), 2, depth=2, steps=5)
    assert all((b[:, 0] == T.BOS_ID).all() for b in batches)
    assert len({tuple(r.tolist()) for b in batches for r in b}) == 5 * 8


def test_validation_chunks_are_contiguous_and_split_across_ranks(tmp_path):
    path = tmp_path / "val.bin"
    write_shard(path, np.arange(5000) % 50000)
    val = T.ValTokens([path], 4096, 50304)
    seen = {}
    for rank in range(3):
        with T.PrefetchLoader(T.ValBatches(val, 1024, rank, 3), 2, CPU) as loader:
            seen[rank] = [b[0] for b in loader]
    assert [len(seen[r]) for r in range(3)] == [2, 1, 1]
    chunks = sorted((int(c[0]), c) for r in seen for c in seen[r])
    for i, (first, chunk) in enumerate(chunks):
        assert first == i * 1024 and torch.equal(chunk, torch.arange(i * 1024, (i + 1) * 1024 + 1, dtype=torch.int32))


def write_raw(path: Path, header: list[int], tokens: np.ndarray) -> Path:
    h = np.zeros(256, dtype="<i4")
    h[: len(header)] = header
    path.write_bytes(h.tobytes() + tokens.astype("<u2").tobytes())
    return path


@pytest.mark.parametrize("case, message", [
    ("magic", "has magic 12345, expected 20240520"),
    ("version", "has version 7, expected 1"),
    ("size", "header says 100 tokens (1224 bytes) but the file has 1184 bytes"),
    ("header", "is truncated: 100 bytes, shorter than the 1024-byte header"),
    ("vocab", "holds token id 60000 at position 3, outside the vocabulary (< 50304)"),
])
def test_bad_shards_name_the_file_and_the_problem(tmp_path, case, message):
    path = tmp_path / "bad_train_000001.bin"
    toks = np.full(100, 7)
    if case == "magic":
        write_raw(path, [12345, 1, 100], toks)
    elif case == "version":
        write_raw(path, [T.SHARD_MAGIC, 7, 100], toks)
    elif case == "size":
        write_raw(path, [T.SHARD_MAGIC, 1, 100], toks[:80])
    elif case == "header":
        path.write_bytes(b"\0" * 100)
    else:
        toks[3] = 60000
        write_raw(path, [T.SHARD_MAGIC, 1, 100], toks)
    with pytest.raises(T.UsageError) as err:
        T.load_shard(path, 50304)
    assert str(path) in str(err.value) and message in str(err.value)


@pytest.mark.parametrize("pattern, hint", [
    ("data/fineweb10B/fineweb_train_*.bin", "download FineWeb shards with `python data/cached_fineweb10B.py 8`"),
    ("data/sample/sample_train_*.bin", None),  # the bundled sample: found from any folder (see below)
    ("nowhere/*.bin", "check the glob (quote it in the shell), or make shards from text with data/tokenize_text.py"),
])
def test_missing_files_name_the_pattern_and_a_hint_that_fits(tmp_path, monkeypatch, pattern, hint):
    monkeypatch.chdir(tmp_path)  # relative patterns are looked up here, then beside train_gpt.py
    if hint is None:
        assert T.find_shards(pattern) == sorted((T.HERE / "data" / "sample").glob("sample_train_*.bin"))
        monkeypatch.setattr(T, "HERE", tmp_path)  # a checkout that lost its sample
        hint = "the bundled sample is missing from this checkout: restore it with `git checkout data/sample`"
    with pytest.raises(T.UsageError, match="no files match") as err:
        T.find_shards(pattern)
    assert str(err.value).endswith(hint)


def test_running_out_of_data_says_how_much_the_files_hold(tmp_path):
    files = synthetic_shards(tmp_path, n=1, tokens=4000)
    loader = T.PrefetchLoader(T.TrainBatches(stream(files), 0, 1), 2, CPU)
    with pytest.raises(T.UsageError, match=r"training data exhausted at step \d+: 1 shard\(s\) .* hold [\d,]+ tokens"):
        for _ in range(100):
            next(loader)
    loader.close()
    assert not loader.thread.is_alive()


def test_prefetch_thread_exits_after_normal_end_and_after_errors(tmp_path):
    files = synthetic_shards(tmp_path, n=1)
    before = threading.active_count()
    loader = T.PrefetchLoader(T.TrainBatches(stream(files, preload=True), 0, 1), 2, CPU)
    next(loader)
    loader.close()
    assert not loader.thread.is_alive()

    bad = write_raw(tmp_path / "bad.bin", [1, 1, 0], np.zeros(0))
    loader = T.PrefetchLoader(T.TrainBatches(stream([bad]), 0, 1), 2, CPU)
    with pytest.raises(T.UsageError, match="has magic 1"):
        next(loader)
    loader.close()
    assert not loader.thread.is_alive()
    assert threading.active_count() == before  # shard preloader and prefetch threads are gone


def test_a_run_with_exactly_enough_data_never_sees_the_end(tmp_path):
    files = synthetic_shards(tmp_path, n=2)
    whole, available = stream(files), 0
    with pytest.raises(T.UsageError):
        while True:
            whole.next_step()
            available += 1
    # Bounded to the run's steps, the prefetch thread stops there instead of running into the end.
    with T.PrefetchLoader(T.TrainBatches(stream(files, preload=True), 0, 1,
                                         steps=available), 2, CPU) as loader:
        assert len(list(loader)) == available
    # Unbounded, the error preparing the batch after the last one is raised only when it is asked for.
    with T.PrefetchLoader(T.TrainBatches(stream(files), 0, 1), 2, CPU) as loader:
        for _ in range(available):
            next(loader)
        with pytest.raises(T.UsageError, match="training data exhausted"):
            next(loader)


@pytest.mark.parametrize("depth", [0, 2])
def test_the_loader_hands_each_batch_out_with_its_hosts_bigram_rows(tmp_path, depth):
    # ShardedMuonAdam.batch_rows' digest, computed by the thread from the host buffer: the rows the batch handed
    # out with it hashes to, micro-step by micro-step, as the model hashes them.
    files = synthetic_shards(tmp_path)
    rows = 1032
    with T.PrefetchLoader(T.TrainBatches(stream(files), 1, 2, steps=4), depth, CPU,
                          lambda batch: T.bigram_index(batch[:, :-1], rows)) as loader:
        for batch in loader:
            want = torch.stack([T.bigram_index(seq[:-1], rows) for seq in batch])
            assert np.array_equal(loader.digest, want.numpy())


@pytest.mark.parametrize("world_size,split", [(1, 2), (2, 4), (8, 8)])
def test_a_split_micro_step_serves_the_unsplit_token_stream_piece_by_piece(tmp_path, world_size, split):
    # --micro_split: each rank's sequences, in order, each as `split` consecutive rows of seq_len / split inputs; a
    # row's last token is the next row's first (a target, then an input): the same (input, target) pairs in the same
    # order as the unsplit rows, on every rank, with stages of several lengths (the buffer fits the longest).
    files = synthetic_shards(tmp_path)
    shapes = [(128, 100), (256, 300), (128, 60)] * 2

    def batches(r: int, k: int) -> list[torch.Tensor]:
        s = T.TrainTokenStream(files, 256, 8, 50304, lambda step: shapes[step])
        with T.PrefetchLoader(T.TrainBatches(s, r, world_size, steps=len(shapes), split=k), 2, CPU) as loader:
            return [b.clone() for b in loader]

    for r in range(world_size):
        for step, (whole, cut) in enumerate(zip(batches(r, 1), batches(r, split))):
            seq_len = shapes[step][0]
            assert cut.shape == (whole.size(0) * split, seq_len // split + 1)
            rows = cut.view(whole.size(0), split, -1)
            assert torch.equal(rows[:, :, :-1].flatten(1), whole[:, :-1])  # inputs
            assert torch.equal(rows[:, :, 1:].flatten(1), whole[:, 1:])  # their targets
