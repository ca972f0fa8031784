import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

import train_gpt as T


def tiny_config(**kw) -> T.Config:
    return T.parse_config(["--preset=tiny", *(f"--{k}={v}" for k, v in kw.items())])


def test_initial_loss_is_log_vocab_for_zero_init_head():
    cfg = tiny_config()
    torch.manual_seed(0)
    model = T.GPT(cfg, use_flex=False, fp8_head=False)
    tokens = torch.randint(0, 50257, (cfg.train_seq_len + 1,))
    model.eval()
    loss = model(tokens[:-1], tokens[1:].long(), torch.tensor([1, 0]))
    assert loss.item() == pytest.approx(math.log(cfg.vocab_size), abs=1e-4)
    model.train()
    summed = model(tokens[:-1], tokens[1:].long(), torch.tensor([1, 0]))
    assert summed.item() == pytest.approx(cfg.train_seq_len * math.log(cfg.vocab_size), rel=1e-4)


def test_forward_backward_shapes_and_dtypes():
    cfg = tiny_config()
    torch.manual_seed(0)
    model = T.GPT(cfg, use_flex=False, fp8_head=False)
    # Break the zero init so every parameter receives a gradient.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    tokens = torch.randint(0, 50257, (cfg.train_seq_len + 1,))
    tokens[::37] = T.BOS_ID
    loss = model(tokens[:-1], tokens[1:].long(), torch.tensor([2, 1]))
    assert loss.dtype == torch.float32 and loss.ndim == 0
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype, name
        assert torch.isfinite(p.grad.float()).all(), name
    assert model.embed.weight.dtype == torch.bfloat16
    assert all(t.weight.dtype == torch.bfloat16 for t in model.value_embeds)
    assert model.lm_head.weight.dtype == torch.float32
    assert model.blocks[2].attn is None  # "LS-L": the third layer has no attention
    assert model.blocks[0].attn.qkvo_w.shape == (4, cfg.num_heads * cfg.head_dim, cfg.model_dim)


def test_recipe_model_has_record_28_shapes():
    cfg = T.Config()
    assert cfg.attn_pattern.count("-") == 1 and cfg.attn_pattern.index("-") == 7
    assert (cfg.attn_pattern.count("L"), cfg.attn_pattern.count("S")) == (3, 8)
    with torch.device("meta"):
        model = T.GPT(cfg, use_flex=True, fp8_head=True)
    groups: dict[tuple, T.ParamGroup] = {}
    for g in T.build_param_groups(model, cfg):  # the token and value embeddings: two groups at one lr
        groups.setdefault((g.kind, g.lr), T.ParamGroup(g.kind, g.lr, [])).params.extend(g.params)
        groups[(g.kind, g.lr)].names.extend(g.names)
    muon = groups[("muon", 0.05)].params
    shapes = sorted({tuple(p.shape) for p in muon})
    assert shapes == [(4, 768, 768), (6, 12), (768, 3072)]
    assert sum(tuple(p.shape) == (768, 3072) for p in muon) == 24
    assert sum(tuple(p.shape) == (4, 768, 768) for p in muon) == 11
    assert len(groups[("adam", 0.6)].params) == 4 and groups[("adam", 0.008)].names == ["lm_head.weight"]


def reference_mask(tokens: torch.Tensor, block_size: int, window: int, paired: bool = False) -> torch.Tensor:
    """The recipe's rule written out with loops: causal + document, then the block window, nearest first.
    paired: over the 2T interleaved positions of paired-head attention, position i in token i // 2's document."""
    doc = [0] * len(tokens)
    for i in range(len(tokens)):
        doc[i] = (doc[i - 1] if i else 0) + int(tokens[i] == T.BOS_ID)
    if paired:
        doc = [d for d in doc for _ in range(2)]
    T_ = len(doc)
    nb = T_ // block_size
    allowed = torch.zeros(T_, T_, dtype=torch.bool)
    for qb in range(nb):
        qdocs = {doc[i] for i in range(qb * block_size, (qb + 1) * block_size)}
        full, partial = [], []
        for kb in range(qb, -1, -1):  # nearest first
            kdocs = {doc[i] for i in range(kb * block_size, (kb + 1) * block_size)}
            if kb < qb and len(qdocs | kdocs) == 1:
                full.append(kb)
            elif min(qdocs) <= max(kdocs):
                partial.append(kb)
        keep = full[: max(window - 1, 0)] + partial[: max(window - len(full), 1)]
        for kb in keep:
            for q in range(qb * block_size, (qb + 1) * block_size):
                for k in range(kb * block_size, (kb + 1) * block_size):
                    allowed[q, k] = q >= k and doc[q] == doc[k]
    return allowed


def mask_tokens(seed: int, length: int = 128) -> torch.Tensor:
    torch.manual_seed(seed)
    tokens = torch.randint(0, 1000, (length,))
    # Documents that start mid-block, on a block edge, and span several blocks; one very short doc.
    for pos in [0, 5, 16, 40, 41, 90]:
        tokens[pos] = T.BOS_ID
    return tokens


