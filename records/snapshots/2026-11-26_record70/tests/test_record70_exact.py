"""Record #70's own arithmetic where a port could plausibly round differently: the bigram rows, bf16 Adam parameters
without a master, the bf16 + mantissa view of the Muon matrices, the gradient scale, the RoPE tables and the state
after the warmup. Each is checked against tests/reference70.py, written from the spec alone."""

import math

import pytest
import torch

import reference70 as R
import train_gpt as T
from conftest import SMALL, tiny_args


def tiny_cfg(**overrides) -> T.Config:
    cfg = T.parse_config(["--preset=tiny", "--device=cpu"])
    for k, v in overrides.items():
        setattr(cfg, k, v)
    T.resolve_for_device(cfg, cuda=False)
    return cfg


def test_bigram_rows_hash_the_reserved_row_at_position_one_with_int32_wraparound():
    torch.manual_seed(0)
    tokens = torch.randint(0, 50304, (4096,), dtype=torch.int32)
    tokens[[0, 1, 2, 700]] = torch.tensor([50256, 50303, 0, 50256], dtype=torch.int32)
    for rows in (R.BIGRAM_ROWS70, 2 * 50304):  # the recipe's table and the tiny preset's
        ours = T.bigram_index(tokens, rows)
        assert ours.tolist() == R.bigram_rows70(tokens, rows).tolist()
    # position 1 pairs x_1 with the reserved index (27191 x 251519 wraps to a negative int32), not with x_0
    assert R.bigram_rows70(tokens, R.BIGRAM_ROWS70)[1] == 247089 != (36313 * 50303 ^ 27191 * 50256) % 251519


def test_adam_parameters_are_bf16_without_a_master_and_step_as_record70():
    model = T.GPT(tiny_cfg(), use_flex=False, fp8_head=False)
    adam = {n for g in T.build_param_groups(model, model.cfg) if g.kind == "adam" for n in g.names}
    dtypes = {n: p.dtype for n, p in model.named_parameters() if n in adam}
    assert {n for n, d in dtypes.items() if d == torch.float32} == {"scalars", "x0_lambdas"}
    assert {"lm_head.weight", "smear_gate", "skip_gate"} <= {n for n, d in dtypes.items() if d == torch.bfloat16}
    torch.manual_seed(1)
    p = (0.05 * torch.randn(64, 12)).bfloat16()
    ref_p, m, v, ref_m, ref_v = p.clone(), torch.zeros(64, 12), torch.zeros(64, 12), torch.zeros(64, 12), \
        torch.zeros(64, 12)
    for t, (lr, wd) in enumerate([(8e-5, 0.0), (0.6, 0.025), (0.008, 0.75)] * 2, start=1):
        g = torch.randn(64, 12).bfloat16()
        T.adam_update_(p, g, m, v, t, lr, 0.9, 0.99, 1e-10, wd)
        ref_p, ref_m, ref_v = R.adam_step70(ref_p, g, ref_m, ref_v, t, lr, 0.9, 0.99, 1e-10, wd, fma_v=True)
        # m and v within an fp32 ulp (CPU eager fuses a multiply-add where #70's compiled kernel may not, or may);
        # the bf16 parameter, #70's difference, exactly
        for ours, ref in ((m, ref_m), (v, ref_v)):
            torch.testing.assert_close(ours, ref, rtol=0, atol=2**-23 * ref.abs().max().item())
        assert torch.equal(p, ref_p), t


def test_an_adam_step_below_half_a_bf16_ulp_leaves_the_parameter_unchanged():
    # The smear gate's first-step lr (0.008 x 0.01): an update of 8e-5 is under half an ulp of 0.05 in bf16.
    p = torch.full((1, 12), 0.05).bfloat16()
    before = p.clone()
    T.adam_update_(p, torch.ones(1, 12).bfloat16(), torch.zeros(1, 12), torch.zeros(1, 12), 1, 8e-5, 0.9, 0.99,
                   1e-10)
    assert torch.equal(p, before)


def test_the_forward_reads_the_muon_masters_truncated_to_bf16_and_their_gradient_passes_through():
    torch.manual_seed(2)
    master = torch.randn(64, 48) * 0.03
    activations = torch.ones(1, dtype=torch.bfloat16)
    assert torch.equal(T.weight_as(master, activations), R.truncate_to_bf16(master))
    assert not torch.equal(T.weight_as(master, activations), master.bfloat16())  # not rounded to nearest
    w = master.clone().requires_grad_()
    (T.weight_as(w, activations).float() * torch.arange(48.0)).sum().backward()
    assert torch.equal(w.grad, torch.arange(48.0).expand(64, 48))
    # The model: masters with low bits set give the logits of their truncations, not of their roundings.
    cfg = tiny_cfg()
    model = T.GPT(cfg, use_flex=False, fp8_head=False)
    tokens = torch.randint(0, 50257, (cfg.train_seq_len + 1,))
    windows = torch.tensor([2, 1])

    def logits_with(fn) -> torch.Tensor:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(("qkvo_w", "c_fc")):
                    p.copy_(fn(masters[n]))
            return model.logits(tokens[:-1], windows)

    masters = {n: p.detach() + 0.3 * torch.rand_like(p) * p.detach().abs() * 2**-8
               for n, p in model.named_parameters() if n.endswith(("qkvo_w", "c_fc"))}
    exact = logits_with(lambda m: m)
    assert torch.equal(exact, logits_with(lambda m: R.truncate_to_bf16(m).float()))
    assert not torch.equal(exact, logits_with(lambda m: m.bfloat16().float()))


