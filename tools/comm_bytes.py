"""Communication per step: the bytes one rank sends per training step, by collective kind, record #89 against this
repo's recipe, at W = 1, 2, 4, 8 ranks, for three step kinds: Muon-only (even steps: the three Muon banks), an Adam
step while the embedding is tied to the head, and an Adam step after the untie.

Accounting. MB = 10^6 bytes one rank sends. Rings: a reduce-scatter or an all-gather sends (W-1)/W of the full
buffer, an all-reduce 2(W-1)/W; an all-to-all sends its whole input (the optimizer's hold only what goes to the
other ranks: no rank sends itself rows).

The recipe: counted from the code. The recipe's model (Config() defaults) is built on the meta device and
ShardedMuonAdam at each rank of W; stand-ins for torch.distributed's collectives record each call (kind, dtype,
numel of the full buffer, of the input for an all-to-all) and return a finished work object; begin_step() and step()
run after set_step() of the schedule's first step of each kind, the Adam kinds with the bigram rows the rank touched
in a step pair (averaged over the ranks and the pairs). Whatever the optimizer issues is counted, so this table
follows train_gpt.py as it changes.

Record #89: from its parameter table (record89_spec.md §5.1, §5.6): replicated parameters all-reduce, sharded ones
reduce-scatter and all-gather; while tied, `embed` does neither (its gradient joins the head's). At W = 8 only
(grad_accum_steps 1) the bigram table's gradient goes as an all-to-all of the rows a rank touched in the step pair
that belong to other ranks' shards, 192 bf16 values and a 4-byte row id each; its all-gather stays dense.

Upstream's current code (f411b3d; upstream_head_spec.md §2.2, §2.8, §2.10): #89's comms over its own parameter table
(five small gate/lambda tensors gone, the MUDD gate network's four replicated ones added), its 377,280 x 768 bigram
table: 768 bf16 values and a 4-byte row id per sparse row, the touched rows counted in that table.

Touched rows: measured on a corpus through the trainer's own data path (TrainTokenStream, bigram_index on the host
tokens): per stage shape, a few step pairs of 8 sequences, rank r of W taking sequences r, r + W, ... of each step
(TrainBatches). --train_files names the corpus (a glob that matches no shards is an error); without it, the proxy
corpus where data/proxy/ has it, else seeded uniform random tokens (far more distinct bigrams than text). The first
line of the output says which.

    python tools/comm_bytes.py [--train_files GLOB] [--pairs 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import train_gpt as T  # noqa: E402

DEFAULT_FILES = str(REPO / "data" / "proxy" / "proxy_train_*.bin")
WORLD_SIZES = (1, 2, 4, 8)
KINDS = ("reduce-scatter", "all-reduce", "all-gather", "all-to-all")
STEP_KINDS = {"Muon-only": (False, None), "Adam tied": (True, True), "Adam untied": (True, False)}  # (adam, tied)

# -----------------------------------------------------------------------------
# Counting collectives: every torch.distributed entry point of the four kinds (tensor and list forms; broadcast and
# reduce too, so none goes unseen), with the argument that holds the full buffer.

COLLECTIVES = {"reduce_scatter_single": ("reduce-scatter", 1), "reduce_scatter_tensor": ("reduce-scatter", 1),
               "reduce_scatter": ("reduce-scatter", 1), "all_reduce": ("all-reduce", 0),
               "all_gather_single": ("all-gather", 0), "all_gather_into_tensor": ("all-gather", 0),
               "all_gather": ("all-gather", 0), "all_to_all_single": ("all-to-all", 1), "all_to_all": ("all-to-all", 1),
               "broadcast": ("broadcast", 0), "reduce": ("reduce", 0)}
RING = {"all-reduce": 2.0}  # full buffers a ring sends per (W-1)/W; every other kind: one


@dataclass(frozen=True)
class Call:
    kind: str
    dtype: torch.dtype
    numel: int  # of the full buffer (all ranks' shards)

    def bytes(self, world_size: int) -> float:
        share = 1.0 if self.kind == "all-to-all" else RING.get(self.kind, 1.0) * (world_size - 1) / world_size
        return share * self.numel * self.dtype.itemsize


class _Done:
    """A finished dist.Work: what the stand-ins return to async callers."""

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Collectives(contextlib.ExitStack):
    """Within the block, records every collective call; stand_in: completes it at once without communicating (no
    process group needed), else passes it on to torch.distributed."""

    def __init__(self, stand_in: bool):
        super().__init__()
        self.stand_in, self.calls = stand_in, []

    def __enter__(self) -> "Collectives":
        super().__enter__()
        for name, (kind, at) in COLLECTIVES.items():
            if (original := getattr(dist, name, None)) is not None:
                self.enter_context(mock.patch.object(dist, name, self._wrap(original, kind, at)))
        return self

    def _wrap(self, original: Callable, kind: str, at: int) -> Callable:
        signature = inspect.signature(original)  # the buffer and async_op, passed by position or by name

        def call(*args: object, **kwargs: object) -> object:
            bound = signature.bind(*args, **kwargs).arguments
            buffer = list(bound.values())[at]
            tensors = buffer if isinstance(buffer, (list, tuple)) else [buffer]
            self.calls.append(Call(kind, tensors[0].dtype, sum(t.numel() for t in tensors)))
            if self.stand_in:
                return _Done() if bound.get("async_op") else None
            return original(*args, **kwargs)
        return call

    def take(self) -> list[Call]:
        calls, self.calls = self.calls, []
        return calls


def by_kind(calls: list[Call], world_size: int) -> dict[str, float]:
    """Bytes per kind (the four, then any other seen)."""
    out = dict.fromkeys(KINDS, 0.0)
    for c in calls:
        out[c.kind] = out.get(c.kind, 0.0) + c.bytes(world_size)
    return out

# -----------------------------------------------------------------------------
# The recipe, counted: the optimizer's communication path run on meta tensors (the update math runs too: on meta it
# only propagates shapes).


def step_rows(cfg: T.Config) -> dict[str, T.StepSchedule]:
    """The schedule's first step of each step kind."""
    table = T.schedule_table(cfg)[:-1]  # the last row is the final validation's
    return {kind: next(s for s in table if s.adam_step == adam and (tied is None or s.tied == tied))
            for kind, (adam, tied) in STEP_KINDS.items()}


