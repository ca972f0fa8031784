"""Pins tests/reference_head.py (the independent float64 reference of upstream HEAD f411b3d) to the spec's own
numbers (/work/shared/upstream_head_spec.md §1.2, §2.2-§2.10, §3, §4), so the reference is right before a port is
compared to it.  CPU, float64, one thread, small shapes."""

import math

import numpy as np
import pytest
import torch

from tests import reference_head as RH

R89, O89 = RH.R89, RH.O89
pytestmark = pytest.mark.usefixtures("one_thread")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------------
# §2.8 bigram hash, sign index
# ----------------------------------------------------------------------------------------------------
def test_bigram_hash_example_and_wrap_constant_of_2_8():
    assert RH.BIGRAM_ROWS_HEAD == 377_280 and RH.BIGRAM_ROWS_HEAD % 8 == 0 and RH.BIGRAM_ROWS_HEAD // 8 == 47_160
    M = RH.BIGRAM_ROWS_HEAD - 1
    assert M == 377_279
    assert int(RH.wrap32(np.array([27191 * M]))[0]) == 1_668_658_697
    h = RH.bigram_hash_head(torch.tensor([50256, 1000, 50256, 198], dtype=torch.int32))
    assert h.dtype == np.int32 and h.tolist() == [377279, 39179, 190342, 138941]
    x = [17, 1000, 5, 6]
    h = RH.bigram_hash_head(x)
    assert h[0] == M and h[1] == ((36313 * 1000) ^ 1_668_658_697) % M
    assert h[2] == ((36313 * 5) ^ (27191 * 1000)) % M
    t = np.random.default_rng(0).integers(0, 50304, 4000)
    hh = RH.bigram_hash_head(t)
    assert hh.min() >= 0 and hh[1:].max() < M


def test_sign_index_unchanged():
    x = [50256, 1000, 50256, 198, 8195, 3]
    assert RH.sign_index(x).tolist() == R89.sign_index89(x).tolist()
    assert RH.sign_index(x)[5] == 0


# ----------------------------------------------------------------------------------------------------
# §1.2 / §2.7 schedule
# ----------------------------------------------------------------------------------------------------
def test_stage_ends_untie_cooldowns_warmup_and_val_steps():
    assert RH.stage_ends_head() == [0, 423, 847, 1270, 1285]
    d = RH.schedule_head(0)
    assert d["untie_step"] == 847 and d["cooldown_start"] == 508 and d["mom_cooldown_start"] == 1235
    assert d["yarn_steps"] == [423, 847, 1270]
    assert RH.warmup_steps_head() == [0, 1, 421, 422, 423, 424, 845, 846, 847, 848, 1268, 1269, 1270, 1271]
    assert d["warmup_steps"] == RH.warmup_steps_head()
    assert RH.val_steps_head() == [0, 250, 500, 750, 1000, 1250, 1285]
    assert RH.schedule_head(1285)["final_val"] and RH.schedule_head(1285)["val"]
    assert not RH.schedule_head(1284)["final_val"] and not RH.schedule_head(1284)["val"]
    assert sum(RH.schedule_head(s)["batch"] for s in range(1285)) == 338_821_120
    assert [RH.schedule_head(s)["stage"] for s in (422, 423, 846, 847, 1269, 1270, 1284)] == [0, 1, 1, 2, 2, 3, 3]
    assert RH.schedule_head(847)["tied"] and not RH.schedule_head(848)["tied"]


def test_momentum_and_lr_around_the_new_ends():
    assert RH.schedule_head(1235)["mu"] == 0.95
    assert RH.schedule_head(1236)["mu"] == pytest.approx(0.95 - 0.1 / 50)
    assert RH.schedule_head(1284)["mu"] == pytest.approx(0.95 - 0.1 * 49 / 50)
    assert RH.schedule_head(507)["s"] == 1.52 and RH.schedule_head(508)["s"] == 1.52
    assert RH.schedule_head(509)["s"] == pytest.approx(1.52 * (1 - 1 / 762) + 0.15 / 762)
    assert RH.schedule_head(1270)["s"] == 0.15 and RH.schedule_head(1284)["s"] == 0.15


