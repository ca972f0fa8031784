"""records/comm_bytes.py: #89's lines pinned to issue 49's figures; the recipe's count against the bucket buffers it
must see; and, on two gloo ranks, the collectives two real optimizer steps issue, pinned to the bucket plan and
equal to what the tool's stand-ins count for the same model."""

import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import train_gpt as T
from conftest import REPO, free_port

sys.path.insert(0, str(REPO / "records"))
import comm_bytes as C  # noqa: E402

MB = 1e6


@pytest.mark.parametrize("kind, total", [("Muon-only", 291.8), ("Adam tied", 1364.0), ("Adam untied", 1509.5)])
def test_record89_lines_at_8_ranks_are_issue_49s(kind, total):
    # The issue's rows: ~18.2k touched at 16,384 tokens (tied, stage 0), ~44.7k at 49,152 (untied, stage 2).
    seq = C.step_rows(T.Config())[kind].seq_len
    got = C.record89_bytes(8, kind, C.ISSUE_TOUCHED_ROWS.get(seq, 0))
    assert sum(got.values()) / MB == pytest.approx(total, abs=0.5)
    assert (got["all-to-all"] > 0) == (kind != "Muon-only")


def test_record89_has_no_sparse_bigram_below_8_ranks_and_no_comms_on_one():
    assert sum(C.record89_bytes(1, "Adam untied", 1e5).values()) == 0
    assert C.record89_bytes(4, "Adam untied", 1e5)["all-to-all"] == 0


@pytest.fixture(scope="module")
def recipe_model() -> T.GPT:
    return C.recipe_model(T.Config())


def test_recipe_count_at_8_ranks_is_every_updated_bucket_reduced_and_gathered_the_bigram_rows_sent(recipe_model):
    # Rank 3 touched every 7th row (some twice): it sends those outside its shard, each once, with its row id, after
    # the rows' counts. The bigram table's bucket is not reduce-scattered, it is all-gathered as every other.
    cfg, W, rank = T.Config(), 8, 3
    touched = np.concatenate([np.arange(0, C.BIGRAM_ROWS, 7), np.arange(0, 1000, 7)])
    shard = C.BIGRAM_ROWS // W
    sent = int((np.unique(touched) // shard != rank).sum())
    buckets = C.recipe_optimizer(cfg, W, rank, recipe_model).buckets
    calls = C.recipe_calls(cfg, W, {"Adam tied": touched, "Adam untied": touched}, rank, recipe_model)
    for kind, (adam, tied) in C.STEP_KINDS.items():  # the tied embedding's bucket stays home while tied
        updated = [b for b in buckets if b.kind == "muon" or adam and not (tied and b.names == [T.TIED_EMBEDDING])]
        size = lambda bs: (W - 1) / W * sum(b.data.numel() * b.data.element_size() for b in bs)  # noqa: E731
        got = C.by_kind(calls[kind], W)
        assert got["all-gather"] == pytest.approx(size(updated))
        assert got["reduce-scatter"] == pytest.approx(size([b for b in updated if b.names != [T.BIGRAM_TABLE]]))
        assert got["all-to-all"] == (W * 8 + sent * (4 + 2 * cfg.bigram_dim) if adam else 0)
        assert got["all-reduce"] == 0


def test_recipe_adam_lines_at_8_ranks_are_record89s_and_its_counts(recipe_model):
    # The same rows on either side (random tokens, one step pair at 2,048 tokens per sequence): the recipe sends what
    # #89 sends, plus the counts' W int64 (which #89's line leaves out), mean over the ranks; in all, the same to 0.1 MB
    # (#89 all-reduces its replicated parameters, the recipe shards them; #89's banks pad otherwise).
    cfg, W = T.Config(), 8
    pairs = C.pair_rows(None, 2048, 2048, 1)
    for kind in ("Adam tied", "Adam untied"):
        got = [C.by_kind(C.recipe_calls(cfg, W, {kind: C.rank_rows(pairs[0], r, W)}, r, recipe_model)[kind], W)
               for r in range(W)]
        want = C.record89_bytes(W, kind, C.record89_rows(pairs))
        assert np.mean([g["all-to-all"] for g in got]) == pytest.approx(want["all-to-all"] + W * 8, rel=1e-12)
        assert np.mean([sum(g.values()) for g in got]) / MB == pytest.approx(sum(want.values()) / MB, abs=0.05)


def small_config() -> T.Config:
    """The recipe's layout at toy widths, buckets small enough to split groups (tests/test_sharded_optim.py's)."""
    fields = dict(preset="tiny", model_dim=64, num_heads=2, head_dim=32, mlp_ratio=2, vocab_size=512,
                  train_seq_len=64, seq_len_stages="64,64,64", val_seq_len=64, block_size=32, bigram_rows=1032,
                  bigram_dim=16, mudd_dim=8, bucket_mb=0.05)
    return T.parse_config([f"--{k}={v}" for k, v in fields.items()])


def _rank_main(rank: int, world_size: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        cfg = small_config()
        torch.manual_seed(0)
        model = T.GPT(cfg, use_flex=False, fp8_head=False)
        opt = T.ShardedMuonAdam(model, cfg, rank, world_size, compile_ns=False)
        seq = torch.randint(0, cfg.vocab_size, (cfg.train_seq_len + 1,), generator=torch.Generator().manual_seed(rank))
        calls = {}
        with C.Collectives(stand_in=False) as seen:  # counts, and passes every call on to gloo
            for kind in ("Muon-only", "Adam tied"):  # as train_step drives it: the hooks launch during backward
                opt.set_step(C.step_rows(cfg)[kind])
                opt.wait_for_params()
                opt.begin_step(opt.batch_rows()(seq[None].numpy()))
                opt.final_micro_step = True
                model(seq[:-1], seq[1:].long(), torch.tensor([2, 1])).backward()
                opt.step()
                opt.zero_grad()
                opt.wait_for_params()
                calls[kind] = seen.take()
        torch.save(calls, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # spawns two processes
def test_two_gloo_ranks_issue_exactly_the_planned_collectives(tmp_path):
    mp.spawn(_rank_main, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    cfg = small_config()
    model = T.GPT(cfg, use_flex=False, fp8_head=False)
    plan = T.plan_buckets(T.build_param_groups(model, cfg), list(T.SCATTER_ORDER), cfg.bucket_mb, 2)
    muon = sum(g.kind == "muon" for g, _ in plan)
    every = sum(names != [T.TIED_EMBEDDING] for _, names in plan)  # while tied the embedding's bucket stays home
    assert muon > 1 and every > muon + 5  # the small buckets split groups: many collectives to count
    for rank in range(2):
        calls = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        seq = torch.randint(0, cfg.vocab_size, (cfg.train_seq_len + 1,), generator=torch.Generator().manual_seed(rank))
        rows = T.bigram_index(seq[:-1].numpy(), cfg.bigram_rows)  # the same both steps: what the pair touched
        counted = C.recipe_calls(cfg, 2, {"Muon-only": rows, "Adam tied": rows}, rank)  # the tool's stand-ins
        # the bigram table: its rows' counts, ids and gradient rows all-to-all, in place of a reduce-scatter
        for kind, want in (("Muon-only", {"reduce-scatter": muon, "all-gather": muon}),
                           ("Adam tied", {"reduce-scatter": every - 1, "all-to-all": 3, "all-gather": every})):
            assert Counter(c.kind for c in calls[kind]) == want, kind
            assert Counter(calls[kind]) == Counter(counted[kind]), kind
