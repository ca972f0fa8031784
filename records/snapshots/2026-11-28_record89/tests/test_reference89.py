"""Pins tests/reference89.py (the independent float64 reference of record #89) to the spec's own numbers
(/work/shared/record89_spec.md sections 3, 4, 6), so the reference is right before a port is compared to it."""

import math

import numpy as np
import pytest
import torch

import reference89 as R


@pytest.fixture(autouse=True)
def _one_thread(_cpu_threads):
    """small float64 matmuls: one thread is ~50x faster than two on the shared 2-core machine (runs after
    conftest's _cpu_threads, which sets 2)"""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------------------------------
# spec 3.3 / 3.4
# ----------------------------------------------------------------------------------------------------
def test_bigram_hash_example_of_spec_3_3():
    assert R.bigram_hash89([50256, 1000, 50256, 198]).tolist() == [754559, 573883, 187911, 514417]
    assert R.bigram_hash89(torch.tensor([50256, 1000, 50256, 198], dtype=torch.int32)).dtype == np.int32


def test_bigram_hash_position_one_uses_the_wrapped_reserved_row():
    M = R.BIGRAM_ROWS89 - 1
    assert int(R._wrap32(np.array([27191 * M]))[0]) == -957_622_711
    x = [17, 1000, 5, 6]
    h = R.bigram_hash89(x)
    assert h[0] == M
    assert h[1] == ((36313 * 1000) ^ -957_622_711) % M != ((36313 * 1000) ^ (27191 * 17)) % M
    assert h[2] == ((36313 * 5) ^ (27191 * 1000)) % M and h[3] == ((36313 * 6) ^ (27191 * 5)) % M
    rng = np.random.default_rng(0)
    t = rng.integers(0, 50304, 5000)
    hh = R.bigram_hash89(t)
    assert hh.min() >= 0 and hh[1:].max() < M  # M only at position 0
    # tiny preset's table
    assert R.bigram_hash89(t, 2 * 50304).max() <= 2 * 50304 - 1


def test_sign_index_of_spec_3_4():
    x = [50256, 1000, 50256, 198, 8192 + 3, 3]
    s = R.sign_index89(x)
    assert s.tolist() == [0, (50256 ^ 1000) % 8192, (1000 ^ 50256) % 8192, (50256 ^ 198) % 8192,
                          (198 ^ 8195) % 8192, (8195 ^ 3) % 8192]
    assert s[5] == 8192 % 8192 == 0


# ----------------------------------------------------------------------------------------------------
# spec 6: schedule
# ----------------------------------------------------------------------------------------------------
def test_stage_ends_untie_cooldown_and_warmup_list():
    assert R.stage_ends89(1380, 10) == [0, 460, 920, 1380, 1390]
    assert R.warmup_steps89(1380, 10) == [0, 1, 458, 459, 460, 461, 918, 919, 920, 921, 1378, 1379, 1380, 1381]
    d = R.schedule89(0)
    assert d["untie_step"] == 921 and d["cooldown_start"] == 552
    # tokens: 460*131072 + 460*262144 + 470*393216
    assert sum(R.schedule89(s)["batch"] for s in range(1390)) == 365_690_880
    # Adam: odd steps, 695 updates, the last at 1389
    adam = [s for s in range(1390) if R.schedule89(s)["adam"]]
    assert len(adam) == 695 and adam[-1] == 1389 and R.schedule89(1389)["adam_t"] == 695


def test_schedule_for_a_general_N_E():
    ends = R.stage_ends89(1000, 40)
    assert ends == [0, round(1000 / 3), round(2000 / 3), 1000, 1040] == [0, 333, 667, 1000, 1040]
    assert R.warmup_steps89(1000, 40) == [0, 1, 331, 332, 333, 334, 665, 666, 667, 668, 998, 999, 1000, 1001]
    d = R.schedule89(667, 1000, 40)
    assert d["stage"] == 2 and d["untie_step"] == 667 and d["tied"]
    assert not R.schedule89(668, 1000, 40)["tied"]
    assert R.schedule89(1039, 1000, 40)["s"] == 0.15 and R.schedule89(1039, 1000, 40)["stage"] == 3
    assert R.schedule89(1000, 1000, 40)["mu"] == pytest.approx(0.95 - 0.1 * 10 / 50)
    assert R.schedule89(10, 1000, 40, seq_lens=(512, 1024, 1024, 1024))["doc_cut"] == 512