def test_yarn_steps_windows_and_scales():
    for step, wt, sc in [(422, (128, 384), 0.1), (423, (384, 896), 0.1169459572),
                         (847, (640, 1408), 0.1275175238), (1270, (768, 1664), 0.1317779884)]:
        d = RH.schedule_head(step)
        assert d["window_tokens"] == wt and abs(d["attn_scale"] - sc) < 5e-11
        assert RH.schedule_head(step - 1)["window_tokens"] != wt or step == 422
    f = RH.schedule_head(1285)
    assert f["window_tokens"] == (768, 2560) and abs(f["attn_scale"] - 0.1317779884) < 5e-11


@pytest.mark.parametrize("step,pw", [(0, 0.25), (422, 0.25), (423, 0.25), (635, 0.125), (846, 0.25 / 424),
                                     (847, 0.0), (1269, 0.0), (1284, 0.0), (1285, 0.0)])
def test_prefix_weight_per_step(step, pw):
    d = RH.schedule_head(step)
    assert d["prefix_weight"] == pytest.approx(pw, rel=1e-13, abs=0)
    if 423 <= step < 847:  # upstream's own expression: start + (end - start) * tau
        assert d["prefix_weight"] == 0.25 + (0.0 - 0.25) * ((step - 423) / 424)
    assert d["prefix_weight_fp32"].dtype == torch.float32 and d["prefix_weight_fp32"].shape == (1,)
    assert d["prefix_weight_fp32"].item() == float(np.float32(d["prefix_weight"]))


def test_mtp_weights_unchanged_formula_at_the_new_ends():
    assert RH.schedule_head(0)["mtp"] == [1.0, 0.5, 0.25]
    assert RH.schedule_head(422)["mtp"][2] == pytest.approx(0.25 / 423)
    assert RH.schedule_head(423)["mtp"] == [1.0, 0.5]
    assert RH.schedule_head(846)["mtp"][1] == pytest.approx(0.5 / 424)
    assert RH.schedule_head(847)["mtp"] == [1.0]


# ----------------------------------------------------------------------------------------------------
# §2.10 optimizer table
# ----------------------------------------------------------------------------------------------------
def test_param_table_rows_and_orders():
    t = RH.param_table_head()
    assert list(t) == RH.SCATTER_ORDER_HEAD and len(t) == 19
    for gone in RH.REMOVED_NAMES_HEAD:
        assert gone not in t
    for name in ("mudd_gate_w1", "mudd_gate_w2", "mudd_gate_b2", "_mudd_gate_scale"):
        e = t[name]
        assert e["opt"] == "adam" and e["comms"] == "replicated" and e["betas"] == (0.9, 0.99)
        assert e["lr_mul"] == 0.1 and e["lr"] == pytest.approx(0.0008)
    assert t["mudd_gate_w1"]["wd_mul"] == 1.0 and t["mudd_gate_w2"]["wd_mul"] == 1.0
    assert t["mudd_gate_b2"]["wd_mul"] == 0.0 and t["_mudd_gate_scale"]["wd_mul"] == 0.0
    assert t["mudd_w1"]["lr_mul"] == 0.25 and t["mudd_b2"]["wd_mul"] == 0.0
    assert t["bigram_embed"]["comms"] == "sharded_sparse" and t["lm_head"]["comms"] == "sharded"
    assert t["qk_bank"]["opt"] == "normuon" and t["scalars"]["comms"] == "replicated"
    assert RH.WORK_ORDER_HEAD[:6] == ["scalars", "smear_gate", "ve_gate_bank", "mudd_b2", "mudd_gate_b2",
                                      "_mudd_gate_scale"]
    assert RH.WORK_ORDER_HEAD[-5:] == ["lm_head", "embed", "qk_bank", "vo_bank", "mlp_bank"]
    assert len(RH.WORK_ORDER_HEAD) == 19


