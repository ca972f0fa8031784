"""Compare speedrun runs from their logs: a table, a two-run diff, significance tests and plots.

Reads this project's run logs (logs/<run_id>.txt, preferring a <run_id>.json summary beside it) and
upstream modded-nanogpt logs. A record folder stands for every run log (*.txt) inside it.

    python tools/compare.py show RUN...
    python tools/compare.py diff A B       (first line: the verdict: reproduced, equal on the steps both cover,
                                              or where the losses part; and the CPU paths where they differ)
    python tools/compare.py stats RUN... [--target 3.28] [--baseline RUN...]
    python tools/compare.py plot RUN... [-o compare.png]
    python tools/compare.py code LOG DIR   (writes the source files a log holds into DIR, byte for byte)
    python tools/compare.py track3 LOG... [--baseline LOG...] [--target 3.28] [-o track3.png]
                                           (the optimization track's rule: n trials' mean val loss per late step,
                                              the earliest valid step, the pairwise rule against a baseline)

Bad input is reported as one `error:` line on stderr with exit code 2, before any output.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import math
import os
import re
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

SEPARATOR = "=" * 100
DEFAULT_TARGET = 3.28  # FineWeb validation loss the speedrun records reach
# Config fields that name a run rather than its recipe: left out of config diffs and of stats' grouping.
RUN_FIELDS = {"run_id", "log_dir", "resume", "overwrite", "seed", "save_every", "save_final", "profile", "bench"}
LOG_SHAPE = ("the script source, a line of 100 '=', a header, then "
             "'step:S/T val_loss:V train_time:Tms step_avg:Ams' lines")


class LogError(Exception):
    """Input the user can fix (missing path, not a log, ...): one line on stderr, exit code 2."""


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


# -----------------------------------------------------------------------------
# Run model
# What the tool knows about one run; every field may be unknown (None / empty). Filled from the
# .txt log first, then overridden by the .json summary where that has a usable value.


@dataclass
class ValPoint:
    step: int
    loss: float
    time_ms: float | None
    digits: int | None = None  # the decimals a log line printed it with; None: exact (a summary's or a .jsonl's)
    trial: int = 0  # of a run of several trials (train_optim.py --trials=N): which, from 0


@dataclass
class StepLine:
    step: int
    total: int
    malformed: list[str] = field(default_factory=list)  # "key:value" fields whose value is not a number
    val_loss: float | None = None
    train_loss: float | None = None
    train_time_ms: float | None = None
    step_avg_ms: float | None = None
    tokens_per_s: float | None = None
    digits: dict[str, int] = field(default_factory=dict)  # decimals of each loss as printed
    trial: int = 0  # the trial the line belongs to (the log's latest `trial T/N:` line), from 0


@dataclass
class Run:
    name: str
    path: Path
    code: str | None = None
    sources: dict[str, str] = field(default_factory=dict)  # file name -> its text, as the log holds them
    config: dict[str, Any] | None = None
    gpu_names: list[str] = field(default_factory=list)
    cpu_info: str | None = None
    cpu_short: str | None = None  # the CPU's name, vector ISA and bf16 GEMM path: show's narrow column
    cpu_path: str | None = None  # "record" (the bundled CPU records' arithmetic) or "native": the README's quick start
    world_size: int | None = None
    torch_version: str | None = None
    cuda_version: str | None = None
    seed: int | None = None
    git_commit: str | None = None
    val_points: list[ValPoint] = field(default_factory=list)
    train_points: list[ValPoint] = field(default_factory=list)  # per logged step: train loss (and train time)
    final_val_loss: float | None = None
    last_step: int | None = None
    total_steps: int | None = None
    train_time_ms: float | None = None
    step_avg_ms: float | None = None
    tokens_per_s: float | None = None
    peak_memory_allocated_mib: float | None = None
    peak_memory_reserved_mib: float | None = None
    has_summary: bool = False
    trial_totals: dict[int, int] = field(default_factory=dict)  # each trial's step count, from its step lines

    @property
    def train_time_s(self) -> float | None:
        return None if self.train_time_ms is None else self.train_time_ms / 1000

    @property
    def incomplete(self) -> bool:
        return self.last_step is not None and self.total_steps is not None and self.last_step < self.total_steps

    @property
    def trials(self) -> int:
        """The trials it logged losses of (train_optim.py --trials=N runs several in one log)."""
        return 1 + max((p.trial for p in self.val_points + self.train_points), default=0)


# -----------------------------------------------------------------------------
# Log parsing
# Step lines are `step:S/T` followed by `key:value` fields in any subset (val_loss, train_loss,
# train_time, step_avg, tok/s, ...). Header lines (GPUs, versions, config JSON, nvidia-smi rows)
# sit between the code snapshot and the step lines.

STEP_RE = re.compile(r"^step:(\d+)/(\d+)(?:\s+(.*))?$")
GPUS_RE = re.compile(r"^GPUs:\s*(.+)$")
CPU_RE = re.compile(r"^CPU run(?: \((.+)\)|: (.+))$")  # older logs: "CPU run (2 cores)"
GEMM_RE = re.compile(r"^bf16 GEMM path: (\w+)")
CPU_PATH_RE = re.compile(r"^CPU path: (\w+)")  # logs before it: the path follows from the vector ISA and GEMM path
SMI_GPU_RE = re.compile(r"^\|\s+\d+\s+(.+?)\s+(?:On|Off)\s+\|")
TORCH_RE = re.compile(r"^Running PyTorch (\S+) compiled for CUDA (\S+)", re.IGNORECASE)
MODEL_RE = re.compile(r"^model:.*\bworld size (\d+)")
RUN_RE = re.compile(r"^run \S+ seed (\d+)")
PEAK_RE = re.compile(r"^peak memory allocated: (\d+) MiB reserved: (\d+) MiB")
TRIAL_RE = re.compile(r"^trial (\d+)/\d+: ")  # train_optim.py's line before each trial's (or resumed trial's) steps


def _float(text: str | None, unit: str = "") -> float | None:
    """A number from a log field such as '153ms' or '1,572,864'; None when absent or malformed."""
    if text is None:
        return None
    if unit and text.endswith(unit):
        text = text[: -len(unit)]
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _duration_ms(text: str | None) -> float | None:
    """A duration field in ms: '153ms' as this project's track-1 logs print it, '22.870s' as track 3's do."""
    if text is not None and text.endswith("s") and not text.endswith("ms"):
        seconds = _float(text, "s")
        return None if seconds is None else seconds * 1000
    return _float(text, "ms")


def parse_step_line(line: str) -> StepLine | None:
    """One `step:S/T key:value ...` line, or None when the line is something else."""
    match = STEP_RE.match(line.strip())
    if match is None:
        return None
    fields: dict[str, str] = {}
    for token in (match.group(3) or "").split():
        key, sep, value = token.partition(":")
        if sep:
            fields[key] = value
    readers = {"val_loss": _float, "train_loss": _float, "train_time": _duration_ms, "step_avg": _duration_ms,
               "tok/s": _float}
    values = {key: read(fields.get(key)) for key, read in readers.items()}
    malformed = [f"{key}:{fields[key]}" for key in readers if key in fields and values[key] is None]
    digits = {key: len(fields[key].partition(".")[2]) for key in ("val_loss", "train_loss") if key in fields}
    return StepLine(step=int(match.group(1)), total=int(match.group(2)), malformed=malformed,
                    val_loss=values["val_loss"], train_loss=values["train_loss"], train_time_ms=values["train_time"],
                    step_avg_ms=values["step_avg"], tokens_per_s=values["tok/s"], digits=digits)


def split_code(text: str) -> tuple[str | None, list[str] | None]:
    """The code snapshot (everything before the first line of exactly 100 '=') and the lines after it;
    (None, None) when there is no such line."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.rstrip("\r") == SEPARATOR:
            code = "\n".join(lines[:i]).strip("\n")
            return (code + "\n" if code else None), lines[i + 1:]
    return None, None


# This project's logs hold every source file the run executed, each after a line `# source: NAME (N bytes)` and
# exactly N bytes (a newline added where the file has none); older logs hold train_gpt.py alone, upstream's its files
# joined by its own separator (two newlines, a line of 40 '-', `# NAME`, a line of 40 '-', two newlines).
SOURCE_RE = re.compile(rb"# source: (\S+) \((\d+) bytes\)\n")
UPSTREAM_FILE_RE = re.compile(r"\n\n-{40}\n# (\S+)\n-{40}\n\n")