def _tol(txt: str) -> float:
    dec = len(txt.split(".")[1]) if "." in txt else 0
    return 0.5 * 10 ** (-dec) + 1e-15


# step, stage, batch, cut, windows (tokens), s, mu, mtp, scale, adam
TABLE_6_2 = [
    (0, 0, 131072, 896, (128, 384), "1.0", "0.85", ["1", "0.5", "0.25"], "0.1", False),
    (1, 0, 131072, 896, (128, 384), "1.0", "0.850333", ["1", "0.5", "0.249457"], "0.1", True),
    (2, 0, 131072, 896, (128, 384), "1.0", "0.850667", ["1", "0.5", "0.248913"], "0.1", False),
    (299, 0, 131072, 896, (128, 384), "1.0", "0.949667", ["1", "0.5", "0.0875"], "0.1", True),
    (300, 0, 131072, 896, (128, 384), "1.0", "0.95", ["1", "0.5", "0.086957"], "0.1", False),
    (458, 0, 131072, 896, (128, 384), "1.0", "0.95", ["1", "0.5", "0.001087"], "0.1", False),
    (459, 0, 131072, 896, (128, 384), "1.0", "0.95", ["1", "0.5", "0.000543"], "0.1", True),
    (460, 1, 262144, 2048, (384, 896), "1.52", "0.95", ["1", "0.5"], "0.1169459572", False),
    (461, 1, 262144, 2048, (384, 896), "1.52", "0.95", ["1", "0.498913"], "0.11695", True),
    (551, 1, 262144, 2048, (384, 896), "1.52", "0.95", ["1", "0.401087"], "0.11695", True),
    (552, 1, 262144, 2048, (384, 896), "1.52", "0.95", ["1", "0.4"], "0.11695", False),
    (553, 1, 262144, 2048, (384, 896), "1.518345", "0.95", ["1", "0.398913"], "0.11695", True),
    (918, 1, 262144, 2048, (384, 896), "0.914420", "0.95", ["1", "0.002174"], "0.11695", False),
    (919, 1, 262144, 2048, (384, 896), "0.912766", "0.95", ["1", "0.001087"], "0.11695", True),
    (920, 2, 393216, 2048, (640, 1408), "1.027778", "0.95", ["1"], "0.1275175238", False),
    (921, 2, 393216, 2048, (640, 1408), "1.025870", "0.95", ["1"], "0.12752", True),
    (922, 2, 393216, 2048, (640, 1408), "1.023961", "0.95", ["1"], "0.12752", False),
    (1340, 2, 393216, 2048, (640, 1408), "0.226329", "0.95", ["1"], "0.12752", False),
    (1341, 2, 393216, 2048, (640, 1408), "0.224420", "0.948", ["1"], "0.12752", True),
    (1378, 2, 393216, 2048, (640, 1408), "0.153816", "0.874", ["1"], "0.12752", False),
    (1379, 2, 393216, 2048, (640, 1408), "0.151908", "0.872", ["1"], "0.12752", True),
    (1380, 3, 393216, 2048, (768, 1664), "0.15", "0.87", ["1"], "0.1317779884", False),
    (1381, 3, 393216, 2048, (768, 1664), "0.15", "0.868", ["1"], "0.13178", True),
    (1382, 3, 393216, 2048, (768, 1664), "0.15", "0.866", ["1"], "0.13178", False),
    (1383, 3, 393216, 2048, (768, 1664), "0.15", "0.864", ["1"], "0.13178", True),
    (1384, 3, 393216, 2048, (768, 1664), "0.15", "0.862", ["1"], "0.13178", False),
    (1385, 3, 393216, 2048, (768, 1664), "0.15", "0.86", ["1"], "0.13178", True),
    (1386, 3, 393216, 2048, (768, 1664), "0.15", "0.858", ["1"], "0.13178", False),
    (1387, 3, 393216, 2048, (768, 1664), "0.15", "0.856", ["1"], "0.13178", True),
    (1388, 3, 393216, 2048, (768, 1664), "0.15", "0.854", ["1"], "0.13178", False),
    (1389, 3, 393216, 2048, (768, 1664), "0.15", "0.852", ["1"], "0.13178", True),
]


