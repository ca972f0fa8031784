"""Attention load balance across ranks: how much the slowest rank's attention exceeds the mean.

Each step the trainer gives rank r the global sequences r, r + W, r + 2W, ... (TrainBatches' rule) of
the step's BOS-aligned sequences (TrainTokenStream). Their packed documents differ, so the attention
work differs between ranks, and every step waits for the slowest rank at the gradient reduction.

Definition. The attention cost of a sequence at a window of W blocks is the number of (query, key)
token pairs the trainer's mask allows: q >= k, same document (doc id = running count of BOS tokens),
and key block among the query block's selected blocks (block_window_selection: at most W - 1 full
blocks and max(W - all full blocks, 1) partial ones, nearest first). It is exactly the number of
True entries of train_gpt.dense_mask(seq, block_size, W), counted without building the T x T mask:
per (query block, selected key block) the allowed pairs are, for the diagonal block, c(c+1)/2 summed
over its document pieces of length c, and for an earlier block, (tokens of the query block's first
document in the query block) x (tokens of that document in the key block), nonzero only when the key
block's last document is the query block's first (documents are contiguous, so they share at most
that one). query_block_costs solves the block selection in closed form per query block, so a
49,152-token sequence costs a few vectorized numpy passes instead of a 49k x 49k mask; the tests
check it against the dense mask on short sequences.

The 11 attention layers of the recipe (attn_pattern LSSSLSS-SSSL) all use this mask with the step's
window: 3 long layers at W = schedule(step).long_window and 8 short ones at short_window(W) (half, rounded
down; 0 blocks = the diagonal block only). A rank's attention cost at a step is the sum over its sequences of
3 * pairs(W) + 8 * pairs(short) (the counts from attn_pattern); "long only" is the sum of pairs(W).
Also reported: the selected 128x128 tiles of the long mask (FlexAttention computes whole tiles, so
with a 1-block window, one tile per query block, its kernel work is exactly balanced), and a
whole-step FLOP model: per rank 6 * train_gpt.matmul_weights * tokens + 12 * heads * head_dim FLOPs per
allowed pair and attention layer (train_gpt.flops_per_token's terms with exact pair counts).

Per step it prints max/mean over ranks; the summary gives the mean, p50, p90 and max of max/mean and
the implied slowdown: a step takes as long as its slowest rank, so the attention core takes
sum(max) / sum(mean) of the perfectly balanced time (and the whole step, by the FLOP model, the same
ratio of whole-step FLOPs).

A proxy corpus (shards in the git-ignored data/proxy/; 23M tokens in ours) holds fewer tokens than
200 steps x 8 x 49,152 (~79M plus the skipped tails), so the files are repeated in order
(TrainTokenStream's epochs, as --train_epochs does in training); the number of passes used is
printed. Repeated passes give the same sequences again: one pass over the proxy files is 50 steps,
so 200 steps are 4 passes over the same 50 steps' batches (with the window schedule of steps
0..199).

    python records/load_balance.py [--train_files PATTERN] [--steps 200] [--world_size 8]
                                   [--window_blocks N] [--quiet]

--window_blocks fixes the long window for every step (e.g. 14, the recipe's final window) instead
of the schedule of the first steps (1 block until step 125, then 2).
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


def query_block_costs(input_seq: np.ndarray, block_size: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Per query block: (allowed (query, key) pairs, selected key tiles) under the mask at `window` blocks.

    The trainer's block_window_selection, solved per block: with d the document of the block's first
    token, starting in block b0, the visible earlier blocks are b0..q-1 (the blocks holding d).
    A block lying wholly in d sees F = q - (first whole block of d) full blocks, keeps min(F, W - 1) of
    them, plus the diagonal and, when d starts inside b0 and W - F >= 2, the partial block b0. Any
    other block has no full blocks and keeps the diagonal and the nearest min(q - b0, W - 1) earlier
    blocks. Pairs: c(c+1)/2 summed over the diagonal block's document pieces; (tokens of d in the query
    block) x (tokens of d in the key block) for an earlier one.
    """
    seq = np.asarray(input_seq)
    nb, bs = len(seq) // block_size, block_size
    docs = np.cumsum(seq[: nb * bs] == T.BOS_ID)
    doc_start = np.r_[0, np.flatnonzero(seq[: nb * bs] == T.BOS_ID)]  # doc id -> first position (doc 0: before any BOS)
    blocks = docs.reshape(nb, bs)
    first, last = blocks[:, 0], blocks[:, -1]
    # document pieces inside blocks: runs of equal doc id that the block boundaries also cut
    cut = np.r_[True, (docs[1:] != docs[:-1]) | (np.arange(1, nb * bs) % bs == 0)]
    starts = np.flatnonzero(cut)
    lengths = np.diff(np.r_[starts, nb * bs])
    piece_block = starts // bs
    diag = np.bincount(piece_block, weights=lengths * (lengths + 1) // 2, minlength=nb).astype(np.int64)
    head = lengths[np.searchsorted(piece_block, np.arange(nb))]  # tokens of d in the query block
    q = np.arange(nb)
    d_start = doc_start[first]
    b0 = d_start // bs
    tail_b0 = bs - d_start % bs  # tokens of d in block b0
    visible = q - b0  # earlier blocks holding d
    W = window
    single = first == last
    # blocks wholly inside d: full blocks, plus the partial b0 when d starts mid-block
    full_all = q - -(-d_start // bs)
    n_full = np.clip(np.minimum(full_all, W - 1), 0, None)
    b0_kept = (d_start % bs != 0) & (b0 < q) & (W - full_all >= 2)
    pairs_single = diag + n_full * bs * bs + b0_kept * bs * tail_b0
    tiles_single = 1 + n_full + b0_kept
    # blocks holding several documents: the nearest earlier blocks, all partial
    n_near = np.clip(np.minimum(visible, W - 1), 0, None)
    near_tokens = n_near * bs - ((n_near == visible) & (visible > 0)) * (bs - tail_b0)
    pairs_multi = diag + head * near_tokens
    tiles_multi = 1 + n_near
    return np.where(single, pairs_single, pairs_multi), np.where(single, tiles_single, tiles_multi)


def attention_pairs(input_seq: np.ndarray, block_size: int, window: int) -> tuple[int, int]:
    """(allowed (query, key) pairs, selected tiles) of one sequence under the mask at `window` blocks."""
    pairs, tiles = query_block_costs(input_seq, block_size, window)
    return int(pairs.sum()), int(tiles.sum())


def brute_force_pairs(input_seq: np.ndarray, block_size: int, window: int) -> tuple[int, int]:
    """The same counts from the trainer's own functions: True entries of its dense (T, T) mask, and the
    tiles block_window_selection picks. For tests on short sequences."""
    seq = torch.from_numpy(np.asarray(input_seq, dtype=np.int64))
    w = torch.tensor(window)
    partial_n, _, full_n, _ = T.block_window_selection((seq == T.BOS_ID).cumsum(0), block_size, w)
    tiles = int(partial_n.clamp_min(0).sum() + full_n.clamp_min(0).sum())
    return int(T.dense_mask(seq, block_size, w).sum()), tiles


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
    W, n_long, n_short = args.world_size, cfg.attn_pattern.count("L"), cfg.attn_pattern.count("S")
    if W <= 0 or cfg.global_batch_seqs % W:
        sys.exit(f"error: --world_size must divide global_batch_seqs={cfg.global_batch_seqs}")
    try:
        files = T.find_shards(args.train_files)
    except T.UsageError as e:
        sys.exit(f"error: {e}")
    held = sum(T.shard_token_count(p) for p in files)
    # enough passes for the tokens the steps take (each sequence skips at most the rest of a document,
    # each shard switch drops at most a window): generous, the stream only opens what it reads
    epochs = max(1, math.ceil(2 * args.steps * cfg.global_batch_seqs * (cfg.train_seq_len + 1) / held) + 1)
    stream = T.TrainTokenStream(files, cfg.train_seq_len, cfg.global_batch_seqs, cfg.vocab_size, epochs)
    pair_flops = 12 * cfg.num_heads * cfg.head_dim
    with torch.device("meta"):  # the trainer's FLOP model reads the weights from the model itself
        model = T.GPT(cfg, use_flex=True, fp8_head=True)
    dense_flops = 6 * T.matmul_weights(model) * cfg.train_seq_len * (cfg.global_batch_seqs // W)
    rows = []
    if not args.quiet:
        print(f"{'step':>5} {'W':>3} {'attn max/mean':>13} {'long max/mean':>13} {'tiles max/mean':>14} "
              f"{'step-FLOP max/mean':>18} slowest")
    for step in range(args.steps):
        sequences = stream.next_step()
        w = args.window_blocks or T.schedule(step, cfg).long_window
        w_short = T.short_window(w)
        cost, long_cost, tiles = np.zeros(W), np.zeros(W), np.zeros(W)
        for i, pieces in enumerate(sequences):
            r = i % W  # TrainBatches: rank r holds global sequences r, r + W, ...
            seq = np.concatenate([stream.tokens[a:b] for a, b in pieces])[:-1]  # the inputs
            (pl, tl), (ps, _) = attention_pairs(seq, cfg.block_size, w), attention_pairs(seq, cfg.block_size, w_short)
            cost[r] += n_long * pl + n_short * ps
            long_cost[r] += pl
            tiles[r] += tl
        total = dense_flops + pair_flops * cost
        row = {"step": step, "window": w, "attn": cost.max() / cost.mean(), "long": long_cost.max() / long_cost.mean(),
               "tiles": tiles.max() / tiles.mean(), "flops": total.max() / total.mean(),
               "attn_max": cost.max(), "attn_mean": cost.mean(), "flops_max": total.max(), "flops_mean": total.mean(),
               "slowest": int(cost.argmax())}
        rows.append(row)
        if not args.quiet:
            print(f"{step:>5} {w:>3} {row['attn']:>13.4f} {row['long']:>13.4f} {row['tiles']:>14.4f} "
                  f"{row['flops']:>18.5f} rank {row['slowest']}")
    passes = stream.next_file / len(files)
    stream.close()
    attn_slow = sum(r["attn_max"] for r in rows) / sum(r["attn_mean"] for r in rows)
    step_slow = sum(r["flops_max"] for r in rows) / sum(r["flops_mean"] for r in rows)
    attn_share = sum(r["flops_mean"] - dense_flops for r in rows) / sum(r["flops_mean"] for r in rows)
    windows = sorted({r["window"] for r in rows})
    print(f"load balance over {args.steps} steps, {W} ranks x {cfg.global_batch_seqs // W} sequence(s) of "
          f"{cfg.train_seq_len} tokens, long windows {windows} blocks of {cfg.block_size} "
          f"(short: half); {len(files)} file(s) repeated in order, {passes:.2f} passes")
    print(f"attention pairs, {n_long} long + {n_short} short layers, max/mean: {summarize([r['attn'] for r in rows])}")
    print(f"attention pairs, long mask only,        max/mean: {summarize([r['long'] for r in rows])}")
    print(f"selected tiles, long mask,              max/mean: {summarize([r['tiles'] for r in rows])}")
    print(f"implied slowdown (the step waits for the slowest rank): attention core x{attn_slow:.4f} "
          f"(+{100 * (attn_slow - 1):.2f}%); whole step by the FLOP model x{step_slow:.5f} "
          f"(+{100 * (step_slow - 1):.3f}%, attention core = {100 * attn_share:.2f}% of the FLOPs)")
    return {"rows": rows, "attn_slowdown": attn_slow, "step_slowdown": step_slow, "passes": passes}


if __name__ == "__main__":
    main()
