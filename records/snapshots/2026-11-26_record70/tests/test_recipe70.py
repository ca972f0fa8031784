"""Record #70's optimizer and schedule at its own numbers, against references written from its spec: the parameter
table (each role's optimizer, lr, betas and decay), the schedule at every step of the full run (stages, lr cooldown,
momentum, MTP weights, windows, untie, Adam every other step) and its spec's sample rows, the stage boundaries'
rounding, NorMuon's per-output-channel statistic of W_o, cautious weight decay on Muon and Adam, and YaRN's rescaled
RoPE and attention scale over #70's windows. (Copied from the repository's tests/test_recipe.py at commit b801279,
when its train_gpt.py was this snapshot.)"""

import math

import pytest
import torch

import train_gpt as T

def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def test_normuon_takes_w_o_per_output_channel_as_record_70_does():
    # #70 keeps W_o as (out, in) and takes the statistic per row: per output channel. Here W_o is kept
    # transposed, the fourth matrix of qkvo_w: its statistic runs per column. The reference works on W_o itself.
    torch.manual_seed(0)
    n, beta2, lr = 8, 0.9, 0.1
    assert T.normuon_columns("blocks.2.attn.qkvo_w", 4) == [False, False, False, True]
    assert not any(T.normuon_columns("blocks.2.mlp.c_fc", 1))
    p = torch.randn(4, n, n)
    state = {"momentum": torch.zeros_like(p), "v": torch.zeros(T.normuon_state_shape(p.shape))}
    ref = p.clone().double()
    ref_v = torch.zeros(4, n, 1, dtype=torch.float64)
    for _ in range(3):
        O = torch.randn(4, n, n)
        T.muon_update_(p, O, state, lr, momentum=0.0, orthogonalize=identity, normuon_beta2=beta2,
                       columns=torch.tensor(T.normuon_columns("attn.qkvo_w", 4)))
        spec = O.double().clone()
        spec[3] = spec[3].T.clone()  # W_o as #70 stores it: (out, in)
        ref_v = beta2 * ref_v + (1 - beta2) * spec.square().mean(-1, keepdim=True)  # per row of (out, in)
        scaled = spec / ref_v.sqrt()
        scaled = scaled * spec.norm(dim=(-2, -1), keepdim=True) / scaled.norm(dim=(-2, -1), keepdim=True)
        scaled[3] = scaled[3].T.clone()  # back to the stored W_o^T
        ref = ref - lr * scaled
    torch.testing.assert_close(p.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state["v"].double(), ref_v, rtol=1e-5, atol=1e-8)


def test_cautious_weight_decay_on_muon_shrinks_only_where_the_update_agrees_in_sign():
    torch.manual_seed(0)
    p, O = torch.randn(3, 8, 8), torch.randn(3, 8, 8)
    lr, wd, lr_mul = 0.02, 1.2, torch.tensor([1.0, 2.0, 4.0]).view(3, 1, 1)
    runs = {}
    for decay in (0.0, wd):  # the same step without decay gives the update U: p - lr lr_mul U
        state = {"momentum": torch.zeros_like(p), "v": torch.zeros(T.normuon_state_shape(p.shape))}
        runs[decay] = p.clone()
        T.muon_update_(runs[decay], O, state, lr, 0.0, 0.95, identity, lr_mul=lr_mul, wd=decay)
    U = (p - runs[0.0]) / (lr * lr_mul)
    want = p - wd * lr * (lr * lr_mul) * (U * p >= 0) * p - lr * lr_mul * U
    torch.testing.assert_close(runs[wd], want)
    assert ((U * p >= 0) & (p != 0)).any() and ((U * p < 0) & (p != 0)).any()  # both signs occur


def test_cautious_weight_decay_on_adam_shrinks_only_where_the_step_agrees_in_sign():
    torch.manual_seed(0)
    p = torch.randn(64)
    m, v = torch.zeros(64), torch.zeros(64)
    ref_p, ref_m, ref_v = p.clone(), m.clone(), v.clone()
    lr, b1, b2, eps, wd = 0.01, 0.8, 0.95, 1e-10, 0.005 * 150
    for t in range(1, 4):
        g = torch.randn(64)
        T.adam_update_(p, g, m, v, t, lr, b1, b2, eps, wd=wd)
        ref_m, ref_v = b1 * ref_m + (1 - b1) * g, b2 * ref_v + (1 - b2) * g * g
        u = lr * math.sqrt(1 - b2**t) / (1 - b1**t) * ref_m / (ref_v.sqrt() + eps)
        ref_p = ref_p - u - lr**2 * wd * (u * ref_p > 0) * ref_p
    torch.testing.assert_close(p, ref_p)