@pytest.mark.parametrize("row", TABLE_6_2, ids=[str(r[0]) for r in TABLE_6_2])
def test_sample_table_6_2(row):
    step, stage, batch, cut, wtok, s, mu, mtp, scale, adam = row
    d = R.schedule89(step, 1380, 10)
    assert d["stage"] == stage and d["batch"] == batch and d["per_rank_tokens"] == batch // 8
    assert d["doc_cut"] == cut and d["window_tokens"] == wtok
    assert abs(d["s"] - float(s)) <= _tol(s)
    assert abs(d["mu"] - float(mu)) <= _tol(mu)
    assert len(d["mtp"]) == len(mtp) and all(abs(a - float(b)) <= _tol(b) for a, b in zip(d["mtp"], mtp))
    assert abs(d["attn_scale"] - float(scale)) <= _tol(scale)
    assert d["adam"] == adam
    assert d["tied"] == (step <= 921)
    assert d["bootstrap_down"] == (step < 16)
    assert not d["final_val"]


def test_final_validation_step():
    d = R.schedule89(1390, 1380, 10)
    assert d["final_val"] and d["window_tokens"] == (768, 2560)
    assert abs(d["attn_scale"] - 0.1317779884) < 5e-11  # no YaRN for 2560


def test_yarn_scales_and_frequency_multipliers():
    f0, s0 = R.yarn89([384])
    assert s0 == 0.1 and torch.equal(f0, R.rope_freqs89(128))
    assert f0[:64:2].tolist() == pytest.approx([(1 / 1024) ** (i / 31) for i in range(32)], rel=1e-15)
    assert (f0[64:] == 0).all() and torch.equal(f0[0::2][:32], f0[1::2][:32])
    for ws, sc in [([384, 896], 0.1169459572), ([384, 896, 1408], 0.1275175238),
                   ([384, 896, 1408, 1664], 0.1317779884)]:
        assert abs(R.yarn89(ws)[1] - sc) < 5e-11
    f1, _ = R.yarn89([384, 896])
    mult = (f1 / f0)[:64:2]
    # record70_spec 4.5 table (fp32 replay; 4 decimals)
    exp = [1, 1, 1, 0.9862, 0.8707, 0.7785, 0.7047, 0.6456, 0.5985, 0.5607, 0.5306, 0.5064, 0.4871, 0.4717,
           0.4594, 0.4495, 0.4416, 0.4353, 0.4303]
    assert mult[:19].tolist() == pytest.approx(exp, abs=6e-5)
    assert mult[19:].tolist() == pytest.approx([3 / 7] * 13, rel=1e-12)
    f3, _ = R.yarn89([384, 896, 1408, 1664])
    assert (f3 / f0)[:64:2][19:].tolist() == pytest.approx([3 / 13] * 13, rel=1e-12)
    assert (f3[64:] == 0).all()


def test_rope_is_a_relative_rotation_with_interleaved_pairs():
    torch.manual_seed(0)
    f = R.yarn89([384, 896])[0]
    q, k = torch.randn(128, dtype=torch.float64), torch.randn(128, dtype=torch.float64)
    a = R.rope89(q, torch.tensor(37.0), f) @ R.rope89(k, torch.tensor(30.0), f)
    b = R.rope89(q, torch.tensor(1007.0), f) @ R.rope89(k, torch.tensor(1000.0), f)
    assert a.item() == pytest.approx(b.item(), rel=1e-9)
    r = R.rope89(q, torch.tensor(3.0), f)
    assert torch.equal(r[64:], q[64:])  # stationary half
    th = 3.0 * f[0]
    assert r[0].item() == pytest.approx((q[0] * th.cos() + q[1] * th.sin()).item())
    assert r[1].item() == pytest.approx((q[1] * th.cos() - q[0] * th.sin()).item())


# ----------------------------------------------------------------------------------------------------
# spec 4.5 / 4.6 values
# ----------------------------------------------------------------------------------------------------
def test_mudd_bias_init_and_effective_values_of_4_6():
    b = R.mudd_b2_init89()
    assert b.dtype == torch.bfloat16 and b.shape == (2, 14)
    assert b[0].float().tolist() == [0, 0, 0, 0, 0, 0, 20, 20, 10.5, 10, 0, 0.5, 10.5, 10]
    assert b[1].float().tolist() == [0, -5] + [0] * 12
    eff = (b.float() * 0.1).bfloat16().float()  # bf16(b2 * 0.1) while W2 = 0
    assert eff[0].tolist() == [0, 0, 0, 0, 0, 0, 2.0, 2.0, 1.046875, 1.0, 0, 0.050048828125, 1.046875, 1.0]
    assert eff[1, :5].tolist() == [0, -0.5, 0, 0, 0]