# ----------------------------------------------------------------------------------------------------
# §2.2 / §2.3 parameters, bias layout
# ----------------------------------------------------------------------------------------------------
def test_parameters_19_tensors_shapes_and_dtypes():
    cfg = RH.cfg_small_head()
    p, sign = RH.random_init_params_head(cfg, seed=0)
    assert len(p) == 19 and {k.split(".")[0] for k in p} == set(RH.PARAM_NAMES_HEAD)
    assert sign.shape == (cfg.bigram_sign_rows, cfg.bigram_dim) and set(sign.float().unique().tolist()) == {-1.0, 1.0}
    assert p["_mudd_gate_scale"].shape == () and p["_mudd_gate_scale"].dtype == torch.float32
    assert p["_mudd_gate_scale"].item() == pytest.approx(0.1)
    assert p["mudd_gate_w1"].shape == (2, cfg.mudd_gate_dim, cfg.model_dim) and p["mudd_gate_w1"].dtype == torch.bfloat16
    assert p["mudd_gate_w1"].float().abs().max() <= 1 / math.sqrt(cfg.model_dim)
    assert p["mudd_gate_w2"].shape == (2, 41, cfg.mudd_gate_dim) and not p["mudd_gate_w2"].float().any()
    assert p["mudd_gate_b2"].shape == (2, 41) and p["mudd_gate_b2"].dtype == torch.bfloat16
    assert p["bigram_embed.weight"].shape == (cfg.bigram_rows, cfg.model_dim)
    assert p["scalars"].tolist() == [0.5, 1.0] * 11 + [0.0, -1.5]
    full = RH.cfg_head()
    assert (full.bigram_rows, full.bigram_dim, full.dc_window) == (377_280, 768, 112)


def test_gate_bias_layout_and_effective_values():
    b = RH.mudd_gate_bias_init()
    assert b.dtype == torch.bfloat16 and b.shape == (2, 41)
    bf = b.float()
    assert bf[0, 12:18].tolist() == [2.5] * 6 and bf[1, 12:18].tolist() == [2.5] * 6
    assert bf[0, [19, 21, 23, 25]].tolist() == [0.5] * 4 and bf[1, [19, 21, 23, 25, 27]].tolist() == [0.5] * 5
    assert bf[1, 28].item() == 5.0 and bf[1, 29:35].tolist() == [10.0] * 6
    zero0 = [i for i in range(41) if i not in (*range(12, 18), 19, 21, 23, 25)]
    zero1 = [i for i in range(41) if i not in (*range(12, 18), 19, 21, 23, 25, 27, 28, *range(29, 35))]
    assert not bf[0, zero0].any() and not bf[1, zero1].any()
    assert torch.tensor(0.1).bfloat16().item() == 0.10009765625
    eff = RH.mudd_gate_bias_effective(b)
    assert eff[0, 12].item() == 0.25 and eff[0, 19].item() == 0.050048828125
    assert eff[1, 28].item() == 0.5 and eff[1, 29].item() == 1.0 and eff[1, 35].item() == 0.0
    # layout: every lane used once, pre 26 lanes, post 41
    pre = sorted(i for s in RH.PRE_SLICES.values() for i in range(s.start, s.stop))
    post = sorted(i for s in RH.POST_SLICES.values() for i in range(s.start, s.stop))
    assert pre == list(range(26)) and post == list(range(41))
    assert RH.PRE_SLICES[("x0", 3)] == slice(24, 25) and RH.PRE_SLICES[("bigram", 3)] == slice(25, 26)
    assert RH.POST_SLICES[("x0", 9)] == slice(26, 27) and RH.POST_SLICES[("bigram", 4)] == slice(19, 20)


# ----------------------------------------------------------------------------------------------------
# §2.7 / §4 item 3 prefix table
# ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks():
    return RH._mergeable_ranks()


def test_prefix_table_invariants(ranks):
    assert len(ranks) == 50256 and set(ranks.values()) == set(range(50256))
    table = RH.build_prefix_table_head(50304, ranks)
    assert table.dtype == torch.int64 and table.shape == (50304,)
    tok = {i: b for b, i in ranks.items()}
    minus = set(torch.nonzero(table == -1).flatten().tolist())
    singles = {i for i, b in tok.items() if len(b) == 1}
    assert len(singles) == 256
    assert minus == singles | {50256} | set(range(50257, 50304)) and len(minus) == 304
    tl = table.tolist()
    for i, b in tok.items():
        if len(b) == 1:
            continue
        pb = tok[tl[i]]
        assert len(pb) < len(b) and b.startswith(pb), i
        # longest: no longer proper prefix is a token
        assert all(b[:n] not in ranks for n in range(len(pb) + 1, len(b))), i
    # the spec's sort + stack algorithm gives the same table
    assert torch.equal(table, RH.prefix_table_stack_head(50304, ranks))


def test_prefix_table_examples(ranks):
    table = RH.build_prefix_table_head(50304, ranks)
    for s in (" the", " hello", "ing", " Theorem"):
        b = s.encode()
        if b not in ranks:
            continue
        exp = next((ranks[b[:n]] for n in range(len(b) - 1, 0, -1) if b[:n] in ranks), -1)
        assert table[ranks[b]].item() == exp
    assert table[ranks[b" t"]].item() == ranks[b" "]