def source_blocks(data: bytes) -> dict[str, bytes]:
    """The files a log's source blocks hold, byte for byte, in order; {} for a log without them."""
    files: dict[str, bytes] = {}
    pos = 0
    while match := SOURCE_RE.match(data, pos):
        start, end = match.end(), match.end() + int(match[2])
        if end > len(data):
            raise LogError(f"source block of {match[1].decode()} is cut short: the log ends within its {match[2]} "
                           f"bytes")
        files[match[1].decode()] = data[start:end]
        pos = end + (data[end - 1:end] != b"\n")
    return files


def split_sources(code: str) -> dict[str, str]:
    """A code snapshot's files by name: this project's source blocks, else upstream's files or one train_gpt.py."""
    blocks = source_blocks(code.encode())
    if blocks:
        return {name: data.decode(errors="replace") for name, data in blocks.items()}
    parts = UPSTREAM_FILE_RE.split(code)
    return {"train_gpt.py": parts[0], **dict(zip(parts[1::2], parts[2::2]))}


def trial_lines(rest: Sequence[str]) -> list[tuple[str, StepLine | None]]:
    """A log's lines after its code, stripped, each with its step line (None for other lines) in the trial the
    latest `trial T/N:` line names (train_optim.py's; without one, every step line is trial 0's)."""
    out, trial = [], 0
    for raw in rest:
        line = raw.strip()
        if m := TRIAL_RE.match(line):
            trial = int(m.group(1)) - 1
        step = parse_step_line(line) if line.startswith("step:") else None
        if step is not None:
            step.trial = trial
        out.append((line, step))
    return out


def parse_log(text: str, name: str, path: Path) -> Run:
    """A Run from a log's text, in this project's format or upstream modded-nanogpt's."""
    code, rest = split_code(text)
    if rest is None:  # both formats put one after the code: a text without it (a README) is no log
        raise LogError(f"{path}: not a run log: no line of 100 '=' (expected {LOG_SHAPE})")
    run = Run(name=name, path=path, code=code, sources=split_sources(code) if code else {})
    steps: list[StepLine] = []
    smi_names: list[str] = []
    isa = gemm = None  # an older log's CPU path: AVX2 kernels and fp32 GEMMs are the record path
    for line, step in trial_lines(rest):
        if step is not None:
            steps.append(step)
        elif line.startswith("config: "):
            try:
                config = json.loads(line[len("config: "):])
            except json.JSONDecodeError:
                warn(f"{path}: config line is not valid JSON; ignoring it")
            else:
                run.config = config if isinstance(config, dict) else None
        elif m := GPUS_RE.match(line):
            run.gpu_names = [n.strip() for n in m.group(1).split(",") if n.strip()]
        elif m := CPU_RE.match(line):
            run.cpu_info = f"CPU ({m.group(1) or m.group(2)})"
            parts = (m.group(1) or m.group(2)).split(", ")
            named = [p for p in parts[:1] if not p.endswith("cores")]  # the old form names no CPU: "CPU (2 cores)"
            isa = next((p[len("vector ISA "):] for p in parts if p.startswith("vector ISA ")), None)
            run.cpu_short = " ".join([*(named or ["CPU"]), *([isa] if isa else [])])
        elif (m := GEMM_RE.match(line)) and run.cpu_info:
            run.cpu_info = f"{run.cpu_info[:-1]}, bf16 GEMM path {m.group(1)})"
            run.cpu_short = f"{run.cpu_short}, {m.group(1)} GEMM"
            gemm = m.group(1)
        elif m := CPU_PATH_RE.match(line):
            run.cpu_path = m.group(1)
        elif m := SMI_GPU_RE.match(line):
            smi_names.append(m.group(1).strip())
        elif m := TORCH_RE.match(line):
            run.torch_version, run.cuda_version = m.group(1), m.group(2)
        elif m := MODEL_RE.match(line):
            run.world_size = int(m.group(1))
        elif m := RUN_RE.match(line):
            run.seed = int(m.group(1))
        elif m := PEAK_RE.match(line):
            run.peak_memory_allocated_mib, run.peak_memory_reserved_mib = float(m.group(1)), float(m.group(2))
    if not steps:
        raise LogError(f"{path}: not a run log: found a line of 100 '=' but no 'step:S/T ...' lines (expected "
                       f"{LOG_SHAPE})")
    run.gpu_names = run.gpu_names or smi_names
    if run.cpu_path is None and isa and gemm:
        run.cpu_path = "record" if (isa, gemm) == ("AVX2", "fp32") else "native"
    if run.seed is None and run.config is not None:
        run.seed = _int(run.config.get("seed"))
    _fill_from_steps(run, steps)
    return run


def _fill_from_steps(run: Run, steps: list[StepLine]) -> None:
    """Final values from the step lines: the last one in file order that has a field is the latest
    measurement of it (the final val line follows the last train line and has the exact time)."""

    def latest(values: list[float | None]) -> float | None:
        return next((v for v in reversed(values) if v is not None), None)

    # A run carried on by --resume=auto logs again the steps after its checkpoint: the later line of a step wins.
    steps = sorted({(s.trial, s.step, s.val_loss is not None): s for s in steps}.values(),
                   key=lambda s: (s.trial, s.step, s.val_loss is not None))
    run.trial_totals = {s.trial: s.total for s in steps}
    run.last_step, run.total_steps = steps[-1].step, steps[-1].total
    run.train_time_ms = latest([s.train_time_ms for s in steps])
    run.step_avg_ms = latest([s.step_avg_ms for s in steps])
    run.tokens_per_s = latest([s.tokens_per_s for s in steps])
    run.val_points = [ValPoint(s.step, s.val_loss, s.train_time_ms, s.digits["val_loss"], s.trial) for s in steps
                      if s.val_loss is not None]
    run.train_points = [ValPoint(s.step, s.train_loss, s.train_time_ms, s.digits["train_loss"], s.trial)
                        for s in steps if s.train_loss is not None]
    for s in steps:
        if s.malformed:
            warn(f"{run.path}: step {s.step}: {', '.join(s.malformed)} is not a number; ignoring it")
    # Final: the val loss of the last step's line, never an earlier one standing in for it.
    last = run.val_points[-1] if run.val_points and run.val_points[-1].trial == steps[-1].trial else None
    run.final_val_loss = last.loss if last is not None and last.step == run.last_step else None
    if last is not None and last.step != run.last_step:
        warn(f"{run.path}: no val loss at its last step {run.last_step} (the latest is step {last.step}'s); "
             f"no final val loss")


# -----------------------------------------------------------------------------
# Summary JSON
# <run_id>.json beside a log holds the trainer's own summary; a usable value there wins over the
# parsed log. Any key may be missing, null or of the wrong type: such keys are simply ignored.