def normuon70(O: torch.Tensor, v: torch.Tensor, beta2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """§5.3.3 in float64 per row: r = mean_j O^2, v <- beta2 v + (1 - beta2) r, O' = O / sqrt(max(v, 1e-10)) scaled to
    O's Frobenius norm; the per-row factor rounded to bf16 and applied to bf16 O (one rounding), as #70's kernel."""
    r = O.double().square().mean(dim=-1, keepdim=True)
    v = beta2 * v.double() + (1 - beta2) * r
    s = v.clamp_min(1e-10).rsqrt()
    factor = s * O.double().norm(dim=(-2, -1), keepdim=True) / (O.double() * s).norm(dim=(-2, -1), keepdim=True)
    return (O.double() * factor.bfloat16().double()).bfloat16(), v.float()


def test_a_muon_step_is_record70s_normuon_and_bf16_mantissa_master_update():
    torch.manual_seed(3)
    shape = (2, 48, 32)  # tall: per-row statistic, shape multiplier sqrt(48 / 32)
    p32 = ((torch.rand(shape) - 0.5) * 0.06).bfloat16().float()  # a bf16 init: the mantissas are zero
    bf16, mantissa = R.split_master(p32)
    p0 = p32.clone()
    state = {"momentum": torch.zeros(shape), "v": torch.zeros(T.normuon_state_shape(shape))}
    ref_v = torch.zeros(2, 48, 1)
    lr, wd, lr_mul, beta2 = 0.023 * 1.52, 1.2, torch.tensor([1.0, 2.0]).view(-1, 1, 1), 0.95
    g = torch.randn(shape).bfloat16().float()
    T.muon_update_(p32, g.clone(), state, lr, 0.85, beta2, lr_mul=lr_mul, wd=wd)
    # From zero momentum, Nesterov's g.lerp(m, mu) with m = (1 - mu) g
    update, ref_v = normuon70(T.polar_express(g.lerp((1 - 0.85) * g, 0.85)).float(), ref_v, beta2)
    step_lr = lr * lr_mul.flatten() * math.sqrt(48 / 32)
    for i in range(2):
        bf16[i], mantissa[i] = R.muon_master_update70(bf16[i], mantissa[i], update[i].float(), step_lr[i].item(),
                                                      wd * lr)
    torch.testing.assert_close(state["v"], ref_v, rtol=1e-6, atol=0)
    ref = R.master_fp32(bf16, mantissa)
    # Within a few fp32 ulps of the terms (CPU eager fuses multiply-adds), but for a rare row whose bf16 factor
    # rounds the other way: off by at most a bf16 ulp of its update.
    terms = p0.abs() + (update.float() * step_lr.view(-1, 1, 1)).abs()
    assert ((p32 - ref).abs() > 2**-21 * terms).float().mean() < 0.01
    torch.testing.assert_close(p32, ref, rtol=0, atol=2**-8 * step_lr.max().item() * update.float().abs().max().item())


def test_the_gradient_is_record70s_two_eighths_of_the_summed_losses_at_every_world_size():
    cfg = tiny_cfg(global_batch_seqs=8)
    for world in (1, 2, 4, 8):
        assert T.train_loss_scale(cfg) == R.grad_scale70(world)
    # The FP8 head's e5m2 gradients are #70's on 8 GPUs: its per-rank gradient 2 g over its scale 2 x 0.75 / 448.
    x_s, w_s, grad_s = T.fp8_scales(cfg, T.train_loss_scale(cfg))
    assert T.train_loss_scale(cfg) / grad_s == pytest.approx(2 / (2 * 0.75 / 448), rel=1e-15)


def test_rope_tables_and_rotation_are_record70s_bit_for_bit():
    rot = T.Rotary(head_dim=128, max_len=512)
    cos, sin = R.rope_tables70(128, 256)
    assert torch.equal(rot.cos, cos) and torch.equal(rot.sin, sin)
    x = torch.randn(1, 200, 6, 128).bfloat16()
    assert torch.equal(rot(x), R.rope_apply70(x[0], cos, sin)[None])
    # paired: head h of token t at position 2t + h % 2, as #70's table of [position 2t | position 2t + 1] rows
    cos2, sin2 = R.rope_tables70(128, 128, paired=True)
    y = R.rope_apply70(x[0].reshape(200, 3, 256), cos2, sin2).reshape(200, 6, 128)
    assert torch.equal(rot(x, paired=True), y[None])
    # YaRN: the stationary half (#49's key offset reads it) never turns
    assert rot.stationary.tolist() == [False] * 64 + [True] * 64


def test_after_the_warmup_the_state_is_record70s_reset(tmp_path, monkeypatch):
    """#70's reset after its warmup: parameters as at init, Muon's momentum, second moment and mantissas zero, Adam's
    state and step counts zero, the embedding tied again."""
    seen = {}
    warmup = T.warmup

    def checked(cfg, rt, log, model, optimizer, *rest):
        warmup(cfg, rt, log, model, optimizer, *rest)
        seen["model"], seen["steps"] = model, (optimizer.step_count, optimizer.adam_steps)
        seen["state"] = [t.clone() for t in optimizer.state_tensors()]
        seen["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        seen["tied"] = model.embed_tied_now and model.embed_tied.item() == 1.0

    monkeypatch.setattr(T, "warmup", checked)
    T.run(tiny_args(tmp_path, num_steps=1, warmup_steps=3, **SMALL))
    assert all(not t.any() for t in seen["state"])
    assert seen["steps"] == (0, 0) and seen["tied"]
    for n, p in seen["params"].items():
        if n.endswith(("qkvo_w", "c_fc", "c_proj")):
            assert torch.equal(p, p.bfloat16().float()), n  # zero mantissas: the master is its bf16 value
