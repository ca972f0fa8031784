"""ShardedMuonAdam against a single-process reference, on gloo ranks spawned on the CPU.

A small GPT shaped like the recipe's (five layers, four with attention: the Q/K, V/O and MLP banks in Muon, head and
VE gates, MUDD and the lambdas in Adam, the skip's and smear's gates, the bigram table, whose gradient goes as the rows
each rank touched: 1028 rows, whole rows per rank at W = 2 and 4) trains 3 steps of 8 sequences with gradient
accumulation and the recipe's optimizer: Polar Express, NorMuon, cautious weight decay, Adam every other step. The
small bucket size splits groups into several buckets; the default one cuts parameters across ranks' shards.

Two variants. "recipe" is the model as trained (bf16 embeddings, bf16 Polar Express): a gradient summed in another
order rounds differently, and bf16 orthogonalization and Adam's normalization blow such last-bit differences up, so
it is compared bit for bit against a reference summing in the same order (W = 1, and W = 2, where one addition has
one rounding). "fp32" (fp32 embeddings, a float64 polar factor for the orthogonalization, a larger Adam eps) is
compared against the plain single-process sum at fp32 tolerance, W = 2 and 4.
"""

import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import train_gpt as T
from conftest import cpu_gemms, free_port, orthogonalizing

STEPS, GLOBAL_SEQS = 3, 8
LR_MULT = [1.0, 0.8, 0.5]  # varied so the test notices an optimizer that ignores lr_mult or momentum
MOMENTUM = [0.85, 0.9, 0.95]
CASES = [(mb,) for mb in (25.0, 0.05)]  # bucket_mb: a bucket per group, and many small ones
CASE_IDS = [f"{mb}MiB" for mb, in CASES]
COLLECTIVES = {"reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
               "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
               "all_to_all_single": "all_to_all", "all_reduce": "other", "reduce_scatter": "other",
               "all_gather": "other", "all_to_all": "other", "broadcast": "other"}