def block_mask_as_dense(bm, length: int) -> torch.Tensor:
    """What a BlockMask lets through: full blocks whole, partial blocks where mask_mod says so."""
    size = bm.BLOCK_SIZE[0]
    allowed = torch.zeros(length, length, dtype=torch.bool)
    pos = torch.arange(length)
    token_rule = bm.mask_mod(0, 0, pos[:, None], pos[None, :])
    for counts, indices, full in [(bm.kv_num_blocks, bm.kv_indices, False),
                                  (bm.full_kv_num_blocks, bm.full_kv_indices, True)]:
        for qb in range(length // size):
            for kb in indices[0, 0, qb, : counts[0, 0, qb]].tolist():
                rows, cols = slice(qb * size, (qb + 1) * size), slice(kb * size, (kb + 1) * size)
                allowed[rows, cols] = True if full else token_rule[rows, cols]
    return allowed


@pytest.mark.parametrize("window", [0, 1, 2, 3, 8])
def test_block_and_dense_masks_match_reference(window):
    block, tokens = 16, mask_tokens(window)
    expected = reference_mask(tokens, block, window)
    assert torch.equal(T.dense_mask(tokens, block, torch.tensor(window)), expected)
    bm = T.block_mask(tokens, block, torch.tensor(window))
    assert torch.equal(block_mask_as_dense(bm, len(tokens)), expected)
    # Window 0 (short layers at a one-block long window) keeps the diagonal block alone, with no negative count.
    assert (bm.kv_num_blocks >= 0).all() and (bm.full_kv_num_blocks >= 0).all()


def test_compiled_flex_attention_equals_sdpa_with_reference_mask():
    # Eager FlexAttention on CPU ignores block sparsity; the compiled kernel honours it, as on the GPU.
    # Window 0 is what short layers get while the long window is one block (it crashed the CPU kernel with
    # a negative full-block count); 7 of 12 blocks leaves some out. Documents cross block edges.
    flex = torch.compile(flex_attention, dynamic=False)
    block, tokens = 16, mask_tokens(0, length=192)
    tokens[[120, 150]] = T.BOS_ID
    for window in [0, 1, 2, 7]:
        q, k, v = torch.randn(3, 1, 2, len(tokens), 8).unbind(0)
        out = flex(q, k, v, block_mask=T.block_mask(tokens, block, torch.tensor(window)), scale=0.12)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=reference_mask(tokens, block, window), scale=0.12)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_window_schedule_matches_recipe():
    cfg = T.Config()
    got = {s: T.schedule(s, cfg).long_window for s in [0, 125, 250, 500, 750, 1000, 1250, 1500, 1695]}
    assert got == {0: 1, 125: 1, 250: 2, 500: 4, 750: 6, 1000: 8, 1250: 10, 1500: 12, 1695: 14}
    assert [T.schedule(s, cfg).short_window for s in [0, 250, 1000, 1695]] == [0, 1, 4, 7]  # half, rounded down
    table = T.window_table(T.schedule_table(cfg), torch.device("cpu"))
    assert table.shape == (1696, 2) and table[1695].tolist() == [14, 7] and table[0].tolist() == [1, 0]


def test_rotary_rotates_a_quarter_of_the_dims():
    rot = T.Rotary(head_dim=16, max_len=10)
    x = torch.randn(1, 10, 2, 16)
    y = rot(x)
    assert torch.equal(y[0, 0], x[0, 0])  # position 0: no rotation
    # dims 4..7 and 12..15 pair with zero frequency: unchanged at every position
    torch.testing.assert_close(y[..., 4:8], x[..., 4:8])
    torch.testing.assert_close(y[..., 12:16], x[..., 12:16])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # rotations keep the norm
    # pair (0, 8) turns by exactly one radian per position at frequency 1
    angle = torch.atan2(y[0, 3, 0, 8], y[0, 3, 0, 0]) - torch.atan2(x[0, 3, 0, 8], x[0, 3, 0, 0])
    assert math.remainder(angle.item() + 3.0, 2 * math.pi) == pytest.approx(0.0, abs=1e-5)


def test_fp8_head_matches_bf16_matmul_forward_and_backward():
    torch.manual_seed(0)
    x = T.norm(torch.randn(64, 128)).bfloat16().requires_grad_()
    w = (0.05 * torch.randn(256, 128)).requires_grad_()
    out = torch.ops.speedrun.fp8_mm(x, w, math.sqrt(128) / 448, 2**-9, 1 / 448)
    ref = F.linear(x.float(), w)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).norm() / ref.norm() < 0.05
    g = torch.randn(64, 256) * 0.1
    out.float().backward(g)
    gx_ref, gw_ref = g @ w.detach(), g.T @ x.detach().float()
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    assert (x.grad.float() - gx_ref).norm() / gx_ref.norm() < 0.1
    assert (w.grad - gw_ref).norm() / gw_ref.norm() < 0.1


