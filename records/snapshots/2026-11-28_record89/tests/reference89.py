"""Independent float64 reference of record #89 ("2026-07-17_FP8DownProjection"): data hashes, model forward, schedule.

Written from /work/shared/record89_spec.md sections 1-4 and 6 (and record70_spec.md 4.4 for the paired-head
layers) and /work/port89_interface.md (parameter names / shapes / generic layer roles).  Where the spec was unclear,
the train_gpt.py embedded in the record's log (upstream KellerJordan/modded-nanogpt,
records/track_1_short/2026-07-17_FP8DownProjection/this_pr/11cb620c-....txt, "r89.py") decided; no code was copied
from it nor from this project's train_gpt.py / gpt_kernels.py.  Plain functions, torch + numpy only.

Numerics: every activation is float64.  bf16 roundings are applied only where the record rounds a VALUE before use:
  * resid / post / x0 / bigram lambdas: ``.bfloat16()`` of the fp32 parameter (r89.py:1402-1407);
  * tanh(xsa_alpha) cast to bf16 (``.type_as(y)``, r89.py:1130);
  * parameters stored in bf16 (mudd_b2 init etc.) are taken at their stored value.
The FP8 MLP / FP8 lm_head / bf16 sigmoid of the CE kernel are NOT modelled (MLP = relu(u W_fc^T)^2 W_proj in float64).
RMSNorm eps = fp32 machine epsilon (what F.rms_norm uses for the record's bf16 inputs).

Contents
  bigram_hash89, sign_index89                       -- spec 3.3, 3.4
  Cfg89, cfg89, cfg_tiny                            -- config (interface's generic layer roles)
  mudd_b2_init89, INIT_LAWS89, random_init_params89 -- spec 4.1 / 4.6 init
  rope_freqs89, yarn89, rope89                      -- spec 4.4
  forward89, logits89, softcap89, mtp_loss89, eval_ce89, loss89   -- spec 4.5-4.7, 4.10
  stage_ends89, schedule89, warmup_steps89          -- spec 6
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "BOS89", "BIGRAM_ROWS89", "bigram_hash89", "sign_index89",
    "Cfg89", "cfg89", "cfg_tiny",
    "mudd_b2_init89", "INIT_LAWS89", "random_init_params89",
    "rope_freqs89", "yarn89", "rope89",
    "forward89", "logits89", "softcap89", "mtp_loss89", "eval_ce89", "loss89",
    "stage_ends89", "schedule89", "warmup_steps89",
]

BOS89: int = 50256
BIGRAM_ROWS89: int = 50304 * 15  # 754,560 (spec 2.1)
_HASH_MUL_CUR: int = 36313
_HASH_MUL_PREV: int = 27191
RMS_EPS: float = float(torch.finfo(torch.float32).eps)  # F.rms_norm(eps=None) on bf16 input -> fp32 eps
MUDD_SCALE: float = 0.1
MUDD_N_COEF: tuple[int, int] = (14, 5)


# ----------------------------------------------------------------------------------------------------
# spec 3.3 / 3.4: bigram hash and sign index
# ----------------------------------------------------------------------------------------------------
def _as_int64_np(tokens) -> np.ndarray:
    if isinstance(tokens, Tensor):
        return tokens.detach().cpu().reshape(-1).to(torch.int64).numpy()
    return np.asarray(tokens).reshape(-1).astype(np.int64)


def _wrap32(a: np.ndarray) -> np.ndarray:
    """two's-complement int32 wrap of int64 values"""
    return ((a + 2**31) % 2**32) - 2**31


def bigram_hash89(tokens, rows: int = BIGRAM_ROWS89) -> np.ndarray:
    """Bigram-hash row of every position of ONE rank's input sequence (spec 3.3, r89.py:get_bigram_hash).

    M = rows - 1.  h_0 = M.  Position 0 of the int32 copy is overwritten with M BEFORE hashing, so
    h_1 = remainder((36313 x_1) XOR wrap32(27191 M), M); h_p = remainder((36313 x_p) XOR (27191 x_{p-1}), M), p >= 2.
    Products wrap in int32; ``%`` on a tensor is floor-mod (result in [0, M)).  No document masking.
    Returns int32 numpy array.
    """
    x = _wrap32(_as_int64_np(tokens))
    mod = int(rows) - 1
    n = x.shape[0]
    out = np.empty(n, dtype=np.int64)
    if n == 0:
        return out.astype(np.int32)
    prev = x.copy()
    prev[0] = mod  # the overwrite happens before the hash of positions >= 1 reads out[:-1]
    out[0] = mod
    if n > 1:
        a = _wrap32(_HASH_MUL_CUR * x[1:])
        b = _wrap32(_HASH_MUL_PREV * prev[:-1])
        c = np.bitwise_xor(a, b)  # int32 XOR of sign-extended values stays in int32 range
        out[1:] = np.mod(c, mod)  # floor convention, like torch.remainder
    return out.astype(np.int32)


