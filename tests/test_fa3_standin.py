"""Pins tests/fa3_standin.py against a per-sequence float64 reference of FA3's documented semantics."""

from typing import Any

import pytest
import torch

from fa3_standin import flash_attn_varlen_func

HEADDIM = 8  # FA3 needs a multiple of 8
CU_SEQLENS = {
    "single": [0, 16],
    "packed": [0, 5, 12, 16],
    "padded": [0, 5, 12, 16, 16, 16],
    "empty_middle": [0, 3, 3, 10, 16],
    "singletons": [0, 1, 2, 3, 4, 16, 16],
}
WINDOWS = [-1, 0, 1, 3, 100]  # -1: no window; 100: wider than any sequence


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float, causal: bool,
    window: tuple[int, int],
) -> torch.Tensor:
    """FA3 docstring rule, one sequence at a time, float64, explicit softmax."""
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros_like(q)
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        seqlen_q = seqlen_k = end - start
        if seqlen_q == 0:
            continue
        i = torch.arange(seqlen_q)[:, None]
        j = torch.arange(seqlen_k)[None, :]
        allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
        if causal:  # bottom-right aligned
            allowed &= j <= i + seqlen_k - seqlen_q
        left, right = window
        if left >= 0:
            allowed &= j >= i + seqlen_k - seqlen_q - left
        if right >= 0:
            allowed &= j <= i + seqlen_k - seqlen_q + right
        scores = torch.einsum("ihd,jhd->hij", q[start:end], k[start:end]) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        row_max = scores.amax(-1, keepdim=True).clamp_min(-1e300)  # finite for fully masked rows
        weights = torch.exp(scores - row_max)
        probs = weights / weights.sum(-1, keepdim=True).clamp_min(1e-300)  # fully masked row -> 0
        out[start:end] = torch.einsum("hij,jhd->ihd", probs, v[start:end])
    return out


def make_inputs(total: int, nheads: int = 3, dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(total, nheads, HEADDIM, generator=gen).to(dtype).requires_grad_() for _ in range(3)]