def fp8_args(tokens: int = 64, dim: int = 128, vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    torch.manual_seed(0)
    x = T.norm(torch.randn(tokens, dim)).bfloat16()
    w = 0.05 * torch.randn(vocab, dim)
    return x, w, (math.sqrt(dim) / T.FP8_MAX_E4M3, T.Config.fp8_w_scale, T.Config.fp8_grad_scale)


def test_fp8_ops_pass_opcheck():
    # opcheck runs each op on real and on fake tensors (as torch.compile traces it) and compares their metadata,
    # checks the schema (no input mutated or aliased) and the autograd registration. A compiled model trusts the
    # fake kernel's strides: a wrong one fails at the first compiled backward.
    x, w, scales = fp8_args()
    g = torch.randn(x.size(0), w.size(0)).bfloat16()
    torch.library.opcheck(torch.ops.speedrun.fp8_mm.default, (x, w, *scales))
    torch.library.opcheck(torch.ops.speedrun.fp8_mm_backward.default, (g, x, w, *scales))
    _, grad_w = torch.ops.speedrun.fp8_mm_backward(g, x, w, *scales)
    assert grad_w.shape == w.shape and grad_w.stride() == (1, w.size(0))  # column-major, as the fake says


def saturated(t: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """t / scale rounded to an fp8 format, values past its range saturating to its largest, times scale (float64)."""
    top = torch.finfo(dtype).max
    return (t.double() / scale).clamp(-top, top).to(dtype).double() * scale


def assert_fp8_head_saturates(device: torch.device) -> None:
    """As the record's compiled casts do on the GPU: a weight past 448 * 2^-9 = 0.875 becomes 0.875 and a gradient
    past 57344 * grad_s becomes that, where a plain cast gives NaN (e4m3 on torch < 2.12) or inf (e5m2), and the
    run would stop as diverged. (tests/test_cuda.py runs it on the GPU.)"""
    x, w, (x_s, w_s, grad_s) = fp8_args()
    x, w = x.to(device), w.to(device)
    w[:8, :16] = 2.0
    g = torch.randn(x.size(0), w.size(0), device=device).bfloat16()
    g[:4, :4] = 1000.0
    xq, wq, gq = saturated(x, x_s, torch.float8_e4m3fn), saturated(w, w_s, torch.float8_e4m3fn), \
        saturated(g, grad_s, torch.float8_e5m2)
    assert wq[0, 0] == 448 * w_s and gq[0, 0] == 57344 * grad_s
    out = torch.ops.speedrun.fp8_mm(x, w, x_s, w_s, grad_s)
    grad_x, grad_w = torch.ops.speedrun.fp8_mm_backward(g, x, w, x_s, w_s, grad_s)
    for got, want in [(out, xq @ wq.T), (grad_x, gq @ wq), (grad_w, gq.T @ xq)]:
        assert torch.isfinite(got).all()
        assert (got.double() - want).norm() < 0.01 * want.norm()


def test_fp8_head_saturates_values_beyond_each_formats_range():
    assert_fp8_head_saturates(torch.device("cpu"))


def test_fp8_head_gradients_quantize_like_the_records_unscaled_loss():
    # Record #28 backpropagates each rank's summed loss; train() scales it by 1/global_batch_seqs first. With
    # that scale folded into the FP8 gradient scale, the float8_e5m2 gradient is the record's, so every
    # gradient equals the record's times the (power-of-two) scale, bit for bit. Unfolded, gradients 8x
    # smaller fall below e5m2's smallest value more often and flush to zero. global_batch_seqs=1 scales by 1:
    # exactly the record's backward.
    grads = []
    tokens = mask_tokens(3, length=513)
    for seqs in (8, 1):
        cfg = tiny_config(global_batch_seqs=seqs)
        torch.manual_seed(0)
        model = T.GPT(cfg, use_flex=False, fp8_head=True)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
            # Logits spread over most of the soft cap's range: many softmax gradients are tiny.
            model.lm_head.weight.uniform_(-0.8, 0.8)
        loss = model(tokens[:-1], tokens[1:].long(), torch.tensor([2, 1]))
        (loss * T.train_loss_scale(cfg)).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    scaled, record = grads
    assert scaled.keys() == record.keys()
    for name in sorted(record, key=lambda n: n != "lm_head.weight"):  # the head's first: it sees e5m2 directly
        assert torch.equal(scaled[name] * 8, record[name]), name
    assert (record["lm_head.weight"] != 0).any()


def test_fp8_head_needs_dimensions_divisible_by_16_and_cuda_needs_128_blocks():
    with pytest.raises(T.UsageError, match=r"FP8 head needs .* divisible by 16 .*--model_dim=120"):
        T.resolve_for_device(tiny_config(model_dim=120, fp8_head=True), cuda=False)
    T.resolve_for_device(tiny_config(model_dim=120, fp8_head=False), cuda=True)
    with pytest.raises(T.UsageError, match="--block_size=64: FlexAttention on CUDA needs a multiple of 128"):
        T.resolve_for_device(tiny_config(block_size=64, fp8_head=False), cuda=True)
    T.resolve_for_device(tiny_config(block_size=64, fp8_head=True), cuda=False)
    T.resolve_for_device(tiny_config(block_size=256), cuda=True)
