"""DC attention's torch path (train_gpt.dc_attention) against a dense float64 reference of spec §3.2 written out here
(T x T scores, the document and window mask built position by position): values and autograd gradients at the
edges (a zero-length segment, a document longer than the window, query blocks across document boundaries,
trailing padding in cu_seqlens, a window longer than the sequence, a T that is not a multiple of the query block);
the weight's rounding to bf16 with a straight-through gradient; w2 = 0 giving base bit for bit; and the memory
autograd keeps, far below the T x T a dense path would."""

import pytest
import torch

import train_gpt as DC

SCALE = 0.1275175238  # the spec's YaRN scale


def document_starts(cu: list[int], T: int) -> list[int]:
    """s(t) for each t: the last of the first n_docs entries of cu at or before t (the spec's binary search)."""
    n_docs = len(cu) - 1
    return [max(c for c in cu[:n_docs] if c <= t) for t in range(T)]


def dense_reference(base, q, k, v, w1, w2, cu: list[int], scale: float, window: int, round_to=None):
    """§3.2 in float64 with a T x T mask; round_to: the dtype the weight w2 A is rounded to (None: not rounded)."""
    T = base.size(0)
    starts = torch.tensor(document_starts(cu, T))
    t, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    mask = (j >= starts[:, None]) & (j <= t) & (t - j < window)
    q, k, v, w1, w2 = (x[0].double() for x in (q, k, v, w1, w2))
    scores = torch.einsum("thd,jhd->htj", q, k) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    mix = torch.einsum("th,htj->tj", w1, probs)
    weight = w2.T[:, :, None] * mix
    if round_to is not None:
        weight = weight.float().to(round_to).double()
    return base.double() + torch.einsum("htj,jhd->thd", weight, v)