def run_both(
    cu_list: list[int], window: int, dtype: torch.dtype, causal: bool = True, scale: float | None = None,
    nheads: int = 3,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(out, dq, dk, dv) from the stand-in and from the float64 reference."""
    cu = torch.tensor(cu_list, dtype=torch.int32)
    max_seqlen = max(b - a for a, b in zip(cu_list[:-1], cu_list[1:]))
    q, k, v = make_inputs(cu_list[-1], nheads, dtype)
    window_size = (window, 0) if window >= 0 else (-1, -1)
    out = flash_attn_varlen_func(
        q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale, causal=causal, window_size=window_size
    )
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_scale = HEADDIM**-0.5 if scale is None else scale
    ref = reference(q64, k64, v64, cu, ref_scale, causal, window_size)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad_out.double())
    return (out, *grads), (ref, *ref_grads)


def assert_close(
    got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], atol: float = 0.0, rel_to_max: float = 0.0
) -> None:
    """Max abs error <= atol + rel_to_max * max|want|, per tensor."""
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        err = (g.double() - w).abs().max().item()
        bound = atol + rel_to_max * w.abs().max().item()
        assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cu_name", CU_SEQLENS)
def test_fp32_matches_reference(cu_name: str, window: int) -> None:
    got, want = run_both(CU_SEQLENS[cu_name], window, torch.float32)
    assert got[0].dtype == torch.float32 and got[0].shape == want[0].shape
    assert got[0].is_contiguous()  # like FA3's output, so callers may .view() it
    # Measured max error 7.7e-7 over all these cases.
    assert_close(got, want, atol=1e-5)


@pytest.mark.parametrize("window", [-1, 1])
@pytest.mark.parametrize("cu_name", ["padded", "single"])
def test_bf16_matches_reference(cu_name: str, window: int) -> None:
    got, want = run_both(CU_SEQLENS[cu_name], window, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in got)
    # Measured over every CU_SEQLENS x WINDOWS case: max error 3.1e-3 of the
    # tensor's max |value| (on this CPU, exactly the cost of rounding the exact
    # result to bf16). 2**-6 (1.6e-2) leaves room for other SDPA backends; a mask
    # error is O(1).
    assert_close(got, want, rel_to_max=2**-6)


def test_non_causal_and_explicit_scale() -> None:
    got, want = run_both(CU_SEQLENS["padded"], -1, torch.float32, causal=False, scale=0.7)
    assert_close(got, want, atol=1e-5)


def test_single_head() -> None:
    got, want = run_both(CU_SEQLENS["packed"], 2, torch.float32, nheads=1)
    assert_close(got, want, atol=1e-5)


def test_window_zero_is_identity_on_v() -> None:
    # Window 0 under causal: each query sees only its own key, so out == v.
    cu = torch.tensor(CU_SEQLENS["padded"], dtype=torch.int32)
    q, k, v = make_inputs(16)
    out = flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True, window_size=(0, 0))
    torch.testing.assert_close(out, v, rtol=0, atol=1e-6)


def test_compiled_fullgraph_matches_eager() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")  # traces forward and backward, no C++ build
    compiled = torch.compile(flash_attn_varlen_func, backend=counter, fullgraph=True)
    # Same shapes, different boundaries: one graph must serve both (mask built from data).
    for cu_list in (CU_SEQLENS["padded"], [0, 2, 9, 10, 16, 16]):
        cu = torch.tensor(cu_list, dtype=torch.int32)
        q, k, v = make_inputs(16)
        kwargs = dict(causal=True, window_size=(3, 0))
        eager = flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, **kwargs)
        eager_grads = torch.autograd.grad(eager.sum(), (q, k, v))
        out = compiled(q, k, v, cu, cu, 8, 8, **kwargs)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        torch.testing.assert_close(out, eager, rtol=0, atol=1e-6)
        for g, e in zip(grads, eager_grads):
            torch.testing.assert_close(g, e, rtol=0, atol=1e-6)
    assert counter.frame_count == 1


def test_compiled_still_checks_static_requirements() -> None:
    # Under fullgraph the failed assert surfaces as dynamo's Unsupported, carrying the message.
    compiled = torch.compile(flash_attn_varlen_func, backend="eager", fullgraph=True)
    q, k, v = make_inputs(16)
    cu = torch.tensor([0, 16])
    with pytest.raises(Exception, match="cu_seqlens_q must be torch.int32"):
        compiled(q, k, v, cu, cu, 16, 16, causal=True)


def _call(
    cu: Any = (0, 5, 12, 16, 16), max_seqlen: Any = 7, q_shape: tuple[int, ...] = (16, 2, HEADDIM),
    k_shape: tuple[int, ...] = (16, 2, HEADDIM), v_shape: tuple[int, ...] = (16, 2, HEADDIM),
    dtype: torch.dtype = torch.float32, k_dtype: torch.dtype | None = None, cu_k: Any = None,
    cu_dtype: torch.dtype = torch.int32, args: tuple[Any, ...] = (), **kwargs: Any,
) -> torch.Tensor:
    """A valid call (16 tokens in 3 sequences, padded) with one thing changed."""
    q = torch.randn(q_shape, dtype=dtype)
    k = torch.randn(k_shape, dtype=k_dtype or dtype)
    v = torch.randn(v_shape, dtype=dtype)
    cu_q = torch.tensor(cu, dtype=cu_dtype)
    cu_k = cu_q if cu_k is None else torch.tensor(cu_k, dtype=cu_dtype)
    kwargs.setdefault("causal", True)
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen, max_seqlen, *args, **kwargs)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (dict(q_shape=(1, 16, 2, HEADDIM)), AssertionError, "q must be 3-D"),
        (dict(k_shape=(15, 2, HEADDIM)), AssertionError, "token counts differ"),
        (dict(v_shape=(16, 2, 16)), AssertionError, "head dims differ"),
        (dict(q_shape=(16, 2, 12), k_shape=(16, 2, 12), v_shape=(16, 2, 12)), AssertionError, "multiple of 8"),
        (dict(k_shape=(16, 1, HEADDIM)), AssertionError, "k and v head counts differ"),
        (dict(q_shape=(16, 4, HEADDIM), k_shape=(16, 2, HEADDIM), v_shape=(16, 2, HEADDIM)),
         NotImplementedError, "GQA"),
        (dict(k_dtype=torch.bfloat16), AssertionError, "dtypes differ"),
        (dict(dtype=torch.float64), AssertionError, "not supported"),
        (dict(cu_dtype=torch.int64), AssertionError, "int32"),
        (dict(cu=[[0, 16]]), AssertionError, "1-D"),
        (dict(cu=[1, 5, 12, 16]), AssertionError, "start at 0"),
        (dict(cu=[0, 12, 5, 16]), AssertionError, "non-decreasing"),
        (dict(cu=[0, 5, 12, 15]), AssertionError, "end at the token count 16"),
        (dict(cu=[0, 5, 12, 16, 16, 17]), AssertionError, "end at the token count 16"),
        (dict(max_seqlen=6), AssertionError, "length 7 > max_seqlen 6"),
        (dict(max_seqlen=torch.tensor(7)), AssertionError, "Python ints"),
        (dict(cu_k=[0, 6, 12, 16, 16]), NotImplementedError, "cu_seqlens_q != cu_seqlens_k"),
        (dict(cu_k=[0, 5, 12, 16]), AssertionError, "batch sizes differ"),
        (dict(causal=False, window_size=(3, 0)), NotImplementedError, "without causal"),
        (dict(window_size=(3, 1)), NotImplementedError, "window_size"),
        (dict(window_size=(-2, 0)), NotImplementedError, "window_size"),
        (dict(softcap=1.0), NotImplementedError, "softcap"),
        (dict(seqused_q=torch.tensor([5], dtype=torch.int32)), NotImplementedError, "seqused_q"),
        (dict(return_attn_probs=True), NotImplementedError, "return_attn_probs"),
        (dict(dropout_p=0.1), TypeError, "dropout_p"),
        # FA3's 8th positional parameter is seqused_q, not softmax_scale.
        (dict(args=(None,)), TypeError, "positional"),
    ],
)
def test_rejects(bad: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        _call(**bad)


def test_accepts_scheduling_kwargs() -> None:
    out = _call(num_splits=1, pack_gqa=None, deterministic=True, sm_margin=0, softcap=0.0, seqused_q=None)
    assert out.shape == (16, 2, HEADDIM)
