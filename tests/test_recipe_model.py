"""The recipe's model beyond record #89's item-by-item parity (tests/test_record89_exact.py): FA3's token windows
as block masks and dense masks, the compiled kernel against SDPA, the layout of the eleven layers, the FLOP count of
the shape, the multi-token loss's value, the FP8 head's scales, the untie, and one-line refusals."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

import train_gpt as T
from test_model import block_mask_as_dense, mask_tokens, saturated

# The model at a test's size: five layers shaped like the spec's eleven (a long layer feeding the attention-less one
# through the skip, the later layers attending over layer 3's output, value embeddings on the first and last two
# layers, paired short layers).
SHAPE = ["--preset=tiny", "--model_dim=64", "--num_heads=2", "--head_dim=32", "--train_seq_len=256",
         "--stage_seq_len=256,256,256,256", "--block_size=32", "--num_layers=5", "--attn_pattern=SL-SL",
         "--value_embeds=0--12", "--skip=1:2", "--attn_input_layer=3", "--bigram_rows=4099",
         "--paired_layers=0,3", "--xsa_layers=1"]
WINDOWS = (3, 1)  # long, short in blocks


def token_mask(tokens: torch.Tensor, reach: float, paired: bool = False) -> torch.Tensor:
    """Record #70's attention rule (§4.4): the query at in-document position p sees the keys at p - reach .. p of
    its document. paired: over the 2T stream, stream position i in token i // 2's document, reach in stream
    positions."""
    doc = [0] * len(tokens)
    for t in range(1, len(tokens)):
        doc[t] = doc[t - 1] + int(tokens[t] == T.BOS_ID)
    n = len(tokens) * (2 if paired else 1)
    owner = [i // 2 if paired else i for i in range(n)]
    return torch.tensor([[doc[owner[q]] == doc[owner[k]] and 0 <= q - k <= reach for k in range(n)] for q in range(n)])


def perturbed_model(cfg: T.Config) -> T.GPT:
    torch.manual_seed(1)
    model = T.GPT(cfg, use_flex=False, fp8_head=False)
    with torch.no_grad():  # every parameter away from its init, so every term counts
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def config(*flags: str) -> T.Config:
    cfg = T.parse_config(SHAPE + list(flags))
    T.validate_config(cfg, 1)
    return cfg


def test_the_recipes_layout_places_windows_value_embeddings_skip_pairs_and_xsa():
    cfg = T.parse_config(["--vocab_size=256", "--model_dim=64", "--num_heads=2", "--head_dim=32", "--bigram_rows=64"])
    model = T.GPT(cfg, use_flex=False, fp8_head=False)
    plans = model.plans
    # Spec §2.2: 11 layers, short 0-2, 4, 5, 7-9, long 3 and 10, none at 6; VEs 0-4 on 1, 2, 8, 9, 10; XSA on 1, 3,
    # 4, 7 and head gates on 3, 10 (upstream's spec §2.3); the skip 3 -> 6; layers 8-10 attend over layer 7's output
    assert [p.window or None for p in plans] == ["short"] * 3 + ["long"] + ["short"] * 2 + [None] + ["short"] * 3 + [
        "long"]
    assert [p.ve_table for p in plans] == [None, 0, 1, None, None, None, None, None, 2, 3, 4]
    assert [p.ve_gate for p in plans] == [None, 0, 1, None, None, None, None, None, 2, 3, 4]
    assert [i for i, p in enumerate(plans) if p.paired] == [0, 2, 5, 9]
    assert [i for i, p in enumerate(plans) if p.xsa] == [1, 3, 4, 7]
    assert [i for i, p in enumerate(plans) if p.attn_gate] == [3, 10]
    assert [p.attn for p in plans] == [0, 1, 2, 3, 4, 5, None, 6, 7, 8, 9]
    assert (model.skip_from, model.skip_to, cfg.attn_input_layer) == (3, 6, 7)


@pytest.mark.parametrize("paired", [False, True], ids=["tokens", "paired"])
@pytest.mark.parametrize("window", [0, 1, 2, 3, 8])
def test_token_windows_let_through_what_fa3s_window_does_at_every_size(window, paired):
    # Documents start mid-block, on a block edge, span blocks; the block masks still skip what no query reaches.
    block, tokens = 16, mask_tokens(window)
    expected = token_mask(tokens, window * block, paired)
    size = torch.tensor(window)
    assert torch.equal(T.dense_mask(tokens, block, size, paired), expected)
    bm = T.block_mask(tokens, block, size, paired)
    assert torch.equal(block_mask_as_dense(bm, len(expected)), expected)
    for counts, indices in [(bm.kv_num_blocks, bm.kv_indices), (bm.full_kv_num_blocks, bm.full_kv_indices)]:
        for qb in range(len(expected) // block):  # no block farther back than the window reaches is read
            assert all(0 <= qb - kb <= window for kb in indices[0, 0, qb, : counts[0, 0, qb]].tolist())


def test_compiled_flex_attention_with_token_windows_equals_sdpa_with_fa3s_rule():
    # The compiled kernel honours block sparsity (eager CPU flex does not), as on the GPU; reach is a tensor the
    # mask reads, so every window shares one graph.
    flex = torch.compile(flex_attention, dynamic=False)
    block, tokens = 16, mask_tokens(0, length=192)
    tokens[[120, 150]] = T.BOS_ID
    for window, paired in [(0, False), (1, False), (3, False), (2, True), (5, True)]:
        n = len(tokens) * (2 if paired else 1)
        q, k, v = torch.randn(3, 1, 2, n, 8).unbind(0)
        mask = T.block_mask(tokens, block, torch.tensor(window), paired)
        out = flex(q, k, v, block_mask=mask, scale=0.12)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=token_mask(tokens, window * block, paired), scale=0.12)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_flops_per_token_counts_the_recipes_shape():
    """6N counts the 10 attention layers' Q, K, V, O, the 11 MLPs, the five VE gates, the smear's gate, MUDD's two
    MLPs, the gate network's two and the head (the embedding, value and bigram tables are lookups); the attention term
    counts the 10 attention layers at their windows and the last one's DC attention over its 112 keys."""
    dims = ["--vocab_size=256", "--model_dim=64", "--num_heads=2", "--head_dim=32", "--bigram_rows=64",
            "--mudd_dim=8"]
    cfg = T.parse_config(dims)
    model = T.GPT(cfg, use_flex=False, fp8_head=False)
    d, H, g, V = 64, 2, cfg.gate_channels, 256
    gates = 5 * H * g + g  # five VE gates and the smear's
    mudd = 2 * (8 * d + 14 * 8)
    # the gate network's widest block, upstream's post block at 2 heads: XSA 4, 7 and the head gate 10 (H each),
    # five (x0, bigram) pairs, the skip, DC's w1 and w2 (H each)
    gate_network = 2 * (8 * d + (3 * H + 10 + 1 + 2 * H) * 8)
    assert T.matmul_weights(model) == 10 * 4 * d * d + 11 * 8 * d * d + gates + mudd + gate_network + d * V
    s = T.schedule(0, cfg)
    attention = T.flops_per_token(model, s) - 6 * T.matmul_weights(model)
    def keys(w: int, n: int) -> float:
        return T.mean_keys_per_query(max(w, 1) * cfg.block_size, n)
    # 2 long layers, 4 short ones, and 4 paired ones (0, 2, 5, 9): H/2 heads over 2T positions, the short window
    long, short, paired = keys(s.long_window, s.seq_len), keys(s.short_window, s.seq_len), keys(s.short_window,
                                                                                                  2 * s.seq_len)
    dc = T.mean_keys_per_query(112, s.seq_len)
    assert attention == pytest.approx(12 * H * 32 * (2 * long + 4 * short + 4 * paired + dc))