def inputs(T: int, H: int, D: int, dtype: torch.dtype, seed: int = 0, w2_scale: float = 0.3):
    """The spec's validation inputs: q and k RMS-normed N(0, 1), v and base N(0, 1), w1 RMS-normed over the heads
    around 1, w2 = w2_scale N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    rms = lambda x: x / x.square().mean(-1, keepdim=True).sqrt()  # noqa: E731
    q, k = (rms(torch.randn(1, T, H, D, generator=g)) for _ in range(2))
    v = torch.randn(1, T, H, D, generator=g)
    base = torch.randn(T, H, D, generator=g)
    w1 = rms(torch.randn(1, T, H, generator=g) + 1)
    w2 = w2_scale * torch.randn(1, T, H, generator=g)
    return [x.to(dtype).requires_grad_() for x in (base, q, k, v, w1, w2)]


def values_and_grads(fn, tensors, grad_out):
    for x in tensors:
        x.grad = None
    out = fn(*tensors)
    (out.double() * grad_out).sum().backward()
    return [out.detach()] + [x.grad.clone() for x in tensors]


CASES = {  # (T, cu_seqlens, window): each cu starts at 0 and ends with T
    # a zero-length segment at 0, a 37-token document, a 163-token one (longer than the window), trailing padding;
    # T = 250 ends inside the last 64-query block
    "spec_edges": (250, [0, 0, 37, 200, 250, 250], 112),
    "one_document": (150, [0, 150], 112),
    "window_beyond_T": (40, [0, 13, 13, 40], 112),  # the tiny preset's short sequences
    "short_window": (130, [0, 64, 65, 130, 130, 130], 5),  # boundaries on and next to a block edge, a 1-token doc
}


@pytest.mark.parametrize("case", CASES)
def test_torch_path_is_the_dense_formula_and_its_exact_gradient(case):
    T, cu, window = CASES[case]
    tensors = inputs(T, 2, 16, torch.float64)
    grad_out = torch.randn(T, 2, 16, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    got = values_and_grads(lambda *x: DC.dc_attention(*x, cu_t, SCALE, window), tensors, grad_out)
    want = values_and_grads(lambda *x: dense_reference(*x, cu, SCALE, window), tensors, grad_out)
    for name, a, b in zip(("out", "base", "q", "k", "v", "w1", "w2"), got, want):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    assert (got[0] - tensors[0]).abs().max() > 0.1  # the correction is there
    assert got[2].abs().max() > 0.01 and got[5].abs().max() > 0.01  # gradients reach q and w1 (the softmax's path)


def test_fp32_inputs_follow_the_float64_formula():
    T, cu, window = CASES["spec_edges"]
    tensors = inputs(T, 6, 32, torch.float32)
    grad_out = torch.randn(T, 6, 32, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    got = values_and_grads(lambda *x: DC.dc_attention(*x, cu_t, SCALE, window), tensors, grad_out)
    want = values_and_grads(lambda *x: dense_reference(*x, cu, SCALE, window), tensors, grad_out)
    for name, a, b in zip(("out", "base", "q", "k", "v", "w1", "w2"), got, want):
        assert a.dtype == torch.float32
        assert (a.double() - b).abs().max() <= 2e-6 * b.abs().max(), name  # measured <= 4e-7 relative


def test_bf16_rounds_the_weight_and_the_output_and_passes_the_gradient_through_the_rounding():
    T, cu, window = CASES["spec_edges"]
    tensors = inputs(T, 6, 32, torch.bfloat16)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    out = DC.dc_attention(*tensors, cu_t, SCALE, window)
    assert out.dtype == torch.bfloat16 and out.shape == (T, 6, 32)
    rounded = dense_reference(*tensors, cu, SCALE, window, round_to=torch.bfloat16)
    unrounded = dense_reference(*tensors, cu, SCALE, window)
    # out: the formula with the weight rounded, itself rounded to bf16; the fp32 sums' order moves an element across
    # a rounding boundary now and then (measured: 2 of 46,080 differ, by one bf16 step), where the unrounded
    # weight's formula differs in 6,022
    def differing(reference: torch.Tensor) -> int:
        return int((out.double() != reference.to(torch.bfloat16).double()).sum())
    assert differing(rounded) <= 10 and differing(unrounded) > 2000
    assert ((out.double() - rounded).abs() <= 2 ** -6 * rounded.abs()).all()
    # The gradient of w2 is sum_j dm A with the fp32 dm, not dm rounded to bf16 (a plain cast's backward would be):
    # against float64 autograd of the unrounded formula at the same bf16 inputs.
    g = torch.randn(T, 6, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (out.double() * g).sum().backward()
    got_w2 = tensors[5].grad.clone()
    ref_inputs = [x.detach().double().requires_grad_() for x in tensors]
    (dense_reference(*ref_inputs, cu, SCALE, window) * g).sum().backward()
    err = (got_w2.double() - ref_inputs[5].grad).abs().max() / ref_inputs[5].grad.abs().max()
    assert err < 2 ** -8, err  # one bf16 rounding of the stored gradient


def test_w2_zero_gives_base_bit_for_bit():
    T, cu, window = CASES["spec_edges"]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        base, q, k, v, w1, _ = inputs(T, 6, 32, dtype)
        base = (base * 1000).detach()  # large values: an added 0.0 still changes nothing, a tiny term would
        out = DC.dc_attention(base, q, k, v, w1, torch.zeros(1, T, 6, dtype=dtype),
                                    torch.tensor(cu, dtype=torch.int32), SCALE, window)
        assert torch.equal(out, base) and out.dtype == dtype


def test_memory_autograd_saves_grows_with_T_times_the_window_not_T_squared():
    T, H, D, window = 4096, 2, 16, 112
    tensors = inputs(T, H, D, torch.bfloat16)
    cu = torch.tensor([0, 1000, 3000, T], dtype=torch.int32)
    storages: dict[int, int] = {}  # what autograd keeps alive: each storage once (a slice of q shares q's)

    def pack(x: torch.Tensor) -> torch.Tensor:
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = DC.dc_attention(*tensors, cu, SCALE, window)
    out.float().sum().backward()  # and it still differentiates
    # A few fp32 (T, H, block + window) maps (scores, probabilities, the weights), q, k, v in fp32 (k and v as the
    # blocks' reach: (block + window) / block of their size) and the masks: T x (block + window) per head, where a
    # dense path's scores alone are T x T.
    keys = 64 + window - 1
    per_map, per_qkv = T * H * keys * 4, T * H * D * 4 * keys / 64
    assert sum(storages.values()) <= 6 * per_map + 4 * per_qkv + T * keys, sum(storages.values())
    assert sum(storages.values()) < T * T * H * 4 / 5
    assert tensors[1].grad is not None and tensors[1].grad.abs().max() > 0