# Record #70's parameter table (its spec, §5.1): per role the optimizer, the effective lr (base x lr_mul), Adam's
# betas and the decay coefficient (Adam: wd x wd_mul, applied as lr^2 x it; Muon: wd, applied as wd x lr x its lr).
RECORD70_ADAM = {"scalars": (0.008 * 5, (0.9, 0.99), 0.0), "x0_lambdas": (0.008 * 5, (0.65, 0.95), 0.0),
                 "value_embeds.0.weight": (0.008 * 75, (0.75, 0.95), 0.005 * 5),
                 "bigram.weight": (0.008 * 75, (0.75, 0.95), 0.005 * 5),
                 "smear_gate": (0.008 * 0.01, (0.9, 0.99), 0.0), "skip_gate": (0.008 * 0.05, (0.9, 0.99), 0.0),
                 "blocks.0.attn.gate_w": (0.008, (0.9, 0.99), 0.005),
                 "blocks.0.attn.ve_gate_w": (0.008, (0.9, 0.99), 0.005),
                 "lm_head.weight": (0.008, (0.5, 0.95), 0.005 * 150), "embed.weight": (0.008, (0.5, 0.95), 0.005 * 150)}
RECORD70_MUON = {"blocks.0.attn.qkvo_w": 1.0, "blocks.0.mlp.c_fc": 2.0, "blocks.0.mlp.c_proj": 4.0}  # x 0.023, wd 1.2


def test_optimizer_table_is_record_70s_for_every_role():
    cfg = T.parse_config(["--preset=tiny", "--bigram_rows=1000"])
    groups = {n: g for g in T.build_param_groups(T.GPT(cfg, use_flex=False, fp8_head=False), cfg) for n in g.names}
    for name, (lr, betas, wd) in RECORD70_ADAM.items():
        g = groups[name]
        assert (g.kind, g.betas) == ("adam", betas) and (g.lr, g.wd) == (pytest.approx(lr), pytest.approx(wd)), name
    for name, mul in RECORD70_MUON.items():
        g = groups[name]
        assert (g.kind, g.lr, g.wd, g.lr_muls[g.names.index(name)]) == ("muon", 0.023, 1.2, mul), name
    assert {n for n, g in groups.items() if g.kind == "muon"} == {n for n in groups if n.endswith(("qkvo_w", "c_fc",
                                                                                                    "c_proj"))}
    assert cfg.adam_eps == 1e-10 and cfg.adam_every == 2


def record70_schedule(step: int, n: int = 1507, e: int = 40) -> dict:
    """Record #70's schedule at a step, written from its spec (§6.1) in float64: stage ends round(kN/3) as cumulative
    float sums of 1/3 with Python's round, the cooldown from int(0.45 N) to 0.1, momentum 0.85 -> 0.95 over 300
    steps and back over the last 50, MTP weights linear in the stage's progress, untied after step e_2 | 1."""
    ends = [0, round(1 / 3 * n), round((1 / 3 + 1 / 3) * n), n, n + e]
    stage = next((k for k in range(4) if step < ends[k + 1]), 3)
    t = (step - ends[stage]) / (ends[stage + 1] - ends[stage]) if step < n + e else 1.0
    lr = [1.0, 1.52, 1.73, 1.0][stage]
    cd = int(n * (1 - 0.55))
    if step >= cd:
        tc = min(1.0, (step - cd) / (n - cd))
        lr = lr * (1 - tc) + 0.1 * tc
    if step < 300:
        mu = 0.85 + step / 300 * 0.1
    elif step > n + e - 50:
        mu = 0.95 - (step - (n + e - 50)) / 50 * 0.1
    else:
        mu = 0.95
    mtp = [[1.0, 0.5, 0.25 + (0.0 - 0.25) * t], [1.0, 0.5 + (0.0 - 0.5) * t], [1.0], [1.0]][stage]
    windows = [(1, 3), (3, 7), (5, 11), (6, 13)][stage] if step < n + e else (6, 20)
    return dict(stage=stage, lr=lr, momentum=mu, mtp=mtp + [0.0] * (3 - len(mtp)), windows=windows,
                tokens=[16384, 32768, 49152, 49152][stage], tied=step <= (ends[2] | 1), adam=step % 2 == 1)


def test_schedule_is_record_70s_at_every_step():
    cfg = T.Config()
    assert (cfg.num_steps, cfg.extension_steps) == (1547, 40) and T.stage_starts(cfg) == [0, 502, 1005, 1507, 1547]
    for step in range(cfg.num_steps + 1):
        got, want = T.schedule(step, cfg), record70_schedule(step)
        assert got.lr_mult == pytest.approx(want["lr"], rel=1e-15, abs=0), step
        assert got.muon_momentum == pytest.approx(want["momentum"], rel=1e-15, abs=0), step
        assert list(got.mtp_weights) == pytest.approx(want["mtp"], rel=1e-15, abs=0), step
        assert (got.short_window, got.long_window) == want["windows"], step
        assert (got.seq_len, got.tied, got.adam_step) == (want["tokens"], want["tied"], want["adam"]), step
    # The spec's sample rows (§6.2): lr multiplier, momentum and the falling MTP weight at those steps.
    s = T.schedule_table(cfg)
    for step, lr, mu in [(800, 1.311025, 0.95), (1004, 0.961592, 0.95), (1005, 1.087045, 0.95),
                         (1497, 0.119662, 0.95), (1498, 0.117696, 0.948), (1506, 0.101966, 0.932), (1546, 0.1, 0.852)]:
        assert (s[step].lr_mult, s[step].muon_momentum) == (pytest.approx(lr, abs=1e-6), pytest.approx(mu)), step
    assert [s[k].mtp_weights[2] for k in (1, 300, 501)] == pytest.approx([0.249502, 0.100598, 0.000498], abs=1e-6)
    assert [s[k].mtp_weights[1] for k in (677, 800, 1004)] == pytest.approx([0.326044, 0.203777, 0.000994], abs=1e-6)
    assert [k for k in range(cfg.num_steps) if s[k].tied][-1] == 1005 and s[678].lr_mult == 1.52  # cooldown start