@pytest.mark.parametrize("args, message", [
    (["--skip=6:3"], "--skip expects A:B with 0 <= A < B"),
    (["--skip=3>6"], "--skip expects A:B"),
    (["--skip=3:5"], "--skip=3:5: the skip lands in place of an attention"),
    (["--value_embeds=012------012"], "--value_embeds='012------012' needs one character per layer"),
    (["--value_embeds=02---------"], "needs one character per layer"),  # table 1 unused
    (["--value_embeds=-12-----341"], "needs one character per layer"),
    (["--attn_input_layer=10"], "--attn_input_layer=10 must be a layer other than the skip's source, before the last"),
    (["--attn_input_layer=3"], "--attn_input_layer=3 must be a layer other than the skip's source"),
    (["--attn_input_layer=0"], "--attn_input_layer must be > 0"),
    (["--attn_pattern=SSSLSSLSSS-", "--skip=3:10"], "the first and last layers need attention"),
    (["--gate_channels=7"], "the VE gates read half of --gate_channels=7"),
    (["--bigram_rows=1"], "--bigram_rows=1: the table needs at least 2 rows"),
    (["--paired_layers=3"], "--paired_layers='3' must list short-window"),
    (["--stage_mtp_start=1/x"], r"--stage_mtp_start expects 1-64 weights W/W/\.\.\. per row of the stage table"),
    (["--stage_mtp_start=1/101,1,1,1"], r"row 1 holds 1/101: an entry is 1-64 weights W/W/\.\.\., each in \[0, 100\]"),
    (["--stage_mtp_start=1/0.5,1", "--stage_lr_mul=1,1.5,2"], "the stage table's columns must each list an entry per "
                                                              "row"),
    (["--fp8_w_scale=0"], r"--fp8_w_scale must be in \(0, 100\]"),
])
def test_bad_model_settings_are_refused_in_one_line(args, message):
    with pytest.raises(T.UsageError, match=message):
        T.validate_config(T.parse_config(args), 1)


