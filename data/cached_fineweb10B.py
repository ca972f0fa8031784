"""Download GPT-2-tokenized FineWeb10B shards from the Hugging Face hub.

    python data/cached_fineweb10B.py N [--dir DIR] [--workers W]

fetches the val shard (fineweb_val_000000.bin) and the first N train shards
(fineweb_train_000001.bin ... ) of the dataset repo kjj0/fineweb10B-gpt2 into DIR
(default: data/fineweb10B next to this script), which is where train_gpt.py looks by default.
Each train shard holds 100M tokens (about 200 MB); 103 exist, and the 8xH100 recipe needs 8.

Files already present and valid are skipped. Every downloaded file is checked against the
shard header (train_gpt.shard_token_count); an invalid one is removed and reported. When the hub
cannot be reached (checked first, in seconds) the script prints one line and exits 1, removing the
partial files of failed downloads and the hub's bookkeeping folder; finished files are kept, so
rerunning resumes where it stopped.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from command_line import OneLineParser, fail  # noqa: E402
from train_gpt import UsageError, shard_token_count  # noqa: E402

REPO_ID = "kjj0/fineweb10B-gpt2"
MAX_TRAIN_SHARDS = 103
DEFAULT_DIR = Path(__file__).parent / "fineweb10B"

Download = Callable[..., str]  # huggingface_hub.hf_hub_download or a stand-in with its keywords


def shard_names(num_train: int) -> list[str]:
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, num_train + 1)]


def network_errors() -> tuple[type[BaseException], ...]:
    """Exceptions meaning 'the hub could not deliver the file' (the HTTP libraries are optional)."""
    errors: list[type[BaseException]] = [OSError]  # covers huggingface_hub's errors and requests'
    for module, name in [("huggingface_hub.errors", "HfHubHTTPError"), ("httpx", "HTTPError"),
                         ("httpx2", "HTTPError"), ("requests", "RequestException")]:
        try:
            errors.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def short_reason(error: BaseException) -> str:
    """The innermost cause of an error as 'Type: first line', short enough for one line."""
    seen = 0
    while error.__cause__ is not None and seen < 5:
        error, seen = error.__cause__, seen + 1
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    reason = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return reason if len(reason) <= 160 else reason[:157] + "..."


def check_shard(path: Path) -> str | None:
    """None when the shard at path is valid, else why not."""
    try:
        shard_token_count(path)
    except UsageError as e:
        return str(e)
    return None


def human_size(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:,.1f} MB" if num_bytes >= 1e5 else f"{num_bytes:,} B"


def remove_partials(local_dir: Path, name: str) -> None:
    """Remove what a failed download of name may have left: a bad target, temporary files, its lock."""
    target = local_dir / name
    if target.exists() and check_shard(target) is not None:
        target.unlink()
    for leftover in [Path(f"{target}.tmp"), Path(f"{target}.incomplete")]:
        leftover.unlink(missing_ok=True)
    hub_dir = local_dir / ".cache" / "huggingface" / "download"
    if hub_dir.is_dir():
        # huggingface_hub names partial downloads by a hash, so take them all: no download is running now.
        for leftover in [*hub_dir.glob("*.incomplete"), hub_dir / f"{name}.lock", hub_dir / f"{name}.metadata"]:
            leftover.unlink(missing_ok=True)


def hub_unreachable(endpoint: str, timeout_s: float = 10.0) -> str | None:
    """Why the hub does not answer at all, or None when it does (any HTTP status): offline, this takes
    about a second, where huggingface_hub would retry each file for half a minute."""
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s)
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError, ValueError) as e:
        return short_reason(e.reason if isinstance(e, urllib.error.URLError) and isinstance(e.reason, BaseException)
                            else e)
    return None


def clean_up(local_dir: Path, created: bool) -> None:
    """After a failed run: the hub's bookkeeping folder, and the target folder if this run made it and it
    holds nothing."""
    shutil.rmtree(local_dir / ".cache", ignore_errors=True)
    if created and local_dir.is_dir() and not any(local_dir.iterdir()):
        local_dir.rmdir()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__.splitlines()[0],
                           usage_hint="usage: python data/cached_fineweb10B.py N [--dir DIR]; see --help")
    parser.add_argument("num_train", metavar="N", help=f"number of train shards to fetch, 1..{MAX_TRAIN_SHARDS}")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"target folder (default {DEFAULT_DIR})")
    parser.add_argument("--workers", type=int, default=8, help="parallel downloads (default 8)")
    args = parser.parse_args(argv)
    try:
        args.num_train = int(args.num_train)
    except ValueError:
        parser.error(f"N must be a whole number of train shards, got {args.num_train!r}")
    if not 1 <= args.num_train <= MAX_TRAIN_SHARDS:
        parser.error(f"N must be between 1 and {MAX_TRAIN_SHARDS} (the train shards that exist), got {args.num_train}")
    if args.workers < 1:
        parser.error(f"--workers must be positive, got {args.workers}")
    return args


def main(argv: Sequence[str] | None = None, download: Download | None = None) -> None:
    args = parse_args(argv)
    if download is None:
        try:
            from huggingface_hub import hf_hub_download
        except ImportError:
            fail("huggingface_hub is not installed: pip install huggingface_hub")
        download = hf_hub_download
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        reason = None if os.environ.get("HF_HUB_OFFLINE") else hub_unreachable(endpoint)
        if reason is not None:
            fail(f"cannot reach the Hugging Face hub at {endpoint} ({reason}); check your connection or "
                 f"HF_ENDPOINT and rerun")
    local_dir: Path = args.dir
    created = not local_dir.exists()
    local_dir.mkdir(parents=True, exist_ok=True)

    todo: list[str] = []
    for name in shard_names(args.num_train):
        path = local_dir / name
        if path.exists():
            problem = check_shard(path)
            if problem is None:
                print(f"{name}  {human_size(path.stat().st_size)}  skip (already present)", flush=True)
                continue
            print(f"{name}  invalid, downloading again: {problem}", flush=True)
            remove_partials(local_dir, name)
        todo.append(name)

    fetch_errors = network_errors()
    failed: dict[str, str] = {}  # name -> one-line reason, in completion order
    invalid: list[str] = []
    with ThreadPoolExecutor(max_workers=args.workers) as pool:
        futures: dict[Future[str], str] = {
            pool.submit(download, repo_id=REPO_ID, filename=name, repo_type="dataset", local_dir=str(local_dir)): name
            for name in todo}
        for future in as_completed(futures):
            name = futures[future]
            if future.cancelled():
                continue
            error = future.exception()
            if error is not None:
                if not isinstance(error, fetch_errors):
                    raise error  # a bug, not the network: keep the traceback
                failed[name] = short_reason(error)
                for other in futures:  # stop starting new downloads; running ones finish
                    other.cancel()
                continue
            path = local_dir / name
            problem = check_shard(path) if path.exists() else f"{path} is missing after the download"
            if problem is None:
                print(f"{name}  {human_size(path.stat().st_size)}  ok", flush=True)
            else:
                remove_partials(local_dir, name)
                invalid.append(name)
                print(f"{name}  INVALID, removed: {problem}", flush=True)

    for name in failed:
        remove_partials(local_dir, name)
    if failed or invalid:
        clean_up(local_dir, created)
    if failed:
        name, reason = next(iter(failed.items()))
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        fail(f"cannot download {name}{more} from the Hugging Face hub ({reason}); check your connection "
             f"or HF_ENDPOINT and rerun — files already downloaded are kept")
    if invalid:
        fail(f"downloaded {', '.join(invalid)} failed the shard check and was removed (see above); "
             f"rerun to download it again")
    print(f"done: {len(todo)} downloaded, {args.num_train + 1 - len(todo)} already present, in {local_dir}")


if __name__ == "__main__":
    main()
