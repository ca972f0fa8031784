"""Turn text files into GPT-2 token shards in the speedrun format (read by train_gpt.load_shard).

    python data/tokenize_text.py INPUT... --out_dir DIR [--name NAME] [--val_tokens N]
                                 [--shard_tokens N] [--workers W] [--overwrite]

Documents: a .txt file is one document; each non-blank line of a .jsonl file is one document,
its "text" field. An INPUT folder contributes its .txt and .jsonl files (not subfolders), sorted
by name. Documents keep the order of the inputs; empty ones are skipped.

Tokens: GPT-2 BPE (tiktoken "r50k_base", encode_ordinary, so a literal "<|endoftext|>" in the
text is plain text), each document prefixed with BOS 50256. The BPE file comes from the bundled
data/tokenizer/ (no network needed) unless TIKTOKEN_CACHE_DIR names another folder.

Shards, all of whole documents:
  NAME_val_000000.bin    the first documents, until it holds at least --val_tokens tokens
                         (default 262,144, as the bundled data/sample; the tiny preset reads
                         16,385 of them; 0 writes no val shard);
  NAME_train_000001.bin, NAME_train_000002.bin, ...  the remaining documents, at most
                         --shard_tokens tokens each (default 100M, as FineWeb); a document longer
                         than that gets a shard of its own, which is then larger (with a warning).
Existing NAME_* shards in DIR are refused unless --overwrite, which replaces them (old ones not
rewritten are deleted once the new shards are written). On an error, the shards this run wrote
are removed again.

Inputs over 1 MB in total are tokenized by a pool of processes (order preserved).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from command_line import OneLineParser, fail  # noqa: E402
from train_gpt import BOS_ID, HEADER_INTS, SHARD_MAGIC, SHARD_VERSION, UsageError, atomic_file  # noqa: E402

if TYPE_CHECKING:
    import tiktoken

ENCODING = "r50k_base"
BUNDLED_TOKENIZER = Path(__file__).resolve().parent / "tokenizer"  # r50k_base's BPE file, named as tiktoken caches it
EXTENSIONS = (".txt", ".jsonl")
PARALLEL_MIN_BYTES = 1_000_000
DEFAULT_VAL_TOKENS = 262_144
DEFAULT_SHARD_TOKENS = 100_000_000


# -- reading --------------------------------------------------------------------------------------

def expand_inputs(inputs: Sequence[str]) -> list[Path]:
    """Files to read, in order: each INPUT file, or a folder's .txt/.jsonl files sorted by name."""
    files: list[Path] = []
    for text in inputs:
        path = Path(text)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in EXTENSIONS)
            if not found:
                raise UsageError(f"folder {path} holds no .txt or .jsonl files")
            files.extend(found)
        elif path.is_file():
            if path.suffix not in EXTENSIONS:
                raise UsageError(f"{path}: unknown extension {path.suffix!r}; expected .txt (one document) "
                                 f"or .jsonl (one document per line, in its \"text\" field)")
            files.append(path)
        else:
            raise UsageError(f"input {path} does not exist")
    return files


def read_documents(files: Sequence[Path]) -> Iterator[str]:
    """Every document's text, in input order; empty documents are dropped."""
    for path in files:
        try:
            with open(path, encoding="utf-8-sig", newline="") as f:
                if path.suffix == ".txt":
                    text = f.read()
                    if text:
                        yield text
                    continue
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise UsageError(f"{path} line {lineno}: invalid JSON ({e.msg})") from None
                    if not isinstance(record, dict) or "text" not in record:
                        raise UsageError(f"{path} line {lineno}: no \"text\" field")
                    if not isinstance(record["text"], str):
                        raise UsageError(f"{path} line {lineno}: \"text\" is {type(record['text']).__name__}, "
                                         f"not a string")
                    if record["text"]:
                        yield record["text"]
        except UnicodeDecodeError as e:
            raise UsageError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
        except OSError as e:
            raise UsageError(f"cannot read {path}: {e.strerror}") from None