def _single_thread():
    """Tiny matmuls on a shared 2-core machine run far faster on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Once for the module-scoped fixtures, and again per test, after conftest's own thread setting.
_one_thread_module = pytest.fixture(autouse=True, scope="module")(_single_thread)
_one_thread = pytest.fixture(autouse=True)(_single_thread)


def small_config(variant: str = "recipe", **overrides: object) -> T.Config:
    fields = dict(preset="tiny", model_dim=64, num_heads=2, head_dim=32, mlp_ratio=2, vocab_size=512,
                  train_seq_len=64, stage_seq_len="64,64,64,64", val_seq_len=64, block_size=32, normuon_beta2=0.9,
                  num_layers=5, attn_pattern="SL-SL", value_embeds="0--12", skip="1:2", attn_input_layer=3,
                  bigram_rows=1028, mudd_dim=8, paired_layers="0,3", xsa_layers="1")
    if variant == "fp32":
        # Adam's step does not shrink with the gradient, so an element whose gradient nearly cancels
        # turns summation-order noise into a visible step; a larger eps bounds that gain.
        fields["adam_eps"] = 1e-6
    return T.parse_config([f"--{k}={v}" for k, v in {**fields, **overrides}.items()])


def polar(G: torch.Tensor) -> torch.Tensor:
    """Exact orthogonalization (U V^T of the SVD) in float64; zero stays zero (the padding)."""
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return (U @ Vh * (G.norm(dim=(-2, -1), keepdim=True) > 0)).float()


def make_model(cfg: T.Config, variant: str) -> T.GPT:
    torch.manual_seed(0)
    model = T.GPT(cfg, use_flex=False, fp8_head=False)
    with torch.no_grad():  # break the zero inits so every parameter gets a gradient from step 1
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    if variant == "fp32":  # every parameter and table in fp32: the activations follow them
        model.float()
    return model


def make_data(cfg: T.Config) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, cfg.vocab_size, (STEPS, GLOBAL_SEQS, cfg.train_seq_len + 1), generator=g)


def own_rows_data(cfg: T.Config) -> torch.Tensor:
    """make_data with rank 1 of 2's sequences one token over and over: one bigram repeated (and the first two
    positions'), all in rank 1's half of the table: it sends no row, rank 0 receives none."""
    rows, half = cfg.bigram_rows, cfg.bigram_rows // 2
    token = next(c for c in range(cfg.vocab_size)
                 if (T.bigram_index(np.full(cfg.train_seq_len, c), rows) >= half).all())
    data = make_data(cfg)
    data[:, 1::2] = token
    return data


def loss(model: T.GPT, seq: torch.Tensor) -> torch.Tensor:
    return model(seq[:-1], seq[1:].long(), torch.tensor([2, 1])) / GLOBAL_SEQS


def reference(cfg: T.Config, variant: str, sum_like_ranks: int = 1) -> tuple[dict, dict]:
    """The plain math: one update per parameter on the summed gradients, no buckets, no sharding.

    With sum_like_ranks = W the gradients are summed as W ranks do: per rank over its micro-steps,
    then the W partial sums in rank order.
    """
    model, data = make_model(cfg, variant), make_data(cfg)
    steps = {"fp32": orthogonalizing(polar), "recipe": T.EAGER_STEPS}[variant]
    groups = T.build_param_groups(model, cfg)
    adam_names = {name for g in groups if g.kind == "adam" for name in g.names}
    state: dict[str, dict[str, torch.Tensor]] = {}
    carried: dict[tuple[int, str], torch.Tensor] = {}  # (rank, name): Adam's gradient since its last update
    for step in range(STEPS):
        adam_step = (step + 1) % cfg.adam_every == 0
        total: dict[str, torch.Tensor] = {}
        for rank in range(sum_like_ranks):
            for name, p in model.named_parameters():  # a rank's buffer keeps accumulating until Adam's step
                p.grad = carried.pop((rank, name), None)
            for seq in data[step, rank::sum_like_ranks]:
                loss(model, seq).backward()
            for name, p in model.named_parameters():
                if name in adam_names and not adam_step:
                    carried[rank, name] = p.grad.clone()
                else:
                    total[name] = total[name] + p.grad if name in total else p.grad.clone()
            model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for g in groups:
                lr = g.lr * LR_MULT[step]
                for name, p, lr_mul in zip(g.names, g.params, g.lr_muls or [1.0] * len(g.names)):
                    if g.kind == "muon":
                        s = state.setdefault(name, T.muon_state(p))
                        per_matrix = torch.tensor(lr_mul, dtype=torch.float64).view(*p.shape[:-2], 1, 1)
                        T.muon_update_(p, total[name], s, lr, MOMENTUM[step], cfg.normuon_beta2, per_matrix, g.wd,
                                       steps)
                    elif adam_step:
                        s = state.setdefault(name, {k: torch.zeros(p.shape) for k in ("m", "v")})
                        T.adam_update_(p, total[name], s["m"], s["v"], (step + 1) // cfg.adam_every, lr, *g.betas,
                                       cfg.adam_eps, g.wd)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, state


class CollectiveCounter:
    """Wraps the torch.distributed collectives (where the optimizer looks them up) and counts calls by kind."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch | None = None):
        self.calls: Counter = Counter()
        for name, kind in COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is None:
                continue

            def counted(*args, _original=original, _kind=kind, **kwargs):
                self.calls[_kind] += 1
                return _original(*args, **kwargs)

            if monkeypatch is not None:
                monkeypatch.setattr(dist, name, counted)
            else:
                setattr(dist, name, counted)

    def take(self) -> dict[str, int]:
        seen, self.calls = dict(self.calls), Counter()
        return seen