def sign_index89(tokens, sign_rows: int = 8192) -> np.ndarray:
    """Sign-table row per position (spec 3.4): s_0 = 0, s_p = (x_{p-1} XOR x_p) mod sign_rows (raw token ids)."""
    x = _wrap32(_as_int64_np(tokens))
    out = np.zeros(x.shape[0], dtype=np.int64)
    if x.shape[0] > 1:
        out[1:] = np.mod(np.bitwise_xor(x[:-1], x[1:]), int(sign_rows))
    return out


# ----------------------------------------------------------------------------------------------------
# config (interface's generic roles)
# ----------------------------------------------------------------------------------------------------
@dataclass
class Cfg89:
    num_layers: int = 11
    model_dim: int = 768
    num_heads: int = 6
    head_dim: int = 128
    attn_pattern: str = "SSSLSS-SSSL"
    paired_layers: str = "0,2,5,9"
    value_embeds: str = "-01-----234"
    skip: str = "3:6"
    attn_input_layer: int = 7
    bigram_rows: int = BIGRAM_ROWS89
    bigram_dim: int = 192
    bigram_sign_rows: int = 8192
    mudd_dim: int = 64
    block_size: int = 128
    vocab_size: int = 50304
    logit_cap: float = 23.0
    logit_shift: float = 5.0
    logit_temp: float = 7.5
    gate_channels: int = 12

    # ---- derived roles ----
    @property
    def attn_layers(self) -> list[int]:
        return [i for i, c in enumerate(self.attn_pattern) if c != "-"]

    @property
    def n_attn(self) -> int:
        return len(self.attn_layers)

    def attn_index(self, i: int) -> int:
        return self.attn_layers.index(i)

    @property
    def paired(self) -> set[int]:
        return {int(s) for s in self.paired_layers.split(",") if s.strip() != ""}

    @property
    def long_layers(self) -> set[int]:  # also the key-offset layers
        return {i for i, c in enumerate(self.attn_pattern) if c == "L"}

    @property
    def xsa_layers(self) -> list[int]:
        return [i for i in self.attn_layers if i not in self.paired]

    def ve_table(self, i: int) -> int | None:
        c = self.value_embeds[i]
        return None if c == "-" else int(c)

    @property
    def ve_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.ve_table(i) is not None]

    @property
    def n_ve_tables(self) -> int:
        return 1 + max(self.ve_table(i) for i in self.ve_layers)

    @property
    def skip_pair(self) -> tuple[int, int]:
        a, b = self.skip.split(":")
        return int(a), int(b)

    def check(self) -> None:
        assert len(self.attn_pattern) == self.num_layers == len(self.value_embeds)
        assert self.num_heads * self.head_dim == self.model_dim and self.num_heads % 2 == 0
        assert all(self.attn_pattern[i] == "S" for i in self.paired)
        a, b = self.skip_pair
        assert self.attn_pattern[b] == "-" and a < b


def cfg89() -> Cfg89:
    return Cfg89()


def cfg_tiny() -> Cfg89:
    return Cfg89(num_layers=5, model_dim=128, num_heads=2, head_dim=64, attn_pattern="SL-SL", paired_layers="0",
                 value_embeds="0--12", skip="1:2", attn_input_layer=3, bigram_rows=2 * 50304, bigram_dim=32,
                 bigram_sign_rows=8192, mudd_dim=16)