def recipe_model(cfg: T.Config) -> T.GPT:
    with torch.device("meta"):
        return T.GPT(cfg, use_flex=False, fp8_head=False)


def recipe_optimizer(cfg: T.Config, world_size: int, rank: int = 0, model: T.GPT | None = None
                     ) -> T.ShardedMuonAdam:
    """At `rank` of W; a model may serve several (each optimizer takes its parameters into its own buffers)."""
    return T.ShardedMuonAdam(model or recipe_model(cfg), cfg, rank, world_size, compile_ns=False)


def recipe_calls(cfg: T.Config, world_size: int, rows: dict[str, np.ndarray] | None = None, rank: int = 0,
                 model: T.GPT | None = None) -> dict[str, list[Call]]:
    """Per step kind, the collectives one optimizer step of `rank` issues (gradients present: the buckets' own
    buffers); rows: per step kind, the bigram rows the rank touched since the last Adam step (none if left out)."""
    opt, out = recipe_optimizer(cfg, world_size, rank, model), {}
    for kind, row in step_rows(cfg).items():
        opt.set_step(row)
        with Collectives(stand_in=True) as seen:
            opt.begin_step((rows or {}).get(kind, np.zeros(0, dtype=np.int64)))
            opt.forward_done()
            opt.step()
            opt.wait_for_params()
        opt.zero_grad()
        out[kind] = seen.calls
    return out

# -----------------------------------------------------------------------------
# Record #89, from its parameter table (spec §5.1): (label, numel, bytes per element, comms) at world size W. Its
# Muon banks shard in whole blocks, padded to a multiple of W (qk: 60 -> 64 at W = 8); `scalars` pads to one too.