# ----------------------------------------------------------------------------------------------------
# §3 DC attention
# ----------------------------------------------------------------------------------------------------
CU_EDGE = [0, 0, 37, 200, 256, 256]  # zero-length segment, short doc, doc longer than the window, padding


def test_dc_doc_bounds_and_mask_edges():
    T, W = 256, 112
    s, e = RH.dc_doc_bounds_head(CU_EDGE, T)
    assert s[0].item() == 0 and e[0].item() == 37  # t = 0 lands in the second (non-empty) segment
    assert s[36].item() == 0 and s[37].item() == 37 and e[37].item() == 200
    assert s[199].item() == 37 and s[200].item() == 200 and e[255].item() == 256
    m = RH.dc_mask_head(CU_EDGE, T, W)
    for t in range(T):
        st = 0 if t < 37 else 37 if t < 200 else 200
        vis = [j for j in range(T) if st <= j <= t and t - j <= W - 1]
        assert torch.nonzero(m[t]).flatten().tolist() == vis, t
    assert m[199].sum().item() == 112 and m[148].sum().item() == 112 and m[147].sum().item() == 111
    assert m[36].sum().item() == 37 and m[37].sum().item() == 1 and m[200].sum().item() == 1
    # cu not padded to T (upstream always pads): the kernel's bounds put queries past the last boundary in the
    # last document, so they see its keys [s, e) (dc.py:24-46, 310-320)
    m2 = RH.dc_mask_head([0, 10, 20], 24, W)
    assert all(torch.nonzero(m2[t]).flatten().tolist() == list(range(10, 20)) for t in range(20, 24))
    assert m2[19].sum().item() == 10 and torch.nonzero(m2[9]).flatten().tolist() == list(range(10))


def _dc_inputs(T=256, H=6, D=8, seed=0):
    g = _gen(seed)
    n = lambda z: z / z.square().mean(-1, keepdim=True).sqrt()
    q = n(torch.randn(T, H, D, generator=g, dtype=torch.float64))
    k = n(torch.randn(T, H, D, generator=g, dtype=torch.float64))
    v = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    base = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    w1 = torch.randn(T, H, generator=g, dtype=torch.float64) + 1
    w1p, _ = RH.dc_gate_head(w1, w1, bf16_w1=False)
    w2p = 0.3 * torch.randn(T, H, generator=g, dtype=torch.float64)
    return q, k, v, base, w1p, w2p


def test_dc_with_zero_w2_is_the_base_exactly():
    q, k, v, base, w1p, _ = _dc_inputs()
    out = RH.dc_dense_head(base, q, k, v, w1p, torch.zeros_like(w1p), CU_EDGE, 0.1275175238)
    assert torch.equal(out, base)
    # init gate: w1 lanes at 1.0 -> w1' = bf16(1/sqrt(1 + 1e-6)) = 1.0
    w1p0, _ = RH.dc_gate_head(torch.ones(4, 6, dtype=torch.float64), torch.zeros(4, 6, dtype=torch.float64))
    assert torch.equal(w1p0, torch.ones(4, 6, dtype=torch.float64))


def test_dc_dense_matches_the_per_query_formula_of_3_2():
    T, H = 256, 6
    q, k, v, base, w1p, w2p = _dc_inputs(T, H, D=8, seed=1)
    sc = 0.1275175238
    out = RH.dc_dense_head(base, q, k, v, w1p, w2p, CU_EDGE, sc)
    starts = [0] * 37 + [37] * 163 + [200] * 56
    for t in (0, 1, 36, 37, 38, 111, 150, 199, 200, 255):
        keys = [j for j in range(starts[t], t + 1) if t - j <= 111]
        P = [torch.softmax(torch.stack([sc * (q[t, h] @ k[j, h]) for j in keys]), 0) for h in range(H)]
        A = sum(w1p[t, h] * P[h] for h in range(H))
        for h in range(H):
            exp = base[t, h] + sum(w2p[t, h] * A[n] * v[j, h] for n, j in enumerate(keys))
            assert torch.allclose(out[t, h], exp, rtol=1e-12, atol=1e-12), (t, h)


