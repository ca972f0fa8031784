"""Independent reference for four details of modded-nanogpt record #70 ("2026-02-03_VeTuned").

Written from /work/shared/record70_spec.md only; where the spec was unclear, the ``train_gpt.py`` embedded
at the top of the record's log ``records/track_1_short/2026-02-03_VeTuned/42cbebac-...txt``
(upstream KellerJordan/modded-nanogpt) decided.  No code was copied from that file or from this project's
train_gpt.py / gpt_kernels.py.  Helper module for tests: plain functions, torch + numpy only.

Contents
  1. bigram_rows70                       -- §3.3 bigram hash (with #70's position-0/1 behaviour)
  2. adam_step70                         -- §5.2 Adam on a bf16 parameter without fp32 master
  3. master_fp32 / split_master / truncate_to_bf16 / muon_master_update70
                                         -- §5.3 step 4, fp32 master via 16-bit mantissa, §7.2
  4. grad_scale70                        -- §2.1 grad_scale, §4.7 (loss is a sum), §5.4 (AVG over ranks)
     angular_freq70 / rope_tables70 / rope_apply70
                                         -- §4.5 half-truncated RoPE, §7.2 (bf16 tables, fp32 angles)
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "BIGRAM_ROWS70",
    "bigram_rows70",
    "adam_step70",
    "master_fp32",
    "split_master",
    "truncate_to_bf16",
    "muon_master_update70",
    "grad_scale70",
    "angular_freq70",
    "rope_tables70",
    "rope_apply70",
]

BIGRAM_ROWS70: int = 50304 * 5  # 251,520 (§2.1 bigram_vocab_size)
_HASH_MUL_CUR: int = 36313  # multiplies the current token x_p (§3.3)
_HASH_MUL_PREV: int = 27191  # multiplies the previous entry (§3.3)


# ----------------------------------------------------------------------------------------------------
# small exact-arithmetic helpers
# ----------------------------------------------------------------------------------------------------
def _wrap_int32(v: int) -> int:
    """Two's-complement wrap of a Python int into the int32 range (what an int32 tensor stores)."""
    return ((v + 2**31) % 2**32) - 2**31


def _f32(x: float) -> Tensor:
    """A Python float rounded to fp32 (as #70 does with ``torch.tensor(0.0).fill_(python_float)``)."""
    return torch.tensor(float(x), dtype=torch.float64).to(torch.float32)


def _bf16_bits(p_bf16: Tensor) -> np.ndarray:
    """bf16 tensor -> its raw 16-bit patterns as a uint16 numpy array (same shape)."""
    assert p_bf16.dtype == torch.bfloat16
    return p_bf16.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def _as_u16(mantissa: Tensor | np.ndarray) -> np.ndarray:
    """Mantissa buffer given as uint16/int16/int32/int64 (tensor or array) -> uint16 numpy (low 16 bits)."""
    if isinstance(mantissa, Tensor):
        m = mantissa.detach().cpu().contiguous()
        if m.dtype == torch.uint16:
            return m.view(torch.int16).numpy().view(np.uint16)
        m = m.to(torch.int64).numpy()
    else:
        m = np.asarray(mantissa)
        if m.dtype == np.uint16:
            return m
        m = m.astype(np.int64)
    return (m & 0xFFFF).astype(np.uint16)