def train_sharded(cfg: T.Config, variant: str, rank: int, world_size: int, counter: CollectiveCounter,
                  set_to_none: bool = False, data: torch.Tensor | None = None) -> dict:
    """Drive the optimizer the way train() does; record the collectives issued at each point of each step.

    set_to_none clears gradients with model.zero_grad(set_to_none=True) instead of the optimizer's zero_grad.
    """
    model, data = make_model(cfg, variant), make_data(cfg) if data is None else data
    opt = T.ShardedMuonAdam(model, cfg, rank, world_size, compile_ns=False)
    if variant == "fp32":
        opt.steps = orthogonalizing(polar)
    micro_steps, batch_rows = GLOBAL_SEQS // world_size, opt.batch_rows()
    counter.take()
    events, sent = [], None
    for step in range(STEPS):
        opt.set_step(T.StepSchedule(LR_MULT[step], MOMENTUM[step], 1, 0, (step + 1) % cfg.adam_every == 0,
                                    cfg.train_seq_len, cfg.train_seq_len, 2048, (1,), (1.0,), 0.0, True))
        opt.wait_for_params()
        opt.begin_step(None if batch_rows is None else batch_rows(data[step, rank::world_size].numpy()))
        events.append(("begin", counter.take()))
        for m in range(micro_steps):
            micro_loss = loss(model, data[step, m * world_size + rank])
            if m == 0:
                opt.forward_done()
            micro_loss.backward()
            events.append(("backward", counter.take()))
        if opt.row_bucket is not None and opt.adam_step:
            sent = sum(opt.row_bucket.send_counts)
        grads_in_buckets = all(p.grad.data_ptr() == view.data_ptr() for b in opt.buckets
                               for p, view in zip(b.params, b.grad_views))
        opt.step()
        events.append(("step", counter.take()))
        if set_to_none:
            model.zero_grad(set_to_none=True)
        else:
            opt.zero_grad()
    opt.wait_for_params()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    sd = opt.state_dict()
    shards = [sd]
    if world_size > 1:  # the loader takes every rank's shard (a checkpoint's rank files)
        shards = [None] * world_size
        dist.all_gather_object(shards, sd)
    fresh = T.ShardedMuonAdam(make_model(cfg, variant), cfg, rank, world_size, compile_ns=False)
    fresh.load_state_dict(shards)
    restored = fresh.step_count == STEPS and all(
        torch.equal(a, b) for a, b in zip(opt.state_tensors(), fresh.state_tensors()))
    return dict(params=params, events=events, buckets=len(opt.buckets), state_bytes=opt.state_bytes(),
                muon_buckets=sum(b.kind == "muon" for b in opt.buckets), rows_exchanged=opt.row_bucket is not None,
                state_dict=sd, restored=restored, grads_in_buckets=grads_in_buckets, sent=sent)


def _rank_main(rank: int, world_size: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        with cpu_gemms():  # the bf16 GEMM path of the reference, computed in the test's process
            counter = CollectiveCounter()
            variants = ["fp32", "recipe"] if world_size == 2 else ["fp32"]
            results = {(v, *case): train_sharded(small_config(v, bucket_mb=case[0]), v, rank,
                                                 world_size, counter) for v in variants for case in CASES}
            # The bigram rows' exchange against the dense reduce-scatter (exchanges_rows turned off), bf16 as trained.
            cfg, datas = small_config(), {"random": make_data(small_config())}
            if world_size == 2:
                datas["own rows"] = own_rows_data(cfg)
            exchanges_rows = T.exchanges_rows
            for rows_exchanged in (True, False):
                T.exchanges_rows = lambda rows, w, on=rows_exchanged: on and exchanges_rows(rows, w)
                for name, data in datas.items():
                    results["rows", rows_exchanged, name] = train_sharded(cfg, "recipe", rank, world_size, counter,
                                                                          data=data)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict[int, list[dict]]:
    """world size -> per rank, {(variant, bucket_mb): result}, from one spawned world per size."""
    runs = {}
    for world_size in (2, 4):
        out = tmp_path_factory.mktemp(f"w{world_size}")
        mp.spawn(_rank_main, args=(world_size, free_port(), str(out)), nprocs=world_size, join=True)
        runs[world_size] = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
    return runs


@pytest.fixture(scope="module")
def fp32_reference() -> tuple[dict, dict]:
    return reference(small_config("fp32"), "fp32")


@pytest.fixture(scope="module")
def recipe_reference() -> dict[int, dict]:
    """Parameters after the recipe variant's steps, gradients summed as 1 and as 2 ranks do."""
    return {ranks: reference(small_config(), "recipe", sum_like_ranks=ranks)[0] for ranks in (1, 2)}


def assert_params_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], exact: bool = False) -> None:
    """Bit for bit, or at fp32 tolerance. Cautious decay is discontinuous where an update element crosses zero:
    there summation-order noise may flip the mask and move the element by one update's decay, wd * lr^2 * |p|
    (Adam), wd * lr * step_lr * lr_mul * |p| (Muon; step_lr <= 2 lr here): allowed on a few elements."""
    assert got.keys() == want.keys()
    cfg = small_config("fp32")
    decay = {name: g.wd * (g.lr * max([1.0, *(m for muls in g.lr_muls for m in muls)])) ** 2 * (2 if g.kind == "muon" else 1)
             for g in T.build_param_groups(make_model(cfg, "fp32"), cfg) for name in g.names}
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        if exact:
            assert torch.equal(got[name], want[name]), name
            continue
        off = ~torch.isclose(got[name], want[name], atol=2e-5, rtol=1e-4)
        assert off.float().mean() < 1e-3, name
        assert ((got[name] - want[name]).abs()[off] <= STEPS * decay[name] * want[name].abs()[off] + 2e-5).all(), name


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_world_size_one_equals_reference_bit_for_bit_without_collectives(case, recipe_reference, monkeypatch):
    counter = CollectiveCounter(monkeypatch)
    result = train_sharded(small_config(bucket_mb=case[0]), "recipe", 0, 1, counter)
    assert_params_close(result["params"], recipe_reference[1], exact=True)
    assert all(calls == {} for _, calls in result["events"])
    assert result["restored"] and result["grads_in_buckets"]  # backward accumulated in place, no copies