def test_dc_explicit_backward_of_3_3_is_the_autograd_gradient():
    T = 160
    q, k, v, base, w1p, w2p = _dc_inputs(T, 6, D=8, seed=2)
    cu = [0, 0, 30, 150, 160]
    ins = [z.clone().requires_grad_(True) for z in (base, q, k, v, w1p, w2p)]
    out = RH.dc_dense_head(*ins[:5], ins[5], cu, 0.12)
    G = torch.randn(out.shape, generator=_gen(3), dtype=torch.float64)
    grads = torch.autograd.grad(out, ins, G)
    exp = RH.dc_backward_head(G, q, k, v, w1p, w2p, cu, 0.12)
    for name, g in zip(("dbase", "dq", "dk", "dv", "dw1", "dw2"), grads):
        assert torch.allclose(exp[name], g, rtol=1e-10, atol=1e-12), name


# ----------------------------------------------------------------------------------------------------
# forward (small config, HEAD's roles)
# ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small():
    cfg = RH.cfg_small_head()
    p, sign = RH.random_init_params_head(cfg, seed=0)
    g = _gen(1)
    p["bigram_embed.weight"] = (0.1 * torch.randn(p["bigram_embed.weight"].shape, generator=g)).bfloat16()
    p["mlp_bank"] = p["mlp_bank"].clone()
    p["mlp_bank"][:, 1] = (0.02 * torch.randn(p["mlp_bank"][:, 1].shape, generator=g)).bfloat16()
    toks = torch.randint(0, 512, (160,), generator=g)
    cu = [0, 40, 41, 160]  # a one-token document; the last one longer than the 112-token DC window
    yarn = R89.yarn89([48, 112], head_dim=cfg.head_dim)
    return cfg, p, sign, toks, cu, yarn


def _fwd(small, p=None, **kw):
    cfg, p0, sign, toks, cu, yarn = small
    return RH.forward_head(p0 if p is None else p, sign, toks, (3, 7), cfg, cu_seqlens=cu, yarn=yarn, **kw)


def _with_w2(p, block: int, lanes, seed=9, scale=0.5):
    q = dict(p)
    w2 = p["mudd_gate_w2"].clone().float()
    g = _gen(seed)
    for lane in lanes:
        w2[block, lane] = scale * torch.randn(w2.shape[-1], generator=g)
    q["mudd_gate_w2"] = w2.bfloat16()
    return q


def test_forward_at_init_gates_skip_and_x0_not_aliased(small):
    cfg, p, sign, toks, cu, yarn = small
    h, aux = _fwd(small, return_aux=True)
    assert h.shape == (160, 96) and torch.isfinite(h).all()
    eff = RH.mudd_gate_bias_effective(p["mudd_gate_b2"])
    assert torch.equal(aux["pre_gate"], eff[0, :26].expand(160, 26))
    assert torch.equal(aux["post_gate"], eff[1, :41].expand(160, 41))
    # skip weight at init: sigmoid(-1.5) * 0.5 (half of #89's sigmoid(-1.5) * 1)
    sk = torch.sigmoid(torch.tensor(-1.5, dtype=torch.float64)).item() * 0.5
    assert torch.allclose(aux["skip_w"], torch.full((160, 1), sk, dtype=torch.float64), rtol=1e-15, atol=0)
    # (the spec writes 0.0911; sigma(-1.5) / 2 = 0.091213: the spec truncated, its 0.1824 / 2 agrees with 0.0912)
    assert aux["skip_w"][0].item() == pytest.approx(0.1824 / 2, abs=1e-4)
    # x0 is the un-injected normed embedding; cache[0] carries the bigram with gate 0.050048828125
    e = p["embed.weight"][toks].double()
    x0 = torch.nn.functional.rms_norm(e, (96,), eps=R89.RMS_EPS)
    assert torch.allclose(aux["x0"], x0, atol=1e-12)
    assert torch.allclose(aux["cache"][0], x0 + 0.050048828125 * aux["b"], atol=1e-12)
    assert aux["b"].abs().sum() > 0 and not torch.allclose(aux["cache"][0], aux["x0"])
    assert sorted(aux["cache"]) == [0, 3, 7, 9]
    # the post gate reads the un-normed layer-3 output
    assert torch.equal(RH.mudd_gate_head(aux["cache"][3], p, 1, 41), aux["post_gate"])
    # MUDD post-loop at its bias: x - 0.5 cache[7]
    assert torch.allclose(aux["post_mudd1"], aux["pre_mudd1"] - 0.5 * aux["cache"][7], atol=1e-12)
    losses = RH.loss_head(p, sign, toks, toks.roll(-1), (3, 7), cfg, [1.0, 0.5, 0.25], 0.25,
                          torch.full((512,), -1, dtype=torch.int64), cu_seqlens=cu, yarn=yarn)
    assert losses.shape == (160,) and torch.isfinite(losses).all()