@pytest.mark.slow  # compiles the FP8 op bodies
def test_fp8_head_takes_the_configured_scales(monkeypatch):
    """The recipe's FP8 head scales (#51, #55: x 100/448, W 1.6/448) reach the matmul: its logits are the product of x
    and W rounded to float8_e4m3 at those scales, not at #28's (sqrt(d)/448, 2^-9: |W| saturates at 0.875)."""
    scales = ("fp8_x_scale", "fp8_w_scale", "fp8_grad_scale")
    cfg = T.parse_config(SHAPE)
    assert [getattr(cfg, k) * 448 for k in scales] == pytest.approx([100, 1.6, 0.75])
    torch.manual_seed(0)
    model = T.GPT(cfg, use_flex=False, fp8_head=True)
    x = T.norm(torch.randn(256, cfg.model_dim)).bfloat16()
    with torch.no_grad():
        model.lm_head.weight.uniform_(-1.5, 1.5)
    w = model.lm_head.weight

    def emulated(x_s: float, w_s: float) -> torch.Tensor:
        return saturated(x, x_s, torch.float8_e4m3fn) @ saturated(w, w_s, torch.float8_e4m3fn).T

    got = torch.ops.speedrun.fp8_mm(x, w, cfg.fp8_x_scale, cfg.fp8_w_scale, cfg.fp8_grad_scale).float()
    ours, r28 = emulated(cfg.fp8_x_scale, cfg.fp8_w_scale), emulated(math.sqrt(64) / 448, 2**-9)
    assert (got - ours).norm() < 0.01 * ours.norm() < (got - r28).norm()
    # The model passes them: its training logits rescale that product of the final norm's output and W.
    normed = []
    monkeypatch.setattr(T, "norm", lambda t: normed.append(T.F.rms_norm(t, (t.size(-1),))) or normed[-1])
    logits = model.logits(torch.randint(0, 1000, (256,)), torch.tensor([2, 1]))
    z = torch.ops.speedrun.fp8_mm(normed[-1].flatten(0, 1), w, *(getattr(cfg, k) for k in scales)).float()
    torch.testing.assert_close(logits, cfg.logit_cap * torch.sigmoid((z + cfg.logit_shift) / cfg.logit_temp),
                               atol=0.1, rtol=2**-8)  # the softcap rounded to bf16, as #89's