def test_lambda_bf16_values():
    assert torch.tensor(1.1 ** 0.5).bfloat16().item() == 1.046875
    assert (0.05 * torch.ones(1)).bfloat16().item() == pytest.approx(0.050048828, abs=1e-9)
    assert (0.05 * torch.ones(1)).bfloat16().item() == 0.050048828125


def test_config_roles():
    c, t = R.cfg89(), R.cfg_tiny()
    assert c.xsa_layers == [1, 3, 4, 7, 8, 10] and t.xsa_layers == [1, 3, 4]
    assert c.long_layers == {3, 10} and t.long_layers == {1, 4}
    assert c.ve_layers == [1, 2, 8, 9, 10] and t.ve_layers == [0, 3, 4]
    assert c.n_attn == 10 and [c.attn_index(i) for i in (7, 10)] == [6, 9]
    assert c.bigram_rows == 754_560 and t.bigram_rows == 100_608


# ----------------------------------------------------------------------------------------------------
# forward at init (tiny cfg)
# ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    cfg = R.cfg_tiny()
    params, sign = R.random_init_params89(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, 50257, (128,), generator=g)
    toks[0] = 50256
    toks[50] = 50256
    toks[51] = 50256  # a one-token document
    toks[90] = 50256
    return cfg, params, sign, toks


def test_forward_at_init_is_finite_and_mudd_is_at_its_bias(tiny):
    cfg, p, s, toks = tiny
    h, aux = R.forward89(p, s, toks, (1, 3), cfg, yarn=R.yarn89([384, 896], head_dim=cfg.head_dim), return_aux=True)
    assert h.shape == (128, cfg.model_dim) and h.dtype == torch.float64 and torch.isfinite(h).all()
    rms = h.square().mean(-1).sqrt()
    assert torch.allclose(rms, torch.ones_like(rms), atol=1e-6)
    eff0 = (R.mudd_b2_init89().double() * 0.1)[0]
    for k, m in enumerate(aux["mu"]):
        assert m.shape == (128, 1) and torch.all(m == eff0[k])
    assert float(aux["mu"][8][0]) == pytest.approx(1.05) and float(aux["mu"][6][0]) == pytest.approx(2.0)
    # MUDD block 1 at init: x - 0.5 cache[attn_input_layer]
    ai = cfg.attn_input_layer
    assert torch.allclose(aux["post_mudd1"], aux["pre_mudd1"] - 0.5 * aux["cache"][ai], rtol=0, atol=1e-12)
    losses = R.loss89(p, s, toks, toks.roll(-1), (1, 3), cfg, [1.0, 0.5, 0.25])
    assert losses.shape == (128,) and torch.isfinite(losses).all()
    # at init the logits are ~0, z ~ 23 sigmoid(5/7.5): CE ~ ln V per unit weight
    assert abs(float(losses[:126].mean()) / 1.75 - math.log(50304)) < 0.05


def test_xsa_is_a_noop_at_init_and_only_on_unpaired_attention_layers(tiny):
    cfg, p, s, toks = tiny
    h = R.forward89(p, s, toks, (1, 3), cfg)
    assert torch.equal(h, R.forward89(p, s, toks, (1, 3), cfg, use_xsa=False))
    q = dict(p)
    a = torch.zeros_like(p["xsa_alphas"])
    a[0] = 0.7  # paired layer
    a[2] = 0.7  # attention-less layer
    q["xsa_alphas"] = a
    assert torch.equal(h, R.forward89(q, s, toks, (1, 3), cfg))
    for layer in cfg.xsa_layers:
        a = torch.zeros_like(p["xsa_alphas"])
        a[layer] = 0.7
        q["xsa_alphas"] = a
        assert not torch.allclose(h, R.forward89(q, s, toks, (1, 3), cfg), atol=1e-6), layer