def test_stage_starts_round_a_third_of_the_scheduled_steps_ties_to_even():
    # round(k N / 3) with Python's round: at N = 1507 step 502 starts stage 1 (int(3 x 502 / 1507) would say 0).
    assert T.stage_starts(T.Config())[1] == 502
    for n in (6, 7, 8, 38, 1505, 1506, 1508, 1555):
        cfg = T.parse_config([f"--num_steps={n + 40}"])
        assert T.stage_starts(cfg) == [0, round(n / 3), round(2 / 3 * n), n, n + 40], n
        assert [T.schedule(k, cfg).seq_len for k in (round(n / 3) - 1, round(n / 3))] == [16384, 32768], n
    cfg = T.parse_config(["--preset=tiny"])  # 40 steps, 38 scheduled: untied after 25 | 1
    assert [k for k in range(cfg.num_steps) if T.schedule(k, cfg).tied][-1] == 25


def yarn_reference(block: int, windows: list[int], base: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Spec §2.3 in float64, one window change at a time: r_j = block * W_old * w_j / 2pi,
    gamma_j = clamp((r_j - 1) / 31, 0, 1), s = W_old / W_new, w_j *= s + gamma_j (1 - s);
    the attention scale is multiplied by 0.2 ln(W_new / W_old) + 1."""
    w, gain = base.double().clone(), 1.0
    for old, new in zip(windows, windows[1:]):
        r = block * old * w / (2 * math.pi)
        gamma = torch.clamp((r - 1) / (32 - 1), 0, 1)
        s = old / new
        w = w * (s + gamma * (1 - s))
        gain *= 0.2 * math.log(new / old) + 1
    return w, gain


def test_yarn_rescales_rope_and_the_attention_scale_as_the_spec_says():
    cfg = T.parse_config(["--preset=tiny", "--head_dim=128", "--model_dim=256"])  # 32 rotating frequencies
    model = T.GPT(cfg, use_flex=False, fp8_head=False)
    rotary = model.blocks[0].attn.rotary
    base_cos = rotary.cos.clone()
    model.apply_yarn((3, 7, 11, 13))
    want, gain = yarn_reference(128, [3, 7, 11, 13], rotary.base)
    theta = torch.outer(torch.arange(rotary.cos.size(0), dtype=torch.float64), want)
    # bf16 tables of fp32 angles up to ~4e3 rad; the sine's odd dims negated (#70's layout)
    torch.testing.assert_close(rotary.cos.float(), theta.cos().float(), atol=6e-3, rtol=0)
    sign = torch.tensor([1.0, -1.0]).repeat(64)
    torch.testing.assert_close(rotary.sin.float(), theta.sin().float() * sign, atol=6e-3, rtol=0)
    # The spec's scales over the standard schedule: 0.1 -> 0.1169 -> 0.1275 -> 0.1318
    assert [round(0.1 * yarn_reference(128, [3, 7, 11, 13][:n], rotary.base)[1], 4) for n in (1, 2, 3, 4)] == [
        0.1, 0.1169, 0.1275, 0.1318]
    assert all(b.attn.q_gain.item() == pytest.approx(gain) for b in model.blocks if b.attn is not None)
    ratio = want / rotary.base.double()
    assert ratio[0] == 1 and ratio[63] == pytest.approx(3 / 13)  # the fastest kept, the slowest interpolated
    model.apply_yarn((3,))  # back to one window (a resume into stage 1): the base tables again, bit for bit
    assert torch.equal(rotary.cos, base_cos) and model.blocks[0].attn.q_gain.item() == 1.0


def test_yarn_follows_the_training_windows_and_the_last_validation_looks_further():
    cfg = T.parse_config(["--num_steps=100", "--extension_steps=10"])
    s = [T.schedule(step, cfg) for step in range(101)]
    assert [s[k].yarn_windows for k in (0, 30, 60, 90, 99, 100)] == [
        (3,), (3, 7), (3, 7, 11), (3, 7, 11, 13), (3, 7, 11, 13), (3, 7, 11, 13)]
    assert (s[99].short_window, s[99].long_window) == (6, 13) and (s[100].short_window, s[100].long_window) == (6, 20)
