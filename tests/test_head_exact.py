"""The recipe (upstream's current code, f411b3d) item by item against tests/reference_head.py, an independent
reference written from its spec without reading this port (float64 model, hashes, gate layout, DC attention,
prefix table, loss, schedule, optimizer table). Each test fails on record #89's file this port replaced (other
parameters, gates, schedule and loss): records/snapshots/2026-11-28_record89/ keeps that one with its own exactness tests."""

import math

import pytest
import torch

import reference_head as RH
import train_gpt as T
from conftest import config

R89 = RH.R89
pytestmark = pytest.mark.usefixtures("one_thread")


def small(**kw) -> T.Config:
    """The recipe's layers and heads (the reference's gate layout is upstream's, fixed to them) at the reference's
    small widths (cfg_small_head) and the tiny preset's schedule."""
    ref = RH.cfg_small_head()
    fields = dict(preset="tiny", num_layers=11, model_dim=ref.model_dim, num_heads=ref.num_heads,
                  head_dim=ref.head_dim, attn_pattern=ref.attn_pattern, paired_layers=ref.paired_layers,
                  value_embeds=ref.value_embeds, skip=ref.skip, attn_input_layer=ref.attn_input_layer,
                  xsa_layers="1,3,4,7", attn_gate_layers="3,10", bigram_rows=ref.bigram_rows,
                  mudd_dim=ref.mudd_dim, block_size=ref.block_size, **kw)
    return config(**fields)


def reference_config(cfg: T.Config) -> RH.CfgHead:
    return RH.CfgHead(model_dim=cfg.model_dim, head_dim=cfg.head_dim, bigram_rows=cfg.bigram_rows,
                      bigram_dim=cfg.model_dim, mudd_dim=cfg.mudd_dim, mudd_gate_dim=cfg.mudd_dim,
                      block_size=cfg.block_size, vocab_size=cfg.vocab_size)


def documents(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50257, (n,), generator=g)
    tokens[torch.tensor([0, 37, 38, 200, 301])] = T.BOS_ID  # a one-token document, documents longer than DC's window
    return tokens


