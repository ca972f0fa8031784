"""The recipe's optimizer, data and schedule: each item's math against a plain reference written from the spec's
formula here (not from the implementation), and the scaled-down recipe through every stage boundary, resuming bit
for bit inside each. Record #89's own numbers (its parameter table, its schedule at every step, NorMuon's axis per
block) are pinned in tests/test_record89_exact.py."""

import itertools
import math

import numpy as np
import pytest
import torch

import train_gpt as T
from conftest import ONE_STAGE, SMALL, orthogonalizing, stage_flags, tiny_args
from test_data import packed_reference, synthetic_shards

# The recipe's stages at a test's scale: 8 steps, 3 stages of 2 and an extension of 2 (over tests/conftest.py's
# ONE_STAGE: tests/test_cuda.py's staged run).
SMALL_STAGES = dict(extension_steps=2, muon_momentum_cooldown_steps=3, final_lr_frac=0.15, train_seq_len=384,
                    **stage_flags((128, 100, "0/1", 1, "1/0.5/0.25", "1/0.5/0", 0.25, 0.25),
                                  (256, 200, "1/2", 1.52, "1/0.5", "1/0", 0.25, 0), (384, 300, "1/2", 1.73, 1, 1, 0, 0),
                                  (384, 300, "1/3", 1.73, 1, 1, 0, 0)),
                    final_val_windows="1/3", untie_stage=2, adam_every=2)
# The recipe's model at a test's scale: five layers shaped like the spec's eleven (tests/test_recipe_model.py).
SMALL_MODEL = dict(num_layers=5, attn_pattern="SL-SL", value_embeds="0--12", skip="1:2", attn_input_layer=3,
                   bigram_rows=4099, paired_layers="0,3", xsa_layers="1")