def test_model_zero_grad_set_to_none_costs_a_copy_but_stays_correct(monkeypatch):
    # Adam every step: set_to_none after a step without Adam would drop the gradients Adam's next step sums.
    cfg = small_config(adam_every=1)
    result = train_sharded(cfg, "recipe", 0, 1, CollectiveCounter(monkeypatch), set_to_none=True)
    assert_params_close(result["params"], reference(cfg, "recipe")[0], exact=True)
    assert not result["grads_in_buckets"]


@pytest.mark.slow  # the spawned worlds
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_two_ranks_equal_rank_ordered_reference_bit_for_bit(case, sharded, recipe_reference):
    for rank_results in sharded[2]:
        assert_params_close(rank_results[("recipe", *case)]["params"], recipe_reference[2], exact=True)
        assert rank_results[("recipe", *case)]["grads_in_buckets"]


@pytest.mark.slow  # the spawned worlds
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_sharded_params_match_single_process_reference(world_size, case, sharded, fp32_reference):
    for rank_results in sharded[world_size]:
        assert_params_close(rank_results[("fp32", *case)]["params"], fp32_reference[0])


@pytest.mark.slow  # the spawned worlds
@pytest.mark.parametrize("world_size", [2, 4])
def test_one_reduce_scatter_and_one_all_gather_per_updated_bucket_per_step(world_size, sharded):
    # Adam steps every other step (step 1 of 0, 1, 2): on the others its buckets neither reduce nor gather. The
    # embedding is tied to the head throughout: its bucket (zero gradients, a zero update) never communicates. The
    # bigram table's bucket sends its rows' counts and ids (two all-to-alls) and its gradient rows
    # in place of a reduce-scatter (one), and all-gathers like the others; dense, it reduce-scatters like them. Its
    # rows' counts go before the forward, their ids after the first forward (behind the backward), as #89's.
    for rank_results in sharded[world_size]:
        for key, result in rank_results.items():
            rows = result["rows_exchanged"]
            assert rows == (key[:2] != ("rows", False))
            per_step = GLOBAL_SEQS // world_size + 2
            assert len(result["events"]) == STEPS * per_step
            for k, (point, calls) in enumerate(result["events"]):
                adam = k // per_step == 1
                n = result["buckets"] - 1 if adam else result["muon_buckets"]
                reduce = {"reduce_scatter": n - 1, "all_to_all": 1} if adam and rows else {"reduce_scatter": n}
                if point in ("begin", "backward") and k % per_step < 2:  # the counts, then the ids
                    assert calls == ({"all_to_all": 1} if adam and rows else {})
                elif point == "backward":  # no gradient leaves while backward runs: all of it after, in #89's order
                    assert calls == {}
                else:
                    assert calls == {**reduce, "all_gather": n}


def bigram_state(results: list[dict], key: tuple) -> dict[str, torch.Tensor]:
    """The bigram table after the steps, and its Adam state put together from every rank's shard."""
    parts = sorted((r[key]["state_dict"]["params"][T.BIGRAM_TABLE] for r in results), key=lambda e: e["units"])
    return {"table": results[0][key]["params"][T.BIGRAM_TABLE],
            **{k: torch.cat([e[k].flatten() for e in parts]) for k in ("m", "v")}}


