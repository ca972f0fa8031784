"""CPU stand-in for Flash-Attention 3's ``flash_attn_varlen_func``, for tests.

Follows the semantics FA3 documents in ``hopper/flash_attn_interface.py``
(Dao-AILab/flash-attention): q (total_q, nheads, headdim) and k, v
(total_k, nheads_k, headdim) hold packed sequences; sequence b is rows
``cu_seqlens[b]:cu_seqlens[b + 1]``; ``softmax_scale`` defaults to headdim**-0.5;
causal is bottom-right aligned; ``window_size=(left, right)`` lets the query at
position i of its sequence see keys at positions
[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]; a fully
masked row gives zero (never arises in the cases implemented here: every query
sees its own key); the output has q's dtype.

It is one ``scaled_dot_product_attention`` call under a dense (total, total)
boolean mask built from ``cu_seqlens``, so autograd gives dq, dk, dv and it
traces under ``torch.compile(fullgraph=True)``. Memory is O(total**2): test
sizes only. Checks that read tensor values (cu_seqlens contents, lengths vs
max_seqlen) run only outside torch.compile; under fullgraph compile a failed
shape/dtype check surfaces as dynamo's Unsupported error carrying the message.

Left out (NotImplementedError): cu_seqlens_q != cu_seqlens_k, GQA/MQA
(nheads_k != nheads), a window without causal, a right window other than 0,
and the extra FA3 inputs (seqused_*, qv, fp8 descales, attention_chunk,
softcap, return_attn_probs). Unlike FA3, which takes only fp16/bf16/fp8, it
also accepts fp32 so tests can compare tightly. ``softmax_scale`` and later
arguments are keyword-only: FA3's 8th positional parameter is ``seqused_q``,
so a positional call that works here would go wrong on the GPU.
"""

from typing import Any

import torch
import torch.nn.functional as F

# Performance/scheduling knobs of FA3: they do not change the result.
_IGNORED_KWARGS = frozenset({"num_splits", "pack_gqa", "deterministic", "sm_margin"})
# FA3 inputs that change the result; only their defaults are implemented.
_UNIMPLEMENTED_KWARGS: dict[str, Any] = {
    "seqused_q": None,
    "seqused_k": None,
    "qv": None,
    "q_descale": None,
    "k_descale": None,
    "v_descale": None,
    "attention_chunk": 0,
    "softcap": 0.0,
    "return_attn_probs": False,
}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_unused(unused: dict[str, Any]) -> None:
    for name, value in unused.items():
        if name in _IGNORED_KWARGS:
            continue
        if name not in _UNIMPLEMENTED_KWARGS:
            raise TypeError(f"flash_attn_varlen_func() got an unexpected keyword argument {name!r}")
        default = _UNIMPLEMENTED_KWARGS[name]
        if (value is not None) if default is None else (value != default):
            raise NotImplementedError(f"FA3 stand-in: {name}={value!r} is not implemented (only {default!r})")


def _check_cu_seqlens(name: str, cu: torch.Tensor, q: torch.Tensor) -> None:
    assert cu.dtype == torch.int32, f"{name} must be torch.int32 (FA3 requirement), got {cu.dtype}"
    assert cu.dim() == 1, f"{name} must be 1-D (batch + 1,), got shape {tuple(cu.shape)}"
    assert cu.numel() >= 2, f"{name} needs at least 2 entries (batch + 1), got {cu.numel()}"
    assert cu.is_contiguous(), f"{name} must be contiguous (FA3 requirement)"
    assert cu.device == q.device, f"{name} is on {cu.device} but q is on {q.device}"