def test_dc_is_a_noop_at_init_and_acts_through_w2(small):
    cfg, p, sign, toks, cu, yarn = small
    h, aux = _fwd(small, return_aux=True)
    d = aux["dc_in"]
    assert torch.equal(d["w1p"], torch.ones(160, 6, dtype=torch.float64)) and not d["w2p"].any()
    assert torch.equal(d["cu"], torch.tensor(cu))
    q = _with_w2(p, 1, range(35, 41))
    h2, aux2 = _fwd(small, q, return_aux=True)
    assert not torch.allclose(h, h2, atol=1e-6)
    # only layer 10's attention changes: everything up to cache[9] is the same
    assert torch.equal(aux2["cache"][9], aux["cache"][9])
    # w1 lanes alone do nothing while w2 = 0
    q = _with_w2(p, 1, range(29, 35))
    assert torch.equal(_fwd(small, q), h)


def test_xsa_attention_gates_and_injections_only_where_the_spec_says(small):
    cfg, p, sign, toks, cu, yarn = small
    h, aux = _fwd(small, return_aux=True)
    c = aux["cache"]
    # pre lanes 26..40 are unused
    assert torch.equal(_fwd(small, _with_w2(p, 0, range(26, 41))), h)
    # XSA layer 1 (pre 0:6) changes layer 3's output; XSA layer 7 (post 6:12) leaves cache[3] alone
    _, a = _fwd(small, _with_w2(p, 0, range(0, 6)), return_aux=True)
    assert not torch.allclose(a["cache"][3], c[3], atol=1e-8)
    _, a = _fwd(small, _with_w2(p, 1, range(6, 12)), return_aux=True)
    assert torch.equal(a["cache"][3], c[3]) and not torch.allclose(a["cache"][7], c[7], atol=1e-8)
    # x0 gates: pre lane 18 (layer 0)
    _, a = _fwd(small, _with_w2(p, 0, [18]), return_aux=True)
    assert not torch.allclose(a["cache"][3], c[3], atol=1e-8)
    # attention gate of layer 10 is linear: at init 0.25 (post lanes 12:18)
    assert torch.equal(aux["gates"]["attn_gate"][10], torch.full((160, 6), 0.25, dtype=torch.float64))
    assert sorted(aux["gates"]["attn_gate"]) == [3, 10] and sorted(aux["gates"]["xsa"]) == [1, 3, 4, 7]
    assert sorted(aux["gates"]["x0"]) == [0, 1, 2, 3, 4, 5, 7, 8, 9]
    assert sorted(aux["gates"]["bigram"]) == [0, 1, 2, 3, 4, 5, 7, 8, 9]


def test_xsa_form_of_86_equals_89s_normalized_form():
    g = _gen(4)
    y = torch.randn(10, 6, 16, generator=g, dtype=torch.float64)
    v = torch.randn(10, 6, 16, generator=g, dtype=torch.float64)
    v[0, 0] = 1e-6  # below the clamp
    gate = torch.randn(10, 6, generator=g, dtype=torch.float64)
    got = RH.xsa_head(y, v, gate, bf16_alpha=False)
    vn = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-4)
    exp = y - torch.tanh(gate)[..., None] * (y * vn).sum(-1, keepdim=True) * vn
    assert torch.allclose(got, exp, rtol=1e-12, atol=1e-14)


def test_forward_is_causal(small):
    cfg, p, sign, toks, cu, yarn = small
    q = _with_w2(p, 0, range(26), seed=5, scale=0.3)
    q = _with_w2(q, 1, range(41), seed=6, scale=0.3)
    h1 = _fwd(small, q)
    t2 = toks.clone()
    t2[100:] = torch.randint(0, 512, (60,), generator=_gen(7))
    h2 = RH.forward_head(q, sign, t2, (3, 7), cfg, cu_seqlens=cu, yarn=yarn)
    assert torch.allclose(h1[:100], h2[:100], atol=1e-12) and not torch.allclose(h1[100:], h2[100:])


