"""tools/comm_bytes.py: #89's lines pinned to issue 49's figures; the recipe's count against the bucket buffers it
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

sys.path.insert(0, str(REPO / "tools"))
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
    assert sum(C.upstream_bytes(1, "Adam untied", 1e5).values()) == 0
    assert C.upstream_bytes(4, "Adam untied", 1e5)["all-to-all"] == 0


@pytest.mark.parametrize("kind", ["Muon-only", "Adam tied", "Adam untied"])
def test_upstream_line_at_8_ranks_is_record89s_with_its_768_wide_table_and_gate_network(kind):
    # Counted by hand from upstream_head_spec.md §2.2, §2.8, §2.10: the Muon banks as #89's; the bigram table
    # 377,280 x 768 bf16 all-gathered (7/8 of it) in place of 754,560 x 192, its sparse rows 768 bf16 + a 4-byte id;
    # all-reduced (2 x 7/8): skip_gate 12 + attn_gate_bank 720 bf16, x0 and bigram lambdas 11 + 11, XSA 66 fp32 gone;
    # mudd_gate_w1 2x64x768, w2 2x41x64, b2 2x41 bf16 and the 0-d fp32 scale added.
    rows = 30_000.0
    got, theirs = C.upstream_bytes(8, kind, rows), C.record89_bytes(8, kind, rows)
    adam = kind != "Muon-only"
    gathered = 7 / 8 * 2 * (377_280 * 768 - 754_560 * 192)
    reduced = 2 * 7 / 8 * ((2 * 64 * 768 + 2 * 41 * 64 + 2 * 41) * 2 + 4 - (12 + 720) * 2 - (11 + 11 + 66) * 4)
    want = {"reduce-scatter": theirs["reduce-scatter"], "all-reduce": theirs["all-reduce"] + adam * reduced,
            "all-gather": theirs["all-gather"] + adam * gathered, "all-to-all": adam * rows * (768 * 2 + 4)}
    assert got == pytest.approx(want, rel=1e-12)
    if not adam:
        assert sum(got.values()) / MB == pytest.approx(291.8, abs=0.05)


@pytest.fixture(scope="module")
def recipe_model() -> T.GPT:
    return C.recipe_model(T.Config())


def test_recipe_count_at_8_ranks_is_every_updated_bucket_reduced_and_gathered_the_bigram_rows_sent(recipe_model):
    # Rank 3 touched every 7th row (some twice): it sends those outside its shard, each once, with its row id, after
    # the rows' counts. The bigram table's bucket is not reduce-scattered, it is all-gathered as every other.
    cfg, W, rank = T.Config(), 8, 3
    touched = np.concatenate([np.arange(0, cfg.bigram_rows, 7), np.arange(0, 1000, 7)])
    shard = cfg.bigram_rows // W
    sent = int((np.unique(touched) // shard != rank).sum())
    buckets = C.recipe_optimizer(cfg, W, rank, recipe_model).buckets
    calls = C.recipe_calls(cfg, W, {"Adam tied": touched, "Adam untied": touched}, rank, recipe_model)
    for kind, (adam, tied) in C.STEP_KINDS.items():  # the tied embedding's bucket stays home while tied
        updated = [b for b in buckets if b.kind == "muon" or adam and not (tied and b.names == [T.TIED_EMBEDDING])]
        size = lambda bs: (W - 1) / W * sum(b.data.numel() * b.data.element_size() for b in bs)  # noqa: E731
        got = C.by_kind(calls[kind], W)
        assert got["all-gather"] == pytest.approx(size(updated))
        assert got["reduce-scatter"] == pytest.approx(size([b for b in updated if b.names != [T.BIGRAM_TABLE]]))
        assert got["all-to-all"] == (W * 8 + sent * (4 + 2 * cfg.model_dim) if adam else 0)
        assert got["all-reduce"] == 0


def test_recipe_adam_lines_at_8_ranks_are_upstreams_and_its_counts(recipe_model):
    # The recipe's model is upstream's current one: its bigram table's shape is upstream's (not #89's).
    # The same rows on either side (random tokens, one step pair at 2,048 tokens per sequence): the recipe sends what
    # upstream sends, plus the counts' W int64 (which upstream's line leaves out), mean over the ranks; in all, the same
    # to 0.1 MB (upstream all-reduces its replicated parameters, the recipe shards them; its banks pad otherwise).
    cfg, W = T.Config(), 8
    assert (cfg.bigram_rows, cfg.model_dim) == (C.UPSTREAM_ROWS, C.UPSTREAM_DIM) == (377_280, 768)
    pairs = C.pair_rows(None, 2048, 2048, 1, cfg.bigram_rows)
    for kind in ("Adam tied", "Adam untied"):
        got = [C.by_kind(C.recipe_calls(cfg, W, {kind: C.rank_rows(pairs[0], r, W)}, r, recipe_model)[kind], W)
               for r in range(W)]
        want = C.upstream_bytes(W, kind, C.record89_rows(pairs, W, cfg.bigram_rows))
        assert np.mean([g["all-to-all"] for g in got]) == pytest.approx(want["all-to-all"] + W * 8, rel=1e-12)
        assert np.mean([sum(g.values()) for g in got]) / MB == pytest.approx(sum(want.values()) / MB, abs=0.05)


def small_config() -> T.Config:
    """The recipe's layout at toy widths, buckets small enough to split groups (tests/test_sharded_optim.py's)."""
    fields = dict(preset="tiny", model_dim=64, num_heads=2, head_dim=32, mlp_ratio=2, vocab_size=512,
                  train_seq_len=64, stage_seq_len="64,64,64,64", val_seq_len=64, block_size=32, bigram_rows=1032,
                  mudd_dim=8, bucket_mb=0.05)
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
            for kind in ("Muon-only", "Adam tied"):  # as train_step drives it
                opt.set_step(C.step_rows(cfg)[kind])
                opt.wait_for_params()
                opt.begin_step(opt.batch_rows()(seq[None].numpy()))
                loss = model(seq[:-1], seq[1:].long(), torch.tensor([2, 1]))
                opt.forward_done()
                loss.backward()
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


def test_a_train_files_glob_that_matches_nothing_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "table.json"
    with pytest.raises(SystemExit) as exit_info:
        C.main([f"--train_files={tmp_path}/nope/*.bin", f"--json={out}"])
    stdout, err = capsys.readouterr()
    assert exit_info.value.code == 2 and stdout == "" and not out.exists(), err
    lines = err.splitlines()  # the trainer's own line for a glob without shards, after the flag it concerns
    assert len(lines) == 1 and lines[0].startswith(f"error: --train_files: no files match '{tmp_path}/nope/*.bin'")


def test_without_train_files_the_first_line_says_which_tokens_were_counted(monkeypatch, capsys):
    monkeypatch.setattr(C, "table", lambda rows_at: {})  # the per-W table: not this test's
    monkeypatch.setattr(C, "DEFAULT_FILES", "/nowhere/proxy_train_*.bin")  # a checkout without the proxy corpus
    C.main(["--pairs=1"])
    assert capsys.readouterr().out.splitlines()[0] == ("Tokens counted: seeded random tokens (1 step pairs x 8 "
                                                       "sequences per stage): no --train_files given and no shards "
                                                       "at /nowhere/proxy_train_*.bin")
    C.main(["--pairs=1", f"--train_files={REPO}/data/sample/sample_train_*.bin"])
    assert capsys.readouterr().out.splitlines()[0] == (f"Tokens counted: {REPO}/data/sample/sample_train_*.bin, 1 "
                                                       f"step pairs x 8 sequences per stage")