def busy_model(cfg: T.Config, seed: int = 0) -> T.GPT:
    """The port's model in float64 with every parameter away from its init (zero gate weights, MUDD and the bigram
    table would hide their terms; DC's w2 starts at 0, which adds nothing)."""
    torch.manual_seed(seed)
    model = T.GPT(cfg, use_flex=False, fp8_head=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = {"value_embeds": 0.3, "bigram_embed.weight": 0.3, "mudd_w2": 1.0, "mudd_gate_w2": 1.0,
                     "mudd_gate_w1": 0.5}.get(name, 0.05)
            p.add_(scale * torch.randn_like(p))
    return model.double()


def exact_rope(model: T.GPT, freqs: torch.Tensor, scale: float) -> None:
    """The model's RoPE tables and attention scale from the reference's float64 YaRN frequencies."""
    for rotary in (model.rotary, model.rotary_paired):
        theta = torch.outer(torch.arange(rotary.cos.size(0), dtype=torch.float64), freqs)
        rotary.cos.copy_(theta.cos())
        rotary.sin.copy_(theta.sin())
        rotary.sin[:, 1::2] *= -1
    model.q_gain.fill_(scale / model.cfg.attn_scale)


# -- model --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_forward_and_gradients_equal_the_reference_in_every_stage(stage, monkeypatch):
    # In float64 both sides unrounded (the reference's bf16 points straight through and off; the lambdas, which both
    # read in bf16, stay rounded): the math, not bf16's steps, is compared. bf16's rounding points: test_gates_at_init.
    for module in (R89, RH):  # the references read their parameters detached; for their gradients, through
        monkeypatch.setattr(module, "_d", lambda t: t.to(torch.float64))
        monkeypatch.setattr(module, "_bf", lambda t: t + (t.to(torch.bfloat16).to(t.dtype) - t).detach())
    monkeypatch.setattr(RH, "_bfst", lambda t: t)
    cfg = small()
    model = busy_model(cfg, seed=stage)
    s = T.schedule(T.stage_starts(cfg)[stage], cfg)
    tokens = documents(384, seed=stage)
    model.tie_embedding(s.tied)
    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    if s.tied:  # the embedding reads the head until the untie
        params["embed.weight"] = params["lm_head.weight"]
    freqs, scale = R89.yarn89([cfg.block_size * w for w in s.yarn_windows], head_dim=cfg.head_dim)
    exact_rope(model, freqs, scale)
    ours = model.hidden(tokens, torch.tensor([s.long_window, s.short_window]))
    ref = RH.forward_head(params, model.bigram_sign_table.clone(), tokens, (s.short_window, s.long_window),
                          reference_config(cfg), yarn=(freqs, scale), bf16_gates=False)
    assert ours.shape == ref.shape == (384, cfg.model_dim)
    assert (ours - ref).abs().max() < 2e-5 * ref.abs().max()
    probe = torch.randn_like(ref)
    (ours * probe).sum().backward()
    (ref * probe).sum().backward()
    for name, p in model.named_parameters():
        if name == "embed.weight" and s.tied:  # read through the head: its gradient is the head's
            continue
        theirs = params[name].grad
        if theirs is None:  # the head while untied: not read by the hidden state
            assert name == "lm_head.weight" and not s.tied and not p.grad.any()
            continue
        tolerance = 4e-3 if name.endswith("lambdas") else 1e-4  # read as bf16: bf16 gradients, as upstream's
        assert (p.grad - theirs).abs().max() <= tolerance * theirs.abs().max() + 1e-12, name


def test_gate_layout_is_upstreams_slot_for_slot():
    slots = T.gate_slots(T.Config(), T.layer_plans(T.Config()), T.skip_layers(T.Config())[0] + 1)
    assert slots.sizes == (RH.PRE_N, RH.POST_N)
    tables = {"xsa": slots.xsa, "attn_gate": slots.attn_gate}
    for block, ref in enumerate((RH.PRE_SLICES, RH.POST_SLICES)):
        for (kind, layer), where in ref.items():
            if kind in tables:
                assert tables[kind][layer] == (block, where.start) and where.stop - where.start == 6, (kind, layer)
            elif kind in ("x0", "bigram"):
                assert slots.inject[layer] == (block, where.start - (kind == "bigram")), (kind, layer)
            elif kind == "skip":
                assert block == 1 and slots.skip == where.start
            else:  # DC's w1 then w2
                assert block == 1 and where.start == slots.dc + 6 * (kind == "dc_w2"), kind
    # every slot named once: the reference's tables cover the blocks, nothing else is read
    assert sum(len(t) for t in tables.values()) == 6 and len(slots.inject) == 9


def test_gates_at_init_are_upstreams_bf16_values():
    cfg = T.Config()
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in T.GPT(cfg, use_flex=False, fp8_head=False).named_parameters()}
    assert len(shapes) == 19 and set(shapes) == {RH._DICT_KEY.get(n, n) for n in RH.PARAM_NAMES_HEAD}
    model = T.GPT(small(), use_flex=False, fp8_head=False)
    assert torch.equal(model.mudd_gate_b2[:, :41], RH.mudd_gate_bias_init()[:, :41].to(model.mudd_gate_b2.dtype))
    x = torch.randn(1, 5, model.cfg.model_dim).bfloat16()
    for block, n in enumerate((RH.PRE_N, RH.POST_N)):
        ours = model.gates(x, block)[0]  # bf16, the shared scale read in bf16: the spec's effective values
        assert torch.equal(ours.double(), RH.mudd_gate_bias_effective()[block, :n].expand_as(ours)), block
    assert sorted({v for v in RH.mudd_gate_bias_effective().flatten().tolist()}) == [0.0, 0.050048828125, 0.25,
                                                                                     0.5, 1.0]
    # the skip's weight at init: sigmoid(-1.5) x the gate's 0.5, half #89's
    assert torch.sigmoid(model.scalars[2 * model.cfg.num_layers + 1]).item() * 0.5 == pytest.approx(0.0912, abs=1e-4)