@pytest.mark.slow  # the spawned worlds
@pytest.mark.parametrize("data", ["random", "own rows"])
def test_bigram_rows_exchange_equals_the_dense_reduce_scatter_bit_for_bit_at_two_ranks(data, sharded):
    # One addition per element either way. "own rows": rank 1 touched no row of rank 0's shard (it sends nothing,
    # rank 0 receives nothing) and one row many times.
    sparse, dense = (bigram_state(sharded[2], ("rows", on, data)) for on in (True, False))
    for k in sparse:
        assert torch.equal(sparse[k], dense[k]), k
    assert sparse["table"].any() and sparse["v"].any()
    assert [r["rows", True, data]["sent"] > 0 for r in sharded[2]] == [True, data == "random"]


@pytest.mark.slow  # the spawned worlds
def test_bigram_rows_exchange_at_four_ranks_is_the_dense_sum_to_bf16_rounding(sharded):
    # Three bf16 additions per element, in another order than gloo's: each may round otherwise, by half an ulp of a
    # partial sum. Measured: m differs in 203 of 16,448 elements, by at most 0.43% of its largest value, v (the
    # gradient squared) by 0.87%; the table in none. With 1032 rows it differed in 1 element, by 0.48: one whose four
    # gradients cancel exactly in gloo's order and leave -1.9e-6 in the other (m -4.8e-7), so Adam's first step,
    # lr x m / sqrt(v) ~ lr x sign, is made on one side only. So: m and v to bf16 rounding, the table wherever the
    # gradient does not cancel.
    sparse, dense = (bigram_state(sharded[4], ("rows", on, "random")) for on in (True, False))
    for k, bound in (("m", 2**-7), ("v", 2**-6)):
        assert (sparse[k] - dense[k]).abs().max() <= bound * dense[k].abs().max(), k
    off = (sparse["table"] != dense["table"]).flatten()
    assert off.float().mean() < 1e-3
    assert (dense["m"][off].abs() <= 2**-8 * dense["m"].abs().max()).all()


@pytest.mark.slow  # the spawned worlds
def test_state_per_rank_at_four_ranks_is_under_a_third_of_one_rank(sharded):
    cfg = small_config("fp32")
    one = T.ShardedMuonAdam(make_model(cfg, "fp32"), cfg, 0, 1, compile_ns=False).state_bytes()
    for rank_results in sharded[4]:
        assert rank_results[("fp32", 25.0)]["state_bytes"] <= 0.3 * one


@pytest.mark.slow  # the spawned worlds
@pytest.mark.parametrize("world_size", [2, 4])
def test_state_dicts_reassemble_to_the_reference_state(world_size, sharded, fp32_reference):
    _, want = fp32_reference
    for case in CASES:
        results = [r[("fp32", *case)] for r in sharded[world_size]]
        assert all(r["restored"] for r in results)  # load_state_dict on a fresh optimizer gives the same state
        sds = [r["state_dict"] for r in results]
        assert [(sd["rank"], sd["world_size"], sd["step_count"]) for sd in sds] == [
            (r, world_size, STEPS) for r in range(world_size)]
        cfg = small_config("fp32", bucket_mb=case[0])
        one = T.ShardedMuonAdam(make_model(cfg, "fp32"), cfg, 0, 1, compile_ns=False)
        one.load_state_dict(sds)  # re-sharded to one rank, which owns every unit
        for name, state in want.items():
            pieces = sorted((sd["params"][name] for sd in sds if name in sd["params"]), key=lambda s: s["units"])
            units = [tuple(s["units"]) for s in pieces]
            assert units[0][0] == 0 and all(a[1] == b[0] for a, b in zip(units, units[1:])), (name, units)
            for key, full in state.items():
                got = torch.cat([s[key] for s in pieces]).view_as(full)
                torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-4, msg=f"{name} {key}")
                assert torch.equal(one.state_dict()["params"][name][key].view_as(full), got)