def _check_cu_values(name: str, cu: torch.Tensor, total: int, max_seqlen: int) -> None:
    # Reads values, so only called outside torch.compile.
    assert int(cu[0]) == 0, f"{name} must start at 0, got {cu.tolist()}"
    lengths = cu[1:] - cu[:-1]
    assert bool((lengths >= 0).all()), f"{name} must be non-decreasing, got {cu.tolist()}"
    assert int(cu[-1]) == total, f"{name} must end at the token count {total}, got {cu.tolist()}"
    # FA3 sizes its work from max_seqlen; a longer sequence is silently mis-computed.
    longest = int(lengths.max())
    assert longest <= max_seqlen, f"{name} has a sequence of length {longest} > max_seqlen {max_seqlen}"


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    **unused: Any,
) -> torch.Tensor:
    """FA3 ``flash_attn_varlen_func`` on any device; returns (total_q, nheads, headdim)."""
    _check_unused(unused)
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.dim() == 3, f"{name} must be 3-D (total, nheads, headdim), got shape {tuple(t.shape)}"
    total, nheads, headdim = q.shape
    assert k.shape[0] == v.shape[0] == total, (
        f"q, k, v token counts differ: {q.shape[0]}, {k.shape[0]}, {v.shape[0]}"
    )
    assert k.shape[2] == v.shape[2] == headdim, f"q, k, v head dims differ: {headdim}, {k.shape[2]}, {v.shape[2]}"
    assert k.shape[1] == v.shape[1], f"k and v head counts differ: {k.shape[1]}, {v.shape[1]}"
    assert nheads % k.shape[1] == 0, f"nheads_k {k.shape[1]} must divide nheads {nheads} (FA3 requirement)"
    if k.shape[1] != nheads:
        raise NotImplementedError(f"FA3 stand-in: GQA/MQA (nheads {nheads}, nheads_k {k.shape[1]}) not implemented")
    assert headdim % 8 == 0 and headdim <= 256, f"FA3 needs headdim a multiple of 8 and <= 256, got {headdim}"
    assert q.dtype in _DTYPES, f"q dtype {q.dtype} not supported (FA3: fp16/bf16; stand-in also fp32)"
    assert k.dtype == v.dtype == q.dtype, f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}"
    assert k.device == v.device == q.device, f"q, k, v devices differ: {q.device}, {k.device}, {v.device}"
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q)
    assert cu_seqlens_q.shape == cu_seqlens_k.shape, (
        f"cu_seqlens_q and cu_seqlens_k batch sizes differ: {cu_seqlens_q.numel()}, {cu_seqlens_k.numel()}"
    )

    left, right = window_size
    if window_size != (-1, -1):
        if not causal:
            raise NotImplementedError(f"FA3 stand-in: window_size={window_size} without causal not implemented")
        # FA3 forces right to 0 under causal; any other value means the caller expects something else.
        if right != 0 or left < -1:
            raise NotImplementedError(f"FA3 stand-in: window_size={window_size} not implemented (need (left >= -1, 0))")

    if not torch.compiler.is_compiling():
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int), (
            f"max_seqlen_q/k must be Python ints, got {type(max_seqlen_q).__name__}, {type(max_seqlen_k).__name__}"
        )
        _check_cu_values("cu_seqlens_q", cu_seqlens_q, total, max_seqlen_q)
        _check_cu_values("cu_seqlens_k", cu_seqlens_k, total, max_seqlen_k)
        if not torch.equal(cu_seqlens_q, cu_seqlens_k):
            raise NotImplementedError("FA3 stand-in: cu_seqlens_q != cu_seqlens_k not implemented")

    # Segment of each row = last b with cu[b] <= row; trailing zero-length
    # sequences (repeated totals) never win because no row reaches the total.
    rows = torch.arange(total, device=q.device, dtype=torch.int32)
    segment = torch.searchsorted(cu_seqlens_q, rows, right=True)
    allowed = segment[:, None] == segment[None, :]
    # With cu_seqlens_q == cu_seqlens_k, seqlen_k - seqlen_q = 0 and the
    # position offsets within a sequence cancel, so the rules use row - col.
    offset = rows[:, None] - rows[None, :]
    if causal:
        allowed = allowed & (offset >= 0)
    if left >= 0:
        allowed = allowed & (offset <= left)

    scale = headdim**-0.5 if softmax_scale is None else softmax_scale
    # SDPA wants (..., tokens, headdim): heads become the batch dimension.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=scale
    )
    # FA3 returns a contiguous (total_q, nheads, headdim) tensor; callers may .view() it.
    return out.transpose(0, 1).contiguous()