def test_bigram_is_injected_in_place_so_x0_carries_it(tiny):
    cfg, p, s, toks = tiny
    q = dict(p)
    g = torch.Generator().manual_seed(5)
    q["bigram_embed.weight"] = torch.randn(cfg.bigram_rows, cfg.bigram_dim, generator=g).bfloat16()
    _, aux = R.forward89(q, s, toks, (1, 3), cfg, return_aux=True)
    e = q["embed.weight"][toks].double()  # smear lambda = 0 at init
    base = torch.nn.functional.rms_norm(e, (cfg.model_dim,), eps=R.RMS_EPS)
    idx = torch.as_tensor(R.bigram_hash89(toks, cfg.bigram_rows), dtype=torch.int64)
    sidx = torch.as_tensor(R.sign_index89(toks), dtype=torch.int64)
    b = q["bigram_embed.weight"][idx].double() * s[sidx].double()
    x0 = aux["x0"]
    assert torch.allclose(x0[:, :cfg.bigram_dim], base[:, :cfg.bigram_dim] + 0.050048828125 * b, atol=1e-12)
    assert torch.equal(x0[:, cfg.bigram_dim:], base[:, cfg.bigram_dim:])
    assert aux["cache"][0] is x0


def test_forward_is_causal(tiny):
    cfg, p, s, toks = tiny
    q = dict(p)
    g = torch.Generator().manual_seed(7)
    for name in ("mlp_bank", "mudd_w2", "attn_gate_bank", "ve_gate_bank", "smear_gate.weight", "skip_gate.weight"):
        q[name] = (0.05 * torch.randn(p[name].shape, generator=g)).to(p[name].dtype)
    q["xsa_alphas"] = torch.randn(p["xsa_alphas"].shape, generator=g)
    h1 = R.forward89(q, s, toks, (1, 3), cfg)
    t2 = toks.clone()
    t2[70:] = torch.randint(0, 50257, (58,), generator=g)
    h2 = R.forward89(q, s, t2, (1, 3), cfg)
    assert torch.allclose(h1[:70], h2[:70], atol=1e-12) and not torch.allclose(h1[70:], h2[70:])


def test_dense_attention_window_and_documents():
    S = 12
    doc = torch.tensor([1] * 5 + [2] * 7)
    v = torch.eye(S, dtype=torch.float64)[:, None, :]  # value of key j = e_j
    q = torch.zeros(S, 1, S, dtype=torch.float64)
    y = R._dense_attention(q, q.clone(), v, doc, window=2, scale=1.0)[:, 0]
    for i in range(S):
        vis = [j for j in range(S) if i - 2 <= j <= i and doc[j] == doc[i]]
        assert y[i].nonzero().flatten().tolist() == vis
        assert torch.allclose(y[i, vis], torch.full((len(vis),), 1 / len(vis), dtype=torch.float64))


def test_mtp_loss_leaves_out_terms_past_the_end():
    g = torch.Generator().manual_seed(3)
    T, V = 6, 9
    logits = torch.randn(T, V, generator=g, dtype=torch.float64) * 4
    y = torch.randint(0, V, (T,), generator=g)
    w = [1.0, 0.5, 0.25]
    out = R.mtp_loss89(logits, y, w)
    z = 23 * torch.sigmoid((logits + 5) / 7.5)
    for p in range(T):
        exp = sum(w[k] * (torch.logsumexp(z[p], 0) - z[p, y[p + k]]) for k in range(3) if p + k < T)
        assert out[p].item() == pytest.approx(float(exp), rel=1e-12)
    assert R.mtp_loss89(logits, y, w + [0.0]).tolist() == out.tolist()
    ce = torch.nn.functional.cross_entropy(z, y)
    assert R.eval_ce89(logits, y).item() == pytest.approx(ce.item(), rel=1e-12)