@pytest.mark.slow  # the spawned worlds
def test_the_bf16_banks_mantissas_load_the_same_at_one_two_and_four_ranks(sharded):
    # The recipe variant's state after two ranks' steps (bf16 banks: their mantissas are state), loaded at 1 and 4
    # ranks (each rank of 4 built alone: loading needs no collective) and saved again: every piece the same bits.
    for case in CASES:
        sds = [r[("recipe", *case)]["state_dict"] for r in sharded[2]]
        cfg = small_config(bucket_mb=case[0])
        full = {}
        for world_size in (1, 4):
            for rank in range(world_size):
                opt = T.ShardedMuonAdam(make_model(cfg, "recipe"), cfg, rank, world_size, compile_ns=False)
                opt.load_state_dict(sds)
                for name, entry in opt.state_dict()["params"].items():
                    full.setdefault((world_size, name), []).append(entry)
        for (world_size, name), pieces in full.items():
            saved = sorted((sd["params"][name] for sd in sds if name in sd["params"]), key=lambda e: e["units"])
            pieces.sort(key=lambda e: e["units"])
            for key in saved[0]:
                if key not in ("bucket", "units"):
                    assert torch.equal(torch.cat([e[key] for e in pieces]), torch.cat([e[key] for e in saved])), (
                        world_size, name, key)
        banks = [e for sd in sds for n, e in sd["params"].items() if n.endswith("_bank") and "mantissa" in e]
        assert len(banks) >= 3 and any(e["mantissa"].any() for e in banks)  # the mantissas travel, and are not zero


def test_buckets_pad_uneven_groups_and_split_big_ones():
    cfg = small_config(bucket_mb=0.05)
    opt = T.ShardedMuonAdam(make_model(cfg, "recipe"), cfg, 0, 4, compile_ns=False)
    muon = [(b.unit, sum(b.counts), b.shard_units) for b in opt.buckets if b.kind == "muon"]
    # a parameter is never split: the Q/K bank (4 attention layers x 2 head-pair blocks) and the V/O bank (4 x 2) are a
    # bucket each, over the limit of 4 matrices; the MLP bank's 10 matrices pad to 3 per rank
    assert [(n, k) for unit, n, k in muon if unit == [64, 64]] == [(8, 2), (8, 2)]
    assert [(n, k) for unit, n, k in muon if unit == [128, 64]] == [(10, 3)]
    assert {str(b.data.dtype) for b in opt.buckets if b.kind == "adam"} == {"torch.float32", "torch.bfloat16"}
    resid = next(b for b in opt.buckets if b.names == ["resid_lambdas"])
    assert (sum(resid.counts), resid.shard_units, resid.data.numel()) == (10, 3, 12)  # 10 elements: 3 per rank
    for b in opt.buckets:
        assert len({p.dtype for p in b.params}) == 1 and b.shard_units * 4 >= sum(b.counts)
        for p, view in zip(b.params, b.grad_views):  # parameters and gradients live in the bucket buffers
            assert p.untyped_storage().data_ptr() == b.data.untyped_storage().data_ptr()
            assert p.grad.data_ptr() == view.data_ptr()


def test_bucket_size_is_validated():
    with pytest.raises(T.UsageError, match=r"--bucket_mb must be in \(0, 100000\]"):
        T.validate_config(small_config(bucket_mb=0), 1)


@pytest.mark.parametrize("tied", [True, False])
def test_a_step_reduces_in_89s_table_order_and_updates_in_its_work_order(monkeypatch, tied):
    # One Adam step of rank 0 of 2, the collectives recorded in place of gloo's: every reduce-scatter after backward
    # in #89's table's order, then each bucket's update and all-gather in #89's work order (small parameters first,
    # the Muon banks last). While tied, the embedding's bucket takes no part.
    cfg = small_config(bucket_mb=1000.0, bigram_rows=1031)  # not whole rows per rank: the table reduce-scatters too
    model = make_model(cfg, "recipe")
    opt = T.ShardedMuonAdam(model, cfg, 0, 2, compile_ns=False)
    names = {id(b.grad): b.names for b in opt.buckets} | {id(b.data): b.names for b in opt.buckets}
    calls = []

    class Done:
        def wait(self) -> None:
            pass

    monkeypatch.setattr(T, "_reduce_scatter", lambda out, inp: calls.append(("reduce", names[id(inp)])) or Done())
    monkeypatch.setattr(T, "all_gather_into", lambda out, inp, async_op=False: calls.append(
        ("gather", names[id(out)])) or Done())
    opt.set_step(T.StepSchedule(1.0, 0.9, 1, 0, True, cfg.train_seq_len, cfg.train_seq_len, 2048, (1,), (1.0,), 0.0, tied))
    loss(model, make_data(cfg)[0, 0]).backward()
    opt.step()
    last = [max(T.SCATTER_ORDER.index(n) for n in b.names) for b in opt.buckets]  # a group's bucket: its last
    assert last == sorted(last) and "qk_bank" in opt.buckets[0].names
    skipped = [[T.TIED_EMBEDDING]] if tied else []
    reduced = [b.names for b in opt.buckets if b.names not in skipped]
    gathered = [b.names for b in opt.work_order if b.names not in skipped]
    assert calls == [("reduce", n) for n in reduced] + [("gather", n) for n in gathered]
    first = [min(T.WORK_ORDER.index(n) for n in names) for names in gathered]
    muon = sum(b.kind == "muon" for b in opt.buckets)
    assert first == sorted(first) and all(b.kind == "muon" for b in opt.work_order[-muon:])