V, D, L = 50304, 768, 11
BIGRAM_ROWS, BIGRAM_DIM = 15 * V, 192
SPARSE_ROW_BYTES = BIGRAM_DIM * 2 + 4  # a bf16 gradient row and its int32 row id
MUON_LABELS = ("qk_bank", "vo_bank", "mlp_bank")


def record89_params(world_size: int) -> list[tuple[str, int, int, str]]:
    W = world_size
    pad = lambda n: -(-n // W) * W  # noqa: E731
    bigram = "sharded_sparse" if W == 8 else "sharded"  # sparse only with grad_accum_steps 1 (§5.6)
    return [("qk_bank", pad(60) * 256 * D, 2, "sharded"), ("vo_bank", pad(20) * D * D, 2, "sharded"),
            ("mlp_bank", 24 * 3072 * D, 2, "sharded"), ("scalars", pad(2 * L + 2), 4, "replicated"),
            ("smear_gate", 12, 2, "replicated"), ("skip_gate", 12, 2, "replicated"),
            ("attn_gate_bank", 10 * 6 * 12, 2, "replicated"), ("ve_gate_bank", 5 * 6 * 12, 2, "replicated"),
            ("lm_head", D * V, 2, "sharded"), ("bigram_embed", BIGRAM_ROWS * BIGRAM_DIM, 2, bigram),
            ("post_lambdas", 2 * L, 4, "replicated"), ("x0_lambdas", L, 4, "replicated"),
            ("bigram_lambdas", L, 4, "replicated"), ("resid_lambdas", 2 * L, 4, "replicated"),
            ("xsa_alphas", 6 * L, 4, "replicated"), ("value_embeds", 5 * V * D, 2, "sharded"),
            ("embed", V * D, 2, "sharded"), ("mudd_w1", 2 * 64 * D, 2, "replicated"),
            ("mudd_w2", 2 * 14 * 64, 2, "replicated"), ("mudd_b2", 2 * 14, 2, "replicated")]


# Upstream's current code (f411b3d; upstream_head_spec.md §2.2, §2.8, §2.10): #89's comms (its optimizer class is the
# same) over its own table: skip_gate, attn_gate_bank, x0_lambdas, bigram_lambdas, xsa_alphas gone; the MUDD gate
# network's four parameters added, replicated; the bigram table 377,280 x 768 (47,160 rows a rank at W = 8), its
# sparse rows 768 bf16 wide.
UPSTREAM_ROWS, UPSTREAM_DIM = V * 15 // 2, D
UPSTREAM_ROW_BYTES = UPSTREAM_DIM * 2 + 4


def upstream_params(world_size: int) -> list[tuple[str, int, int, str]]:
    removed = {"skip_gate", "attn_gate_bank", "x0_lambdas", "bigram_lambdas", "xsa_alphas"}
    bigram = "sharded_sparse" if world_size == 8 else "sharded"
    return [("bigram_embed", UPSTREAM_ROWS * UPSTREAM_DIM, 2, bigram) if label == "bigram_embed" else
            (label, numel, size, comms) for label, numel, size, comms in record89_params(world_size)
            if label not in removed] + [
        ("mudd_gate_w1", 2 * 64 * D, 2, "replicated"), ("mudd_gate_w2", 2 * 41 * 64, 2, "replicated"),
        ("mudd_gate_b2", 2 * 41, 2, "replicated"), ("_mudd_gate_scale", 1, 4, "replicated")]


def record89_bytes(world_size: int, step_kind: str, touched_rows: float) -> dict[str, float]:
    """#89's bytes per kind for one rank and step; touched_rows: other ranks' bigram rows this rank sends (W = 8)."""
    return table_bytes(record89_params(world_size), SPARSE_ROW_BYTES, world_size, step_kind, touched_rows)


def upstream_bytes(world_size: int, step_kind: str, touched_rows: float) -> dict[str, float]:
    """Upstream f411b3d's, as record89_bytes (touched_rows: of its 377,280-row table)."""
    return table_bytes(upstream_params(world_size), UPSTREAM_ROW_BYTES, world_size, step_kind, touched_rows)


def table_bytes(params: list[tuple[str, int, int, str]], row_bytes: int, world_size: int, step_kind: str,
                touched_rows: float) -> dict[str, float]:
    """Bytes per kind of a parameter table with #89's comms for one rank and step."""
    adam, tied = STEP_KINDS[step_kind]
    out, ring = dict.fromkeys(KINDS, 0.0), (world_size - 1) / world_size
    for label, numel, size, comms in params:
        if world_size == 1 or not adam and label not in MUON_LABELS or tied and label == "embed":
            continue
        if comms == "replicated":
            out["all-reduce"] += 2 * ring * numel * size
            continue
        if comms == "sharded":
            out["reduce-scatter"] += ring * numel * size
        else:
            out["all-to-all"] += touched_rows * row_bytes
        out["all-gather"] += ring * numel * size
    return out

# -----------------------------------------------------------------------------
# Touched bigram rows: the rows a rank's two steps hash to (#89's row mask, cleared after each odd step; the recipe's
# RowBucket alike); those in another rank's contiguous shard of the table are sent. ISSUE_TOUCHED_ROWS: the counts
# the issue's 1,364.0 / 1,509.5 MB imply.

ISSUE_TOUCHED_ROWS = {16384: 18_200, 49152: 44_650}
SEQS = 8  # sequences per step: the recipe's global_batch_seqs, #89's 8 ranks


def pair_rows(files: list[Path] | None, seq_len: int, max_doc_len: int, pairs: int, table_rows: int = BIGRAM_ROWS
              ) -> list[list[np.ndarray]]:
    """Per step pair from the corpus start, the bigram rows of its 2 x 8 sequences' inputs (step-major) in a table of
    table_rows rows (#89's by default); files None: seeded random tokens."""
    if files is None:
        g = np.random.default_rng(0)
        return [list(T.bigram_index(g.integers(0, V, (2 * SEQS, seq_len)), table_rows)) for _ in range(pairs)]
    stream = T.TrainTokenStream(files, seq_len, SEQS, V, lambda _: (seq_len, max_doc_len), epochs=8)
    return [[T.bigram_index(np.concatenate([stream.tokens[a:b] for a, b in pieces])[:-1], table_rows)
             for _ in range(2) for pieces in stream.next_step()] for _ in range(pairs)]


def rank_rows(pair: list[np.ndarray], rank: int, world_size: int) -> np.ndarray:
    """The rows rank r of W touched in a step pair: its sequences r, r + W, ... of each step (TrainBatches')."""
    return np.concatenate([rows for k, rows in enumerate(pair) if k % SEQS % world_size == rank])


def record89_rows(pairs: list[list[np.ndarray]], world_size: int = 8, table_rows: int = BIGRAM_ROWS) -> float:
    """#89's touched rows in other ranks' shards (of a table of table_rows rows: #89's by default, upstream's
    UPSTREAM_ROWS), mean over the pairs and the ranks."""
    shard_rows = table_rows // world_size
    return float(np.mean([(np.unique(rank_rows(pair, r, world_size)) // shard_rows != r).sum()
                          for pair in pairs for r in range(world_size)]))


def stage_rows(pattern: str | None, pairs: int) -> tuple[dict[int, dict[int, list[list[np.ndarray]]]], str]:
    """Per stage's tokens per sequence (seq_len) and per table size (#89's, upstream's, the recipe's rows), pair_rows,
    and where they came from. pattern None: the proxy
    corpus where it is, else random tokens; a pattern given: its shards (UsageError where it has none)."""
    cfg = T.Config()
    shapes = [(s.seq_len, s.doc_len) for s in cfg.stages[:-1]]  # the extension trains at the last stage's
    shape = f"{pairs} step pairs x 8 sequences per stage"
    try:
        files = T.find_shards(DEFAULT_FILES if pattern is None else pattern)
        source = f"{pattern}, {shape}" if pattern is not None else f"{DEFAULT_FILES} (the default corpus), {shape}"
    except T.UsageError:
        if pattern is not None:  # asked for by name: counting random tokens in its place answers another question
            raise
        files, source = None, (f"seeded random tokens ({shape}): no --train_files given and no shards at "
                               f"{DEFAULT_FILES}")
    tables = sorted({BIGRAM_ROWS, UPSTREAM_ROWS, cfg.bigram_rows})  # #89's, upstream's, the recipe's row counts
    return {seq: {n: pair_rows(files, seq, doc, pairs, n) for n in tables} for seq, doc in shapes}, source

# -----------------------------------------------------------------------------
# The table: per W, each step kind's #89, upstream and recipe lines in MB; touched rows at the step's own shape, each
# in its own table (#89's 754,560 rows, upstream's 377,280, the recipe's cfg.bigram_rows).


def table(rows_at: dict[int, dict[int, list[list[np.ndarray]]]]) -> dict[int, dict[str, dict[str, dict[str, float]]]]:
    """Per W and step kind, #89's MB, upstream's and the recipe's (train_gpt.py's model, Config() defaults), each at
    the step's own shape; the recipe's mean over its ranks and the step pairs."""
    cfg, out, model = T.Config(), {}, recipe_model(T.Config())
    at = lambda n: {kind: rows_at[s.seq_len][n] for kind, s in step_rows(cfg).items()  # noqa: E731
                    if STEP_KINDS[kind][0]}
    theirs, upstream, pairs = at(BIGRAM_ROWS), at(UPSTREAM_ROWS), at(cfg.bigram_rows)
    for W in WORLD_SIZES:
        runs = [{kind: by_kind(calls, W) for kind, calls in recipe_calls(
                    cfg, W, {kind: rank_rows(p[i], r, W) for kind, p in pairs.items()}, r, model).items()}
                for r in range(W) for i in range(len(pairs["Adam tied"]))]
        out[W] = {kind: {"record #89": record89_bytes(W, kind, record89_rows(theirs[kind]) if kind in pairs else 0.0),
                         "upstream f411b3d": upstream_bytes(W, kind, record89_rows(upstream[kind], 8, UPSTREAM_ROWS)
                                                            if kind in pairs else 0.0),
                         "recipe": {k: float(np.mean([run[kind][k] for run in runs])) for k in KINDS}}
                  for kind in STEP_KINDS}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train_files", default=None, help="corpus for the touched bigram rows (default: "
                    f"{DEFAULT_FILES} where it is, else seeded random tokens)")
    ap.add_argument("--pairs", type=int, default=4, help="step pairs per stage for the touched rows")
    ap.add_argument("--json", default="", help="also write the table here")
    args = ap.parse_args(argv)
    try:
        rows_at, source = stage_rows(args.train_files, args.pairs)
    except T.UsageError as e:
        print(f"error: --train_files: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    counts = {seq: {n: record89_rows(pairs, 8, n) for n, pairs in tables.items()} for seq, tables in rows_at.items()}
    print(f"Tokens counted: {source}")
    print("The bigram all-to-all at W = 8, rows a rank sends per step pair (other ranks' shards), per table:")
    for n in next(iter(counts.values())):
        print(f"  {n:,} rows: " + ", ".join(f"{seq:,} tokens: {c[n]:,.0f}" for seq, c in counts.items()))
    step_seq = {kind: s.seq_len for kind, s in step_rows(T.Config()).items()}
    print("  used: " + ", ".join(f"{k} at {seq:,} tokens" for k, seq in step_seq.items() if STEP_KINDS[k][0]))
    result = table(rows_at)
    for W, kinds in result.items():
        print(f"\nW = {W}: MB per rank per step  {''.join(f'{k:>15}' for k in KINDS)}{'total':>10}")
        for kind, lines in kinds.items():
            for who, mb in lines.items():
                print(f"  {kind:<12}{who:<16}{''.join(f'{mb[k] / 1e6:15.1f}' for k in KINDS)}"
                      f"{sum(mb.values()) / 1e6:10.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"touched_rows": {"source": source, **counts},
                                               "mb": {W: {kind: {who: {k: v / 1e6 for k, v in mb.items()}
                                                                 for who, mb in lines.items()}
                                                          for kind, lines in kinds.items()}
                                                      for W, kinds in result.items()}}, indent=1))


if __name__ == "__main__":
    main()