# ----------------------------------------------------------------------------------------------------
# §2.7 loss with the prefix term and the kernel's gradient
# ----------------------------------------------------------------------------------------------------
def _loss_case(T=7, V=11, seed=3):
    g = _gen(seed)
    logits = torch.randn(T, V, generator=g, dtype=torch.float64) * 4
    y = torch.randint(0, V, (T,), generator=g)
    pt = torch.randint(-1, V, (T,), generator=g)
    pt[0], pt[1] = -1, y[1 + 1]  # an invalid prefix; a prefix column that is also an MTP target
    return logits, y, pt


def test_loss_with_prefix_weight_zero_is_89s_mtp_loss():
    logits, y, pt = _loss_case()
    w = [1.0, 0.5, 0.25]
    ref = R89.mtp_loss89(logits, y, w)
    assert torch.equal(RH.mtp_prefix_loss_head(logits, y, w, pt, 0.0), ref)
    assert torch.equal(RH.mtp_prefix_loss_head(logits, y, w, None, 0.7), ref)
    assert torch.equal(RH.mtp_prefix_loss_head(logits, y, w, torch.full_like(pt, -1), 0.7), ref)


def test_loss_prefix_term():
    logits, y, pt = _loss_case()
    w, pw = [1.0, 0.5], 0.25
    out = RH.mtp_prefix_loss_head(logits, y, w, pt, pw)
    z = 23 * torch.sigmoid((logits + 5) / 7.5)
    for p in range(7):
        lse = torch.logsumexp(z[p], 0)
        exp = sum(w[k] * (lse - z[p, y[p + k]]) for k in range(2) if p + k < 7)
        if pt[p] >= 0:
            exp = exp + pw * (lse - z[p, pt[p]])
        assert out[p].item() == pytest.approx(float(exp), rel=1e-12)


def test_kernel_gradient_S_w_and_sparse_correction():
    T, V = 7, 11
    logits, y, pt = _loss_case(T, V)
    w, pw = [1.0, 0.5, 0.25], 0.25
    # true derivative (sw_quirk=False) = autograd of the summed loss
    l = logits.clone().requires_grad_(True)
    RH.mtp_prefix_loss_head(l, y, w, pt, pw).sum().backward()
    g_true = RH.mtp_prefix_grad_head(logits, y, w, pt, pw, sw_quirk=False)
    assert torch.allclose(g_true, l.grad, rtol=1e-10, atol=1e-13)
    # the kernel's S_w: all K weights + w_pre where T' is valid; rows p <= T-K agree with the true derivative
    g = RH.mtp_prefix_grad_head(logits, y, w, pt, pw)
    assert torch.allclose(g[: T - 2], l.grad[: T - 2], rtol=1e-10, atol=1e-13)
    z = 23 * torch.sigmoid((logits + 5) / 7.5)
    sig = torch.sigmoid((logits + 5) / 7.5)
    P = torch.softmax(z, -1)
    for p in range(T):
        sw = sum(w) + (pw if pt[p] >= 0 else 0.0)
        t2 = torch.zeros(V, dtype=torch.float64)
        for k in range(3):
            if p + k < T:
                t2[y[p + k]] += w[k]
        if pt[p] >= 0:
            t2[pt[p]] += pw
        exp = (23 / 7.5) * (sw * P[p] - t2) * sig[p] * (1 - sig[p])
        assert torch.allclose(g[p], exp, rtol=1e-12, atol=1e-15), p
    # prefix weight 0 / no prefix: #89's kernel gradient (reference89_optim, K <= 3)
    lb = logits.bfloat16()
    a = RH.softcap_ce_head(lb, y, w, None, 0.0)
    b = O89.softcap_ce89(lb, y, torch.tensor(w))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))


def test_spec_labels_are_accepted_as_keys(small):
    cfg, p, sign, toks, cu, yarn = small
    bare = {k.split(".")[0]: v for k, v in p.items()}
    assert set(bare) == set(RH.PARAM_NAMES_HEAD)
    assert torch.equal(_fwd(small, bare), _fwd(small))
    # HEAD's own lm_head storage (d, V) gives the same logits
    h = _fwd(small)
    assert torch.equal(RH.logits_head(h, {"lm_head": p["lm_head.weight"].T}), RH.logits_head(h, p))