# ----------------------------------------------------------------------------------------------------
# 1. bigram hash (§3.3)
# ----------------------------------------------------------------------------------------------------
def bigram_rows70(tokens: np.ndarray | Tensor, rows: int = BIGRAM_ROWS70) -> np.ndarray:
    """Bigram-hash row index for every position of ONE rank's input sequence, exactly as #70 computes it.

    Spec §3.3 (M = rows - 1 = 251,519 for #70): h_0 = M (reserved index); h_p = ((36313*x_p) XOR
    (27191*x_{p-1})) mod M, int32 arithmetic, per rank, on host, same for validation windows.

    Resolved from #70's code (``get_bigram_hash``), where the spec is not exact:
      * the input is first converted to int32 and *copied*; position 0 of that copy is overwritten with M
        BEFORE the hash of positions 1.. is formed, and the hash reads the overwritten copy.  Hence
        position 1 hashes (x_1, M), NOT (x_1, x_0); positions p >= 2 hash (x_p, x_{p-1}) (original tokens,
        because the right-hand side is fully evaluated before it is written back).
      * products are int32 tensor x Python int -> int32, and they WRAP (two's complement).  For tokens
        < 50304 no wrap occurs except at position 1, where 27191*M = 6,839,053,129 wraps to
        -1,750,881,463, so the XOR there is negative.  (The spec's "no overflow" remark is wrong for p=1.)
      * ``%`` on an int32 tensor is ``torch.remainder``: floor convention (result has the divisor's sign),
        so the negative XOR at p=1 still gives a row in [0, M).
    All rows are in [0, M]; M = rows-1 is the reserved row, only produced at position 0 (and never by the
    hash, since floor mod M < M).

    Computed with Python ints (exact) and an explicit int32 wrap after every int32 operation.
    Returns an int32 array (the dtype #70 produces) of the same length as ``tokens``.
    """
    if isinstance(tokens, Tensor):
        seq = [int(v) for v in tokens.detach().cpu().reshape(-1).tolist()]
    else:
        seq = [int(v) for v in np.asarray(tokens).reshape(-1).tolist()]
    mod = int(rows) - 1
    assert 0 < mod < 2**31
    x = [_wrap_int32(v) for v in seq]  # ``.to(torch.int32)``
    n = len(x)
    out = np.empty(n, dtype=np.int32)
    if n == 0:
        return out
    x[0] = mod  # overwrite position 0 of the (copied) int32 array first
    out[0] = mod
    for p in range(1, n):
        a = _wrap_int32(_HASH_MUL_CUR * x[p])
        b = _wrap_int32(_HASH_MUL_PREV * x[p - 1])  # x[0] is already the reserved index here
        c = a ^ b  # XOR of two int32 values stays in int32 range (Python ints are sign-extended)
        out[p] = c % mod  # Python % == torch.remainder (floor) for a positive divisor
    return out