# ----------------------------------------------------------------------------------------------------
# init (spec 4.1, 4.6)
# ----------------------------------------------------------------------------------------------------
def mudd_b2_init89(dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """(2, 14) MUDD bias init, "pre-scaled" (effective = b2 * 0.1), built in fp32 then cast (r89.py:1328-1340)."""
    b = torch.zeros(2, 14, dtype=torch.float32)
    b[0, 6] = 2.0 / MUDD_SCALE
    b[0, 7] = 2.0 / MUDD_SCALE
    b[0, 8] = 1.1 ** 0.5 / MUDD_SCALE
    b[0, 9] = 1.0 / MUDD_SCALE
    b[0, 10] = 0.0
    b[0, 11] = 0.05 / MUDD_SCALE
    b[0, 12] = 1.1 ** 0.5 / MUDD_SCALE
    b[0, 13] = 1.0 / MUDD_SCALE
    b[1, 1] = -0.5 / MUDD_SCALE
    return b.to(dtype)


INIT_LAWS89: dict[str, str] = {
    "embed.weight": "exact copy of lm_head.weight (interface stores both (V, d))",
    "lm_head.weight": "N(0, 0.005) drawn in bf16",
    "value_embeds": "0.01 * N(0,1) (randn in bf16, then x0.01)",
    "bigram_embed.weight": "zeros",
    "bigram_sign_table": "sign(N(0,1)) in {-1,+1}, bf16 buffer",
    "smear_gate.weight": "zeros", "skip_gate.weight": "zeros",
    "attn_gate_bank": "zeros", "ve_gate_bank": "zeros",
    "qk_bank": "U(+-sqrt(3)*0.5*d^-0.5) (1/32 at d=768), cast bf16",
    "vo_bank": "U(+-sqrt(3)*0.5*d^-0.5), cast bf16",
    "mlp_bank": "[:,0] (W_fc) U(+-sqrt(3)*0.5*d^-0.5); [:,1] (W_proj) zeros; cast bf16",
    "scalars": "[0.5, 1.0] x L, then 0.0 (smear), -1.5 (skip); fp32",
    "post_lambdas": "ones (L,2) fp32", "resid_lambdas": "sqrt(1.1) (L,2) fp32",
    "x0_lambdas": "zeros (L,) fp32", "bigram_lambdas": "0.05 (L,) fp32", "xsa_alphas": "zeros (L,H) fp32",
    "mudd_w1": "kaiming_uniform(a=sqrt5) per block = U(+-1/sqrt(d)), cast bf16",
    "mudd_w2": "zeros, bf16", "mudd_b2": "mudd_b2_init89(), bf16",
}


def random_init_params89(cfg: Cfg89, seed: int = 0) -> tuple[dict[str, Tensor], Tensor]:
    """A parameter dict at init (interface names/shapes/dtypes) + sign table, following INIT_LAWS89. For tests."""
    cfg.check()
    g = torch.Generator().manual_seed(seed)
    L, d, H, D, V = cfg.num_layers, cfg.model_dim, cfg.num_heads, cfg.head_dim, cfg.vocab_size
    na, bound = cfg.n_attn, math.sqrt(3) * 0.5 * d ** -0.5
    bf = torch.bfloat16

    def U(*shape, b=bound):
        return (torch.rand(*shape, generator=g, dtype=torch.float32) * 2 - 1) * b

    lm = (torch.randn(V, d, generator=g, dtype=bf) * 0.005).to(bf)
    mlp = torch.zeros(L, 2, 4 * d, d)
    mlp[:, 0] = U(L, 4 * d, d)
    p = {
        "embed.weight": lm.clone(),
        "lm_head.weight": lm,
        "value_embeds": 0.01 * torch.randn(cfg.n_ve_tables, V, d, generator=g, dtype=bf),
        "bigram_embed.weight": torch.zeros(cfg.bigram_rows, cfg.bigram_dim, dtype=bf),
        "smear_gate.weight": torch.zeros(1, cfg.gate_channels, dtype=bf),
        "skip_gate.weight": torch.zeros(1, cfg.gate_channels, dtype=bf),
        "attn_gate_bank": torch.zeros(na, H, cfg.gate_channels, dtype=bf),
        "ve_gate_bank": torch.zeros(len(cfg.ve_layers), H, cfg.gate_channels, dtype=bf),
        "qk_bank": U(na * H, 2 * D, d).to(bf),
        "vo_bank": U(2 * na, H * D, d).to(bf),
        "mlp_bank": mlp.to(bf),
        "scalars": torch.tensor([0.5, 1.0] * L + [0.0, -1.5], dtype=torch.float32),
        "post_lambdas": torch.ones(L, 2),
        "resid_lambdas": torch.full((L, 2), 1.1 ** 0.5),
        "x0_lambdas": torch.zeros(L),
        "bigram_lambdas": 0.05 * torch.ones(L),
        "xsa_alphas": torch.zeros(L, H),
        "mudd_w1": U(2, cfg.mudd_dim, d, b=1 / math.sqrt(d)).to(bf),
        "mudd_w2": torch.zeros(2, 14, cfg.mudd_dim, dtype=bf),
        "mudd_b2": mudd_b2_init89(bf),
    }
    sign = torch.randn(cfg.bigram_sign_rows, cfg.bigram_dim, generator=g).sign().to(bf)
    return p, sign


# ----------------------------------------------------------------------------------------------------
# RoPE / YaRN (spec 4.4)
# ----------------------------------------------------------------------------------------------------
def rope_freqs89(head_dim: int = 128) -> Tensor:
    """Initial angular frequencies (float64): (1/1024)^(i/(D/4-1)), i < D/4, each twice, then D/2 zeros."""
    n = head_dim // 4
    i = torch.arange(n, dtype=torch.float64)
    w = (1.0 / 1024.0) ** (i / (n - 1))
    w = w.repeat_interleave(2)
    return torch.cat([w, torch.zeros(head_dim // 2, dtype=torch.float64)])


def yarn89(long_windows_so_far, head_dim: int = 128, alpha: float = 1.0, beta: float = 32.0,
           initial_scale: float = 0.1) -> tuple[Tensor, float]:
    """(frequencies (D,) float64, softmax scale) after the YaRN updates of a history of long windows in TOKENS.

    ``long_windows_so_far``: the long window of stage 0, then each later value in force (e.g. [384, 896, 1408]);
    every change W_old -> W_new applies  w <- w*(r + clamp((W_old w/2pi - alpha)/(beta-alpha), 0, 1)(1 - r)),
    r = W_old/W_new, and scale <- scale*(0.2 ln(W_new/W_old) + 1) (r89.py Yarn.apply).  Equal neighbours: no-op.
    (The final validation's 2560 is never passed through YaRN in the record: do not include it.)
    """
    w = rope_freqs89(head_dim)
    scale = float(initial_scale)
    ws = [int(v) for v in long_windows_so_far]
    for old, new in zip(ws[:-1], ws[1:]):
        if new == old:
            continue
        rot = old * w / (2 * math.pi)
        r = old / new
        interp = torch.clamp((rot - alpha) / (beta - alpha), 0, 1)
        w = w * (r + interp * (1 - r))
        scale *= 0.2 * math.log(new / old) + 1
    return w, scale


def rope89(x: Tensor, pos: Tensor, freqs: Tensor) -> Tensor:
    """Interleaved-pair rotation of x (..., D) at positions pos (broadcastable to x[..., 0]):
    x'_{2i} = x_{2i} cos + x_{2i+1} sin, x'_{2i+1} = x_{2i+1} cos - x_{2i} sin, theta = pos * freq."""
    th = pos.to(torch.float64)[..., None] * freqs.to(torch.float64)
    c, s = th.cos(), th.sin()
    xf = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2).flip(-1).reshape(x.shape)  # swap pairs
    sign = torch.ones(x.shape[-1], dtype=torch.float64)
    sign[1::2] = -1
    return c * x + s * sign * xf


# ----------------------------------------------------------------------------------------------------
# forward (spec 4.5 - 4.7)
# ----------------------------------------------------------------------------------------------------
def _norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), eps=RMS_EPS)


def _bf(t: Tensor) -> Tensor:
    """value rounded to bf16, then float64"""
    return t.detach().to(torch.bfloat16).to(torch.float64)


def _d(t: Tensor) -> Tensor:
    return t.detach().to(torch.float64)


def _mudd(x: Tensor, p: dict[str, Tensor], block: int, n: int) -> list[Tensor]:
    """MUDD_j(x) = (gelu(x W1^T) W2[:n]^T + b2[:n]) * 0.1 (exact erf GELU). Returns n (T, 1) tensors."""
    h = F.gelu(x @ _d(p["mudd_w1"][block]).T)
    out = (h @ _d(p["mudd_w2"][block, :n]).T + _d(p["mudd_b2"][block, :n])) * MUDD_SCALE
    return list(out.split(1, dim=-1))


def _doc_ids(input_seq: Tensor, doc_starts=None) -> Tensor:
    T = input_seq.shape[0]
    starts = torch.zeros(T, dtype=torch.int64)
    if doc_starts is None:
        starts[input_seq.to(torch.int64) == BOS89] = 1
    else:
        for c in doc_starts:
            if 0 <= int(c) < T:
                starts[int(c)] = 1
    starts[0] = 1
    return torch.cumsum(starts, 0)


def _dense_attention(q: Tensor, k: Tensor, v: Tensor, doc: Tensor, window: int, scale: float) -> Tensor:
    """q, k, v: (S, h, D); doc: (S,) doc id per position; key j visible from query i iff same doc and
    i - window <= j <= i (FA3 causal, window (w, 0)).  Returns (S, h, D)."""
    S = q.shape[0]
    idx = torch.arange(S)
    diff = idx[:, None] - idx[None, :]
    mask = (diff >= 0) & (diff <= window) & (doc[:, None] == doc[None, :])
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    s = s.masked_fill(~mask, float("-inf"))
    a = torch.softmax(s, dim=-1)
    return torch.einsum("hij,jhd->ihd", a, v)


def _attention(i: int, u: Tensor, aux_v: Tensor | None, p: dict[str, Tensor], cfg: Cfg89, doc: Tensor,
               window: int, freqs: Tensor, scale: float, use_xsa: bool) -> Tensor:
    T, d = u.shape
    H, D = cfg.num_heads, cfg.head_dim
    a = cfg.attn_index(i)
    lam_qkv, lam_o = _d(p["scalars"][2 * i]), _d(p["scalars"][2 * i + 1])  # fp32, no bf16 cast (r89.py:1399)
    qk = _d(p["qk_bank"][a * H:(a + 1) * H])  # (H, 2D, d)
    Wq = qk[: H // 2].reshape(H * D, d)
    Wk = qk[H // 2:].reshape(H * D, d)
    Wv = _d(p["vo_bank"][2 * a])
    Wo = _d(p["vo_bank"][2 * a + 1])
    q = (u @ (lam_qkv * Wq).T).view(T, H, D)
    k = (u @ (lam_qkv * Wk).T).view(T, H, D)
    v = (u @ (lam_qkv * Wv).T).view(T, H, D)
    q, k = _norm(q), _norm(k)
    t = torch.arange(T, dtype=torch.float64)
    if i not in cfg.paired:
        q = rope89(q, t[:, None], freqs)
        k = rope89(k, t[:, None], freqs)
        if i in cfg.long_layers:  # key offset on the stationary half, flat sequence, after RoPE
            k = k.clone()
            k[1:, :, D // 2:] = k[:-1, :, D // 2:].clone()
        if aux_v is not None:
            v = v + aux_v.view(T, H, D)
        y = _dense_attention(q, k, v, doc, window, scale)
    else:
        # head h of token t rotated at position 2t + (h mod 2) (paired table over head pairs)
        pos = 2 * t[:, None] + (torch.arange(H) % 2).to(torch.float64)[None, :]
        q = rope89(q, pos, freqs)
        k = rope89(k, pos, freqs)
        if aux_v is not None:
            v = v + aux_v.view(T, H, D)
        # stream of length 2T: row 2t holds heads 0..H/2-1 of token t, row 2t+1 heads H/2..H-1
        qs, ks, vs = (z.reshape(2 * T, H // 2, D) for z in (q, k, v))
        docs = doc.repeat_interleave(2)
        y = _dense_attention(qs, ks, vs, docs, window, scale).reshape(T, H, D)
    if use_xsa and i not in cfg.paired:
        vn = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-4)
        proj = (y * vn).sum(-1, keepdim=True)
        alpha = _bf(torch.tanh(p["xsa_alphas"][i].float())).view(1, H, 1)
        y = y - alpha * proj * vn
    G = _d(p["attn_gate_bank"][a])  # (H, 12)
    y = y * torch.sigmoid(u[:, : cfg.gate_channels] @ G.T)[..., None]
    return y.reshape(T, H * D) @ (lam_o * Wo).T


def _mlp(u: Tensor, p: dict[str, Tensor], i: int) -> Tensor:
    W = _d(p["mlp_bank"][i])
    return torch.relu(u @ W[0].T).square() @ W[1]


def _windows_blocks(windows) -> tuple[int, int]:
    if isinstance(windows, dict):
        return int(windows["short"]), int(windows["long"])
    s, l = windows
    return int(s), int(l)


def forward89(params: dict[str, Tensor], sign_table: Tensor, input_seq, windows, cfg: Cfg89, *,
              attn_scale: float | None = None, freqs: Tensor | None = None, yarn: tuple[Tensor, float] | None = None,
              bigram_idx=None, doc_starts=None, use_xsa: bool = True, return_aux: bool = False):
    """#89's forward (spec 4.5) on ONE rank's flat sequence, float64, dense attention.  Returns hidden (T, d) after
    the final norm (and an aux dict if ``return_aux``).

    windows   : (short, long) in blocks of cfg.block_size (or dict with 'short'/'long').
    yarn      : (freqs, scale) from yarn89(); or give ``freqs`` / ``attn_scale`` separately.  Default: no YaRN
                update (initial frequencies, scale 0.1).
    bigram_idx: bigram rows (default bigram_hash89(input_seq, cfg.bigram_rows)).
    doc_starts: optional cu_seqlens-like positions; default: a document starts at 0 and at every token == 50256.
    """
    cfg.check()
    p = params
    x_ids = torch.as_tensor(np.asarray(_as_int64_np(input_seq)), dtype=torch.int64)
    T = x_ids.shape[0]
    L, H, D, bd, gc = cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.bigram_dim, cfg.gate_channels
    if yarn is not None:
        freqs, attn_scale = yarn
    if freqs is None:
        freqs = rope_freqs89(D)
    if attn_scale is None:
        attn_scale = 0.1
    assert freqs.shape[-1] == D, f"freqs are for head_dim {freqs.shape[-1]}, cfg.head_dim is {D} (yarn89(..., head_dim=))"
    short_b, long_b = _windows_blocks(windows)
    win = {"S": short_b * cfg.block_size, "L": long_b * cfg.block_size}
    doc = _doc_ids(x_ids, doc_starts)
    if bigram_idx is None:
        bigram_idx = bigram_hash89(x_ids, cfg.bigram_rows)
    bigram_idx = torch.as_tensor(np.asarray(bigram_idx), dtype=torch.int64)
    sidx = torch.as_tensor(sign_index89(x_ids, cfg.bigram_sign_rows), dtype=torch.int64)

    # lambdas: bf16 values (r89.py:1402-1407); sa / smear / skip lambdas stay fp32
    resid = _bf(p["resid_lambdas"])
    post = _bf(p["post_lambdas"])
    x0l = _bf(p["x0_lambdas"])
    bgl = _bf(p["bigram_lambdas"])
    smear_l = _d(p["scalars"][2 * L])
    skip_l = _d(p["scalars"][2 * L + 1])

    # 3.4 bigram feature
    b = _d(p["bigram_embed.weight"][bigram_idx]) * _d(sign_table[sidx])  # (T, bd)
    ve_tab = p["value_embeds"]
    ve = {j: _d(ve_tab[j][x_ids]) for j in range(ve_tab.shape[0])}

    # 1-3 embed, smear, norm
    e = _d(p["embed.weight"][x_ids])
    g = smear_l * torch.sigmoid(e[1:, :gc] @ _d(p["smear_gate.weight"]).T)  # (T-1, 1)
    e = torch.cat([e[:1], e[1:] + g * e[:-1]])
    x = _norm(e)
    # 4 in-place bigram injection: x0 aliases x, so x0 carries it too (quirk)
    x = x.clone()
    x[:, :bd] = x[:, :bd] + b * bgl[0]
    x0 = x
    skip_a, skip_b = cfg.skip_pair
    skip_g = torch.sigmoid(skip_l) * 2 * torch.sigmoid(x0[:, :gc] @ _d(p["skip_gate.weight"]).T)  # (T, 1)
    cache: dict[int, Tensor] = {0: x0}
    ai = cfg.attn_input_layer
    ve_layers = cfg.ve_layers
    aux = {"x0": x0, "b": b, "mu": None, "nu": None}

    for i in range(L):
        if cfg.attn_pattern[i] == "-":
            assert i == skip_b
            x = x + skip_g * cache[skip_a]
        else:
            u = _norm(cache[ai] if ai in cache else x)
            mu = None
            if i == L - 1:  # MUDD block 0 at the last layer
                cache[L - 1] = x
                mu = _mudd(x, p, 0, MUDD_N_COEF[0])
                aux["mu"] = mu
                v_mudd = mu[0] * cache[0] + mu[1] * cache[ai] + mu[2] * x
                x = (1 + mu[5]) * x + mu[3] * cache[0] + mu[4] * cache[ai]
                aux_v = v_mudd
                j = cfg.ve_table(i)
                if j is not None:
                    gate = torch.cat([mu[6].expand(T, H // 2), mu[7].expand(T, H - H // 2)], dim=-1)  # (T, H)
                    aux_v = aux_v + (gate[..., None] * ve[j].view(T, H, D)).reshape(T, H * D)
            elif cfg.ve_table(i) is not None:
                j = cfg.ve_table(i)
                G = _d(p["ve_gate_bank"][ve_layers.index(i)])  # (H, 12)
                gin = torch.cat([u[:, : gc // 2], ve[j][:, : gc // 2]], dim=-1)
                gate = 2 * torch.sigmoid(gin @ G.T)  # (T, H)
                aux_v = (gate[..., None] * ve[j].view(T, H, D)).reshape(T, H * D)
            else:
                aux_v = None
            att = _attention(i, u, aux_v, p, cfg, doc, win[cfg.attn_pattern[i]], freqs, attn_scale, use_xsa)
            if mu is not None:
                x = mu[8] * x + mu[9] * att + mu[10] * cache[0]
                x = x.clone()
                x[:, :bd] = x[:, :bd] + mu[11] * b
            else:
                x = resid[i, 0] * x + post[i, 0] * att + x0 * x0l[i]
                if i >= 1:
                    x = x.clone()
                    x[:, :bd] = x[:, :bd] + b * bgl[i]
        m = _mlp(_norm(x), p, i)
        if i == L - 1:
            x = mu[12] * x + mu[13] * m
        else:
            x = resid[i, 1] * x + post[i, 1] * m
        if i in (skip_a, ai):
            cache[i] = x

    aux["pre_mudd1"] = x
    nu = _mudd(x, p, 1, MUDD_N_COEF[1])
    aux["nu"] = nu
    x = x + nu[0] * cache[0] + nu[1] * cache[ai] + nu[2] * cache[L - 1] + nu[3] * ve[0] + nu[4] * cache[skip_a]
    aux["post_mudd1"] = x
    aux["cache"] = cache
    h = _norm(x)
    return (h, aux) if return_aux else h


# ----------------------------------------------------------------------------------------------------
# head, softcap and losses (spec 4.10)
# ----------------------------------------------------------------------------------------------------
def logits89(hidden: Tensor, params: dict[str, Tensor]) -> Tensor:
    """raw logits (T, V) = hidden @ lm_head.weight^T (interface stores lm_head (V, d))"""
    return hidden.to(torch.float64) @ _d(params["lm_head.weight"]).T


def softcap89(logits: Tensor, cap: float = 23.0, shift: float = 5.0, temp: float = 7.5) -> Tensor:
    return cap * torch.sigmoid((logits.to(torch.float64) + shift) / temp)


def mtp_loss89(logits: Tensor, targets, weights, cap: float = 23.0, shift: float = 5.0, temp: float = 7.5) -> Tensor:
    """Per-token MTP loss (T,) in float64: l_p = sum_k w_k [p+k < T] (lse(z_p) - z_p[y_{p+k}]), z = softcap(logits).
    ``weights`` may be padded with zeros; terms past the end of the sequence are left out.  Rank loss = .sum()."""
    z = softcap89(logits, cap, shift, temp)
    y = torch.as_tensor(np.asarray(_as_int64_np(targets)), dtype=torch.int64)
    T = z.shape[0]
    lse = torch.logsumexp(z, dim=-1)
    w = [float(v) for v in (weights.tolist() if isinstance(weights, Tensor) else weights)]
    out = torch.zeros(T, dtype=torch.float64)
    for k, wk in enumerate(w):
        if k >= T:
            break
        n = T - k
        ce = lse[:n] - z[torch.arange(n), y[k:]]
        out[:n] += wk * ce
    return out


def eval_ce89(logits: Tensor, targets, cap: float = 23.0, shift: float = 5.0, temp: float = 7.5) -> Tensor:
    """Eval loss: mean plain next-token CE of the softcapped logits (0-d float64)."""
    return mtp_loss89(logits, targets, [1.0], cap, shift, temp).mean()


def loss89(params, sign_table, input_seq, target_seq, windows, cfg: Cfg89, mtp_weights, **kw) -> Tensor:
    """Per-token training losses (T,) of the float64 forward (sum them for the rank's loss)."""
    h = forward89(params, sign_table, input_seq, windows, cfg, **kw)
    return mtp_loss89(logits89(h, params), target_seq, mtp_weights, cfg.logit_cap, cfg.logit_shift, cfg.logit_temp)


# ----------------------------------------------------------------------------------------------------
# schedule (spec 6)
# ----------------------------------------------------------------------------------------------------
_STAGE_DURATIONS = (1 / 3, 1 / 3, 1 / 3)
_STAGE_LR_MULS = (1.0, 1.52, 1.73, 1.0)
_STAGE_WINDOWS = ((1, 3), (3, 7), (5, 11), (6, 13))
_STAGE_BATCH = (8 * 2048 * 8, 16 * 2048 * 8, 24 * 2048 * 8, 24 * 2048 * 8)
_STAGE_SEQ_LEN = (896, 2048, 2048, 2048)
_MTP_START = ((1.0, 0.5, 0.25), (1.0, 0.5), (1.0,), (1.0,))
_MTP_END = ((1.0, 0.5, 0.0), (1.0, 0.0), (1.0,), (1.0,))


def stage_ends89(N: int = 1380, E: int = 10, durations=_STAGE_DURATIONS) -> list[int]:
    """[0, round(N*c_1), ..., round(N*c_k), N+E] with c cumulative float sums of the durations (Python round)."""
    ends = [0, *[round(c * N) for c in accumulate(durations)], N + E]
    assert ends[-2] == N, ends
    return ends


def warmup_steps89(N: int = 1380, E: int = 10, durations=_STAGE_DURATIONS) -> list[int]:
    """sorted({0, 1} | {s + o : s a later stage start (incl. the extension's), o in -2..1, s + o >= 2})"""
    ends = stage_ends89(N, E, durations)
    starts = ends[1:-1]
    return sorted({0, 1} | {s + o for s in starts for o in (-2, -1, 0, 1) if s + o >= 2})


def schedule89(step: int, N: int = 1380, E: int = 10, *, durations=_STAGE_DURATIONS, stage_lr_muls=_STAGE_LR_MULS,
               windows=_STAGE_WINDOWS, batch_sizes=_STAGE_BATCH, seq_lens=_STAGE_SEQ_LEN, mtp_start=_MTP_START,
               mtp_end=_MTP_END, cooldown_frac: float = 0.60, lr_floor: float = 0.15, mom_warmup: int = 300,
               mom_cooldown: int = 50, mom_min: float = 0.85, mom_max: float = 0.95, world_size: int = 8,
               block_size: int = 128, final_long_window: int = 20, split_stage: int = 2,
               bootstrap_steps: int = 16, initial_scale: float = 0.1, head_dim: int = 128, doc_cuts=None) -> dict:
    """Everything the training step ``step`` (0 .. N+E; N+E = final validation) uses (spec 6.1).

    Keys: stage (0..3; 3 = extension), tau, s (lr multiplier), mu (NorMuon momentum), windows (short, long) in blocks,
    window_tokens, batch (global tokens), per_rank_tokens, doc_cut (= train_max_seq_len), mtp (list of floats; the
    record stores them fp32), mtp_fp32, attn_scale, freqs (YaRN frequencies for ``head_dim``), adam (odd step),
    adam_t (Adam update count after this step's update, odd steps), tied (embedding still tied during this step:
    step <= untie_step), untie_step, bootstrap_down (step < 16), final_val (step == N+E).
    """
    if doc_cuts is not None:  # alias: the loader's document cut IS train_max_seq_len (also FA's max_seqlen)
        seq_lens = doc_cuts
    ends = stage_ends89(N, E, durations)
    total = N + E
    bounds = list(zip(ends[:-1], ends[1:]))
    stage, tau = len(bounds) - 1, 1.0
    for k, (a, b) in enumerate(bounds):
        if step < b:
            stage, tau = k, (step - a) / (b - a)
            break
    # lr multiplier
    s = stage_lr_muls[stage]
    cd = int(N * (1 - cooldown_frac))
    if step >= cd:
        tc = min(1.0, (step - cd) / (N - cd))
        s = s * (1 - tc) + lr_floor * tc
    # momentum
    mcd = total - mom_cooldown
    if step < mom_warmup:
        mu = mom_min + (step / mom_warmup) * (mom_max - mom_min)
    elif step > mcd:
        mu = mom_max - ((step - mcd) / mom_cooldown) * (mom_max - mom_min)
    else:
        mu = mom_max
    # windows / YaRN (YaRN follows the long window of each stage up to this one; the final ext is not YaRN'd)
    short_b, long_b = windows[stage]
    freqs, scale = yarn89([windows[k][1] * block_size for k in range(stage + 1)], head_dim=head_dim,
                         initial_scale=initial_scale)
    final_val = step == total
    if final_val:
        long_b = final_long_window
    mtp = [a + (b - a) * tau for a, b in zip(mtp_start[stage], mtp_end[stage])]
    untie = ends[split_stage] | 1
    return {
        "stage": stage, "tau": tau, "s": s, "mu": mu,
        "windows": (short_b, long_b), "window_tokens": (short_b * block_size, long_b * block_size),
        "batch": batch_sizes[stage], "per_rank_tokens": batch_sizes[stage] // world_size,
        "doc_cut": seq_lens[stage], "train_max_seq_len": seq_lens[stage],
        "mtp": mtp, "mtp_fp32": torch.tensor(mtp, dtype=torch.float32),
        "attn_scale": scale, "freqs": freqs,
        "adam": step % 2 == 1, "adam_t": (step + 1) // 2 if step % 2 == 1 else None,
        "tied": step <= untie, "untie_step": untie,
        "bootstrap_down": step < bootstrap_steps, "final_val": final_val,
        "cooldown_start": cd, "stage_ends": ends,
    }