def test_multi_token_loss_is_the_weighted_sum_of_shifted_cross_entropies():
    # Spec §4.10: L = sum_t sum_k w_k CE(z_t, y_(t+k)), the terms past the end dropped, not normalized by sum(w), over
    # z = 23 bf16(sigmoid((l + 5) / 7.5)) (the gradient: tests/test_record89_exact.py)
    cfg = config()
    model, tokens = perturbed_model(cfg).float(), mask_tokens(5, length=cfg.train_seq_len + 1)
    inp, tgt, windows = tokens[:-1], tokens[1:].long(), torch.tensor(WINDOWS)
    w = torch.tensor([1.0, 0.5, 0.125])
    with torch.no_grad():
        loss = model(inp, tgt, windows, w)
        l, T_ = model.head(model.hidden(inp, windows)).double(), len(tgt)
        z = 23 * torch.sigmoid((l + 5) / 7.5).bfloat16().double()
        ref = sum(w[k] * F.cross_entropy(z[: T_ - k], tgt[k:], reduction="sum") for k in range(3))
        assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
        assert model(inp, tgt, windows, torch.tensor([1.0, 0.0, 0.0])).item() == pytest.approx(
            model(inp, tgt, windows).item(), rel=1e-6)  # weights (1, 0, 0): the next-token loss
        model.eval()  # eval: the next token's mean, z rounded in the head's dtype (fp32 here)
        plain = F.cross_entropy(23 * torch.sigmoid((l + 5) / 7.5), tgt)
        assert model(inp, tgt, windows, w).item() == pytest.approx(plain.item(), rel=1e-6)


def test_tied_until_the_first_adam_step_of_stage_two_then_the_embedding_is_the_heads_copy():
    # #70: untied after the first Adam step of stage 2 (odd with Adam every other step): 1001 | 1 at N = 1501.
    cfg = T.parse_config(["--num_steps=1541", "--extension_steps=40"])
    assert [s for s in range(cfg.num_steps + 1) if T.schedule(s, cfg).tied][-1] == 1001
    assert T.schedule(1002, cfg).tied is False
    cfg = config()
    assert T.build_param_groups(T.GPT(cfg, False, False), cfg)[1].lr == cfg.head_lr  # the embedding's lr: the head's
    torch.manual_seed(0)
    model = T.GPT(cfg, use_flex=False, fp8_head=False)
    assert 0.004 < model.lm_head.weight.std() < 0.006  # N(0, 0.005), not zero
    opt = T.ShardedMuonAdam(model, cfg, 0, 1, compile_ns=False)
    tokens = mask_tokens(6, length=cfg.train_seq_len + 1)
    for step in range(2):
        opt.set_step(T.schedule(step, cfg))
        model(tokens[:-1], tokens[1:].long(), torch.tensor(WINDOWS)).backward()
        opt.step()
        opt.zero_grad()
    embed = model.embed.weight.detach().clone()
    opt.copy_param("lm_head.weight", "embed.weight")
    model.tie_embedding(False)
    state = {n: st for b in opt.buckets for n, _, _, st in b.owned()}
    assert not torch.equal(model.embed.weight, embed)
    assert torch.equal(model.embed.weight, model.lm_head.weight.bfloat16())
    for k in ("m", "v"):
        assert state["lm_head.weight"][k].abs().sum() > 0
        assert torch.equal(state["embed.weight"][k], state["lm_head.weight"][k].to(state["embed.weight"][k].dtype))
    # Untied, the model is the untied model with these weights: the head no longer takes the lookup's gradient.
    model(tokens[:-1], tokens[1:].long(), torch.tensor(WINDOWS)).backward()
    twin = T.GPT(config(), use_flex=False, fp8_head=False)
    twin.load_state_dict(model.state_dict())
    twin.tie_embedding(False)
    twin(tokens[:-1], tokens[1:].long(), torch.tensor(WINDOWS)).backward()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad), name