def test_bigram_and_sign_indices_are_the_references():
    tokens = documents(4096, seed=1).int()
    for rows in (T.Config.bigram_rows, T.parse_config(["--preset=tiny"]).bigram_rows):
        assert T.bigram_index(tokens, rows).tolist() == RH.bigram_hash_head(tokens, rows).tolist()
    assert T.sign_index(tokens, 8192).tolist() == RH.sign_index(tokens, 8192).tolist()
    assert T.Config.bigram_rows == 377_280
    assert T.bigram_index(torch.tensor([50256, 1000, 50256, 198]), 377_280).tolist() == [377279, 39179, 190342,
                                                                                         138941]


def test_dc_attention_equals_the_reference_and_its_gradients():
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 0, 37, 200, 256, 256])  # a zero-length document, one longer than the window, padding
    Tn, H, D = 256, 6, 16
    q, k, v, base = (torch.randn(Tn, H, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(4))
    w1, w2 = (torch.randn(Tn, H, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    ours = T.dc_attention(base, q[None], k[None], v[None], w1[None], w2[None], cu, 0.13)
    ref = RH.dc_dense_head(base, q, k, v, w1, w2, cu, 0.13)
    assert (ours - ref).abs().max() <= 1e-12 * ref.abs().max()
    probe = torch.randn(Tn, H, D, generator=g, dtype=torch.float64)
    grads = [torch.autograd.grad((out * probe).sum(), (base, q, k, v, w1, w2)) for out in (ours, ref)]
    for name, a, b in zip(("base", "q", "k", "v", "w1", "w2"), *grads):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max(), name
    # w2 = 0: the base, bit for bit (bf16 too)
    zero = T.dc_attention(base.bfloat16(), q[None].bfloat16(), k[None].bfloat16(), v[None].bfloat16(),
                          w1[None].bfloat16(), torch.zeros(1, Tn, H, dtype=torch.bfloat16), cu, 0.13)
    assert torch.equal(zero, base.bfloat16())


# -- prefix-token loss -----------------------------------------------------------------------------------------

def test_prefix_table_is_the_references():
    cfg = T.Config()
    ours = T.prefix_table(T.read_vocabulary(cfg), cfg.vocab_size)
    assert ours.dtype == torch.int64 and torch.equal(ours, RH.build_prefix_table_head(cfg.vocab_size))
    assert (ours == -1).sum() == 256 + 48 and (ours[50256:] == -1).all()


def test_loss_and_its_gradient_are_the_kernels_with_the_prefix_term():
    g = torch.Generator().manual_seed(0)
    T_, V = 24, 512
    logits = (torch.randn(T_, V, generator=g) * 6).bfloat16()
    targets = torch.randint(0, V, (T_,), generator=g)
    prefix = torch.randint(0, V, (T_,), generator=g)
    prefix[::3] = -1  # no prefix token
    prefix[1] = targets[1]  # the prefix column is an MTP target's too
    weights, prefix_weight = torch.tensor([1.0, 0.5, 0.25]), torch.tensor([0.25])
    x = logits.float().requires_grad_()
    losses = T.SoftcappedMTPLoss.apply(x.bfloat16(), targets, weights, prefix, prefix_weight, 23.0, 5.0, 7.5)
    losses.sum().backward()
    ref_losses = RH.mtp_prefix_loss_head(logits, targets, weights, prefix, 0.25, bf16_sigma=True)
    ref_grad = RH.mtp_prefix_grad_head(logits, targets, weights, prefix, 0.25, bf16_sigma=True)
    assert torch.allclose(losses.double(), ref_losses, rtol=1e-6, atol=1e-5)
    assert ((x.grad.double() - ref_grad).abs() <= 2**-8 * ref_grad.abs() + 1e-9).all()  # a bf16 gradient
    # weight 0 (stage 2 on) or no prefix token (the warmup's table): #89's loss and gradient, bit for bit
    plain = logits.float().requires_grad_()
    T.SoftcappedMTPLoss.apply(plain.bfloat16(), targets, weights, torch.full_like(prefix, -1), prefix_weight, 23.0,
                              5.0, 7.5).sum().backward()
    zero = logits.float().requires_grad_()
    T.SoftcappedMTPLoss.apply(zero.bfloat16(), targets, weights, prefix, torch.zeros(1), 23.0, 5.0,
                              7.5).sum().backward()
    assert torch.equal(plain.grad, zero.grad)
    plain_ref = RH.mtp_prefix_grad_head(logits, targets, weights, None, 0.0, bf16_sigma=True)
    assert ((plain.grad.double() - plain_ref).abs() <= 2**-8 * plain_ref.abs() + 1e-9).all()


def test_the_model_trains_on_the_next_tokens_prefix():
    cfg = T.parse_config(["--preset=tiny"])
    torch.manual_seed(0)
    model = T.GPT(cfg, use_flex=False, fp8_head=False)
    tokens = documents(400, seed=2)[:257]
    windows, mtp = torch.tensor([2, 1]), torch.tensor([1.0, 0.5, 0.25])
    without = model(tokens[:-1], tokens[1:], windows, mtp, torch.tensor([0.25]))  # the table still -1: warmup's
    model.prefix_table.copy_(T.prefix_table(T.read_vocabulary(cfg), cfg.vocab_size))
    with_prefix = model(tokens[:-1], tokens[1:], windows, mtp, torch.tensor([0.25]))
    assert with_prefix > without
    assert model(tokens[:-1], tokens[1:], windows, mtp, torch.tensor([0.0])) == without


# -- schedule and optimizer ---------------------------------------------------------------------------------

def test_schedule_is_upstreams_at_every_step():
    cfg = T.Config()
    assert T.stage_starts(cfg) == RH.stage_ends_head() == [0, 423, 847, 1270, 1285]
    for step in range(cfg.num_steps + 1):
        ours, ref = T.schedule(step, cfg), RH.schedule_head(step)
        assert ours.lr_mult == pytest.approx(ref["s"], rel=1e-12), step
        assert ours.muon_momentum == pytest.approx(ref["mu"], rel=1e-12), step
        assert (ours.short_window, ours.long_window) == tuple(ref["windows"]), step
        assert ours.seq_len * cfg.global_batch_seqs == ref["batch"] and ours.max_doc_len == ref["doc_cut"], step
        assert [w for w in ours.mtp_weights if w] == pytest.approx([w for w in ref["mtp"] if w], rel=1e-12), step
        assert ours.prefix_weight == ref["prefix_weight"], step  # the same double, so the same fp32 on the device
        assert ours.adam_step == ref["adam"] and ours.tied == ref["tied"], step
    untie = next(k for k in range(cfg.num_steps) if not T.schedule(k + 1, cfg).tied)
    assert untie == 847 and T.validates_at(cfg, 1285) and T.schedule(1235, cfg).muon_momentum == 0.95


def test_optimizer_table_is_upstreams_for_every_label():
    cfg = T.Config()
    with torch.device("meta"):
        model = T.GPT(cfg, use_flex=False, fp8_head=False)
    table = RH.param_table_head()
    seen = set()
    for g in T.build_param_groups(model, cfg):
        for k, (name, p) in enumerate(zip(g.names, g.params)):
            label = name.removesuffix(".weight")
            ref = table[label]
            seen.add(label)
            assert g.kind == {"adam": "adam", "normuon": "muon"}[ref["opt"]], label
            if g.kind == "adam":
                assert g.lr == pytest.approx(RH.O89.effective_lr89(label) if label in RH.O89.param_table89()
                                             else ref["lr"]), label
                assert g.betas == tuple(ref["betas"]), label
                assert g.wd == pytest.approx(ref["weight_decay"] * ref["wd_mul"]), label
            else:
                shape_mul = math.sqrt(max(1.0, p.shape[-2] / p.shape[-1]))
                for index, mul in enumerate(g.lr_muls[k]):
                    assert g.lr * mul * shape_mul == pytest.approx(RH.O89.effective_lr89(label, index=index))
    assert seen == set(table)
    names = [n.removesuffix(".weight") for n in T.SCATTER_ORDER]
    assert names == RH.SCATTER_ORDER_HEAD
    assert [n.removesuffix(".weight") for n in T.WORK_ORDER] == RH.WORK_ORDER_HEAD