# Polar Express (Amsel et al. 2025; record #38): per-iteration (a, b, c), safety factor 1.02.
PE_COEFFS = [(8.156554524902461, -22.48329292557795, 15.878769915207462),
             (4.042929935166739, -2.808917465908714, 0.5000178451051316),
             (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
             (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
             (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)]


def polar_express_exact(G: torch.Tensor) -> torch.Tensor:
    """Spec §2.9 in float64: X / (|X|_F * 1.02 + 1e-6), then X <- a X + (b A + c A^2) X with A = X X^T."""
    X = G.double()
    tall = X.size(-2) > X.size(-1)
    X = X.mT if tall else X
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    for a, b, c in PE_COEFFS:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


@pytest.mark.parametrize("shape", [(768, 768), (768, 3072), (3072, 768), (3, 48, 96)])
def test_polar_express_follows_its_coefficients_within_bf16_rounding(shape):
    torch.manual_seed(0)
    G = torch.randn(shape)
    exact = polar_express_exact(G)

    def error(X: torch.Tensor) -> float:
        return ((X.double() - exact).norm() / exact.norm()).item()

    assert error(T.polar_express(G)) < 0.035  # bf16: about 1-3%
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    spectrum = torch.logspace(0, -2, min(shape[-2:]))  # condition number 100
    s = torch.linalg.svdvals(T.polar_express(U @ torch.diag_embed(spectrum.expand(*shape[:-2], -1)) @ Vh).float())
    assert s.min() > 0.7 and s.max() < 1.2  # near-orthogonal, as the coefficients were designed for


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def test_normuon_divides_rows_or_columns_by_their_running_rms_and_keeps_the_norm():
    torch.manual_seed(0)
    for shape, axis in [((12, 8), -1), ((8, 12), -2)]:  # tall/square: per row; wide: per column
        p, beta2, lr = torch.randn(shape), 0.9, 0.1
        state = {"momentum": torch.zeros(shape), "v": torch.zeros(T.normuon_state_shape(shape))}
        ref_p, ref_v = p.clone(), torch.zeros(1)
        for _ in range(3):
            O = torch.randn(shape)
            T.muon_update_(p, O, state, lr, momentum=0.0, normuon_beta2=beta2, steps=orthogonalizing(identity))
            ref_v = beta2 * ref_v + (1 - beta2) * (O**2).mean(dim=axis, keepdim=True)
            scaled = O / ref_v.clamp_min(1e-10).sqrt()
            ref_p = ref_p - lr * math.sqrt(max(1, shape[0] / shape[1])) * scaled * O.norm() / scaled.norm()
        torch.testing.assert_close(state["v"], ref_v)
        torch.testing.assert_close(p, ref_p)


def test_cautious_weight_decay_on_muon_shrinks_only_where_the_update_agrees_in_sign():
    torch.manual_seed(0)
    p, O = torch.randn(3, 8, 8), torch.randn(3, 8, 8)
    lr, wd, lr_mul = 0.02, 1.2, torch.tensor([1.0, 2.0, 4.0]).view(3, 1, 1)
    runs = {}
    for decay in (0.0, wd):  # the same step without decay gives the update U: p - lr lr_mul U
        state = {"momentum": torch.zeros_like(p), "v": torch.zeros(T.normuon_state_shape(p.shape))}
        runs[decay] = p.clone()
        T.muon_update_(runs[decay], O, state, lr, 0.0, 0.95, lr_mul=lr_mul, wd=decay,
                       steps=orthogonalizing(identity))
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


def test_fp32_adam_state_steps_a_bf16_embedding_as_exact_adam_does():
    # #56: Adam's m and v in fp32 for the bf16 embeddings. Against Adam in float64 with the parameter rounded
    # to bf16 after each step, fp32 state matches all but a rounding tie here and there; bf16 state not.
    torch.manual_seed(0)
    p0 = (0.02 * torch.randn(512, 64)).bfloat16()
    grads = [(torch.randn(512, 64) * 1e-3 * (1 + k % 3)).bfloat16() for k in range(12)]
    b1, b2, eps, lr = 0.65, 0.95, 1e-10, 0.6
    want = p0.clone()
    m = v = torch.zeros(p0.shape, dtype=torch.float64)
    for k, g in enumerate(grads, 1):
        m, v = b1 * m + (1 - b1) * g.double(), b2 * v + (1 - b2) * g.double() ** 2
        want = (want.double() - lr * math.sqrt(1 - b2**k) / (1 - b1**k) * m / (v.sqrt() + eps)).bfloat16()
    mismatch = {}
    for dtype in (torch.float32, torch.bfloat16):
        p, m_, v_ = p0.clone(), torch.zeros(p0.shape, dtype=dtype), torch.zeros(p0.shape, dtype=dtype)
        for k, g in enumerate(grads, 1):
            T.adam_update_(p, g, m_, v_, k, lr, b1, b2, eps)
        mismatch[dtype] = (p != want).float().mean().item()
    assert mismatch[torch.float32] < 1e-3 and mismatch[torch.bfloat16] > 0.1
    # The optimizer keeps fp32 state for the bf16 tables.
    cfg = T.parse_config(["--preset=tiny"])
    opt = T.ShardedMuonAdam(T.GPT(cfg, use_flex=False, fp8_head=False), cfg, 0, 1, compile_ns=False)
    embed = next(b for b in opt.buckets if "embed.weight" in b.names)
    assert embed.data.dtype == torch.bfloat16 and embed.state["m"].dtype == embed.state["v"].dtype == torch.float32


def test_stage_starts_round_a_third_of_the_scheduled_steps_ties_to_even():
    # round(k N / 3) with Python's round: at N = 1507 step 502 starts stage 1 (int(3 x 502 / 1507) would say 0).
    assert T.stage_starts(T.parse_config(["--num_steps=1547", "--extension_steps=40"]))[1] == 502
    for n in (6, 7, 8, 38, 1505, 1506, 1508, 1555):
        cfg = T.parse_config([f"--num_steps={n + 40}", "--extension_steps=40"])
        assert T.stage_starts(cfg) == [0, round(n / 3), round(2 / 3 * n), n, n + 40], n
        assert [T.schedule(k, cfg).seq_len for k in (round(n / 3) - 1, round(n / 3))] == [16384, 32768], n
    cfg = T.parse_config(["--preset=tiny"])  # 40 steps, 38 scheduled: untied after 25 | 1
    assert [k for k in range(cfg.num_steps) if T.schedule(k, cfg).tied][-1] == 25


# The stage tables as upstream states its own (TRAINING_STAGES): a row per stage, the last the extension, each weight
# from its start to its end value across the row, a + (b - a) t. The recipe's (#89's) and the tiny preset's.
ROWS = ("seq_len", "doc_len", "windows", "lr_mul", "mtp_start", "mtp_end", "prefix_start", "prefix_end")
RECIPE_TABLE = [(16384, 896, (1, 3), 1.0, (1.0, 0.5, 0.25), (1.0, 0.5, 0.0), 0.25, 0.25),
                (32768, 2048, (3, 7), 1.52, (1.0, 0.5), (1.0, 0.0), 0.25, 0.0),
                (49152, 2048, (5, 11), 1.73, (1.0,), (1.0,), 0.0, 0.0),
                (49152, 2048, (6, 13), 1.73, (1.0,), (1.0,), 0.0, 0.0)]
TINY_TABLE = [(256, 224, (0, 1), 1.0, (1.0, 0.5, 0.25), (1.0, 0.5, 0.0), 0.25, 0.25),
              (384, 512, (1, 2), 1.52, (1.0, 0.5), (1.0, 0.0), 0.25, 0.0),
              (512, 512, (1, 3), 1.73, (1.0,), (1.0,), 0.0, 0.0),
              (512, 512, (2, 4), 1.73, (1.0,), (1.0,), 0.0, 0.0)]


def upstream_step(step: int, cfg: T.Config, table: list[tuple]) -> dict:
    """What a step trains with, looked up as upstream's TrainingSchedule does: the row whose steps hold it and the
    share t of them done (1 at the final validation), the lr cooled down from the row's, YaRN over the long windows
    of the rows so far; the last validation's windows its own."""
    rows, scheduled = [dict(zip(ROWS, r)) for r in table], cfg.num_steps - cfg.extension_steps
    n = len(rows) - 1
    ends = [0, *(round(c * scheduled) for c in itertools.accumulate([1 / n] * (n - 1))), scheduled, cfg.num_steps]
    k, t = next(((k, (step - a) / (b - a)) for k, (a, b) in enumerate(zip(ends, ends[1:])) if step < b), (n, 1.0))
    row, most = rows[k], max(len(r["mtp_start"]) for r in rows)
    cooldown = int(scheduled * (1 - cfg.cooldown_frac))
    c = min(1.0, (step - cooldown) / max(scheduled - cooldown, 1))
    mtp = [a + (b - a) * t for a, b in zip(row["mtp_start"], row["mtp_end"])]
    windows = tuple(int(w) for w in cfg.final_val_windows.split("/")) if step == cfg.num_steps else row["windows"]
    return dict(seq_len=row["seq_len"], max_doc_len=row["doc_len"], short_window=windows[0], long_window=windows[1],
                lr_mult=row["lr_mul"] * (1 - c) + cfg.final_lr_frac * c if step >= cooldown else row["lr_mul"],
                mtp_weights=tuple(mtp) + (0.0,) * (most - len(mtp)),
                prefix_weight=row["prefix_start"] + (row["prefix_end"] - row["prefix_start"]) * t,
                yarn_windows=tuple(dict.fromkeys(r["windows"][1] for r in rows[:k + 1])))


@pytest.mark.parametrize("preset, table", [("", RECIPE_TABLE), ("tiny", TINY_TABLE)])
def test_every_step_gets_the_stage_tables_values_bit_for_bit(preset, table):
    cfg = T.parse_config([f"--preset={preset}"] if preset else [])
    for step, s in enumerate(T.schedule_table(cfg)):
        want = upstream_step(step, cfg, table)
        assert {k: getattr(s, k) for k in want} == want, step


def test_batch_stages_set_the_sequence_lengths_and_the_warmup_replays_each():
    cfg = T.parse_config(["--num_steps=100", "--extension_steps=10"])  # 90 scheduled: thirds of 30
    s = [T.schedule(step, cfg) for step in range(101)]
    assert [(x.seq_len, x.max_doc_len) for x in (s[0], s[29], s[30], s[60], s[90], s[100])] == [
        (16384, 896), (16384, 896), (32768, 2048), (49152, 2048), (49152, 2048), (49152, 2048)]
    assert s[60].lr_mult > s[59].lr_mult  # the jump at the third stage, inside the cooldown
    # each length's first step, and the first Adam step (1: none of those is one) for the compiled Adam's graphs
    assert T.warmup_plan(T.parse_config(["--warmup_steps=2"]), s) == [0, 0, 1, 30, 30, 60, 60]


def staged_batches(files, shapes, world_size: int, depth: int) -> list[np.ndarray]:
    """Each step's rows from every rank's loader, in global order (micro-step m of rank r: row m * W + r)."""
    loaders = [T.PrefetchLoader(T.TrainBatches(T.TrainTokenStream(files, 384, 8, 50304, step_shape=shapes.__getitem__),
                                               r, world_size, steps=len(shapes)), depth, torch.device("cpu"))
               for r in range(world_size)]
    try:
        steps = [[next(loader).numpy() for loader in loaders] for _ in shapes]
        return [np.stack([ranks[r][m] for m in range(8 // world_size) for r in range(world_size)]) for ranks in steps]
    finally:
        for loader in loaders:
            loader.close()


def test_clipped_documents_and_staged_lengths_follow_the_packing_rule_at_every_world_size(tmp_path):
    files = synthetic_shards(tmp_path, n=1, tokens=60000)  # documents of 2..301 tokens
    shapes = [(128, 100), (128, 100), (256, 200), (256, 50), (384, 385), (384, 100), (128, 129)]
    want = packed_reference([T.load_shard(files[0], 50304)], shapes)
    got = staged_batches(files, shapes, 1, depth=0)
    assert [g.shape for g in got] == [(8, n + 1) for n, _ in shapes]
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    for world_size in (2, 4):
        for a, b in zip(got, staged_batches(files, shapes, world_size, depth=2)):
            np.testing.assert_array_equal(a, b)


def test_record_70s_packing_skips_a_document_whose_bos_ended_a_sequence_and_drops_a_shards_unfinished_step(
        tmp_path):
    files = synthetic_shards(tmp_path, n=3, tokens=40000)  # documents of 2..300 tokens
    shapes = [(128, 64), (256, 96), (384, 128)] * 8  # into the third shard, documents cut
    shards = [T.load_shard(f, 50304) for f in files]
    want = packed_reference(shards, shapes)
    assert sum(row[-1] == T.BOS_ID for step in want for row in step) >= 3  # sequences that end on a lone BOS
    got = staged_batches(files, shapes, 1, depth=0)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)
    for shard in shards[1:]:  # the steps reach every shard, a new shard's first step at its first document
        m = min(int(np.flatnonzero(shard == T.BOS_ID)[1]), 64)
        assert any(np.array_equal(step[0, :m], shard[:m]) for step in got)


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
    rotary = model.rotary
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
    assert model.q_gain.item() == pytest.approx(gain)
    ratio = want / rotary.base.double()
    assert ratio[0] == 1 and ratio[63] == pytest.approx(3 / 13)  # the fastest kept, the slowest interpolated
    model.apply_yarn((3,))  # back to one window (a resume into stage 1): the base tables again, bit for bit
    assert torch.equal(rotary.cos, base_cos) and model.q_gain.item() == 1.0


def test_yarn_follows_the_training_windows_and_the_last_validation_looks_further():
    cfg = T.parse_config(["--num_steps=100", "--extension_steps=10"])
    s = [T.schedule(step, cfg) for step in range(101)]
    assert [s[k].yarn_windows for k in (0, 30, 60, 90, 99, 100)] == [
        (3,), (3, 7), (3, 7, 11), (3, 7, 11, 13), (3, 7, 11, 13), (3, 7, 11, 13)]
    assert (s[99].short_window, s[99].long_window) == (6, 13) and (s[100].short_window, s[100].long_window) == (6, 20)


def test_logit_rescale_is_the_spec_asymmetric_sigmoid():
    # Spec §2.22 (#54): z' = 23 sigmoid((z + 5) / 7.5) in place of #28's 30 sigmoid(z / 7.5), train and eval.
    small = ["--model_dim=64", "--head_dim=32", "--train_seq_len=256", "--stage_seq_len=256,256,256,256"]
    v2 = T.parse_config(["--preset=tiny", *small])
    r28 = T.parse_config(["--preset=tiny", *small, "--logit_cap=30", "--logit_shift=0"])  # #28's rescale
    assert (v2.logit_cap, v2.logit_shift, v2.logit_temp) == (23.0, 5.0, 7.5)
    torch.manual_seed(0)
    # in fp32: the logits are not rounded to the head's dtype
    a, b = T.GPT(v2, use_flex=False, fp8_head=False).float(), T.GPT(r28, use_flex=False, fp8_head=False).float()
    with torch.no_grad():
        for p in a.parameters():
            p.add_(0.3 * torch.randn_like(p))
    b.load_state_dict(a.state_dict())
    tokens, windows = torch.randint(0, 50000, (256,)), torch.tensor([2, 1])
    for training in (True, False):
        a.train(training)
        b.train(training)
        with torch.no_grad():
            z = 7.5 * torch.logit(b.logits(tokens, windows).double() / 30)  # #28's cap inverted: the raw logits
            got = a.logits(tokens, windows).double()
        assert z.abs().max() > 5  # the asymmetry shows
        torch.testing.assert_close(got, 23 * torch.sigmoid((z + 5) / 7.5), atol=2e-4, rtol=0)


@pytest.mark.parametrize("args, message", [
    (["--stage_windows=3/7,x"], r"--stage_windows expects SHORT/LONG blocks per row of the stage table, "
                                r"comma-separated \(e.g. 1/3,3/7,5/11,6/13\), got '3/7,x'"),
    (["--extension_steps=10", "--num_steps=10"], "--extension_steps=10 must be below --num_steps=10"),
    (["--adam_every=2", "--save_every=3"], "--save_every=3 must be a multiple of --adam_every=2"),
    (["--stage_seq_len=16384,100,49152,49152"], r"--stage_seq_len=16384,100,49152,49152: row 2 holds 100: at most "
     r"--train_seq_len=49152 \(the longest\), in --micro_split=1 pieces of a multiple of --block_size=128"),
    (["--stage_seq_len=16384,32768,65536,49152"], "row 3 holds 65536: at most --train_seq_len=49152"),
    # A column of another length than the others (given or the table's): each named with what it lists.
    (["--stage_seq_len=16384,32768,49152", "--stage_lr_mul=1,1.5,2,2"], r"the stage table's columns must each list "
     r"an entry per row \(the stages, then the extension\): --stage_seq_len=16384,32768,49152 lists 3, "
     r"--stage_lr_mul=1,1.5,2,2 lists 4, the table has 4 rows; give every column to change the number of stages"),
    (["--stage_doc_len=2048,x"], r"--stage_doc_len expects tokens per row of the stage table, comma-separated "
                                 r"\(e.g. 896,2048,2048,2048\), got '2048,x'"),
    (["--final_val_windows=6/20,7/21"], "--final_val_windows expects one SHORT/LONG pair"),
    (["--final_val_windows=4"], r"--final_val_windows expects one SHORT/LONG pair of blocks \(e.g. 6/20\), got '4'"),
    (["--stage_mtp_start=0,0,0,0", "--stage_mtp_end=0,0,0,0"],
     r"--stage_mtp_start=0,0,0,0: row 1 holds 0: its first weight \(the next token's\) must be above 0"),
    (["--stage_mtp_end=1/0.5/0,1/0,0,1"], r"--stage_mtp_end=1/0.5/0,1/0,0,1: row 3 holds 0: its first weight"),
    (["--stage_mtp_end=1/0.5,1/0,1,1"], r"row 1 holds 1/0.5: as many weights as --stage_mtp_start's \(3\)"),
    (["--stage_lr_mul=1,1e300,1,1"], r"--stage_lr_mul=1,1e\+300,1,1: row 2 holds 1e\+300: an entry is a multiplier in "
                                     r"\(0, 100\]"),
    (["--stage_lr_mul=1,0,1,1"], r"--stage_lr_mul=1,0,1,1: row 2 holds 0: an entry is a multiplier in \(0, 100\]"),
    (["--stage_prefix_end=0.25,nan,0,0"], r"row 2 holds nan: an entry is a weight in \[0, 100\]"),
    (["--num_steps=17"], "3 stages need at least as many scheduled steps"),
    (["--num_steps=5", "--extension_steps=3"], "3 stages need at least"),
    (["--stage_windows=3/1,1/2,1/3,1/3"], r"--stage_windows=3/1,1/2,1/3,1/3: row 1 holds 3/1: the short window "
                                          r"exceeds the long one"),
    (["--final_val_windows=9/4"], r"--final_val_windows=9/4: the short window exceeds the long one"),
    (["--untie_stage=0"], r"--untie_stage must be > 0, got 0"),
    (["--untie_stage=5"], r"--untie_stage=5: the stages are 1 to 3 \(the last: the extension\)"),
    (["--stage_doc_len=2048,0,2048,2048"], r"--stage_doc_len=2048,0,2048,2048: row 2 holds 0: an entry is tokens > 0"),
    (["--normuon_beta2=0"], r"--normuon_beta2 must be in \(0, 1\), got 0"),
    (["--cooldown_frac=1.5"], r"--cooldown_frac must be in \[0, 1\], got 1.5"),
])
def test_bad_stage_and_optimizer_settings_are_refused_in_one_line(args, message):
    with pytest.raises(T.UsageError, match=message):
        T.validate_config(T.parse_config(args), 1)


def test_adam_every_other_step_applies_the_summed_gradients_of_two_steps():
    cfg = T.parse_config([f"--{k}={v}" for k, v in {**SMALL, "preset": "tiny", "train_seq_len": 128,
                                                    "stage_seq_len": "128,128,128,128"}.items()])
    torch.manual_seed(0)
    model = T.GPT(cfg, use_flex=False, fp8_head=False)
    with torch.no_grad():  # break the zero inits: every parameter gets a gradient at step 0
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    opt = T.ShardedMuonAdam(model, cfg, 0, 1, compile_ns=False)
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    adam = [n for g in T.build_param_groups(model, cfg) if g.kind == "adam" for n in g.names]
    seq = torch.randint(0, cfg.vocab_size, (2, 129))
    grads = []
    for step in range(2):
        opt.set_step(T.schedule(step, cfg))
        model(seq[step, :-1], seq[step, 1:], torch.tensor([1, 1]), torch.tensor([1.0])).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        params = dict(model.named_parameters())
        if step == 0:
            assert all(torch.equal(params[n], ref[n]) for n in adam)
            assert not torch.equal(params["mlp_bank"], ref["mlp_bank"])  # Muon: every step
    g = next(x for x in T.build_param_groups(model, cfg) if x.names == ["lm_head.weight"])
    want = ref["lm_head.weight"].clone()
    m, v = (torch.zeros_like(want, dtype=torch.float32) for _ in range(2))  # fp32 state of a bf16 parameter
    # backward adds step 1's gradient onto step 0's, which stayed in place
    T.adam_update_(want, grads[1]["lm_head.weight"], m, v, 1, g.lr * T.schedule(1, cfg).lr_mult, *g.betas,
                   cfg.adam_eps, g.wd)
    assert torch.equal(model.lm_head.weight, want)


def scaled_recipe_args(tmp_path, **overrides) -> list[str]:
    """The tiny preset (the recipe at tiny shapes, its stages, extension, untie and Adam every other step in place
    of tests' ONE_STAGE), shortened to 12 scheduled steps (stages from steps 4 and 8, untied after 9) and the 2-step
    extension with its longer windows: every boundary in 14 steps, of 2 sequences of a narrower model (conftest's
    SMALL) to be quick."""
    tiny = T.parse_config(["--preset=tiny"])
    staged = {name: getattr(tiny, name) for name in ONE_STAGE if name in T.FIELD_KINDS}
    staged |= {f"stage_{column}": T.column_text(tiny.stages, column) for column in T.STAGE_COLUMNS}
    return tiny_args(tmp_path, **{**staged, **SMALL, "num_steps": 14, "val_every": 4, **overrides})


@pytest.mark.slow  # four runs of the scaled-down recipe
def test_scaled_down_recipe_crosses_every_stage_and_resumes_bit_for_bit_inside_each(tmp_path):
    cfg = T.parse_config(scaled_recipe_args(tmp_path))
    assert T.stage_starts(cfg) == [0, 4, 8, 12, 14]
    assert [k for k in range(cfg.num_steps) if T.schedule(k, cfg).tied][-1] == 9
    full = T.run(scaled_recipe_args(tmp_path, run_id="full", save_every=2))
    log = (tmp_path / "logs" / "full.txt").read_text()
    assert [line.split(":")[1] for line in log.splitlines() if line.startswith("stage:")] == [
        " steps 0-3", " steps 4-7", " steps 8-11", " steps 12-13"]
    for step in (6, 10, 12):  # inside stages 1 and 2 (after the untie), and the extension's start (stage 0's resume:
        #                        tests/test_checkpoint.py)
        resumed = T.run(scaled_recipe_args(tmp_path, run_id=f"from{step}",
                                       resume=tmp_path / "logs" / "full" / f"ckpt_{step}"))
        assert resumed.val_losses == [v for v in full.val_losses if v[0] >= step], step
        for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
            assert torch.equal(a, b), (step, name)
    assert full.val_losses[-1][1] < full.val_losses[0][1] - 0.5


@pytest.mark.slow  # two short runs with the FP8 matmuls on the CPU
def test_fp8_mlps_delayed_scales_resume_bit_for_bit(tmp_path):
    """The GPU path's FP8 head and MLP on the CPU: the MLP's delayed scales (its weight scale from the step before, its
    input scale from the last forward) are model state a checkpoint carries, so a resume inside the delayed phase
    continues the run exactly."""
    fp8 = dict(fp8_head="true", fp8_mlp="true", fp8_down_exact_steps=1, num_steps=4, val_every=2, **SMALL)
    full = T.run(tiny_args(tmp_path, run_id="fp8", save_every=2, **fp8))
    assert "fp8 head True, fp8 mlp True" in (tmp_path / "logs" / "fp8.txt").read_text()
    assert (full.model.fp8_act_scales != 1).all()
    assert (full.model.fp8_down_scales != full.model.fp8_down_next_scales).any()  # delayed: last step's amax
    resumed = T.run(tiny_args(tmp_path, run_id="fp8_from2", resume=tmp_path / "logs" / "fp8" / "ckpt_2", **fp8))
    assert resumed.val_losses == full.val_losses[1:]
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