# -- tokenizing -----------------------------------------------------------------------------------

def load_encoding() -> tiktoken.Encoding:
    try:
        import tiktoken
    except ImportError:
        raise UsageError("tiktoken is not installed: pip install tiktoken") from None
    cache = os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(BUNDLED_TOKENIZER))  # read at the first get_encoding
    try:
        return tiktoken.get_encoding(ENCODING)
    except Exception as e:  # a missing or wrong BPE file: tiktoken then tries to download it
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        reason = reason if len(reason) <= 120 else reason[:117] + "..."
        where = f"the bundled {cache}" if cache == str(BUNDLED_TOKENIZER) else f"TIKTOKEN_CACHE_DIR={cache}"
        raise UsageError(f"cannot load the GPT-2 tokenizer ({ENCODING}) from {where} ({reason}); restore it with "
                         f"`git checkout data/tokenizer` or point TIKTOKEN_CACHE_DIR at a folder holding the "
                         f"{ENCODING} file") from None


_encoding: tiktoken.Encoding | None = None  # per process: set by _init_worker or on first use


def _init_worker() -> None:
    global _encoding
    _encoding = load_encoding()


def _init_pool_worker() -> None:
    """A pool process: Ctrl-C reaches the whole process group, and only the main process handles it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker()


def encode_document(text: str) -> np.ndarray:
    """BOS followed by the document's GPT-2 tokens, as uint16."""
    if _encoding is None:
        _init_worker()
    ids = _encoding.encode_ordinary(text)
    tokens = np.empty(len(ids) + 1, dtype=np.uint16)
    tokens[0] = BOS_ID
    tokens[1:] = ids
    return tokens


# -- writing --------------------------------------------------------------------------------------