# ----------------------------------------------------------------------------------------------------
# 2. Adam without fp32 master (§5.2)
# ----------------------------------------------------------------------------------------------------
def adam_step70(
    p_bf16: Tensor,
    grad: Tensor,
    m: Tensor,
    v: Tensor,
    t: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    wd: float,
    wd_mul: float = 1.0,
    compute_dtype: torch.dtype = torch.float32,
    fma_v: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """One #70 Adam update of a bf16 parameter with fp32 state; returns new (p_bf16, m, v).

    Spec §5.2 / §5.1: m <- b1*m + (1-b1)*g; v <- b2*v + (1-b2)*g^2;
    u = lr*sqrt(1-b2^t)/(1-b1^t) * m/(sqrt(v)+eps) (eps on the UNcorrected sqrt(v));
    u <- u + lam*p*[u*p > 0] (strict >); p <- p - u, bf16 parameter, one rounding.  §7.2: states fp32.

    Arguments (as #70's ``_adam_update`` forms them):
      lr      effective lr = (base_lr * s(step)) * lr_mul, a Python double (e.g. 0.008*s*75 for embeds);
      t       this parameter's Adam step count AFTER the increment (1 on the first Adam step);
      wd, wd_mul  #70's ``weight_decay`` (0.005) and ``wd_mul`` (e.g. 150 for lm_head).  Passing the product
              as ``wd`` with wd_mul=1 is equivalent up to the last bit of a double.

    Exact order of operations resolved from #70's code:
      * the bias correction is folded into a scalar step size computed in Python double,
        step_size = lr * ((1-b2^t)**0.5 / (1-b1^t)), and the decay coefficient
        lam = ((lr*lr)*wd)*wd_mul, both then stored as fp32 0-d tensors (rounded to fp32 once);
      * m = m*b1 + (1-b1)*g;  v = v*b2 + ((1-b2)*g)*g   (addcmul order), all in fp32, g upcast from bf16;
      * update = (m / (sqrt(v) + eps)) * step_size;
      * mask = (update * p) > 0 with p the CURRENT bf16 parameter upcast (strict >);
      * update = update + (lam * p) * mask;
      * p_new = bf16( fp32(p) - update ): a single rounding to bf16 (no master copy; the decay uses bf16 p).
    ``compute_dtype=torch.float32`` reproduces that sequence with per-op fp32 rounding (eager semantics; the
    compiled GPU kernel may contract mul+add into FMA, so the fp32 update can differ by ~1 ulp, which
    very rarely flips the final bf16 rounding).  ``compute_dtype=torch.float64`` gives the real-valued
    version (scalars kept in double), rounded once to bf16 at the end; m, v are returned as fp32.
    ``fma_v=True`` (fp32 only) forms v as fma((1-b2)*g, g, v*b2), i.e. the last multiply-add rounded once;
    this is what torch 2.13 CPU eager ``v.mul_(b2).addcmul_(g, g, value=1-b2)`` produces (measured: the
    default per-op version differs from it by 1 ulp in ~25% of v entries; m matched eager exactly).
    Emulated via float64 (product exact; the double rounding f64->f32 is negligible).

    Gradient (from #70's code, for tests to build ``grad``): the parameter is bf16, so its .grad is bf16.
    Adam params are only updated on odd steps; on the even step the grad is NOT reduced and NOT cleared, the
    odd step's backward accumulates into it in bf16 (local, per rank), then (lm_head only, while tied)
    embed.grad.T is added in bf16, then one AVG reduction over ranks (all_reduce / reduce_scatter,
    bf16, NCCL).  So ``grad`` here is a bf16 tensor = AVG_ranks(bf16(g_even_local + g_odd_local)).
    scalars and x0_lambdas are fp32 parameters (fp32 grads); this function is for the bf16 ones, but also
    accepts an fp32 ``p`` (then the final cast is to fp32).
    """
    cd = compute_dtype
    out_dtype = p_bf16.dtype
    p = p_bf16.detach().to(cd)
    g = grad.detach().to(cd)
    m_ = m.detach().to(cd)
    v_ = v.detach().to(cd)

    bias1 = 1 - beta1**t
    bias2 = 1 - beta2**t
    step_size_py = lr * (bias2**0.5 / bias1)
    eff_wd_py = lr * lr * wd * wd_mul
    if cd == torch.float32:
        step_size = _f32(step_size_py)
        eff_wd = _f32(eff_wd_py)
        b1 = _f32(beta1)
        one_m_b1 = _f32(1 - beta1)
        b2 = _f32(beta2)
        one_m_b2 = _f32(1 - beta2)
        eps_t = _f32(eps)
    else:
        step_size = torch.tensor(step_size_py, dtype=cd)
        eff_wd = torch.tensor(eff_wd_py, dtype=cd)
        b1 = torch.tensor(beta1, dtype=cd)
        one_m_b1 = torch.tensor(1 - beta1, dtype=cd)
        b2 = torch.tensor(beta2, dtype=cd)
        one_m_b2 = torch.tensor(1 - beta2, dtype=cd)
        eps_t = torch.tensor(eps, dtype=cd)

    m_new = m_ * b1 + one_m_b1 * g
    if fma_v and cd == torch.float32:
        v_new = ((v_ * b2).double() + (one_m_b2 * g).double() * g.double()).to(torch.float32)
    else:
        v_new = v_ * b2 + (one_m_b2 * g) * g
    update = (m_new / (torch.sqrt(v_new) + eps_t)) * step_size
    mask = (update * p) > 0
    update = update + (eff_wd * p) * mask.to(cd)
    p_new = (p - update).to(out_dtype)
    return p_new, m_new.to(torch.float32), v_new.to(torch.float32)


# ----------------------------------------------------------------------------------------------------
# 3. NorMuon fp32 master via the 16-bit mantissa (§5.3 step 4, §7.2)
# ----------------------------------------------------------------------------------------------------
def master_fp32(p_bf16: Tensor, mantissa: Tensor | np.ndarray) -> Tensor:
    """fp32 master = (bf16 bit pattern << 16) | mantissa, reinterpreted as float32 (§5.3 step 4).

    ``mantissa`` is the optimizer's uint16 buffer (int16/int32/int64 accepted; low 16 bits are used).
    With mantissa == 0 this is exactly ``p_bf16.float()``.
    """
    hi = _bf16_bits(p_bf16).astype(np.uint32)
    lo = _as_u16(mantissa).astype(np.uint32)
    assert hi.shape == lo.shape, (hi.shape, lo.shape)
    bits = (hi << np.uint32(16)) | lo
    return torch.from_numpy(bits.view(np.float32).copy()).reshape(p_bf16.shape)


def split_master(p32: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 master -> (bf16 = upper 16 bits, i.e. truncation toward zero; mantissa = lower 16 bits, uint16).

    §5.3 step 4: "bf16 p := upper 16 bits of p32 (truncation toward zero), mantissa := lower 16 bits".
    ``master_fp32(*split_master(x))`` reproduces x bit for bit (including -0.0, inf, NaN payloads).
    """
    assert p32.dtype == torch.float32
    bits = p32.detach().cpu().contiguous().numpy().view(np.uint32)
    hi = (bits >> np.uint32(16)).astype(np.uint16)
    lo = (bits & np.uint32(0xFFFF)).astype(np.uint16)
    p_bf16 = torch.from_numpy(hi.view(np.int16).copy()).view(torch.bfloat16).reshape(p32.shape)
    mant = torch.from_numpy(lo.copy()).reshape(p32.shape)
    return p_bf16, mant


def truncate_to_bf16(x_fp32: Tensor) -> Tensor:
    """The bf16 copy the forward pass reads for a NorMuon bank: the upper 16 bits of the fp32 master
    (round toward zero, NOT round-to-nearest as ``x.to(torch.bfloat16)`` would do).  §5.3 step 4, §7.2."""
    return split_master(x_fp32.to(torch.float32))[0]


def muon_master_update70(
    p_bf16: Tensor,
    mantissa: Tensor | np.ndarray,
    update: Tensor,
    lr_eff: float,
    wd_eff: float,
) -> tuple[Tensor, Tensor]:
    """#70's NorMuon parameter update with cautious weight decay on the fp32 master; returns (p_bf16, mantissa).

    Spec §5.3 step 4: p32 = bits(p)<<16 | mantissa; mask = [O''*p32 >= 0] (>=: zero-update entries ARE
    decayed); p32 <- p32 - lam*p32*mask - lr_eff*O''; p := upper 16 bits (truncation), mantissa := lower 16.

    Argument convention = #70's two fp32 0-d factors (``_cautious_wd_and_update_inplace``):
      lr_eff  = eff_lr_t = lr_mul * per_matrix_lr_mul * (0.023 * s)      (0.023 s / 0.046 s / 0.092 s);
      wd_eff  = eff_wd_t = wd_mul * 1.2 * (0.023 * s)   -- NOT including the lr multipliers;
      so the per-element decay is p32 * wd_eff * lr_eff (= 1.2*(0.023 s)*(lr_eff), the table's
      "lr-coupled twice" coefficient).  Both are rounded to fp32 first, then in fp32, left to right:
        mask   = (update * p32) >= 0                      (fp32 product; underflow to 0 counts as >= 0)
        decay  = ((p32 * mask) * wd_eff) * lr_eff
        p32    = (p32 - decay) - (update * lr_eff)
      (eager per-op rounding; a compiled GPU kernel may use FMA: ~1 fp32 ulp.)
    ``update`` is O'' (in #70 a bf16 tensor: Polar Express output times the bf16-cast NorMuon row factor),
    upcast with ``.float()``; pass it in any float dtype.
    """
    wd_f = _f32(wd_eff)
    lr_f = _f32(lr_eff)
    p32 = master_fp32(p_bf16, mantissa)
    u = update.detach().cpu().to(torch.float32).reshape(p32.shape)
    mask = ((u * p32) >= 0).to(torch.float32)
    decay = ((p32 * mask) * wd_f) * lr_f
    new32 = (p32 - decay) - (u * lr_f)
    return split_master(new32)


# ----------------------------------------------------------------------------------------------------
# 4. gradient scale (§2.1, §4.7, §5.4) and RoPE tables (§4.5, §7.2)
# ----------------------------------------------------------------------------------------------------
def grad_scale70(world_size: int, global_seqs: int = 8) -> float:
    """Factor c such that #70's rank-averaged gradient = c * d/dθ [ Σ over the step's ``global_seqs``
    per-rank micro-batch sequences of Σ_p ℓ_p ] (sum of per-token, MTP-weighted losses).

    §2.1/§4.7/§5.4 and #70's code: grad_accum_steps = 8 // world_size; each micro-step's loss is a SUM over
    its tokens, multiplied by grad_scale = 2 / grad_accum_steps before backward; grads accumulate over the
    grad_accum_steps micro-steps on each rank; then AVG over world_size ranks.
    So c = (2 / grad_accum_steps) / world_size = 2 / global_seqs = 0.25 for any valid world_size.
    (Adam parameters, updated on odd steps only, see the sum of two such step gradients.)
    """
    assert world_size >= 1 and global_seqs % world_size == 0, "world_size must divide 8"
    grad_accum_steps = global_seqs // world_size
    grad_scale = 2 / grad_accum_steps
    return grad_scale / world_size


def angular_freq70(head_dim: int = 128) -> Tensor:
    """#70's fp32 RoPE angular frequencies for one head (§4.5), before any YaRN update.

    (1/1024) ** linspace(0, 1, head_dim//4) in fp32 (32 values for head_dim 128), each repeated twice
    (repeat_interleave: dims 2i, 2i+1 share ω_i), then head_dim//2 zeros: dims 0..head_dim/2-1 rotate,
    the upper half is stationary (half-truncated RoPE).  Built with torch fp32 ops like #70 (CPU pow may
    differ from CUDA's by an fp32 ulp).
    """
    f = (1 / 1024) ** torch.linspace(0, 1, steps=head_dim // 4, dtype=torch.float32)
    f = f.repeat_interleave(2)
    return torch.cat([f, f.new_zeros(head_dim // 2)])


def rope_tables70(
    head_dim: int,
    max_len: int,
    paired: bool = False,
    angular_freq: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """#70's RoPE tables (``factor1``, ``factor2``) exactly as its Yarn module builds them (§4.5, §7.2).

    ``max_len`` is Yarn's ``max_seq_len`` argument (262,144 in #70 = val tokens per rank); the tables have
    2*max_len rows (positions t = 0 .. 2*max_len-1, fp32 arange).  θ = outer(t, ω) in fp32 (one fp32
    multiply per entry), cos/sin in fp32, then cast to bf16.
      factor1 = bf16(cos θ);  factor2 = bf16(sin θ) with every ODD column negated (after the bf16 cast).
    Shapes: (2*max_len, head_dim); paired=True: (2*max_len, 2*head_dim) where row t holds
    [table(position 2t) | table(position 2t+1)] (t_even = 2t, t_odd = 2t+1, same ω).
    In the stationary half cos = 1 and factor2 = +0.0 (even cols) / -0.0 (odd cols).
    ``angular_freq`` (fp32) may be given to build post-YaRN tables; default ``angular_freq70(head_dim)``.
    Rotation applied with these tables: see ``rope_apply70`` (interleaved pairs, not split-half).
    """
    freq = angular_freq70(head_dim) if angular_freq is None else angular_freq.to(torch.float32)
    t = torch.arange(2 * max_len, dtype=torch.float32)
    if not paired:
        theta = torch.outer(t, freq)
        f1 = theta.cos().to(torch.bfloat16)
        f2 = theta.sin().to(torch.bfloat16)
    else:
        th1 = torch.outer(2 * t, freq)
        th2 = torch.outer(2 * t + 1, freq)
        f1 = torch.cat((th1.cos(), th2.cos()), dim=-1).to(torch.bfloat16)
        f2 = torch.cat((th1.sin(), th2.sin()), dim=-1).to(torch.bfloat16)
    f2[..., 1::2] *= -1
    return f1, f2


def rope_apply70(x: Tensor, factor1: Tensor, factor2: Tensor, fused_fp32: bool = True) -> Tensor:
    """Apply #70's rotary to x of shape (..., T, H, D) (D = head_dim, or 2*head_dim with paired tables).

    out = factor1[t] * x + factor2[t] * swap_pairs(x), swap_pairs exchanging x_{2i} and x_{2i+1}; i.e.
      out_{2i}   = x_{2i} cos θ_i + x_{2i+1} sin θ_i
      out_{2i+1} = x_{2i+1} cos θ_i - x_{2i} sin θ_i          (§4.5; interleaved pairs)
    Rows 0..T-1 of the tables are used (position = index in the rank's flat sequence).
    fused_fp32=True: both bf16 products are exact in fp32, summed in fp32, rounded once to bf16 (what the
    compiled model computes; FMA-independent because the products are exact).  False: eager bf16 ops
    (each product and the sum rounded to bf16).
    """
    T = x.shape[-3]
    f1 = factor1[:T, None, :]
    f2 = factor2[:T, None, :]
    xs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2).flip(-1).reshape(x.shape)
    if fused_fp32:
        y = f1.float() * x.float() + f2.float() * xs.float()
        return y.to(x.dtype)
    return f1 * x + f2 * xs