def test_the_bigram_rows_counts_go_async_before_the_forward_and_are_waited_for_after_it(monkeypatch):
    # Rank 0 of 2, the all-to-alls recorded in place of gloo's. #89's order: the counts' exchange starts before the
    # forward without blocking (async), is waited for after the forward, then the ids' exchange starts (async); the
    # ids go up from the table's own host buffer (pinned on CUDA: tests/test_cuda.py), not a fresh one per step.
    cfg = small_config()
    model = make_model(cfg, "recipe")
    opt = T.ShardedMuonAdam(model, cfg, 0, 2, compile_ns=False)
    table, events = opt.row_bucket, []

    class Work:
        def __init__(self, what: str):
            self.what = what

        def wait(self) -> None:
            events.append(f"wait {self.what}")

    def all_to_all_single(out, inp, out_splits=None, in_splits=None, async_op=False):
        what = "counts" if out_splits is None else "ids" if inp.dtype == torch.int32 else "rows"
        events.append(f"{what} {'async' if async_op else 'blocking'}")
        return Work(what)

    monkeypatch.setattr(T.dist, "all_to_all_single", all_to_all_single)
    monkeypatch.setattr(T, "_reduce_scatter", lambda out, inp: Work("reduce"))
    monkeypatch.setattr(T, "all_gather_into", lambda out, inp, async_op=False: Work("gather"))
    opt.set_step(T.StepSchedule(1.0, 0.9, 1, 0, True, cfg.train_seq_len, cfg.train_seq_len, 2048, (1,), (1.0,), 0.0,
                                True))
    seq = make_data(cfg)[0, 0]
    opt.begin_step(opt.batch_rows()(seq[None].numpy()))
    assert table.send_ids.untyped_storage().data_ptr() == table.send_buffer.untyped_storage().data_ptr()
    micro_loss = loss(model, seq)
    events.append("forward")
    opt.forward_done()
    micro_loss.backward()
    opt.step()
    assert events[:5] == ["counts async", "forward", "wait counts", "ids async", "rows async"]


def test_the_bigram_hash_is_the_same_on_numpy_and_torch():
    # #89's example (spec 3.3): position 0 takes the last row, position 1 hashes that row's index in x_0's place.
    x = np.array([50256, 1000, 50256, 198], dtype=np.int32)
    assert T.bigram_index(x, 754_560).tolist() == T.bigram_index(torch.from_numpy(x), 754_560).tolist() == [
        754_559, 573_883, 187_911, 514_417]
    tokens = np.random.default_rng(0).integers(0, 65536, (3, 200)).astype(np.int32)  # the widest uint16 tokens
    for rows in (1031, 754_560):
        host = T.bigram_index(tokens, rows)
        assert host.dtype == np.int64 and (host[:, 0] == rows - 1).all()
        assert np.array_equal(host, np.stack([T.bigram_index(torch.from_numpy(t), rows).numpy() for t in tokens]))


def test_the_bigram_rows_exchange_needs_whole_rows_per_rank():
    # 1031 rows: a shard of 515.5 rows at W = 2 would split a row between two owners; the dense reduce-scatter does.
    for rows, world_size, exchanged in ((1032, 2, True), (1032, 4, True), (1031, 2, False), (1032, 1, False)):
        cfg = small_config(bigram_rows=rows)
        opt = T.ShardedMuonAdam(make_model(cfg, "recipe"), cfg, 0, world_size, compile_ns=False)
        table = next(b for b in opt.buckets if b.names == [T.BIGRAM_TABLE])
        assert isinstance(table, T.RowBucket) == exchanged and (opt.batch_rows() is None) != exchanged
        if exchanged:  # this rank's own rows of its local gradient are its shard's
            assert table.grad_shard.shape == ((rows // world_size) * cfg.model_dim,)
            assert table.grad_shard.data_ptr() == table.grad.data_ptr()
