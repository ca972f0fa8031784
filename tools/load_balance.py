"""Attention load balance across ranks: how much the slowest rank's attention exceeds the mean.

Each step the trainer gives rank r the global sequences r, r + W, r + 2W, ... (TrainBatches' rule) of
the step's BOS-aligned sequences (TrainTokenStream, documents cut at the stage's length). Their packed documents
differ, so the attention work differs between ranks, and every step waits for the slowest rank at the gradient
reduction.

Definition. The attention cost of a sequence at a window of W blocks is the number of (query, key) token pairs the
trainer's mask allows (FA3's token window, record #70): the query at position p of its document sees the keys at
p - W x block_size .. p of that document, min(p, W x block_size) + 1 of them; summed over the queries it is exactly
the number of True entries of train_gpt.dense_mask(seq, block_size, W), counted without building the T x T mask
(the tests check it against the dense mask on short sequences). A paired-head layer attends over the 2T
interleaved positions (token t at 2t and 2t + 1) with half the heads: its pairs are counted there, at half weight.

The recipe's attention layers (attn_pattern SSSLSS-SSSL, paired layers 0, 2, 5, 9) use the step's windows: the long
layers schedule(step).long_window, the others its short_window. A rank's attention cost at a step is the sum over
its sequences and layers of (heads of the layer / heads) x pairs; "long only" is the sum of the long layers' pairs.
Also reported: the tiles of the long mask the trainer's block selection reads (FlexAttention computes whole tiles),
and a whole-step FLOP model: per rank 6 * train_gpt.matmul_weights * tokens + 12 * heads * head_dim FLOPs per
allowed pair and full-head layer (train_gpt.flops_per_token's terms with exact pair counts).

Per step it prints max/mean over ranks; the summary gives the mean, p50, p90 and max of max/mean and
the implied slowdown: a step takes as long as its slowest rank, so the attention core takes
sum(max) / sum(mean) of the perfectly balanced time (and the whole step, by the FLOP model, the same
ratio of whole-step FLOPs).

A proxy corpus (shards in the git-ignored data/proxy/; 23M tokens in ours) holds fewer tokens than the steps take,
so the files are repeated in order (TrainTokenStream's epochs, as --train_epochs does in training); the number of
passes used is printed. Repeated passes give the same sequences again.

    python tools/load_balance.py [--train_files PATTERN] [--steps 200] [--world_size 8]
                                   [--window_blocks N] [--quiet]

--window_blocks fixes the long window for every step (the short one: the schedule's) instead of the schedule's.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import train_gpt as T  # noqa: E402

DEFAULT_FILES = str(REPO / "data" / "proxy" / "proxy_train_*.bin")


def attention_pairs(input_seq: np.ndarray, block_size: int, window: int, paired: bool = False) -> tuple[int, int]:
    """(allowed (query, key) pairs, tiles the block selection reads) of one sequence at `window` blocks; paired:
    over the 2T interleaved positions of a paired-head layer."""
    seq = np.asarray(input_seq)
    docs = np.cumsum(seq == T.BOS_ID)
    starts = np.r_[0, np.flatnonzero(seq == T.BOS_ID)]  # doc id -> its first position (doc 0: before any BOS)
    offset = np.arange(len(seq)) - starts[docs]  # each token's position in its document
    if paired:  # token t at stream positions 2t, 2t + 1: in-document stream positions 2 offset, 2 offset + 1
        offset, docs = np.stack([2 * offset, 2 * offset + 1], 1).ravel(), np.repeat(docs, 2)
    pairs = int(np.minimum(offset, window * block_size).sum() + len(offset))
    partial_n, _, full_n, _ = T.block_window_selection(torch.from_numpy(docs), block_size, torch.tensor(window))
    return pairs, int(partial_n.sum() + full_n.sum())


def brute_force_pairs(input_seq: np.ndarray, block_size: int, window: int, paired: bool = False) -> tuple[int, int]:
    """The same counts from the trainer's own mask: True entries of its dense (T, T) (paired: (2T, 2T)) mask, and
    the tiles it reads. For tests on short sequences."""
    seq = torch.from_numpy(np.asarray(input_seq, dtype=np.int64))
    _, (partial_n, _, full_n, _) = T.document_blocks(seq, block_size, torch.tensor(window), paired)
    return int(T.dense_mask(seq, block_size, torch.tensor(window), paired).sum()), int(partial_n.sum() + full_n.sum())


def summarize(ratios: list[float]) -> str:
    r = np.asarray(ratios)
    return (f"mean {r.mean():.4f}  p50 {np.percentile(r, 50):.4f}  p90 {np.percentile(r, 90):.4f}  "
            f"max {r.max():.4f}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train_files", default=DEFAULT_FILES, help="shard glob (default: the proxy corpus)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--world_size", type=int, default=8)
    ap.add_argument("--window_blocks", type=int, default=0, help="fixed long window in blocks (default: schedule)")
    ap.add_argument("--quiet", action="store_true", help="summary only, no per-step lines")
    args = ap.parse_args(argv)
    cfg = T.Config()
    W = args.world_size
    if W <= 0 or cfg.global_batch_seqs % W:
        sys.exit(f"error: --world_size must divide global_batch_seqs={cfg.global_batch_seqs}")
    try:
        files = T.find_shards(args.train_files)
    except T.UsageError as e:
        sys.exit(f"error: {e}")
    held = sum(T.shard_token_count(p) for p in files)
    schedules = T.schedule_table(cfg)
    # enough passes for the tokens the steps take (each step drops at most the rest of a shard): generous, the
    # stream only opens what it reads
    taken = sum(cfg.global_batch_seqs * (s.seq_len + 1) for s in schedules[: args.steps])
    epochs = max(1, math.ceil(2 * taken / held) + 1)
    stream = T.TrainTokenStream(files, cfg.train_seq_len, cfg.global_batch_seqs, cfg.vocab_size,
                                T.step_shape(schedules), epochs)
    # Per attention layer: its window ("long" or "short"), whether it pairs heads, and its heads' share.
    paired = T.paired_layers(cfg)
    layers = [("long" if c == "L" else "short", i in paired, 0.5 if i in paired else 1.0)
              for i, c in enumerate(cfg.attn_pattern) if c != "-"]
    pair_flops = 12 * cfg.num_heads * cfg.head_dim
    with torch.device("meta"):  # the trainer's FLOP model reads the weights from the model itself
        model = T.GPT(cfg, use_flex=True, fp8_head=True)
    rows = []
    if not args.quiet:
        print(f"{'step':>5} {'W':>3} {'attn max/mean':>13} {'long max/mean':>13} {'tiles max/mean':>14} "
              f"{'step-FLOP max/mean':>18} slowest")
    for step in range(args.steps):
        sequences, s = stream.next_step(), schedules[step]
        windows = {"long": args.window_blocks or s.long_window, "short": s.short_window}
        cost, long_cost, tiles = np.zeros(W), np.zeros(W), np.zeros(W)
        for i, pieces in enumerate(sequences):
            r = i % W  # TrainBatches: rank r holds global sequences r, r + W, ...
            seq = np.concatenate([stream.tokens[a:b] for a, b in pieces])[:-1]  # the inputs
            counts = {(kind, pair): attention_pairs(seq, cfg.block_size, windows[kind], pair)
                      for kind, pair, _ in layers}
            cost[r] += sum(share * counts[kind, pair][0] for kind, pair, share in layers)
            long_cost[r] += counts["long", False][0]
            tiles[r] += counts["long", False][1]
        dense_flops = 6 * T.matmul_weights(model) * s.seq_len * (cfg.global_batch_seqs // W)
        total = dense_flops + pair_flops * cost
        row = {"step": step, "window": windows["long"], "attn": cost.max() / cost.mean(),
               "long": long_cost.max() / long_cost.mean(), "tiles": tiles.max() / tiles.mean(),
               "flops": total.max() / total.mean(), "attn_max": cost.max(), "attn_mean": cost.mean(),
               "flops_max": total.max(), "flops_mean": total.mean(), "dense": dense_flops,
               "slowest": int(cost.argmax())}
        rows.append(row)
        if not args.quiet:
            print(f"{step:>5} {row['window']:>3} {row['attn']:>13.4f} {row['long']:>13.4f} {row['tiles']:>14.4f} "
                  f"{row['flops']:>18.5f} rank {row['slowest']}")
    passes = stream.next_file / len(files)
    stream.close()
    attn_slow = sum(r["attn_max"] for r in rows) / sum(r["attn_mean"] for r in rows)
    step_slow = sum(r["flops_max"] for r in rows) / sum(r["flops_mean"] for r in rows)
    attn_share = sum(r["flops_mean"] - r["dense"] for r in rows) / sum(r["flops_mean"] for r in rows)
    windows = sorted({r["window"] for r in rows})
    lengths = sorted({schedules[k].seq_len for k in range(args.steps)})
    print(f"load balance over {args.steps} steps, {W} ranks x {cfg.global_batch_seqs // W} sequence(s) of "
          f"{lengths} tokens, long windows {windows} blocks of {cfg.block_size}; {len(files)} file(s) repeated "
          f"in order, {passes:.2f} passes")
    print(f"attention pairs, {len(layers)} layers ({len(paired)} paired), max/mean: "
          f"{summarize([r['attn'] for r in rows])}")
    print(f"attention pairs, long mask only,        max/mean: {summarize([r['long'] for r in rows])}")
    print(f"selected tiles, long mask,              max/mean: {summarize([r['tiles'] for r in rows])}")
    print(f"implied slowdown (the step waits for the slowest rank): attention core x{attn_slow:.4f} "
          f"(+{100 * (attn_slow - 1):.2f}%); whole step by the FLOP model x{step_slow:.5f} "
          f"(+{100 * (step_slow - 1):.3f}%, attention core = {100 * attn_share:.2f}% of the FLOPs)")
    return {"rows": rows, "attn_slowdown": attn_slow, "step_slowdown": step_slow, "passes": passes}


if __name__ == "__main__":
    main()