def write_shard(path: Path, tokens: np.ndarray) -> None:
    """A shard atomically: the 256-int32 header (magic, version, token count), then the tokens as uint16."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError("shard tokens must fit in uint16")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (SHARD_MAGIC, SHARD_VERSION, len(tokens))
    with atomic_file(path) as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())


class ShardWriter:
    """Groups whole documents into the val shard, then train shards of at most shard_tokens tokens."""

    def __init__(self, out_dir: Path, name: str, val_tokens: int, shard_tokens: int):
        self.out_dir, self.name = out_dir, name
        self.val_tokens, self.shard_tokens = val_tokens, shard_tokens
        self.in_val = val_tokens > 0
        self.next_train = 1
        self.parts: list[np.ndarray] = []
        self.held = 0
        self.written: list[tuple[str, Path, int, int]] = []  # (kind, path, documents, tokens)

    def add(self, doc: np.ndarray) -> None:
        if self.in_val:
            self.parts.append(doc)
            self.held += len(doc)
            if self.held >= self.val_tokens:
                self._flush()
                self.in_val = False
            return
        if self.parts and self.held + len(doc) > self.shard_tokens:
            self._flush()
        if len(doc) > self.shard_tokens:
            print(f"warning: a document of {len(doc):,} tokens exceeds --shard_tokens={self.shard_tokens:,}; "
                  f"it gets a shard of its own", file=sys.stderr)
        self.parts.append(doc)
        self.held += len(doc)

    def close(self) -> None:
        if self.parts:
            self._flush()

    def _flush(self) -> None:
        if self.in_val:
            kind, path = "val", self.out_dir / f"{self.name}_val_000000.bin"
        else:
            kind, path = "train", self.out_dir / f"{self.name}_train_{self.next_train:06d}.bin"
            self.next_train += 1
        write_shard(path, np.concatenate(self.parts))
        self.written.append((kind, path, len(self.parts), self.held))
        print(f"wrote {path}: {len(self.parts):,} documents, {self.held:,} tokens", flush=True)
        self.parts, self.held = [], 0


def existing_shards(out_dir: Path, name: str) -> list[Path]:
    return sorted([*out_dir.glob(f"{name}_val_*.bin"), *out_dir.glob(f"{name}_train_*.bin")])


# -- command line ---------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help=".txt or .jsonl files, or folders of them")
    parser.add_argument("--out_dir", type=Path, required=True, help="folder for the shards (created if needed)")
    parser.add_argument("--name", default="text", help="shard name prefix (default: text)")
    parser.add_argument("--val_tokens", type=int, default=DEFAULT_VAL_TOKENS,
                        help=f"minimum tokens in the val shard; 0 for none (default {DEFAULT_VAL_TOKENS:,})")
    parser.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                        help=f"maximum tokens per train shard (default {DEFAULT_SHARD_TOKENS:,})")
    parser.add_argument("--workers", type=int, default=0,
                        help=f"tokenizer processes; 0 = one per CPU (at most 8) for inputs over "
                             f"{PARALLEL_MIN_BYTES:,} bytes, else none (default 0)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing NAME_* shards in --out_dir")
    args = parser.parse_args(argv)
    if args.val_tokens < 0:
        parser.error(f"--val_tokens must be >= 0, got {args.val_tokens}")
    if args.shard_tokens < 1:
        parser.error(f"--shard_tokens must be positive, got {args.shard_tokens}")
    if args.workers < 0:
        parser.error(f"--workers must be >= 0, got {args.workers}")
    if not args.name or any(c in args.name for c in "/\\*?[]"):
        parser.error(f"--name must be a plain file-name prefix, got {args.name!r}")
    return args


def tokenize(args: argparse.Namespace) -> None:
    files = expand_inputs(args.inputs)
    total_bytes = sum(p.stat().st_size for p in files)
    old = existing_shards(args.out_dir, args.name) if args.out_dir.is_dir() else []
    if old and not args.overwrite:
        raise UsageError(f"{args.out_dir} already holds {len(old)} {args.name}_* shard(s) ({old[0].name}, ...); "
                         f"pass --overwrite to replace them, or pick another --name or --out_dir")
    _init_worker()  # load the tokenizer here first: fail early, with the hint, before any process starts
    args.out_dir.mkdir(parents=True, exist_ok=True)

    workers = args.workers or (min(8, os.cpu_count() or 1) if total_bytes > PARALLEL_MIN_BYTES else 1)
    writer = ShardWriter(args.out_dir, args.name, args.val_tokens, args.shard_tokens)
    documents = read_documents(files)
    try:
        if workers > 1:
            with multiprocessing.Pool(workers, initializer=_init_pool_worker) as pool:
                for doc in pool.imap(encode_document, documents, chunksize=64):
                    writer.add(doc)
        else:
            for text in documents:
                writer.add(encode_document(text))
        writer.close()
    except BaseException:  # bad input halfway or Ctrl-C: leave no half set of shards behind
        for _, path, _, _ in writer.written:
            path.unlink(missing_ok=True)
        if writer.written:
            print(f"removed the {len(writer.written)} shard(s) written before the error", flush=True)
        raise

    if not writer.written:
        raise UsageError(f"no documents found in {len(files)} input file(s)")
    written = {path for _, path, _, _ in writer.written}
    for stale in old:
        if stale not in written:
            stale.unlink()
            print(f"removed stale {stale}")
    total = {kind: sum(t for k, _, _, t in writer.written if k == kind) for kind in ("val", "train")}
    docs = sum(d for _, _, d, _ in writer.written)
    print(f"done: {len(files)} input file(s), {total_bytes:,} bytes -> {docs:,} documents, "
          f"{total['val'] + total['train']:,} tokens (val {total['val']:,}, train {total['train']:,}) "
          f"in {len(writer.written)} shard(s) under {args.out_dir}")
    if not total["train"]:
        print("warning: every document went to the val shard; lower --val_tokens to leave some for training",
              file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        tokenize(args)
    except UsageError as e:
        fail(str(e))
    except KeyboardInterrupt:  # the shards written so far were removed on the way out
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
