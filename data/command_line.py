"""The data scripts' command line (cached_fineweb10B.py, tokenize_text.py): every error is one `error: ...` line on
stderr and an exit code, never a usage page or a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


def fail(message: str, code: int = 1) -> NoReturn:
    """Exit with code after one line: 2 for bad arguments, 1 when the work itself cannot be done."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors (argparse's own and parser.error's) are one line, exit 2, ending in
    usage_hint: where to read more."""

    def __init__(self, *, usage_hint: str = "see --help", **kwargs) -> None:
        super().__init__(**kwargs)
        self.usage_hint = usage_hint

    def error(self, message: str) -> NoReturn:
        fail(f"{message} ({self.usage_hint})", 2)
