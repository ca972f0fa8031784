"""Record #89's math, item by item, against independent references written from its spec without reading this
port: tests/reference89.py (model, hashes, schedule; float64) and tests/reference89_optim.py (optimizer table,
NorMuon, loss kernel). Each test fails on the #70 file this port replaced (other parameters, schedule and loss)."""

import math

import pytest
import torch

import reference89 as R
import reference89_optim as RO
import train_gpt as T
from conftest import orthogonalizing


@pytest.fixture(autouse=True)
def _one_thread(_cpu_threads):
    """Small float64 matmuls run far faster on one thread of the shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(**kw) -> T.Config:
    return T.parse_config(["--preset=tiny", *(f"--{k}={v}" for k, v in kw.items())])


def reference_config(cfg: T.Config) -> R.Cfg89:
    return R.Cfg89(num_layers=cfg.num_layers, model_dim=cfg.model_dim, num_heads=cfg.num_heads,
                   head_dim=cfg.head_dim, attn_pattern=cfg.attn_pattern, paired_layers=cfg.paired_layers,
                   value_embeds=cfg.value_embeds, skip=cfg.skip, attn_input_layer=cfg.attn_input_layer,
                   bigram_rows=cfg.bigram_rows, bigram_dim=cfg.bigram_dim, bigram_sign_rows=cfg.bigram_sign_rows,
                   mudd_dim=cfg.mudd_dim, block_size=cfg.block_size, vocab_size=cfg.vocab_size)


def documents(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50257, (n,), generator=g)
    tokens[torch.tensor([0, 37, 38, 200, 301])] = T.BOS_ID  # a one-token document, documents across blocks
    return tokens


def busy_model(cfg: T.Config, seed: int = 0) -> T.GPT:
    """The port's model in float64 with every parameter away from its init (zero gates, MUDD, XSA and the bigram
    table would hide their terms), RoPE tables in fp32 precision rather than bf16 (the reference's are exact)."""
    torch.manual_seed(seed)
    model = T.GPT(cfg, use_flex=False, fp8_head=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = {"value_embeds": 0.3, "bigram_embed.weight": 0.3, "mudd_w2": 1.0, "xsa_alphas": 0.8}.get(name, 0.05)
            p.add_(scale * torch.randn_like(p))
    return model.double()


def exact_rope(model: T.GPT, freqs: torch.Tensor, scale: float) -> None:
    """The model's RoPE tables and attention scale set from the reference's float64 YaRN frequencies (the port's
    own frequencies and bf16 tables: test_rope_tables_after_each_yarn_update_are_the_references_in_bf16)."""
    for rotary in (model.rotary, model.rotary_paired):
        theta = torch.outer(torch.arange(rotary.cos.size(0), dtype=torch.float64), freqs)
        rotary.cos.copy_(theta.cos())
        rotary.sin.copy_(theta.sin())
        rotary.sin[:, 1::2] *= -1
    model.q_gain.fill_(scale / model.cfg.attn_scale)


# -- model --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_forward_and_gradients_equal_the_reference_in_every_stage(stage, monkeypatch):
    # the reference reads its parameters detached; for its gradients, through (bf16 rounding: straight through)
    monkeypatch.setattr(R, "_d", lambda t: t.to(torch.float64))
    monkeypatch.setattr(R, "_bf", lambda t: t + (t.to(torch.bfloat16).to(t.dtype) - t).detach())
    cfg = tiny()
    model = busy_model(cfg, seed=stage)
    s = T.schedule(T.stage_starts(cfg)[stage], cfg)
    tokens = documents(384, seed=stage)
    model.tie_embedding(s.tied)
    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    if s.tied:  # the embedding reads the head until the untie
        params["embed.weight"] = params["lm_head.weight"]
    freqs, scale = R.yarn89([cfg.block_size * w for w in s.yarn_windows], head_dim=cfg.head_dim)
    exact_rope(model, freqs, scale)
    ours = model.hidden(tokens, torch.tensor([s.long_window, s.short_window]))
    ref = R.forward89(params, model.bigram_sign_table.clone(), tokens, (s.short_window, s.long_window),
                      reference_config(cfg), yarn=(freqs, scale))
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
        # the lambdas #89 reads as bf16 get bf16 gradients (as in the record)
        tolerance = 4e-3 if name.endswith(("lambdas", "xsa_alphas")) else 1e-4
        assert (p.grad - theirs).abs().max() <= tolerance * theirs.abs().max() + 1e-12, name


def test_bigram_and_sign_indices_are_the_references():
    tokens = documents(4096, seed=1).int()
    for rows in (T.Config.bigram_rows, tiny().bigram_rows):
        assert T.bigram_index(tokens, rows).tolist() == R.bigram_hash89(tokens, rows).tolist()
    assert T.sign_index(tokens, 8192).tolist() == R.sign_index89(tokens, 8192).tolist()
    assert T.bigram_index(torch.tensor([50256, 1000, 50256, 198]), 754560).tolist() == [754559, 573883, 187911,
                                                                                         514417]


def test_initial_values_follow_the_spec():
    cfg = T.Config()
    with torch.device("meta"):
        shapes = {n: (tuple(p.shape), p.dtype) for n, p in T.GPT(cfg, use_flex=False, fp8_head=False)
                  .named_parameters()}
    assert shapes["qk_bank"] == ((60, 256, 768), torch.bfloat16) and shapes["vo_bank"][0] == (20, 768, 768)
    assert shapes["mlp_bank"][0] == (11, 2, 3072, 768) and shapes["bigram_embed.weight"] == ((754560, 192),
                                                                                             torch.bfloat16)
    assert shapes["value_embeds"][0] == (5, 50304, 768) and shapes["ve_gate_bank"][0] == (5, 6, 12)
    assert shapes["scalars"][0] == (24,) and shapes["xsa_alphas"][0] == (11, 6)
    small = tiny()
    torch.manual_seed(0)
    model = T.GPT(small, use_flex=False, fp8_head=False)
    L = small.num_layers
    assert torch.equal(model.mudd_b2, R.mudd_b2_init89())
    assert model.scalars.tolist() == [0.5, 1.0] * L + [0.0, -1.5]
    assert torch.equal(model.resid_lambdas, torch.full((L, 2), 1.1**0.5))
    assert torch.equal(model.bigram_lambdas, torch.full((L,), 0.05)) and not model.x0_lambdas.any()
    assert not model.xsa_alphas.any() and not model.mlp_bank[:, 1].any() and not model.mudd_w2.any()
    assert set(model.bigram_sign_table.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(model.embed.weight, model.lm_head.weight)
    bound = math.sqrt(3) * 0.5 / math.sqrt(small.model_dim)
    for bank in (model.qk_bank, model.vo_bank, model.mlp_bank[:, 0]):
        assert bank.abs().max() <= bound * (1 + 2**-8) and bank.std() > 0.5 * bound / math.sqrt(3)
        assert bank.dtype == torch.bfloat16  # #89's: drawn in fp32, stored bf16 (the optimizer's mantissas start at 0)
    assert model.mudd_w1.abs().max() <= 1 / math.sqrt(small.model_dim)


# -- schedule -----------------------------------------------------------------------------------------------

def schedule_matches(cfg: T.Config, **reference_kw) -> None:
    N = cfg.num_steps - cfg.extension_steps
    per_rank = None
    for step in range(cfg.num_steps + 1):
        ours, ref = T.schedule(step, cfg), R.schedule89(step, N, cfg.extension_steps, **reference_kw)
        assert ours.lr_mult == pytest.approx(ref["s"], abs=1e-12), step
        assert ours.muon_momentum == pytest.approx(ref["mu"], abs=1e-12), step
        assert (ours.short_window, ours.long_window) == ref["windows"], step
        assert ours.max_doc_len == ref["doc_cut"], step
        assert ours.adam_step == ref["adam"] and ours.tied == ref["tied"], step
        weights = torch.tensor(ours.mtp_weights, dtype=torch.float32)
        assert torch.equal(weights[: len(ref["mtp"])], ref["mtp_fp32"]) and not weights[len(ref["mtp"]):].any(), step
        if step < cfg.num_steps:
            per_rank = ours.seq_len * cfg.global_batch_seqs
            assert per_rank == ref["batch"], step
        model_scale = 1.0
        for old, new in zip(ours.yarn_windows, ours.yarn_windows[1:]):
            model_scale *= 1 + 0.2 * math.log(new / old)
        assert cfg.attn_scale * model_scale == pytest.approx(ref["attn_scale"], rel=1e-12), step


def test_schedule_is_record_89s_at_every_step():
    schedule_matches(T.Config())


def test_tiny_schedule_is_record_89s_scaled_down():
    cfg = tiny()
    parse = T.parse_stages
    windows, lengths = parse("window_stages", cfg.window_stages), parse("seq_len_stages", cfg.seq_len_stages)
    schedule_matches(cfg, windows=[tuple(w) for w in windows],
                     batch_sizes=[n * cfg.global_batch_seqs for n in [*lengths, lengths[-1]]],
                     seq_lens=list(parse("doc_len_stages", cfg.doc_len_stages)) + [cfg.train_seq_len],
                     mom_warmup=cfg.muon_momentum_warmup_steps, mom_cooldown=cfg.muon_momentum_cooldown_steps,
                     final_long_window=parse("final_val_windows", cfg.final_val_windows)[0][1],
                     block_size=cfg.block_size, head_dim=cfg.head_dim)
    # #89's shape in 40 steps: three stages, the untie after the first Adam step of the third, an extension whose
    # windows grow (YaRN again), documents cut shorter in the first stage
    starts = T.stage_starts(cfg)
    s = [T.schedule(k, cfg) for k in range(cfg.num_steps + 1)]
    assert len(starts) == 5 and s[starts[3]].long_window > s[starts[3] - 1].long_window
    assert s[starts[0]].max_doc_len < s[starts[1]].max_doc_len
    assert [k for k in range(cfg.num_steps) if s[k].tied and not s[k + 1].tied] == [starts[2] | 1]


def test_rope_tables_after_each_yarn_update_are_the_references_in_bf16():
    cfg = tiny()
    torch.manual_seed(0)
    model = T.GPT(cfg, use_flex=False, fp8_head=False)
    for step in T.stage_starts(cfg)[:4]:
        windows = T.schedule(step, cfg).yarn_windows
        model.apply_yarn(windows)
        freqs, _ = R.yarn89([cfg.block_size * w for w in windows], head_dim=cfg.head_dim)
        theta = torch.outer(torch.arange(model.rotary.cos.size(0), dtype=torch.float64), freqs)
        # within half a bf16 ulp, plus what fp32 angles (as #89's) can be off by
        slack = theta.abs() * 2**-22 + 2**-40
        for ours, exact in ((model.rotary.cos, theta.cos()), (model.rotary.sin[:, ::2], theta.sin()[:, ::2])):
            assert ((ours.double() - exact).abs() <= exact.abs() * 2**-8 + slack[:, : exact.size(1)]).all()


# -- optimizer ----------------------------------------------------------------------------------------------

def test_optimizer_table_is_record_89s_for_every_label():
    cfg = T.Config()
    with torch.device("meta"):
        model = T.GPT(cfg, use_flex=False, fp8_head=False)
    table = RO.param_table89()
    seen = set()
    for g in T.build_param_groups(model, cfg):
        for k, (name, p) in enumerate(zip(g.names, g.params)):
            label = name.removesuffix(".weight")
            ref = table[label]
            seen.add(label)
            assert g.kind == {"adam": "adam", "normuon": "muon"}[ref["opt"]], label
            if g.kind == "adam":
                assert g.lr == pytest.approx(RO.effective_lr89(label)), label
                assert g.betas == tuple(ref["betas"]), label
                assert g.lr**2 * g.wd == pytest.approx(RO.decay_coeff89(label), abs=1e-15), label
            else:
                shape_mul = math.sqrt(max(1.0, p.shape[-2] / p.shape[-1]))
                for index, mul in enumerate(g.lr_muls[k]):
                    lr = g.lr * mul * shape_mul
                    assert lr == pytest.approx(RO.effective_lr89(label, index=index)), (label, index)
                    assert g.wd * g.lr * lr == pytest.approx(RO.decay_coeff89(label, index=index)), (label, index)
    assert seen == set(table) and cfg.normuon_beta2 == 0.9


@pytest.mark.parametrize("shape, axis", [((256, 768), -2), ((768, 768), -1), ((3072, 768), -1)],
                         ids=["qk-pair", "vo", "mlp"])
def test_normuon_step_is_the_references_per_block_axis(shape, axis, monkeypatch):
    g = torch.Generator().manual_seed(0)
    rows, cols = shape[0] // 8, shape[1] // 8  # the same aspect, smaller
    p16 = (torch.rand(2, rows, cols, generator=g) - 0.5).bfloat16()  # #89's storage: bf16, the mantissa in the state
    grads = [torch.randn(2, rows, cols, generator=g).bfloat16() for _ in range(3)]
    state = T.muon_state(p16)
    assert state["v"].shape[axis] == 1 and state["v"].shape[-1 - (axis == -1)] == (cols if axis == -2 else rows)
    ref = [(p16[j].clone(), torch.zeros(rows, cols, dtype=torch.int32), torch.zeros(rows, cols),
            torch.zeros(state["v"].shape[1:])) for j in range(2)]
    outputs = {}

    def orthogonalize(G):  # the reference's polar factor: the rest of the step is compared, not bf16 summation order
        outputs["O"] = torch.stack([polar(G[j]) for j in range(2)])
        return outputs["O"]

    # the reference step then takes the same factor (its input differs from ours in the last fp32 bit at most)
    polar, block = RO.polar_express89, iter(())
    monkeypatch.setattr(RO, "polar_express89", lambda G, precision="float64": next(block))

    lr, mul, mu = 0.023 * 0.8, [1.0, 2.0], 0.9
    for grad in grads:
        T.muon_update_(p16, grad, state, lr, mu, 0.9, torch.tensor(mul, dtype=torch.float64).view(-1, 1, 1), wd=1.2,
                       steps=orthogonalizing(orthogonalize))
        shape_mul = math.sqrt(max(1.0, rows / cols))
        block = iter(outputs["O"])
        for j in range(2):
            p, mant, m, v = ref[j]
            p, mant, m, v, _ = RO.normuon_step89(p, mant, grad[j], m, v, lr, lr * shape_mul * mul[j], mu, 0.9, 1.2,
                                                 axis=axis)
            ref[j] = (p, mant, m, v)
        for j in range(2):
            p, mant, m, v = ref[j]
            assert torch.allclose(state["v"][j], v, rtol=1e-6, atol=0)
            assert torch.allclose(state["momentum"][j], m, rtol=1e-6, atol=1e-7)
            master = RO.master_fp32(p, mant)
            ours = T.master_of(p16[j], state["mantissa"][j])
            assert (ours - master).abs().max() <= 4 * torch.finfo(torch.float32).eps * master.abs().max()


# -- loss ---------------------------------------------------------------------------------------------------

def test_loss_and_its_gradient_are_the_kernels_with_its_tail_quirk():
    g = torch.Generator().manual_seed(0)
    T_, V = 24, 512
    logits = (torch.randn(T_, V, generator=g) * 6).bfloat16()
    targets = torch.randint(0, V, (T_,), generator=g)
    weights = torch.tensor([1.0, 0.5, 0.25])
    x = logits.float().requires_grad_()
    losses = T.SoftcappedMTPLoss.apply(x.bfloat16(), targets, weights, 23.0, 5.0, 7.5)
    losses.sum().backward()
    ref_losses, _, ref_grad = RO.softcap_ce89(logits, targets, weights, grad_s=RO.GRAD_S)
    assert torch.allclose(losses.double(), ref_losses, rtol=1e-6, atol=1e-5)
    # e5m2 keeps 2 mantissa bits: the reference's gradient (e5m2 x grad_s) is within an eighth of each of our
    # values, or of e5m2's smallest step
    ours = x.grad.double()
    assert ((ours - ref_grad).abs() <= 0.125 * ours.abs() + RO.GRAD_S * 2**-16).all()
    # the quirk: the last K - 1 rows' gradient is not their loss's (the softmax term weighs all K weights)
    _, _, true_grad = RO.softcap_ce89(logits, targets, weights, grad_s=RO.GRAD_S, sw_quirk=False)
    assert torch.equal(true_grad[: T_ - 2], ref_grad[: T_ - 2])
    # in float64 (e5m2 is too coarse to tell the two apart): spec 4.10's gradient, not the loss's derivative
    sigma = torch.sigmoid((logits.double() + 5) / 7.5).bfloat16().double()
    softmax = torch.softmax(23 * sigma, dim=-1)
    for row, valid in ((T_ - 2, 2), (T_ - 1, 1)):
        onehots = torch.zeros(V, dtype=torch.float64)
        for k in range(valid):
            onehots[targets[row + k]] += weights[k].item()
        common = (23 / 7.5) * sigma[row] * (1 - sigma[row])
        quirk, derivative = ((total * softmax[row] - onehots) * common for total in (1.75, weights[:valid].sum()))
        assert ((ours[row] - quirk).abs() <= 2**-8 * quirk.abs() + 1e-12).all()
        assert not ((ours[row] - derivative).abs() <= 2**-8 * derivative.abs() + 1e-12).all()