def test_paired_layer_matches_the_stream_description_of_record70_spec_4_4():
    """Paired layer written per head from the spec's words (H = 6 so the RoPE quirk of heads 1 and 4 shows):
    head k of token t sits at stream position 2t + [k >= H/2] in FA head k mod H/2, is rotated at 2t + (k mod 2),
    causal + window in stream positions, documents doubled."""
    cfg = R.Cfg89(num_layers=2, model_dim=96, num_heads=6, head_dim=16, attn_pattern="SS", paired_layers="0",
                  value_embeds="--", skip="0:1", attn_input_layer=9, bigram_rows=64, bigram_dim=8, mudd_dim=4,
                  vocab_size=64)
    g = torch.Generator().manual_seed(11)
    H, D, d, T = 6, 16, 96, 20
    p = {"qk_bank": torch.randn(2 * H, 2 * D, d, generator=g) / 10, "vo_bank": torch.randn(4, d, d, generator=g) / 10,
         "scalars": torch.tensor([0.7, 1.3, 0.5, 1.0, 0.0, -1.5]), "xsa_alphas": torch.full((2, H), 0.9),
         "attn_gate_bank": torch.randn(2, H, 12, generator=g)}
    u = torch.randn(T, d, generator=g, dtype=torch.float64)
    aux_v = torch.randn(T, d, generator=g, dtype=torch.float64)
    doc = torch.tensor([1] * 7 + [2] * 13)
    freqs, scale, w = R.yarn89([384, 896], head_dim=D)[0], 0.12, 5
    got = R._attention(0, u, aux_v, p, cfg, doc, w, freqs, scale, True)

    lq, lo = float(p["scalars"][0]), float(p["scalars"][1])  # fp32 lambdas, used unrounded to bf16
    Wq = p["qk_bank"][:H // 2].double().reshape(H * D, d) * lq  # Q rows: blocks a*H + j, j < H/2
    Wk = p["qk_bank"][H // 2:H].double().reshape(H * D, d) * lq  # K rows: blocks a*H + H/2 + j
    Wv, Wo = p["vo_bank"][0].double() * lq, p["vo_bank"][1].double() * lo
    nrm = lambda z: z / z.square().mean(-1, keepdim=True).add(R.RMS_EPS).sqrt()
    q = nrm((u @ Wq.T).view(T, H, D))
    k = nrm((u @ Wk.T).view(T, H, D))
    v = (u @ Wv.T).view(T, H, D) + aux_v.view(T, H, D)
    for t in range(T):
        for h in range(H):
            q[t, h] = R.rope89(q[t, h], torch.tensor(2.0 * t + h % 2), freqs)
            k[t, h] = R.rope89(k[t, h], torch.tensor(2.0 * t + h % 2), freqs)
    y = torch.zeros(T, H, D, dtype=torch.float64)
    half = H // 2
    for t in range(T):
        for h in range(H):
            sq = 2 * t + (h >= half)
            keys = [(t2, h2) for t2 in range(T) for h2 in (h % half, h % half + half)
                    if doc[t2] == doc[t] and 0 <= sq - (2 * t2 + (h2 >= half)) <= w]
            sc = torch.stack([q[t, h] @ k[t2, h2] for t2, h2 in keys]) * scale
            a = torch.softmax(sc, 0)
            y[t, h] = sum(a[n] * v[t2, h2] for n, (t2, h2) in enumerate(keys))
    y = y * torch.sigmoid(u[:, :12] @ p["attn_gate_bank"][0].double().T)[..., None]  # no XSA on paired layers
    exp = y.reshape(T, d) @ Wo.T
    assert torch.allclose(got, exp, atol=1e-12, rtol=1e-10)


def test_full_size_roles_run_on_a_small_vocab():
    """#89's 11-layer roles and 6 heads (narrowed to d = 96, small vocab / bigram table, to stay fast): finite,
    caches 0/3/7/10, MUDD at its bias."""
    cfg = R.cfg89()
    cfg.model_dim, cfg.head_dim, cfg.vocab_size, cfg.bigram_rows, cfg.bigram_dim = 96, 16, 256, 512, 24
    p, s = R.random_init_params89(cfg, seed=2)
    assert p["qk_bank"].shape == (60, 32, 96) and p["vo_bank"].shape == (20, 96, 96)
    assert p["mlp_bank"].shape == (11, 2, 384, 96) and p["value_embeds"].shape == (5, 256, 96)
    assert p["ve_gate_bank"].shape == (5, 6, 12) and p["attn_gate_bank"].shape == (10, 6, 12)
    toks = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(3))
    h, aux = R.forward89(p, s, toks, (1, 3), cfg, doc_starts=[0, 30], return_aux=True,
                         yarn=R.yarn89([384, 896], head_dim=16))
    assert torch.isfinite(h).all() and h.shape == (64, 96)
    assert sorted(aux["cache"]) == [0, 3, 7, 10]
    assert torch.allclose(aux["post_mudd1"], aux["pre_mudd1"] - 0.5 * aux["cache"][7], rtol=0, atol=1e-12)