def _num(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _int(value: object) -> int | None:
    number = _num(value)
    return int(number) if number is not None and number == int(number) else None


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def load_summary(path: Path) -> dict[str, Any]:
    """The summary dict, or {} (with a warning) when the file is unreadable or not a JSON object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, json.JSONDecodeError) as e:
        warn(f"{path}: unreadable summary ({e}); using the log alone")
        return {}
    if not isinstance(data, dict):
        warn(f"{path}: summary is not a JSON object; using the log alone")
        return {}
    return data


def _loss(value: object) -> float | None:
    """A loss: any float, NaN and infinity included (a diverged run keeps them; they must show)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _val_point(item: object, trial: int = 0) -> ValPoint | None:
    if not isinstance(item, (list, tuple)) or len(item) < 2:
        return None
    step, loss = _int(item[0]), _loss(item[1])
    if step is None or loss is None:
        return None
    return ValPoint(step, loss, _num(item[2]) if len(item) > 2 else None, trial=trial)


def summary_val_points(summary: dict[str, Any]) -> list[ValPoint]:
    """A summary's val losses: its "val_losses", or those of each entry of its "trials" (a run of several trials
    keeps them there alone: each trial's own final loss and time are its last point's)."""
    trials = summary.get("trials") if isinstance(summary.get("trials"), list) else []
    if "val_losses" in summary or len(trials) < 2:
        return [p for p in map(_val_point, summary.get("val_losses") or []) if p is not None]
    return [p for k, trial in enumerate(trials) if isinstance(trial, dict)
            for p in (_val_point(item, k) for item in trial.get("val_losses") or []) if p is not None]


# Summaries written before the names were unified (2026-11-23) call two figures differently.
LEGACY_KEYS = {"peak_memory_allocated_mib": "peak_mem_allocated_mib",
               "peak_memory_reserved_mib": "peak_mem_reserved_mib"}


def apply_summary(run: Run, summary: dict[str, Any]) -> None:
    """Override the run's fields with the summary's usable values."""
    if not summary:
        return
    run.has_summary = True
    points = summary_val_points(summary)
    if points:
        run.val_points = points
        run.final_val_loss = points[-1].loss
    numbers = {"final_val_loss": _loss, "train_time_ms": _num, "step_avg_ms": _num, "tokens_per_s": _num,
               "peak_memory_allocated_mib": _num, "peak_memory_reserved_mib": _num, "world_size": _int, "seed": _int,
               "torch_version": _str, "cuda_version": _str, "git_commit": _str}
    for key, convert in numbers.items():
        value = convert(summary.get(key, summary.get(LEGACY_KEYS.get(key))))
        if value is not None:
            setattr(run, key, value)
    steps = _int(summary.get("steps"))
    if steps is not None:
        run.last_step = steps
    names = summary.get("gpu_names")
    if isinstance(names, list) and names and all(isinstance(n, str) for n in names):
        run.gpu_names = list(names)
    if isinstance(summary.get("config"), dict):
        run.config = summary["config"]
    if run.config is not None and _int(run.config.get("num_steps")) is not None:
        run.total_steps = _int(run.config["num_steps"])


# -----------------------------------------------------------------------------
# Loading paths
# A path is a log file or a record folder; a folder contributes every *.txt that parses as a run
# log (others, such as notes, are skipped). Runs with the same file stem get their folder prefixed.


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise LogError(f"{path}: cannot read ({e.strerror or e})") from None


def load_step_records(path: Path) -> dict[str, list[ValPoint]]:
    """Per logged step, the train loss and per validation the val loss, with the train time, from a run's .jsonl
    (full precision), by "train_loss" and "val_loss"; empty when unreadable. A run in progress or stopped has no
    summary: these are its exact losses. A line a kill cut short is left out; a step logged again by a later launch
    of a --resume=auto run takes that launch's record. A run of several trials numbers them ("trial")."""
    points: dict[str, dict[tuple[int, int], ValPoint]] = {"train_loss": {}, "val_loss": {}}
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        warn(f"{path}: unreadable step records; the losses come from the log lines")
        return {"train_loss": [], "val_loss": []}
    for line in lines:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # cut short by a kill; the next launch began a line of its own
            continue
        for key, found in points.items():
            step, loss = _int(entry.get("step")) if isinstance(entry, dict) else None, None
            if step is not None and (loss := _loss(entry.get(key))) is not None:
                trial = _int(entry.get("trial")) or 0
                found[trial, step] = ValPoint(step, loss, _num(entry.get("train_time_ms")), trial=trial)
    return {key: [found[k] for k in sorted(found)] for key, found in points.items()}


def load_run(path: Path) -> Run:
    """One run from its .txt log, with the .json summary and the .jsonl step records beside it applied when
    present: the losses as the trainer computed them, and only where neither is there as the log printed them."""
    run = parse_log(_read(path), path.stem, path)
    summary = path.with_suffix(".json")
    if summary.is_file():
        apply_summary(run, load_summary(summary))
    records = path.with_suffix(".jsonl")
    if records.is_file():
        exact = load_step_records(records)
        run.train_points = exact["train_loss"] or run.train_points
        if exact["val_loss"] and not run.has_summary:
            final = run.final_val_loss is not None and (exact["val_loss"][-1].step, exact["val_loss"][-1].trial) == (
                run.last_step, run.val_points[-1].trial)
            run.val_points = exact["val_loss"]
            run.final_val_loss = run.val_points[-1].loss if final else run.final_val_loss
    return run


def load_runs(paths: Sequence[str]) -> list[Run]:
    """Runs from log files and record folders, in the order given (folders sorted by file name)."""
    runs: list[Run] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise LogError(f"{raw}: no such file or directory")
        if not path.is_dir():
            runs.append(load_run(path))
            continue
        found = []
        for log in sorted(path.glob("*.txt")):
            try:
                found.append(load_run(log))
            except LogError as e:  # notes beside the logs are fine, but say which files were left out
                warn(f"skipped {e}")
        if not found:
            raise LogError(f"{raw}: no run logs in this folder (expected *.txt files holding {LOG_SHAPE})")
        runs.extend(found)
    unique = {run.path.resolve(): run for run in reversed(runs)}
    if len(unique) < len(runs):
        warn("the same run log was given more than once; counting it once")
        runs = [run for run in runs if unique.get(run.path.resolve()) is run]
    _make_names_unique(runs)
    return runs


def trial_view(run: Run, k: int) -> Run:
    """Trial k of a run of several, as a run of its own named "NAME trial K": its losses, final val loss, time and
    steps."""
    val = [dataclasses.replace(p, trial=0) for p in run.val_points if p.trial == k]
    train = [dataclasses.replace(p, trial=0) for p in run.train_points if p.trial == k]
    last = max((p.step for p in val + train), default=None)
    final = val[-1].loss if val and val[-1].step == last else None
    time_ms = next((p.time_ms for p in val + train if p.step == last and p.time_ms is not None), None)
    return dataclasses.replace(run, name=f"{run.name} trial {k + 1}", val_points=val, train_points=train,
                               final_val_loss=final, last_step=last, total_steps=run.trial_totals.get(k, last),
                               train_time_ms=time_ms, step_avg_ms=time_ms / last if time_ms and last else None,
                               tokens_per_s=None, trial_totals={})


def by_trials(runs: Sequence[Run]) -> list[Run]:
    """Each run of several trials as one run per trial (show, stats and plot treat a trial as a run)."""
    return [view for run in runs for view in ([run] if run.trials == 1 else
                                              [trial_view(run, k) for k in range(run.trials)])]


def _make_names_unique(runs: list[Run]) -> None:
    counts = Counter(run.name for run in runs)
    for run in runs:
        if counts[run.name] > 1:
            run.name = f"{run.path.parent.name}/{run.path.stem}"
    seen: Counter[str] = Counter()
    for run in runs:
        seen[run.name] += 1
        if seen[run.name] > 1:
            run.name = f"{run.name}#{seen[run.name]}"


def load_single(raw: str) -> Run:
    runs = load_runs([raw])
    if len(runs) != 1:
        raise LogError(f"{raw}: expected a single run, found {len(runs)} run logs in this folder")
    return runs[0]


# -----------------------------------------------------------------------------
# Formatting
# Plain-text helpers shared by the subcommands: a value or '-', hardware in one phrase, and an
# aligned table (first column left-aligned, numbers right-aligned).


HARDWARE_WIDTH = 40  # show's table stays within a terminal's width


def fmt(value: float | int | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def describe_hardware(run: Run) -> str:
    """E.g. '8x NVIDIA H100 80GB HBM3', 'CPU (2 cores), world size 1' or '-'."""
    parts = [f"{count}x {name}" for name, count in Counter(run.gpu_names).items()]
    if not parts and run.cpu_info:
        parts.append(run.cpu_info)
    if run.world_size is not None and run.world_size != len(run.gpu_names):
        parts.append(f"world size {run.world_size}")
    return ", ".join(parts) or "-"


def short_hardware(run: Run) -> str:
    """describe_hardware in at most HARDWARE_WIDTH characters for show's column, e.g. '8x H100 80GB HBM3' or
    'AMD EPYC AVX512, native GEMM, W=2'; diff and stats name the hardware in full."""
    parts = [f"{count}x {name.removeprefix('NVIDIA ')}" for name, count in Counter(run.gpu_names).items()]
    if not parts and run.cpu_short:
        parts.append(run.cpu_short)
    if run.world_size is not None and run.world_size != len(run.gpu_names):
        parts.append(f"W={run.world_size}")
    text = ", ".join(parts) or "-"
    return text if len(text) <= HARDWARE_WIDTH else text[:HARDWARE_WIDTH - 3] + "..."


def describe_steps(run: Run) -> str:
    if run.last_step is None:
        return "-"
    return f"{run.last_step}/{run.total_steps}" if run.incomplete else str(run.last_step)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[int] = (0,)) -> str:
    """Columns padded to their widest cell; the columns in `left` are left-aligned."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]

    def line(cells: Sequence[str]) -> str:
        padded = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(padded).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


# -----------------------------------------------------------------------------
# show
# One row per run with the headline numbers; runs without a validation line or that stopped
# early are still listed, with a warning on stderr.


def diverged(run: Run) -> bool:
    return run.final_val_loss is not None and not math.isfinite(run.final_val_loss)


def describe_loss(run: Run) -> str:
    return f"{run.final_val_loss} (diverged)" if diverged(run) else fmt(run.final_val_loss, ".4f")


def show_table(runs: Sequence[Run]) -> str:
    headers = ["run", "val loss", "time (s)", "steps", "step_avg (ms)", "tok/s", "hardware"]
    rows = [[run.name, describe_loss(run), fmt(run.train_time_s, ".2f"), describe_steps(run),
             fmt(run.step_avg_ms, ".2f"), fmt(run.tokens_per_s, ",.0f"), short_hardware(run)] for run in runs]
    return format_table(headers, rows, left=(0, 6))


def cmd_show(args: argparse.Namespace) -> int:
    runs = by_trials(load_runs(args.runs))
    for run in runs:
        if run.final_val_loss is None:
            warn(f"{run.name}: no validation line; val loss shown as -")
        if run.incomplete:
            warn(f"{run.name}: stopped at step {run.last_step} of {run.total_steps}")
    print(show_table(runs))
    return 0


# -----------------------------------------------------------------------------
# diff
# Config fields that differ, the code change as changed hunks only, time ratios B/A and the val
# losses at the steps both runs validated. A run without a code snapshot still gets the other
# sections, then the command fails with exit code 2.


def config_diff(a: Run, b: Run) -> list[str]:
    """'field: A -> B' for every differing config field, or a note on what is missing."""
    missing = [run.name for run in (a, b) if run.config is None]
    if missing:
        return [f"no config recorded for {' and '.join(missing)} (upstream logs keep hyperparameters in the code)"]
    assert a.config is not None and b.config is not None
    lines = [f"{key}: {json.dumps(a.config[key])} -> {json.dumps(b.config[key])}"
             for key in sorted(set(a.config) & set(b.config)) if a.config[key] != b.config[key]
             and key not in RUN_FIELDS]
    for run, other in ((a, b), (b, a)):  # fields one code version has and the other lacks (at their defaults)
        only = sorted(set(run.config) - set(other.config))
        if only:
            lines.append(f"only in {'A' if run is a else 'B'}'s config ({len(only)}): {', '.join(only)}")
    return lines or ["(no differences)"]


def file_diffs(a: Run, b: Run, context: int = 2) -> dict[str, list[str]]:
    """Per file either snapshot holds (A's order, then B's others), the unified diff of the two, or [] when the file
    is the same in both (a file one run lacks is diffed against nothing). Both snapshots must exist."""
    assert a.code is not None and b.code is not None
    return {name: list(difflib.unified_diff(a.sources.get(name, "").splitlines(), b.sources.get(name, "").splitlines(),
                                            fromfile=f"{a.name}: {name}", tofile=f"{b.name}: {name}", n=context,
                                            lineterm=""))
            for name in [*a.sources, *(n for n in b.sources if n not in a.sources)]}


def code_diff(a: Run, b: Run, context: int = 2) -> list[str]:
    return [line for diff in file_diffs(a, b, context).values() for line in diff]


def code_change(a: Run, b: Run) -> list[str]:
    """A line per file that changed: lines removed and added, or that only one run has it."""
    lines = []
    for name, diff in file_diffs(a, b, context=0).items():
        changed = [line[0] for line in diff[2:] if line[:1] in "+-"]
        if name not in a.sources or name not in b.sources:
            lines.append(f"{name}: only in {'A' if name in a.sources else 'B'}")
        elif changed:
            lines.append(f"{name}: {changed.count('-')} line(s) removed, {changed.count('+')} added")
    return [*lines, "(--code shows the hunks)"] if lines else ["(identical)"]


def ratio(b: float | None, a: float | None) -> float | None:
    return None if a is None or b is None or a == 0 else b / a


def matching_val_losses(a: Run, b: Run) -> list[tuple[int, int, float, float]]:
    """(trial, step, A loss, B loss) at every step both runs validated, by trial and step."""
    b_at = {(p.trial, p.step): p.loss for p in b.val_points}
    return [(p.trial, p.step, p.loss, b_at[p.trial, p.step]) for p in a.val_points if (p.trial, p.step) in b_at]


def logged_losses(run: Run) -> dict[tuple[int, int, str], ValPoint]:
    """Every loss a run logged, by (trial, step, "train" or "val"): runs of several trials meet trial by trial."""
    return {**{(p.trial, p.step, "train"): p for p in run.train_points},
            **{(p.trial, p.step, "val"): p for p in run.val_points}}


def compared_digits(x: ValPoint, y: ValPoint) -> int | None:
    """The precision two losses can be compared at: the fewer decimals of the one a log line printed; None: both
    exact (a summary's or a .jsonl's)."""
    printed = [p.digits for p in (x, y) if p.digits is not None]
    return min(printed) if printed else None


def same_loss(x: ValPoint, y: ValPoint) -> bool:
    """Equal at the precision both have: bit for bit when both are exact, else as the log prints them."""
    digits = compared_digits(x, y)
    if digits is not None:
        return f"{x.loss:.{digits}f}" == f"{y.loss:.{digits}f}"
    return x.loss == y.loss or (math.isnan(x.loss) and math.isnan(y.loss))  # two diverged runs agree on NaN


def describe_span(keys: Sequence[tuple[int, int, str]], trials: bool = False) -> str:
    """The steps keys cover, e.g. "steps 0-20"; with trials, which trials too: "trials 1-2, steps 0-6"."""
    steps, numbers = sorted({step for _, step, _ in keys}), sorted({trial + 1 for trial, _, _ in keys})
    span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    if not trials:
        return span
    return f"{f'trial {numbers[0]}' if len(numbers) == 1 else f'trials {numbers[0]}-{numbers[-1]}'}, {span}"


def trials_note(a: Run, b: Run) -> str:
    """' trial by trial (N trials each)' where either run has several trials (trial k of A against trial k of B)."""
    if a.trials == b.trials == 1:
        return ""
    counts = f"{a.trials} trials each" if a.trials == b.trials else f"{a.trials} and {b.trials} trials"
    return f" trial by trial ({counts})"


def verdict(a: Run, b: Run) -> str:
    """One line: whether B reproduced A (every train and val loss either logged equal, at the same steps); where one
    covers steps the other does not (a resumed, stopped or running run), whether the losses of the steps both cover
    are equal, and which those are; else the first step where they differ and the largest difference. A loss known
    only as a log line printed it is compared at that line's precision. Runs on different CPU paths (record, native)
    are named so: their losses differ by rounding, and rerunning one on the other's path is what compares them."""
    line = losses_verdict(a, b)
    if a.cpu_path and b.cpu_path and a.cpu_path != b.cpu_path:
        line += f"; {a.name} ran the {a.cpu_path} CPU path, {b.name} the {b.cpu_path} one"
    return line


def losses_verdict(a: Run, b: Run) -> str:
    """verdict()'s line from the two runs' logged losses alone."""
    la, lb = logged_losses(a), logged_losses(b)
    if not la or not lb:
        return f"verdict: cannot tell: {' and '.join(r.name for r, l in ((a, la), (b, lb)) if not l)} logged no loss"
    note = trials_note(a, b)
    span = functools.partial(describe_span, trials=bool(note))
    common = sorted(la.keys() & lb.keys())
    if not common:
        return (f"verdict: cannot tell{note}: no step logged by both ({a.name}: {span(list(la))}, {b.name}: "
                f"{span(list(lb))})")
    differ = [k for k in common if not same_loss(la[k], lb[k])]
    only = [(run, sorted(mine.keys() - other.keys())) for run, mine, other in ((a, la, lb), (b, lb, la))]
    only_parts = [f"{len(keys)} logged loss(es) only in {run.name} ({span(keys)})" for run, keys in only if keys]
    if differ:
        first, gaps = differ[0], {k: abs(lb[k].loss - la[k].loss) for k in differ}
        worst = max(gaps, key=lambda k: math.inf if math.isnan(gaps[k]) else gaps[k])  # a NaN against a number: worst
        where = {k: f"{f'trial {k[0] + 1} ' if note else ''}step {k[1]}" for k in (first, worst)}
        return f"verdict: not reproduced{note}: " + "; ".join([
            f"first difference at {where[first]} ({first[2]} loss {la[first].loss!r} vs {lb[first].loss!r}), "
            f"largest {gaps[worst]:.4g} ({worst[2]} loss, {where[worst]})", *only_parts])
    trains = sum(kind == "train" for _, _, kind in common)
    printed = [d for k in common if (d := compared_digits(la[k], lb[k])) is not None]
    equal = (f"all {len(common)} logged losses equal ({trains} train, {len(common) - trains} val"
             f"{f'; {len(printed)} to the {min(printed)} decimals a log line prints' if printed else ''})")
    if not only_parts:
        return f"verdict: reproduced{note}: {equal}"
    return f"verdict: equal on the steps both cover{note}, {span(common)}: {equal}; {'; '.join(only_parts)}"


def result_rows(a: Run, b: Run, label: str = "") -> list[list[str]]:
    """diff's rows of final val loss, times and steps, A against B; label names a trial."""
    delta = None if a.final_val_loss is None or b.final_val_loss is None else b.final_val_loss - a.final_val_loss
    return [[f"final val loss{label}", describe_loss(a), describe_loss(b), fmt(delta, "+.4f")],
            [f"train time (s){label}", fmt(a.train_time_s, ".2f"), fmt(b.train_time_s, ".2f"),
             fmt(ratio(b.train_time_ms, a.train_time_ms), ".4f") + "x"],
            [f"step_avg (ms){label}", fmt(a.step_avg_ms, ".2f"), fmt(b.step_avg_ms, ".2f"),
             fmt(ratio(b.step_avg_ms, a.step_avg_ms), ".4f") + "x"],
            [f"steps{label}", describe_steps(a), describe_steps(b), ""]]


def diff_report(a: Run, b: Run, with_code: bool = False) -> str:
    """The verdict, then losses at common steps, the final val loss and the times, then the config fields that
    changed, then the code change: its size, or (with_code) its hunks."""
    out = [verdict(a, b), f"A: {a.path}", f"B: {b.path}", "", "== val loss at matching steps"]
    several = a.trials > 1 or b.trials > 1
    rows = [[*([str(trial + 1)] if several else []), str(step), f"{la:.4f}", f"{lb:.4f}", f"{lb - la:+.4f}"]
            for trial, step, la, lb in matching_val_losses(a, b)]
    headers = [*(["trial"] if several else []), "step", "A", "B", "B-A"]
    out.append(format_table(headers, rows, left=()) if rows else "(no common validation steps)")
    if several:  # each trial's results, trial k of A against trial k of B
        pairs = [(f" (trial {k + 1})", *(trial_view(r, k) if k < r.trials else Run(r.name, r.path) for r in (a, b)))
                 for k in range(max(a.trials, b.trials))]
    else:
        pairs = [("", a, b)]
    results = [row for label, ta, tb in pairs for row in result_rows(ta, tb, label)]
    out += ["", format_table(["", "A", "B", "B vs A"], results)]
    if describe_hardware(a) != describe_hardware(b):
        out += [f"A ran on {describe_hardware(a)}", f"B ran on {describe_hardware(b)}"]
    out += ["", "== config (A -> B)", *config_diff(a, b), "", "== code (A -> B)"]
    if a.code is None or b.code is None:
        out.append("unavailable: " + " and ".join(r.name for r in (a, b) if r.code is None) + " has no code snapshot")
    elif with_code:
        out.extend(code_diff(a, b) or ["(identical)"])
    else:
        out.extend(code_change(a, b))
    return "\n".join(out)


def cmd_diff(args: argparse.Namespace) -> int:
    a, b = load_single(args.a), load_single(args.b)
    lacking = [run for run in (a, b) if run.code is None]  # refused before any output: half a diff misleads
    if lacking:
        raise LogError(f"{lacking[0].path}: no code snapshot (expected the script source above a line of 100 '=')")
    print(diff_report(a, b, args.code))
    return 0


# -----------------------------------------------------------------------------
# stats
# Mean ± sample std of final val loss and train time per group, a one-sided t-test of the mean
# loss against the target, and Welch's two-sided t-tests against a baseline group. Tests that need
# two runs per group say so instead of failing.


@dataclass
class GroupStats:
    names: list[str]
    losses: list[float]
    times_s: list[float]
    warnings: list[str]  # what the statistics leave out or pool; stats_report prints each once


def group_stats(runs: Sequence[Run], label: str) -> GroupStats:
    """Final val losses and train times; runs lacking one are left out of that metric (with a warning)."""
    notes = []
    for run in runs:
        if run.final_val_loss is None:
            notes.append(f"{run.name}: no validation line; left out of the {label} val loss statistics")
        elif diverged(run):
            notes.append(f"{run.name}: diverged (final val loss {run.final_val_loss}); left out of the {label} val "
                         f"loss statistics")
        if run.train_time_s is None:
            notes.append(f"{run.name}: no train time; left out of the {label} train time statistics")
    hardware = sorted({describe_hardware(run) for run in runs} - {"-"})
    if len(hardware) > 1:
        notes.append(f"the {label} ran on different hardware ({'; '.join(hardware)}); pooling them anyway")
    ends = sorted({run.last_step for run in runs if run.last_step is not None})
    if len(ends) > 1:
        notes.append(f"the {label} end at different steps ({', '.join(map(str, ends))}); computing anyway")
    return GroupStats(names=[run.name for run in runs],
                      losses=[run.final_val_loss for run in runs
                              if run.final_val_loss is not None and not diverged(run)],
                      times_s=[run.train_time_s for run in runs if run.train_time_s is not None], warnings=notes)


def mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (ddof=1); None where there are too few values."""
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def target_test(losses: Sequence[float], target: float) -> tuple[float, float] | None:
    """(t, p) of the one-sided t-test H1: mean loss < target; None with fewer than 2 losses."""
    if len(losses) < 2:
        return None
    from scipy import stats
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = stats.ttest_1samp(losses, target, alternative="less")
    return float(result.statistic), float(result.pvalue)


def welch_test(x: Sequence[float], y: Sequence[float]) -> tuple[float, float] | None:
    """(t, p) of Welch's two-sided t-test between x and y; None unless both have 2+ values."""
    if len(x) < 2 or len(y) < 2:
        return None
    from scipy import stats
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = stats.ttest_ind(x, y, equal_var=False, alternative="two-sided")
    return float(result.statistic), float(result.pvalue)


def describe_test(result: tuple[float, float] | None, needed: str) -> str:
    if result is None:
        return f"needs at least 2 runs {needed}"
    t, p = result
    if math.isnan(p):
        return "undefined (no spread in the values)"
    return f"t = {t:.4f}, p = {p:.6g}"


def describe_group(label: str, group: GroupStats) -> list[str]:
    loss_mean, loss_std = mean_std(group.losses)
    time_mean, time_std = mean_std(group.times_s)
    return [f"{label} (n={len(group.names)}): {', '.join(group.names)}",
            f"  val loss:   {fmt(loss_mean, '.4f')} ± {fmt(loss_std, '.4f')}  "
            f"(mean ± sample std, n={len(group.losses)})",
            f"  train time: {fmt(time_mean, '.3f')} ± {fmt(time_std, '.3f')} s  "
            f"(mean ± sample std, n={len(group.times_s)})"]


def recipe_groups(runs: Sequence[Run]) -> list[tuple[str, list[Run]]]:
    """Runs grouped by recipe (their config without the fields that name a run), each labelled by the fields
    that set it apart from the other groups; one group, labelled "", when they agree (or have no config)."""
    def key(run: Run) -> str:
        return json.dumps({k: v for k, v in (run.config or {}).items() if k not in RUN_FIELDS}, sort_keys=True)

    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(key(run), []).append(run)
    if len(groups) == 1:
        return [("", list(runs))]
    configs = [json.loads(k) for k in groups]
    differing = sorted({f for c in configs for f in c if any(c.get(f) != o.get(f) for o in configs)})
    if len(differing) > 4:  # labels would not fit a line: number the recipes
        return [(f"recipe {i + 1} of {len(groups)}", members) for i, members in enumerate(groups.values())]
    return [(", ".join(f"{f}={json.dumps(c.get(f))}" for f in differing), members)
            for c, members in zip(configs, groups.values())]


def recipe_target(runs: Sequence[Run]) -> float | None:
    """The val loss the runs' recipe aims at: the speedrun's FineWeb target for runs validated on FineWeb (or
    upstream logs, which carry no config); none for other data (the tiny CPU preset on the bundled sample)."""
    on_fineweb = ["fineweb" in str((run.config or {}).get("val_files", "fineweb")) for run in runs]
    return DEFAULT_TARGET if all(on_fineweb) else None


def stats_report(runs: Sequence[Run], target: float | None, baseline: Sequence[Run] | None = None) -> str:
    """Per recipe group: mean ± std and the t-test against the target (given, else the recipe's); with a
    baseline, Welch's tests of the (one) group against it."""
    groups = recipe_groups(runs)
    if len(groups) > 1:
        warn(f"the runs are {len(groups)} different recipes: statistics per recipe, never pooled")
    if baseline and len(groups) > 1:
        raise LogError("--baseline compares one recipe's runs: give the runs of one recipe (see the groups above)")
    out, notes = [], {}  # the warnings in order, each once: groups often share one (the same hardware mix)
    for label, members in groups:
        group = group_stats(members, "runs")
        notes.update(dict.fromkeys(group.warnings))
        out += describe_group(f"runs{f' [{label}]' if label else ''}", group)
        aim = target if target is not None else recipe_target(members)
        out.append(f"  one-sided t-test, H1 mean val loss < {aim:g}: "
                   f"{describe_test(target_test(group.losses, aim), f'(have {len(group.losses)})')}" if aim is not None
                   else "  no target: these are not FineWeb validation runs (--target gives one)")
        if baseline:
            base = group_stats(baseline, "baseline runs")
            notes.update(dict.fromkeys(base.warnings))
            out += describe_group("baseline", base)
            need = "in each group"
            out.append(f"Welch t-test (two-sided), train time, runs vs baseline: "
                       f"{describe_test(welch_test(group.times_s, base.times_s), need)}")
            out.append(f"Welch t-test (two-sided), val loss, runs vs baseline: "
                       f"{describe_test(welch_test(group.losses, base.losses), need)}")
    for note in notes:
        warn(note)
    return "\n".join(out)


def cmd_stats(args: argparse.Namespace) -> int:
    if args.target is not None and not math.isfinite(args.target):  # argparse's float takes nan and inf
        raise LogError(f"--target={args.target}: the val loss target must be a finite number (e.g. --target=3.28)")
    runs = by_trials(load_runs(args.runs))
    baseline = by_trials(load_runs(args.baseline)) if args.baseline else None
    print(stats_report(runs, args.target, baseline))
    return 0


# -----------------------------------------------------------------------------
# plot
# Two panels, loss against step and against train time (s): per run, its val points (markers, a line
# style of its own, so that identical runs stay apart) and its per-step train loss (thin, same colour).
# The loss axis leaves out the step-0 loss (about ln(vocab) for every run) so that the late,
# close-together part of the curves stays readable.

LINE_STYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D", "v", "x", "P", "*"]


def loss_limits(runs: Sequence[Run]) -> tuple[float, float] | None:
    """y-limits spanning every validation after step 0 with a 5% margin; None if there is none."""
    losses = [p.loss for run in runs for p in run.val_points + run.train_points if p.step > 0 and math.isfinite(p.loss)]
    if not losses:
        return None
    low, high = min(losses), max(losses)
    margin = 0.05 * (high - low) or 0.01
    return low - margin, high + margin


def plot_figure(runs: Sequence[Run]):  # -> matplotlib Figure
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, run in enumerate(runs):
        style = dict(linestyle=LINE_STYLES[i % len(LINE_STYLES)], marker=MARKERS[i % len(MARKERS)], markersize=4)
        line, = by_step.plot([p.step for p in run.val_points], [p.loss for p in run.val_points], label=run.name,
                             **style)
        timed = [(p.time_ms / 1000, p.loss) for p in run.val_points if p.time_ms is not None]
        by_time.plot([t for t, _ in timed], [loss for _, loss in timed], label=run.name, color=line.get_color(),
                     **style)
        if run.train_points:
            train = dict(color=line.get_color(), linewidth=0.6, alpha=0.5, label=f"{run.name} (train)")
            by_step.plot([p.step for p in run.train_points], [p.loss for p in run.train_points], **train)
            timed = [(p.time_ms / 1000, p.loss) for p in run.train_points if p.time_ms is not None]
            by_time.plot([t for t, _ in timed], [loss for _, loss in timed], **train)
    limits = loss_limits(runs)
    clipped = limits is not None and any(not limits[0] <= p.loss <= limits[1] for r in runs for p in r.val_points)
    for ax, xlabel in ((by_step, "step"), (by_time, "train time (s)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (step 0 off scale)" if clipped else "loss")
        if limits is not None:
            ax.set_ylim(*limits)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    by_step.set_title("loss vs step (val: markers, train: thin)")
    by_time.set_title("loss vs train time")
    fig.tight_layout()
    return fig


def plot_runs(runs: Sequence[Run], out: Path) -> None:
    save_figure(plot_figure(runs), out)


def save_figure(fig: Any, out: Path) -> None:
    """The figure as a PNG at out, then closed."""
    import matplotlib.pyplot as plt

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png", dpi=110)
    except OSError as e:
        raise LogError(f"{out}: cannot write the plot ({e.strerror or e})") from None
    finally:
        plt.close(fig)


def cmd_plot(args: argparse.Namespace) -> int:
    runs = by_trials(load_runs(args.runs))
    for run in runs:
        if not run.val_points:
            warn(f"{run.name}: no validation line; nothing to plot for it")
    if not any(run.val_points for run in runs):
        raise LogError("no run has a validation line ('step:S/T val_loss:V ...'); nothing to plot")
    plot_runs(runs, Path(args.output))
    print(f"wrote {Path(args.output).resolve()}")
    return 0


# -----------------------------------------------------------------------------
# track3
# The optimization track (upstream's records/track_3_optimization/): the fewest steps to the target val loss with
# the baseline's model, data and batch, any optimizer. A result is n trials: several in one log (a trial starts
# where the step count returns to 0, as upstream's result logs and this project's multi-trial logs print them),
# one per log, or a folder of logs. The track's rule (upstream's README): at one step, the same for every trial,
# the trials' mean val loss must satisfy (target - mean) * sqrt(n) >= 0.004, a one-sided z-test at sigma 0.0013
# (p < .001); the result's step count is the earliest step that does. Against an earlier result, the pairwise
# rule counts the steps saved as loss, at 0.0045 per 100 steps.

RULE_MARGIN = 0.004  # 3.09 sigma (one-sided p < .001) at upstream's sigma of 0.0013
LOSS_PER_100_STEPS = 0.0045  # upstream's slope near the target: result #12 run 200 steps shorter lost 0.0091
LABEL_WIDTH = 40  # a result's name in the plot's legend


@dataclass
class Trial:
    name: str
    path: Path
    total: int  # the steps it was to train: the T of its `step:S/T` lines
    losses: dict[int, float]  # val loss by step


@dataclass(frozen=True)
class StepStats:
    """The trials' mean val loss at one step, measured against the target by the track's rule."""
    step: int
    n: int
    mean: float
    target: float

    @property
    def margin(self) -> float:
        return (self.target - self.mean) * math.sqrt(self.n)

    @property
    def valid(self) -> bool:
        return self.margin >= RULE_MARGIN  # never for a NaN mean: a diverged trial counts against its result

    @property
    def evidence(self) -> str:
        """The mean as upstream's results table writes it, e.g. '3.2790 (n=20)'."""
        return f"{self.mean:.4f} (n={self.n})"


@dataclass
class Result:
    label: str  # names the logs it came from
    trials: list[Trial]
    table: list[StepStats]  # the steps every trial validated in its last 10%, and the result's step
    headline: StepStats  # the earliest valid step, else the last step every trial validated


def trial_numbers(steps: Sequence[int]) -> list[int]:
    """For validations in file order, the trial (0, 1, ...) each belongs to: a trial starts where the step count
    returns to 0, as upstream's make_figures.py splits its logs."""
    numbers, current = [], 0
    for i, step in enumerate(steps):
        if step == 0 and i > 0:
            current += 1
        numbers.append(current)
    return numbers


def by_trial(records: Sequence[tuple[int, ValPoint]]) -> list[list[ValPoint]]:
    """(trial, point) records as one list per trial, in the order the trials first appear."""
    grouped: dict[int, list[ValPoint]] = {}
    for trial, point in records:
        grouped.setdefault(trial, []).append(point)
    return list(grouped.values())


def read_trial_records(path: Path) -> list[list[ValPoint]] | None:
    """Per trial, the exact val losses of a .jsonl beside a log: one object per validation with "step", "val_loss"
    and "trial" (without "trial", a trial starts where the step returns to 0); None when unreadable. A kill may cut
    the last line short: it is left out."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as e:
        warn(f"{path}: cannot read ({e.strerror or e}); the val losses come from the log lines")
        return None
    records: list[tuple[int | None, ValPoint]] = []
    for number, line in enumerate(lines):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) - 1:
                break
            entry = None
        if not isinstance(entry, dict):
            warn(f"{path}: line {number + 1} is not a JSON object; the val losses come from the log lines")
            return None
        step, loss = _int(entry.get("step")), _loss(entry.get("val_loss"))
        if step is not None and loss is not None:
            records.append((_int(entry.get("trial")), ValPoint(step, loss, None)))
    trials = [trial for trial, _ in records]
    if None in trials:
        trials = trial_numbers([point.step for _, point in records])
    return by_trial(list(zip(trials, (point for _, point in records))))


def exact_losses(path: Path, printed: list[list[ValPoint]]) -> list[list[ValPoint]]:
    """The printed val losses of a log's trials, each replaced by its exact value from the .jsonl beside the log
    where that has it; all printed ones (with a warning) when the .jsonl disagrees with a line."""
    records = read_trial_records(path) if path.is_file() else None
    if not records:
        return printed
    exact = [{point.step: point for point in trial} for trial in records]
    merged = [[exact[k].get(p.step, p) if k < len(exact) else p for p in trial] for k, trial in enumerate(printed)]
    if any(not same_loss(p, m) for trial, mine in zip(printed, merged) for p, m in zip(trial, mine)):
        warn(f"{path}: its val losses differ from the log's lines (from another run?); using the lines'")
        return printed
    return merged


def parse_trials(text: str, path: Path) -> list[Trial]:
    """The trials of a log, in its order, with the exact val losses of the .jsonl beside it where it has them."""
    _, rest = split_code(text)
    if rest is None:
        raise LogError(f"{path}: not a run log: no line of 100 '=' (expected {LOG_SHAPE})")
    tagged = trial_lines(rest)
    lines = [s for _, s in tagged if s is not None and s.val_loss is not None]
    if not lines:
        raise LogError(f"{path}: not a run log: no 'step:S/T val_loss:V ...' line")
    marked = any(TRIAL_RE.match(line) for line, _ in tagged)  # this project's: a resumed trial logs its steps again
    numbers = [s.trial for s in lines] if marked else trial_numbers([s.step for s in lines])
    totals = {k: s.total for k, s in zip(numbers, lines)}  # the last line's: a trial's lines all name the same
    printed = by_trial([(k, ValPoint(s.step, s.val_loss, None, s.digits["val_loss"]))
                        for k, s in zip(numbers, lines)])
    trials = exact_losses(path.with_suffix(".jsonl"), printed)
    names = [path.stem] if len(trials) == 1 else [f"{path.stem} trial {k + 1}" for k in range(len(trials))]
    return [Trial(name, path, totals[k], {p.step: p.loss for p in points})
            for k, (name, points) in enumerate(zip(names, trials))]


def load_trials(paths: Sequence[str]) -> list[Trial]:
    """The trials of the logs and folders of logs given, in that order (a folder's *.txt by name); a log named twice
    counts once, since its trials would count twice in n."""
    trials: list[Trial] = []
    seen: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise LogError(f"{raw}: no such file or directory")
        found = []
        for log in sorted(path.glob("*.txt")) if path.is_dir() else [path]:
            if log.resolve() in seen:
                warn(f"{log}: given more than once; counting its trials once")
                continue
            seen.add(log.resolve())
            try:
                found += parse_trials(_read(log), log)
            except LogError as e:
                if not path.is_dir():
                    raise
                warn(f"skipped {e}")  # notes beside the logs are fine, but say which files were left out
        if path.is_dir() and not found:
            raise LogError(f"{raw}: no run logs in this folder (expected *.txt files holding {LOG_SHAPE})")
        trials += found
    return trials


def finished(trial: Trial) -> bool:
    """Whether it validated its last step: one that stopped (or is still running) lacks its late steps and is no
    result yet."""
    return trial.total in trial.losses


def common_steps(trials: Sequence[Trial]) -> list[int]:
    """The steps every trial validated, in order."""
    return sorted(set.intersection(*(set(trial.losses) for trial in trials)))


def late_steps(trials: Sequence[Trial]) -> list[int]:
    """The steps every trial validated in its last 10% of steps (where upstream's trainer validates every 25),
    its last included."""
    return [s for s in common_steps(trials) if all(10 * s >= 9 * trial.total for trial in trials)]


def stats_at(trials: Sequence[Trial], step: int, target: float) -> StepStats:
    losses = [trial.losses[step] for trial in trials]
    return StepStats(step, len(losses), sum(losses) / len(losses), target)


def result_step(trials: Sequence[Trial], target: float) -> StepStats:
    """The result as upstream's table states it: the earliest step, the same for every trial, at which the trials'
    mean is valid; where none is, the last step every trial validated."""
    steps = [stats_at(trials, step, target) for step in common_steps(trials)]
    return next((stats for stats in steps if stats.valid), steps[-1])


def pairwise_margin(new: StepStats, old: StepStats) -> float:
    """Upstream's pairwise rule: new's lead over the earlier result old, (loss saved + the steps saved counted as
    loss) / sqrt(1/n_new + 1/n_old); new is significantly better at RULE_MARGIN or more."""
    saved_loss = old.mean - new.mean
    saved_steps_loss = (old.step - new.step) / 100 * LOSS_PER_100_STEPS
    return (saved_loss + saved_steps_loss) / math.sqrt(1 / new.n + 1 / old.n)


def result_label(paths: Sequence[str]) -> str:
    """The logs' names (a file's stem, a folder's name), shortened to LABEL_WIDTH."""
    names = [Path(raw).stem if Path(raw).is_file() else Path(raw).resolve().name for raw in paths]
    text = ", ".join(names)
    return text if len(text) <= LABEL_WIDTH else f"{names[0][:LABEL_WIDTH - 12]}... and {len(names) - 1} more"


def track3_result(paths: Sequence[str], target: float) -> Result:
    """The statistics of the finished trials of the logs given; refusals come before any warning."""
    loaded = load_trials(paths)
    trials = [trial for trial in loaded if finished(trial)]
    if not trials:
        raise LogError(f"{' '.join(paths)}: no trial validated its last step")
    if not common_steps(trials):
        raise LogError(f"{' '.join(paths)}: the trials share no validated step")
    for trial in loaded:
        if not finished(trial):
            warn(f"{trial.name}: stopped before its last step ({max(trial.losses)} of {trial.total}); left out")
    totals = sorted({trial.total for trial in trials})
    if len(totals) > 1:
        warn(f"{result_label(paths)}: the trials train for different step counts ({', '.join(map(str, totals))}); "
             f"their statistics are at the steps all of them validated")
    for trial in trials:
        if any(not math.isfinite(loss) for loss in trial.losses.values()):
            warn(f"{trial.name}: diverged (a val loss is not finite); it counts, so its result's mean is not valid")
    headline = result_step(trials, target)
    table = [stats_at(trials, step, target) for step in sorted({*late_steps(trials), headline.step})]
    return Result(result_label(paths), trials, table, headline)


def describe_result(role: str, result: Result) -> list[str]:
    """A result's trials, its table of late steps, and its step count by the rule."""
    n, files = len(result.trials), len({trial.path for trial in result.trials})
    totals = sorted({trial.total for trial in result.trials})
    length = f"{totals[0]} to {totals[-1]} steps" if len(totals) > 1 else f"{totals[0]} steps{' each' * (n > 1)}"
    rows = [[str(s.step), str(s.n), f"{s.mean:.5f}", f"{s.margin:+.5f}", "yes" if s.valid else "no"]
            for s in result.table]
    head = result.headline
    verdict = (f"valid at {head.step} steps: {head.evidence}, margin {head.margin:.5f} >= {RULE_MARGIN}"
               if head.valid else f"not valid at any step; at its last, {head.step}: {head.evidence}, margin "
                                  f"{head.margin:.5f} < {RULE_MARGIN}")
    return [f"{role}: {result.label}: {n} trial{'s' * (n > 1)} from {files} log{'s' * (files > 1)}, {length}",
            format_table(["step", "n", "mean val loss", f"({head.target:g} - mean) * sqrt(n)", "valid"], rows,
                         left=()),
            f"{role}: {verdict}"]


def describe_pairwise(new: StepStats, old: StepStats) -> str:
    """The pairwise rule's sum as upstream's README writes it out, and its verdict."""
    margin = pairwise_margin(new, old)
    numerator = (old.mean - new.mean) + (old.step - new.step) / 100 * LOSS_PER_100_STEPS
    better = "significantly better" if margin >= RULE_MARGIN else "not significantly better"
    return (f"pairwise, runs ({new.step} steps, {new.evidence}) vs baseline ({old.step} steps, {old.evidence}): "
            f"the runs are {better}\n"
            f"  ((baseline - runs mean) + (baseline - runs steps) / 100 * {LOSS_PER_100_STEPS}) / sqrt(1/n_runs + "
            f"1/n_baseline)\n"
            f"  = (({old.mean:.5f} - {new.mean:.5f}) + ({old.step} - {new.step}) / 100 * {LOSS_PER_100_STEPS}) "
            f"/ sqrt(1/{new.n} + 1/{old.n}) = {numerator:+.5f} / {math.sqrt(1 / new.n + 1 / old.n):.4f} = "
            f"{margin:+.5f} {'>=' if margin >= RULE_MARGIN else '<'} {RULE_MARGIN}")


def track3_report(runs: Result, baseline: Result | None) -> str:
    out = [f"rule: valid where (target - mean) * sqrt(n) >= {RULE_MARGIN}, at one step for every trial", "",
           *describe_result("runs", runs)]
    if baseline is not None:
        out += ["", *describe_result("baseline", baseline), "", describe_pairwise(runs.headline, baseline.headline)]
    return "\n".join(out)


def mean_curve(trials: Sequence[Trial]) -> dict[int, float]:
    """The mean val loss at each step over the trials that validated it, by step (as make_figures.py averages)."""
    by_step: dict[int, list[float]] = {}
    for trial in trials:
        for step, loss in trial.losses.items():
            by_step.setdefault(step, []).append(loss)
    return {step: sum(by_step[step]) / len(by_step[step]) for step in sorted(by_step)}


def track3_figure(results: Sequence[Result], target: float) -> Any:
    """Per result, its mean val loss against step up to its step count (as upstream's make_figures.py draws them),
    and the target: the whole run, and from 90% of the fewest steps on."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (whole, late) = plt.subplots(1, 2, figsize=(12, 4.5))
    curves = [{s: loss for s, loss in mean_curve(r.trials).items() if s <= r.headline.step} for r in results]
    for i, (result, curve) in enumerate(zip(results, curves)):
        head = result.headline
        label = f"{result.label} → {head.evidence} in {head.step} steps{'' if head.valid else ' (not valid)'}"
        for ax in (whole, late):
            ax.plot(list(curve), list(curve.values()), marker="o", markersize=3.5, linewidth=2.2, label=label,
                    color=f"C{i}")
    last = max(r.headline.step for r in results)
    start = 0.9 * min(r.headline.step for r in results)
    shown = [loss for curve in curves for s, loss in curve.items() if s >= last / 10 and math.isfinite(loss)]
    zoomed = [loss for curve in curves for s, loss in curve.items() if s >= start and math.isfinite(loss)]
    for ax, left, losses in ((whole, 0, shown), (late, start, zoomed)):
        low, high = min([*losses, target]), max([*losses, target])
        margin = 0.08 * (high - low) or 0.01  # room below the target line for its label
        ax.axhline(target, color="gray", linestyle="--", linewidth=1.5)
        ax.annotate(f"target={target:g}", xy=(left, target), xytext=(8, -12), textcoords="offset points",
                    color="gray", fontsize=9)  # below the line: the curves come down to it from above
        ax.set_xlim(left, last * 1.02)
        ax.set_ylim(low - margin, high + margin)
        ax.set_xlabel("training steps")
        ax.set_ylabel("validation loss (mean over trials)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    whole.set_title("mean val loss vs step")
    late.set_title(f"from step {start:.0f} (90% of the fewest steps)")
    fig.tight_layout()
    return fig


def cmd_track3(args: argparse.Namespace) -> int:
    if not math.isfinite(args.target):  # argparse's float takes nan and inf
        raise LogError(f"--target={args.target}: the val loss target must be a finite number (e.g. --target=3.28)")
    runs = track3_result(args.logs, args.target)
    baseline = track3_result(args.baseline, args.target) if args.baseline else None
    report = track3_report(runs, baseline)
    if args.output:  # written before any output: a path it cannot write is the one error line
        save_figure(track3_figure([r for r in (runs, baseline) if r is not None], args.target), Path(args.output))
    print(report)
    if args.output:
        print(f"wrote {Path(args.output).resolve()}")
    return 0


# -----------------------------------------------------------------------------
# Command line
# argparse subcommands; every LogError becomes one `error:` line on stderr and exit code 2
# (argparse's own usage errors also exit with 2).


def cmd_code(args: argparse.Namespace) -> int:
    """Write each source file a log holds into a folder, byte for byte: the files that ran, ready to run again."""
    log, out = Path(args.log), Path(args.dir)
    try:
        data = log.read_bytes()
    except OSError as e:
        raise LogError(f"{log}: cannot read ({e.strerror or e})") from None
    files = source_blocks(data)
    if not files:
        raise LogError(f"{log}: holds no source blocks ('# source: NAME (N bytes)' lines, which this project's logs "
                       f"begin with); an older log's code is its text above the line of 100 '='")
    if clash := [name for name in files if (out / name).exists()]:
        raise LogError(f"{out / clash[0]} exists: give an empty or new folder (nothing there is overwritten)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, content in files.items():
            (out / name).write_bytes(content)
    except OSError as e:
        raise LogError(f"{out}: cannot write ({e.strerror or e})") from None
    for name, content in files.items():
        print(f"{out / name} ({len(content):,} bytes)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compare.py", description="Compare speedrun runs from their logs (.txt) or record folders.")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="one row per run: val loss, time, steps, step_avg, tok/s, hardware")
    show.add_argument("runs", nargs="+", metavar="RUN", help="run log (.txt) or record folder")
    show.set_defaults(func=cmd_show)
    diff = sub.add_parser("diff", help="the verdict (every logged loss equal?), val loss at common steps, final loss "
                                       "and times, then config and code")
    diff.add_argument("a", metavar="A", help="run log (.txt) or a folder holding one run")
    diff.add_argument("b", metavar="B", help="run log (.txt) or a folder holding one run")
    diff.add_argument("--code", action="store_true", help="show the code diff's hunks (default: its size)")
    diff.set_defaults(func=cmd_diff)
    stats = sub.add_parser("stats", help="per recipe: mean ± std, t-test against its target, Welch t-tests vs a "
                                         "baseline")
    stats.add_argument("runs", nargs="+", metavar="RUN", help="run log (.txt) or record folder")
    stats.add_argument("--target", type=float, default=None,
                       help=f"val loss target for the one-sided t-test (default: {DEFAULT_TARGET} for FineWeb "
                            f"validation runs, none for others)")
    stats.add_argument("--baseline", nargs="+", metavar="RUN", help="runs to compare against (Welch t-tests)")
    stats.set_defaults(func=cmd_stats)
    plot = sub.add_parser("plot", help="PNG of val loss vs step and vs train time")
    plot.add_argument("runs", nargs="+", metavar="RUN", help="run log (.txt) or record folder")
    plot.add_argument("-o", "--output", default="compare.png", help="PNG file to write (default: compare.png)")
    plot.set_defaults(func=cmd_plot)
    code = sub.add_parser("code", help="write the source files a log holds into a folder, byte for byte")
    code.add_argument("log", metavar="LOG", help="run log (.txt)")
    code.add_argument("dir", metavar="DIR", help="folder to write them into (created; no file there is overwritten)")
    code.set_defaults(func=cmd_code)
    track3 = sub.add_parser("track3", help="the optimization track's rule: per late step n, mean val loss, margin, "
                                           "valid; the earliest valid step; the pairwise rule vs a baseline")
    track3.add_argument("logs", nargs="+", metavar="LOG", help="track-3 log (.txt, one or several trials) or folder")
    track3.add_argument("--baseline", nargs="+", metavar="LOG", help="an earlier result's logs: the pairwise rule")
    track3.add_argument("--target", type=float, default=DEFAULT_TARGET,
                        help=f"the val loss the trials must reach (default: {DEFAULT_TARGET})")
    track3.add_argument("-o", "--output", help="also write a PNG of each result's mean val loss against step")
    track3.set_defaults(func=cmd_track3)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except LogError as e:
        sys.stdout.flush()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into e.g. `head`: stop quietly
        sys.stdout = open(os.devnull, "w")
        return 0


if __name__ == "__main__":
    sys.exit(main())
