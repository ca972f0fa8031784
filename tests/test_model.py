import math

import pytest
import torch
import torch.nn.functional as F

import gpt_kernels as K
import train_gpt as T


def tiny_config(**kw) -> T.Config:
    return T.parse_config(["--preset=tiny", *(f"--{k}={v}" for k, v in kw.items())])


def test_loss_is_log_vocab_for_a_zero_head():
    cfg = tiny_config()
    torch.manual_seed(0)
    model = T.GPT(cfg, use_flex=False, fp8_head=False)
    with torch.no_grad():  # the soft cap makes every logit the same: uniform over the vocabulary
        model.lm_head.weight.zero_()
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
    # Upstream's dtypes: fp32 for the scalars, the per-layer lambdas and the gates' shared scale, bf16 for everything
    # else (the Muon banks too: their fp32 masters' low halves are optimizer state)
    fp32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert fp32 == {"scalars", "post_lambdas", "resid_lambdas", "_mudd_gate_scale"}, fp32
    L, H, D, d = cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.model_dim
    attention_layers = L - cfg.attn_pattern.count("-")
    assert model.qk_bank.shape == (attention_layers * H, 2 * D, d)  # Q and K in head pairs (#80)
    assert model.vo_bank.shape == (2 * attention_layers, H * D, d)
    assert model.mlp_bank.shape == (L, 2, cfg.mlp_ratio * d, d)
    assert [p.attn for p in model.plans] == [0, 1, None, 2, 3]  # "SL-SL": the third layer has no attention


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


def test_rotary_turns_the_first_half_in_pairs_and_keeps_the_second():
    rot = T.Rotary(head_dim=16, max_len=10)
    x = torch.randn(1, 10, 2, 16)
    y = rot(x)
    assert torch.equal(y[0, 0], x[0, 0])  # position 0: no rotation
    torch.testing.assert_close(y[..., 8:], x[..., 8:], atol=0, rtol=0)  # frequency 0: unchanged at every position
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-2, atol=0)  # rotations keep the norm (bf16)
    # pair (0, 1) turns by one radian per position at frequency 1 (bf16 tables: to about 2^-8)
    angle = torch.atan2(-y[0, 3, 0, 1], y[0, 3, 0, 0]) - torch.atan2(-x[0, 3, 0, 1], x[0, 3, 0, 0])
    assert math.remainder(angle.item() - 3.0, 2 * math.pi) == pytest.approx(0.0, abs=1e-2)


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
    return x, w, (math.sqrt(dim) / K.FP8_MAX_E4M3, T.Config.fp8_w_scale, T.Config.fp8_grad_scale)


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
    """As the record's compiled casts do on the GPU: a weight past 448 * w_s (1.6) becomes that and a gradient
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
    # The records backpropagate each rank's summed loss; train() scales it by 1/global_batch_seqs first. With
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


def test_fp8_matmuls_need_dimensions_divisible_by_16_and_cuda_needs_128_blocks():
    with pytest.raises(T.UsageError, match=r"FP8 head needs .* divisible by 16 .*--model_dim=120"):
        T.resolve_for_device(tiny_config(model_dim=120, fp8_head=True), cuda=False)
    with pytest.raises(T.UsageError, match=r"FP8 MLP needs .* divisible by 16 .*--model_dim=120.*--fp8_mlp=false"):
        T.resolve_for_device(tiny_config(model_dim=120, fp8_head=False), cuda=True)
    T.resolve_for_device(tiny_config(model_dim=120, fp8_head=False, fp8_mlp=False), cuda=True)
    with pytest.raises(T.UsageError, match="--block_size=64: FlexAttention on CUDA needs a multiple of 128"):
        T.resolve_for_device(tiny_config(block_size=64, fp8_head=False), cuda=True)
    T.resolve_for_device(tiny_config(block_size=64, fp8_head=True), cuda=False)
    T.resolve_for_device(tiny_config(block_size=256), cuda=True)
