"""Independent float64 reference of upstream modded-nanogpt HEAD (commit f411b3d): hashes, prefix table, model
forward (MUDD gate network, per-token gates, #86 XSA, DC attention on layer 10), prefix loss + kernel gradient,
schedule (1270 + 15), optimizer table.

Written from /work/shared/upstream_head_spec.md (HEAD relative to record #89) on top of the independent #89
reference (records/snapshots/2026-11-28_record89/tests/reference89.py and reference89_optim.py), whose helpers (RoPE,
YaRN, dense FA3-style attention, #89 schedule formulas, #89 optimizer rows, softcap CE) are re-used unchanged.
Where the spec was unclear, upstream's own train_gpt.py / triton_kernels.py / dc_triton_kernels.py at f411b3d
decided ("head.py:NNN" below); no code was copied from them nor from this project's train_gpt.py / gpt_kernels.py.
Plain functions, torch + numpy only (tiktoken only for the prefix table).

Numerics (same policy as reference89): activations are float64.  bf16 roundings are applied only where HEAD rounds
a VALUE before use, as straight-through roundings (value rounded, gradient of the identity) so autograd of the
reference still works:
  * the gate network's output (a bf16 tensor in HEAD, head.py:1465-1467), with the scale s = bf16(_mudd_gate_scale);
    so at init the gates are exactly 0.25 / 0.050048828125 / 0.5 / 1.0 (``bf16_gates=False`` keeps b*s unrounded);
  * tanh(XSA gate) cast to bf16 (``.type_as(y)``, head.py:1156);
  * DC w1' = bf16(rms_norm(fp32 w1, eps=1e-6)) (head.py:1078);
  * resid / post lambdas: bf16 of the fp32 parameters (head.py:1509-1512).
The FP8 MLP / FP8 lm_head and the kernels' bf16 intermediate roundings are NOT modelled (MLP = relu(u W_fc^T)^2 W_proj).

Layouts: as reference89 (the port's interface): lm_head stored (V, d) (HEAD itself stores (d, V): accepted too),
mlp_bank[l, 0] = W_fc (4d, d), mlp_bank[l, 1] = W_proj (4d, d) used h W_proj, qk_bank block a*H + j (j < H/2: Q rows
of heads 2j, 2j+1; H/2 + j: K rows), vo_bank[2a] = W_v, vo_bank[2a+1] = W_o; a = attention-layer index (i - [i > 6]).
Parameter dict keys: reference89's ("embed.weight", "lm_head.weight", "smear_gate.weight", "bigram_embed.weight",
the others by their label); ``_p`` also accepts the bare labels (spec §2.2 names).

Contents
  BOS, BIGRAM_ROWS_HEAD, bigram_hash_head, sign_index, wrap32           -- spec §2.8 (#89 §3.3/3.4)
  build_prefix_table_head, prefix_table_stack_head                        -- spec §2.7 (two independent algorithms)
  CfgHead, cfg_head, cfg_small_head                                       -- config
  PRE_SLICES, POST_SLICES, mudd_gate_bias_init, unpack_pre_gate_head, unpack_post_gate_head   -- spec §2.3
  INIT_LAWS_HEAD, PARAM_NAMES_HEAD, random_init_params_head               -- spec §2.2
  mudd_gate_head, dc_gate_head, dc_doc_bounds_head, dc_mask_head, dc_dense_head, dc_backward_head  -- §2.3, §2.6, §3
  xsa_head                                                                -- §2.5
  forward_head, logits_head, loss_head                                    -- §2.3-§2.6 (+ #89 §4.5)
  mtp_prefix_loss_head, mtp_prefix_grad_head, softcap_ce_head            -- §2.7 (fused CE kernel)
  stage_ends_head, warmup_steps_head, val_steps_head, prefix_weight_head, schedule_head   -- §1.2, §2.7
  param_table_head, SCATTER_ORDER_HEAD, WORK_ORDER_HEAD                   -- §2.10
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

_HERE = Path(__file__).resolve().parent
_REPO = _HERE.parent


def _load(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


_RECORD89 = _REPO / "records" / "snapshots" / "2026-11-28_record89" / "tests"  # #89's references, with its snapshot
R89 = _load("reference89", _RECORD89 / "reference89.py")
O89 = _load("reference89_optim", _RECORD89 / "reference89_optim.py")

__all__ = [
    "R89", "O89", "BOS", "VOCAB", "BIGRAM_ROWS_HEAD", "wrap32", "bigram_hash_head", "sign_index",
    "build_prefix_table_head", "prefix_table_stack_head", "TOKENIZER_DIR",
    "CfgHead", "cfg_head", "cfg_small_head",
    "GATE_SCALE_INIT", "PRE_N", "POST_N", "PRE_SLICES", "POST_SLICES", "mudd_gate_bias_init",
    "mudd_gate_bias_effective", "unpack_pre_gate_head", "unpack_post_gate_head",
    "INIT_LAWS_HEAD", "PARAM_NAMES_HEAD", "random_init_params_head",
    "mudd_gate_head", "dc_gate_head", "dc_doc_bounds_head", "dc_mask_head", "dc_dense_head", "dc_backward_head",
    "xsa_head", "forward_head", "logits_head", "loss_head",
    "mtp_prefix_loss_head", "mtp_prefix_grad_head", "softcap_ce_head",
    "stage_ends_head", "warmup_steps_head", "val_steps_head", "prefix_weight_head", "schedule_head",
    "param_table_head", "SCATTER_ORDER_HEAD", "WORK_ORDER_HEAD",
]

BOS: int = 50256
VOCAB: int = 50304
BIGRAM_ROWS_HEAD: int = 50304 * 15 // 2  # 377,280 (head.py:1902)
TOKENIZER_DIR: Path = _REPO / "data" / "tokenizer"
RMS_EPS: float = R89.RMS_EPS
MUDD_SCALE: float = 0.1
GATE_SCALE_INIT: float = 0.1
DC_EPS: float = 1e-6
XSA_EPS: float = 1e-8

wrap32 = R89._wrap32
_bf = R89._bf
_d = R89._d
_norm = R89._norm


def _bfst(t: Tensor) -> Tensor:
    """straight-through bf16 rounding: the value of bf16(t) (single RNE rounding of the float64 value), the
    gradient of the identity"""
    r = O89._bf16(t.detach()).to(torch.float64)
    return t + (r - t).detach()


# ----------------------------------------------------------------------------------------------------
# §2.8 bigram hash (modulus 377,279), sign index (unchanged)
# ----------------------------------------------------------------------------------------------------
def bigram_hash_head(tokens, rows: int = BIGRAM_ROWS_HEAD) -> np.ndarray:
    """#89's host hash (#89 spec §3.3) with HEAD's table: M = rows - 1 = 377,279; int32 arithmetic.
    h_0 = M; h_1 = remainder((36313 x_1) XOR wrap32(27191 M), M) (27191 M wraps to +1,668,658,697);
    h_p = remainder((36313 x_p) XOR (27191 x_{p-1}), M).  Returns int32 numpy."""
    return R89.bigram_hash89(tokens, rows)


def sign_index(tokens, sign_rows: int = 8192) -> np.ndarray:
    """s_0 = 0, s_p = (x_{p-1} XOR x_p) mod 8192 (unchanged from #89)."""
    return R89.sign_index89(tokens, sign_rows)


# ----------------------------------------------------------------------------------------------------
# §2.7 prefix-token table
# ----------------------------------------------------------------------------------------------------
def _mergeable_ranks(encoding: str = "r50k_base", cache_dir: str | os.PathLike | None = None) -> dict[bytes, int]:
    """The GPT-2 byte-level BPE ranks, loaded OFFLINE: tiktoken's r50k_base (same ranks as "gpt2") from the
    project's bundled cache (TIKTOKEN_CACHE_DIR, default data/tokenizer)."""
    if cache_dir is None:
        cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR") or str(TOKENIZER_DIR)
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache_dir)
    try:
        import tiktoken
        enc = tiktoken.get_encoding(encoding)
    finally:
        if old is None:
            os.environ.pop("TIKTOKEN_CACHE_DIR", None)
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old
    return dict(enc._mergeable_ranks)


def build_prefix_table_head(vocab_size: int = VOCAB, ranks: dict[bytes, int] | None = None) -> Tensor:
    """table[id] = id of the LONGEST PROPER byte-prefix of bytes(id) that is itself a token, else -1 (int64,
    (vocab_size,)).  Algorithm (this reference's own): dict lookup of every prefix length, longest first.
    Ids not in the mergeable ranks (<|endoftext|> 50256, padding 50257..) stay -1."""
    if ranks is None:
        ranks = _mergeable_ranks()
    table = torch.full((vocab_size,), -1, dtype=torch.int64)
    for b, tid in ranks.items():
        for n in range(len(b) - 1, 0, -1):
            pid = ranks.get(b[:n])
            if pid is not None:
                table[tid] = pid
                break
    return table


def prefix_table_stack_head(vocab_size: int = VOCAB, ranks: dict[bytes, int] | None = None) -> Tensor:
    """Same table by the spec's description of upstream's algorithm (§2.7: sort the byte strings, keep a stack of
    ancestors; the stack top is the longest proper prefix).  For cross-checking build_prefix_table_head."""
    if ranks is None:
        ranks = _mergeable_ranks()
    table = torch.full((vocab_size,), -1, dtype=torch.int64)
    stack: list[tuple[bytes, int]] = []
    for b, tid in sorted(ranks.items()):
        while stack and not b.startswith(stack[-1][0]):
            stack.pop()
        if stack:
            table[tid] = stack[-1][1]
        stack.append((b, tid))
    return table


# ----------------------------------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------------------------------
@dataclass
class CfgHead:
    """HEAD's model constants.  The gate layouts hard-code 11 layers, 6 heads and the layer roles below
    (head.py:1436-1484), so only widths / vocab / tables / window units may be shrunk for tests."""
    num_layers: int = 11
    model_dim: int = 768
    num_heads: int = 6
    head_dim: int = 128
    attn_pattern: str = "SSSLSS-SSSL"
    paired_layers: str = "0,2,5,9"
    value_embeds: str = "-01-----234"
    skip: str = "3:6"
    attn_input_layer: int = 7
    bigram_rows: int = BIGRAM_ROWS_HEAD
    bigram_dim: int = 768
    bigram_sign_rows: int = 8192
    mudd_dim: int = 64
    mudd_gate_dim: int = 64
    block_size: int = 128
    vocab_size: int = VOCAB
    logit_cap: float = 23.0
    logit_shift: float = 5.0
    logit_temp: float = 7.5
    gate_channels: int = 12
    dc_window: int = 112
    xsa_layers: tuple = (1, 3, 4, 7)
    attn_gate_layers: tuple = (3, 10)
    dc_layers: tuple = (10,)
    post_gate_layer: int = 4

    # roles shared with reference89's Cfg89
    def _c89(self) -> "R89.Cfg89":
        return R89.Cfg89(num_layers=self.num_layers, model_dim=self.model_dim, num_heads=self.num_heads,
                         head_dim=self.head_dim, attn_pattern=self.attn_pattern, paired_layers=self.paired_layers,
                         value_embeds=self.value_embeds, skip=self.skip, attn_input_layer=self.attn_input_layer,
                         bigram_rows=self.bigram_rows, bigram_dim=self.bigram_dim,
                         bigram_sign_rows=self.bigram_sign_rows, mudd_dim=self.mudd_dim, block_size=self.block_size,
                         vocab_size=self.vocab_size, gate_channels=self.gate_channels)

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
        return {int(s) for s in self.paired_layers.split(",") if s.strip()}

    @property
    def long_layers(self) -> set[int]:
        return {i for i, c in enumerate(self.attn_pattern) if c == "L"}

    def ve_table(self, i: int) -> int | None:
        c = self.value_embeds[i]
        return None if c == "-" else int(c)

    @property
    def ve_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.ve_table(i) is not None]

    @property
    def n_ve_tables(self) -> int:
        return 1 + max(self.ve_table(i) for i in self.ve_layers)

    def check(self) -> None:
        assert self.num_layers == 11 and self.num_heads == 6, "HEAD's gate layout needs 11 layers and 6 heads"
        assert self.attn_pattern == "SSSLSS-SSSL" and self.skip == "3:6" and self.attn_input_layer == 7
        assert self.num_heads * self.head_dim == self.model_dim
        assert self.bigram_dim <= self.model_dim and 0 < self.dc_window


def cfg_head() -> CfgHead:
    return CfgHead()


def cfg_small_head() -> CfgHead:
    """HEAD's roles (11 layers, 6 heads, windows in 16-token blocks) at d = 96, small vocab / tables: fast in
    float64 on the CPU.  DC keeps its 112-token window."""
    return CfgHead(model_dim=96, head_dim=16, bigram_rows=1024, bigram_dim=96, mudd_dim=8, mudd_gate_dim=8,
                   block_size=16, vocab_size=512)


# ----------------------------------------------------------------------------------------------------
# §2.3 gate network layout and bias
# ----------------------------------------------------------------------------------------------------
PRE_N, POST_N = 26, 41
# (kind, layer, slice) of each used output lane (head.py:1469-1484)
PRE_SLICES: dict = {
    ("xsa", 1): slice(0, 6), ("xsa", 3): slice(6, 12), ("attn_gate", 3): slice(12, 18),
    **{("x0", l): slice(18 + 2 * n, 19 + 2 * n) for n, l in enumerate((0, 1, 2, 3))},
    **{("bigram", l): slice(19 + 2 * n, 20 + 2 * n) for n, l in enumerate((0, 1, 2, 3))},
}
POST_SLICES: dict = {
    ("xsa", 4): slice(0, 6), ("xsa", 7): slice(6, 12), ("attn_gate", 10): slice(12, 18),
    **{("x0", l): slice(18 + 2 * n, 19 + 2 * n) for n, l in enumerate((4, 5, 7, 8, 9))},
    **{("bigram", l): slice(19 + 2 * n, 20 + 2 * n) for n, l in enumerate((4, 5, 7, 8, 9))},
    ("skip", 6): slice(28, 29), ("dc_w1", 10): slice(29, 35), ("dc_w2", 10): slice(35, 41),
}


def mudd_gate_bias_init(dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """(2, 41) gate bias, "pre-scaled" by 1/0.1, built fp32 then cast (HEAD stores it bf16, head.py:2254):
    pre: attn[3] 12:18 = 2.5, bigram 19,21,23,25 = 0.5; post: attn[10] 12:18 = 2.5, bigram 19..27 odd = 0.5,
    skip 28 = 5.0, DC w1 29:35 = 10.0; everything else 0 (pre lanes 26..40 unused)."""
    b = torch.zeros(2, 41, dtype=torch.float32)
    b[0, 12:18] = 0.25 / GATE_SCALE_INIT
    b[0, [19, 21, 23, 25]] = 0.05 / GATE_SCALE_INIT
    b[1, 12:18] = 0.25 / GATE_SCALE_INIT
    b[1, [19, 21, 23, 25, 27]] = 0.05 / GATE_SCALE_INIT
    b[1, 28] = 0.5 / GATE_SCALE_INIT
    b[1, 29:35] = 1.0 / GATE_SCALE_INIT
    return b.to(dtype)


def mudd_gate_bias_effective(b2: Tensor | None = None, scale: float | Tensor = GATE_SCALE_INIT) -> Tensor:
    """Gate output while W2 = 0: bf16( b2 * bf16(scale) ) (2, 41) float64."""
    if b2 is None:
        b2 = mudd_gate_bias_init()
    s = _bf(torch.as_tensor(scale, dtype=torch.float32))
    return _bf(_d(b2) * s)


def _unpack(g: Tensor, slices: dict) -> dict:
    out: dict = {"xsa": {}, "attn_gate": {}, "x0": {}, "bigram": {}}
    for (kind, layer), sl in slices.items():
        out.setdefault(kind, {})[layer] = g[..., sl]
    return out


def unpack_pre_gate_head(g: Tensor) -> dict:
    """dict kind -> {layer: (T, n) slice} of the pre gate (T, 26)"""
    return _unpack(g, PRE_SLICES)


def unpack_post_gate_head(g: Tensor) -> dict:
    """dict kind -> {layer: (T, n) slice} of the post gate (T, 41); kinds xsa, attn_gate, x0, bigram, skip, dc_w1,
    dc_w2"""
    return _unpack(g, POST_SLICES)


# ----------------------------------------------------------------------------------------------------
# §2.2 parameters and init
# ----------------------------------------------------------------------------------------------------
PARAM_NAMES_HEAD: tuple = (
    "qk_bank", "vo_bank", "mlp_bank", "scalars", "smear_gate", "ve_gate_bank", "lm_head", "bigram_embed",
    "post_lambdas", "resid_lambdas", "value_embeds", "embed", "mudd_w1", "mudd_w2", "mudd_b2",
    "mudd_gate_w1", "mudd_gate_w2", "mudd_gate_b2", "_mudd_gate_scale",
)
REMOVED_NAMES_HEAD: tuple = ("attn_gate_bank", "skip_gate", "x0_lambdas", "bigram_lambdas", "xsa_alphas")
_DICT_KEY = {"embed": "embed.weight", "lm_head": "lm_head.weight", "smear_gate": "smear_gate.weight",
             "bigram_embed": "bigram_embed.weight"}

INIT_LAWS_HEAD: dict[str, str] = {
    **{k: v for k, v in R89.INIT_LAWS89.items() if k.split(".")[0] not in REMOVED_NAMES_HEAD},
    "bigram_embed.weight": "zeros (377280, 768) bf16",
    "bigram_sign_table": "sign(N(0,1)) in {-1,+1}, (8192, 768) bf16 buffer",
    "_mudd_gate_scale": "0-d fp32 0.1 (never cast; bf16(0.1) = 0.10009765625 at use)",
    "mudd_gate_w1": "kaiming_uniform(a=sqrt5) per block = U(+-1/sqrt(d)) (2, 64, d), cast bf16",
    "mudd_gate_w2": "zeros (2, 41, 64), bf16",
    "mudd_gate_b2": "mudd_gate_bias_init() (2, 41), bf16",
}


def random_init_params_head(cfg: CfgHead, seed: int = 0) -> tuple[dict[str, Tensor], Tensor]:
    """A HEAD parameter dict at init (19 tensors; reference89's keys, see module doc) + the sign table."""
    cfg.check()
    c89 = cfg._c89()
    # #89's init for the tensors HEAD keeps (same laws, same shapes up to the bigram width)
    p89, sign = R89.random_init_params89(c89, seed=seed)
    g = torch.Generator().manual_seed(seed + 1_000_003)
    d = cfg.model_dim
    p = {k: v for k, v in p89.items() if k.split(".")[0] not in REMOVED_NAMES_HEAD}
    w1 = (torch.rand(2, cfg.mudd_gate_dim, d, generator=g, dtype=torch.float32) * 2 - 1) / math.sqrt(d)
    p["mudd_gate_w1"] = w1.to(torch.bfloat16)
    p["mudd_gate_w2"] = torch.zeros(2, POST_N, cfg.mudd_gate_dim, dtype=torch.bfloat16)
    p["mudd_gate_b2"] = mudd_gate_bias_init(torch.bfloat16)
    p["_mudd_gate_scale"] = torch.tensor(GATE_SCALE_INIT, dtype=torch.float32)
    assert len(p) == 19 and {k.split(".")[0] for k in p} == set(PARAM_NAMES_HEAD), sorted(p)
    return p, sign


def _p(params: dict[str, Tensor], label: str) -> Tensor:
    if label in params:
        return params[label]
    key = _DICT_KEY.get(label, label + ".weight")
    if key in params:
        return params[key]
    if label.endswith(".weight") and label[:-7] in params:
        return params[label[:-7]]
    raise KeyError(label)


# ----------------------------------------------------------------------------------------------------
# §2.3 gate network; §2.5 XSA; §2.6 / §3 DC
# ----------------------------------------------------------------------------------------------------
def mudd_gate_head(x: Tensor, params: dict[str, Tensor], block: int, n: int, bf16_gates: bool = True) -> Tensor:
    """gate_j(x) = (gelu(x W1_j^T) W2_j[:n]^T + b2_j[:n]) * bf16(_mudd_gate_scale)  (exact-erf GELU), (T, n).
    bf16_gates: the output rounded to bf16 (straight-through) as HEAD's bf16 activation is."""
    s = _bfst(_p(params, "_mudd_gate_scale").to(torch.float64))  # type_as(x): bf16 value, grad flows
    W1 = _p(params, "mudd_gate_w1")[block].to(torch.float64)
    W2 = _p(params, "mudd_gate_w2")[block, :n].to(torch.float64)
    b2 = _p(params, "mudd_gate_b2")[block, :n].to(torch.float64)
    out = (F.gelu(x @ W1.T) @ W2.T + b2) * s
    return _bfst(out) if bf16_gates else out


def xsa_head(y: Tensor, v: Tensor, gate: Tensor, bf16_alpha: bool = True) -> Tensor:
    """#86 form: y - alpha (sum_d y v / max(sum_d v^2, 1e-8)) v, alpha = tanh(gate) per token and head.
    y, v (T, H, D); gate (T, H)."""
    alpha = torch.tanh(gate)
    if bf16_alpha:
        alpha = _bfst(alpha)
    dot = (y * v).sum(-1, keepdim=True)
    den = v.square().sum(-1, keepdim=True).clamp_min(XSA_EPS)
    return y - alpha[..., None] * (dot / den) * v


def dc_gate_head(w1: Tensor, w2: Tensor, bf16_w1: bool = True) -> tuple[Tensor, Tensor]:
    """(w1', w2') = (bf16(rms_norm(w1 over the H heads, eps 1e-6)), w2)  (head.py:1072-1080); (T, H) each."""
    w1p = w1 / torch.sqrt(w1.square().mean(-1, keepdim=True) + DC_EPS)
    if bf16_w1:
        w1p = _bfst(w1p)
    return w1p, w2


def dc_doc_bounds_head(cu, T: int) -> tuple[Tensor, Tensor]:
    """(s(t), e(t)) of §3.2: idx(t) = #{i < n_docs : cu[i] <= t} - 1 clamped >= 0; s = cu[idx], e = cu[idx+1]."""
    cu = torch.as_tensor(cu, dtype=torch.int64).reshape(-1)
    n_docs = cu.numel() - 1
    t = torch.arange(T)
    idx = (cu[:n_docs][None, :] <= t[:, None]).sum(1) - 1
    idx = idx.clamp_min(0)
    return cu[idx], cu[idx + 1]


def dc_mask_head(cu, T: int, window: int = 112) -> Tensor:
    """(T, T) bool: key j valid for query t iff s(t) <= j < e(t), j <= t, t - j < window (§3.2)."""
    s, e = dc_doc_bounds_head(cu, T)
    t = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    return (j >= s[:, None]) & (j < e[:, None]) & (j <= t) & (t - j < window)


def _dc_probs(q: Tensor, k: Tensor, mask: Tensor, scaling: float) -> Tensor:
    """P_h[t, j] (H, T, T): softmax over the valid keys (rows with none: all zero, the kernel's denominator 0 -> 1)"""
    S = torch.einsum("thd,jhd->htj", q, k) * scaling
    S = S.masked_fill(~mask[None], float("-inf"))
    m = S.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(S - m)
    den = e.sum(-1, keepdim=True)
    den = torch.where(den > 0, den, torch.ones_like(den))
    return e / den


def dc_dense_head(base: Tensor, q: Tensor, k: Tensor, v: Tensor, w1p: Tensor, w2p: Tensor, cu, scaling: float,
                  window: int = 112, round_weight: bool = False) -> Tensor:
    """Dense masked reference of §3.2: out[t,h] = base[t,h] + sum_{j in V(t)} w2'[t,h] A[t,j] v[j,h],
    A[t,j] = sum_h' w1'[t,h'] P_h'[t,j], P_h = softmax over V(t) of scaling q_h k_h^T (a FRESH softmax over the
    112-token window).  base/q/k/v (T, H, D); w1p/w2p (T, H).  round_weight: bf16(w2' A) as the kernel rounds the
    weight before its dot (straight-through).  Differentiable: autograd = §3.3's gradients (float64)."""
    T = q.shape[0]
    mask = dc_mask_head(cu, T, window)
    P = _dc_probs(q, k, mask, scaling)  # (H, T, T)
    A = torch.einsum("th,htj->tj", w1p, P)
    Wt = w2p.T[:, :, None] * A[None]  # (H, T, T): w2'[t,h] A[t,j]
    if round_weight:
        Wt = _bfst(Wt)
    return base + torch.einsum("htj,jhd->thd", Wt, v)


def dc_backward_head(G: Tensor, q: Tensor, k: Tensor, v: Tensor, w1p: Tensor, w2p: Tensor, cu, scaling: float,
                     window: int = 112) -> dict[str, Tensor]:
    """The explicit backward of §3.3 (float64, no roundings): dbase, dq, dk, dv, dw1, dw2 (dw1 = d/dw1', before the
    rms_norm)."""
    T = q.shape[0]
    mask = dc_mask_head(cu, T, window)
    P = _dc_probs(q, k, mask, scaling)
    A = torch.einsum("th,htj->tj", w1p, P)
    dm = torch.einsum("thd,jhd->htj", G, v) * mask[None]
    dv = torch.einsum("th,tj,thd->jhd", w2p, A, G)
    dw2 = torch.einsum("htj,tj->th", dm, A)
    dA = torch.einsum("th,htj->tj", w2p, dm)
    dw1 = torch.einsum("tj,htj->th", dA, P)
    dS = P * (w1p.T[:, :, None] * dA[None] - (w1p * dw1).T[:, :, None])
    dq = scaling * torch.einsum("htj,jhd->thd", dS, k)
    dk = scaling * torch.einsum("htj,thd->jhd", dS, q)
    return {"dbase": G.clone(), "dq": dq, "dk": dk, "dv": dv, "dw1": dw1, "dw2": dw2}


# ----------------------------------------------------------------------------------------------------
# forward (§2.3 - §2.6; unchanged parts as #89 §4.5)
# ----------------------------------------------------------------------------------------------------
def _cu_from(x_ids: Tensor, cu_seqlens=None, doc_starts=None) -> Tensor:
    """cu_seqlens of the flat sequence: given, or from doc_starts, or a document at 0 and at every BOS."""
    T = x_ids.shape[0]
    if cu_seqlens is not None:
        return torch.as_tensor(cu_seqlens, dtype=torch.int64).reshape(-1)
    if doc_starts is not None:
        st = sorted({0, *[int(c) for c in doc_starts if 0 <= int(c) < T]})
    else:
        st = sorted({0, *torch.nonzero(x_ids == BOS).flatten().tolist()})
    return torch.tensor(st + [T], dtype=torch.int64)


def _doc_of(cu: Tensor, T: int) -> Tensor:
    """FA3 varlen segment id of each position (segment i = [cu[i], cu[i+1]))"""
    t = torch.arange(T)
    return (cu[None, :] <= t[:, None]).sum(1) - 1


def _attention_head(i: int, u: Tensor, aux_v: Tensor | None, p: dict, cfg: CfgHead, cu: Tensor, window: int,
                    freqs: Tensor, scale: float, xsa_gate: Tensor | None, attn_gate: Tensor | None,
                    dc_w: tuple[Tensor, Tensor] | None, bf16_gates: bool, aux: dict | None = None) -> Tensor:
    """One attention layer (head.py:1083-1163): QKV, QK-norm, RoPE (paired: #89 stream layout), key offset on long
    layers, +aux_v, dense FA3 (causal, window (w, 0), documents), then DC (layer 10), XSA (per-token alpha), linear
    attention gate, W_o."""
    T, d = u.shape
    H, D = cfg.num_heads, cfg.head_dim
    a = cfg.attn_index(i)
    lam_qkv, lam_o = _d(p["scalars"][2 * i]), _d(p["scalars"][2 * i + 1])
    qk = _d(p["qk_bank"][a * H:(a + 1) * H])
    Wq, Wk = qk[: H // 2].reshape(H * D, d), qk[H // 2: H].reshape(H * D, d)
    Wv, Wo = _d(p["vo_bank"][2 * a]), _d(p["vo_bank"][2 * a + 1])
    q = (u @ (lam_qkv * Wq).T).view(T, H, D)
    k = (u @ (lam_qkv * Wk).T).view(T, H, D)
    v = (u @ (lam_qkv * Wv).T).view(T, H, D)
    q, k = _norm(q), _norm(k)
    tpos = torch.arange(T, dtype=torch.float64)
    doc = _doc_of(cu, T)
    if i not in cfg.paired:
        q = R89.rope89(q, tpos[:, None], freqs)
        k = R89.rope89(k, tpos[:, None], freqs)
        if i in cfg.long_layers:
            k = torch.cat([k[:, :, : D // 2], torch.cat([k[:1, :, D // 2:], k[:-1, :, D // 2:]], 0)], -1)
        if aux_v is not None:
            v = v + aux_v.view(T, H, D)
        y = R89._dense_attention(q, k, v, doc, window, scale)
        if dc_w is not None:
            w1p, w2p = dc_gate_head(dc_w[0], dc_w[1], bf16_w1=bf16_gates)
            if aux is not None:
                aux["dc_in"] = {"base": y, "q": q, "k": k, "v": v, "w1p": w1p, "w2p": w2p, "cu": cu, "scale": scale}
            y = dc_dense_head(y, q, k, v, w1p, w2p, cu, scale, cfg.dc_window)
        if xsa_gate is not None:
            y = xsa_head(y, v, xsa_gate, bf16_alpha=bf16_gates)
    else:
        assert dc_w is None and xsa_gate is None
        pos = 2 * tpos[:, None] + (torch.arange(H) % 2).to(torch.float64)[None, :]
        q = R89.rope89(q, pos, freqs)
        k = R89.rope89(k, pos, freqs)
        if aux_v is not None:
            v = v + aux_v.view(T, H, D)
        qs, ks, vs = (z.reshape(2 * T, H // 2, D) for z in (q, k, v))
        y = R89._dense_attention(qs, ks, vs, doc.repeat_interleave(2), window, scale).reshape(T, H, D)
    if attn_gate is not None:
        y = y * attn_gate[..., None]
    return y.reshape(T, H * D) @ (lam_o * Wo).T


def _mudd(x: Tensor, p: dict, block: int, n: int) -> list[Tensor]:
    h = F.gelu(x @ _d(p["mudd_w1"][block]).T)
    out = (h @ _d(p["mudd_w2"][block, :n]).T + _d(p["mudd_b2"][block, :n])) * MUDD_SCALE
    return list(out.split(1, dim=-1))


def forward_head(params: dict[str, Tensor], sign_table: Tensor, input_seq, windows, cfg: CfgHead, *,
                 attn_scale: float | None = None, freqs: Tensor | None = None, yarn: tuple[Tensor, float] | None = None,
                 bigram_idx=None, cu_seqlens=None, doc_starts=None, bf16_gates: bool = True,
                 return_aux: bool = False):
    """HEAD's forward (head.py:1486-1675) on ONE rank's flat sequence, float64, dense attention.  Returns the hidden
    (T, d) after the final norm (and an aux dict).

    windows   : (short, long) in blocks of cfg.block_size (final validation: long = 20).
    yarn      : (freqs, scale) from R89.yarn89(); default: initial frequencies, scale 0.1.
    cu_seqlens: FA3 / DC document boundaries (int, length n_docs + 1, may contain zero-length segments and trailing
                T padding); default from doc_starts, else a document at 0 and at every token 50256.
    aux keys  : x0 (un-injected normed embedding), b (bigram feature), pre_gate (T,26), post_gate (T,41), gates
                {kind: {layer: ...}}, skip_w (T,1) = sigmoid(skip_lambda) * post[28], cache {0,3,7,9}, mu, nu,
                pre_mudd1 / post_mudd1, dc_in (layer 10's DC inputs).
    """
    cfg.check()
    p = params
    x_ids = torch.as_tensor(np.asarray(R89._as_int64_np(input_seq)), dtype=torch.int64)
    T = x_ids.shape[0]
    L, H, D, bd, gc = cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.bigram_dim, cfg.gate_channels
    if yarn is not None:
        freqs, attn_scale = yarn
    if freqs is None:
        freqs = R89.rope_freqs89(D)
    if attn_scale is None:
        attn_scale = 0.1
    assert freqs.shape[-1] == D
    short_b, long_b = R89._windows_blocks(windows)
    win = {"S": short_b * cfg.block_size, "L": long_b * cfg.block_size}
    cu = _cu_from(x_ids, cu_seqlens, doc_starts)
    if bigram_idx is None:
        bigram_idx = bigram_hash_head(x_ids, cfg.bigram_rows)
    bigram_idx = torch.as_tensor(np.asarray(bigram_idx), dtype=torch.int64)
    sidx = torch.as_tensor(sign_index(x_ids, cfg.bigram_sign_rows), dtype=torch.int64)

    resid, post = _bf(p["resid_lambdas"]), _bf(p["post_lambdas"])
    smear_l, skip_l = _d(p["scalars"][2 * L]), _d(p["scalars"][2 * L + 1])

    b = _d(_p(p, "bigram_embed")[bigram_idx]) * _d(sign_table[sidx])  # (T, bd)
    ve_tab = p["value_embeds"]
    if ve_tab.ndim == 2:  # HEAD's flat (5 V, d) storage
        ve_tab = ve_tab.view(-1, cfg.vocab_size, cfg.model_dim)
    ve = {j: _d(ve_tab[j][x_ids]) for j in range(ve_tab.shape[0])}

    e = _d(_p(p, "embed")[x_ids])
    g = smear_l * torch.sigmoid(e[1:, :gc] @ _d(_p(p, "smear_gate")).T)
    e = torch.cat([e[:1], e[1:] + g * e[:-1]])
    x0 = _norm(e)

    # pre gate from the UN-injected x0 (head.py:1551)
    pre = mudd_gate_head(x0, p, 0, PRE_N, bf16_gates)
    gates = unpack_pre_gate_head(pre)

    def inject(z: Tensor, lam: Tensor) -> Tensor:
        if bd == z.shape[-1]:
            return z + b * lam
        return torch.cat([z[:, :bd] + b * lam, z[:, bd:]], -1)

    x = inject(x0, gates["bigram"][0])  # x = x0.clone(); x[..., :bd] += bigram * g_bg0 (x0 not aliased)
    cache: dict[int, Tensor] = {0: x}
    ai = cfg.attn_input_layer
    aux: dict = {"x0": x0, "b": b, "pre_gate": pre, "post_gate": None, "mu": None, "nu": None, "cu": cu}
    skip_w = None

    for i in range(L):
        if i == cfg.post_gate_layer:  # post gate from the un-normed residual (= output of layer 3)
            postg = mudd_gate_head(x, p, 1, POST_N, bf16_gates)
            aux["post_gate"] = postg
            for kind, dct in unpack_post_gate_head(postg).items():
                gates.setdefault(kind, {}).update(dct)
        if i == 6:
            skip_w = torch.sigmoid(skip_l) * gates["skip"][6]
            x = x + skip_w * cache[3]
        else:
            u = _norm(cache[ai] if ai in cache else x)
            mu = None
            if i == L - 1:
                cache[9] = x
                mu = _mudd(x, p, 0, 14)
                aux["mu"] = mu
                v_mudd = mu[0] * cache[0] + mu[1] * cache[ai] + mu[2] * x
                x = (1 + mu[5]) * x + mu[3] * cache[0] + mu[4] * cache[ai]
                gate = torch.cat([mu[6].expand(T, H // 2), mu[7].expand(T, H - H // 2)], dim=-1)
                aux_v = (gate[..., None] * ve[cfg.ve_table(i)].view(T, H, D)).reshape(T, H * D) + v_mudd
            elif cfg.ve_table(i) is not None:
                j = cfg.ve_table(i)
                G = _d(p["ve_gate_bank"][cfg.ve_layers.index(i)])
                gin = torch.cat([u[:, : gc // 2], ve[j][:, : gc // 2]], dim=-1)
                aux_v = ((2 * torch.sigmoid(gin @ G.T))[..., None] * ve[j].view(T, H, D)).reshape(T, H * D)
            else:
                aux_v = None
            dc_w = None
            if i in cfg.dc_layers and i not in cfg.paired:
                dc_w = (gates["dc_w1"][i], gates["dc_w2"][i])
            att = _attention_head(
                i, u, aux_v, p, cfg, cu, win[cfg.attn_pattern[i]], freqs, attn_scale,
                xsa_gate=gates["xsa"].get(i) if i in cfg.xsa_layers else None,
                attn_gate=gates["attn_gate"].get(i) if i in cfg.attn_gate_layers else None,
                dc_w=dc_w, bf16_gates=bf16_gates, aux=aux)
            if mu is not None:
                x = inject(mu[8] * x + mu[9] * att + mu[10] * cache[0], mu[11])
            else:
                x = resid[i, 0] * x + post[i, 0] * att + x0 * gates["x0"][i]
                if i != 0:
                    x = inject(x, gates["bigram"][i])
        m = R89._mlp(_norm(x), p, i)
        if i == L - 1:
            x = mu[12] * x + mu[13] * m
        else:
            x = resid[i, 1] * x + post[i, 1] * m
        if i in (3, 7):
            cache[i] = x

    aux["pre_mudd1"] = x
    nu = _mudd(x, p, 1, 5)
    aux["nu"] = nu
    x = x + nu[0] * cache[0] + nu[1] * cache[ai] + nu[2] * cache[9] + nu[3] * ve[0] + nu[4] * cache[3]
    aux.update(post_mudd1=x, cache=cache, gates=gates, skip_w=skip_w)
    h = _norm(x)
    return (h, aux) if return_aux else h


def logits_head(hidden: Tensor, params: dict[str, Tensor]) -> Tensor:
    """raw logits (T, V) = hidden W^T with W (V, d) (HEAD's own (d, V) storage is accepted)."""
    W = _d(_p(params, "lm_head"))
    if W.shape[-1] != hidden.shape[-1]:
        W = W.T
    return hidden.to(torch.float64) @ W.T


# ----------------------------------------------------------------------------------------------------
# §2.7 loss with the prefix term, and the fused kernel's gradient
# ----------------------------------------------------------------------------------------------------
def _ce_parts(logits: Tensor, targets, weights, prefix_targets, prefix_weight, cap, shift, temp, bf16_sigma):
    l64 = logits.to(torch.float64)
    T, V = l64.shape
    sig = torch.sigmoid((l64 + shift) / temp)
    if bf16_sigma:
        sig = _d(O89._bf16(sig))
    z = cap * sig
    lse = torch.logsumexp(z, dim=-1)
    y = torch.as_tensor(np.asarray(R89._as_int64_np(targets)), dtype=torch.int64)
    w = [float(v) for v in (weights.tolist() if isinstance(weights, Tensor) else weights)]
    if prefix_targets is None:
        pt = torch.full((T,), -1, dtype=torch.int64)
    else:
        pt = torch.as_tensor(np.asarray(R89._as_int64_np(prefix_targets)), dtype=torch.int64)
    pw = float(torch.as_tensor(prefix_weight, dtype=torch.float64).reshape(-1)[0]) if prefix_weight is not None else 0.0
    return l64, sig, z, lse, y, w, pt, pw, T, V


def mtp_prefix_loss_head(logits: Tensor, targets, weights, prefix_targets=None, prefix_weight=0.0,
                         cap: float = 23.0, shift: float = 5.0, temp: float = 7.5, bf16_sigma: bool = False) -> Tensor:
    """Per-row training loss (T,) float64 (headk.py:1066-1090):
      l_p = sum_k w_k [p+k < T][0 <= y_{p+k} < V] (lse_p - z_p[y_{p+k}])  +  [0 <= T'_p < V] w_pre (lse_p - z_p[T'_p])
    z = cap*sigmoid((logits + shift)/temp) (exact sigmoid; bf16_sigma rounds it as the kernel does), targets[p+k]
    is row p's k-th target, T'_p = prefix_targets[p] = prefix_table[targets[p]] (next token's prefix, MTP offset 0).
    With prefix_weight 0 or all T' = -1 this is #89's mtp loss (reference89.mtp_loss89)."""
    l64, sig, z, lse, y, w, pt, pw, T, V = _ce_parts(logits, targets, weights, prefix_targets, prefix_weight, cap,
                                                     shift, temp, bf16_sigma)
    out = torch.zeros(T, dtype=torch.float64)
    rows = torch.arange(T)
    for k, wk in enumerate(w):
        if k >= T:
            break
        idx = rows[: T - k]
        tgt = y[k:]
        ok = (tgt >= 0) & (tgt < V)
        out[idx[ok]] += wk * (lse[idx[ok]] - z[idx[ok], tgt[ok]])
    pv = (pt >= 0) & (pt < V)
    out[rows[pv]] += pw * (lse[rows[pv]] - z[rows[pv], pt[pv]])
    return out


def mtp_prefix_grad_head(logits: Tensor, targets, weights, prefix_targets=None, prefix_weight=0.0,
                         cap: float = 23.0, shift: float = 5.0, temp: float = 7.5, grad_scale: float = 1.0,
                         sw_quirk: bool = True, bf16_sigma: bool = False) -> Tensor:
    """d(grad_scale * sum_p l_p)/d logits (T, V) float64 as the fused kernel defines it (headk.py:1093-1168):
      S_w(p) = sum_{k<K} w_k (ALL K weights, no p+k<T test: #89 quirk kept) + [T'_p valid] w_pre;
      term2(p, j) = sum_{k: p+k<T, y_{p+k} = j, 0<=y<V} w_k + [T'_p valid, T'_p = j] w_pre;
      G_pj = grad_scale (cap/temp) (S_w softmax(z_p)_j - term2) sigma (1 - sigma).
    sw_quirk=False: S_w sums only the valid k (the true derivative of l_p).  No e5m2 / grad_s here (softcap_ce_head).
    Note: HEAD's target-term loop runs over all n_predict weights (#89's kernel stopped at k < 3)."""
    l64, sig, z, lse, y, w, pt, pw, T, V = _ce_parts(logits, targets, weights, prefix_targets, prefix_weight, cap,
                                                     shift, temp, bf16_sigma)
    P = torch.exp(z - lse[:, None])
    rows = torch.arange(T)
    term2 = torch.zeros(T, V, dtype=torch.float64)
    sw = torch.zeros(T, dtype=torch.float64)
    for k, wk in enumerate(w):
        n = max(T - k, 0)
        idx, tgt = rows[:n], y[k:k + n]
        ok = (tgt >= 0) & (tgt < V)
        term2.index_put_((idx[ok], tgt[ok]), torch.full((int(ok.sum()),), wk, dtype=torch.float64), accumulate=True)
        sw[idx] += wk
    if sw_quirk:
        sw = torch.full((T,), float(sum(w)), dtype=torch.float64)
    pv = (pt >= 0) & (pt < V)
    sw = sw + pw * pv.to(torch.float64)
    term2.index_put_((rows[pv], pt[pv]), torch.full((int(pv.sum()),), pw, dtype=torch.float64), accumulate=True)
    return grad_scale * (cap / temp) * (sw[:, None] * P - term2) * sig * (1 - sig)


def softcap_ce_head(logits_bf16: Tensor, targets, weights, prefix_targets=None, prefix_weight=0.0,
                    grad_s: float = O89.GRAD_S, grad_scale: float = 1.0, sw_quirk: bool = True):
    """The fused ce_fwd_bwd kernel's outputs (like reference89_optim.softcap_ce89, plus the prefix column):
    sigma rounded to bf16, weights as fp32 values; returns (losses float64 (T,), g8 float8_e5m2 (T, V) =
    e5m2(G / grad_s) with saturation, g8 dequantised * grad_s float64)."""
    l = _d(logits_bf16.to(torch.bfloat16))
    w32 = torch.as_tensor(weights, dtype=torch.float32).to(torch.float64).reshape(-1).tolist()
    pw32 = float(torch.as_tensor(prefix_weight, dtype=torch.float32).reshape(-1)[0])
    losses = mtp_prefix_loss_head(l, targets, w32, prefix_targets, pw32, bf16_sigma=True)
    G = mtp_prefix_grad_head(l, targets, w32, prefix_targets, pw32, grad_scale=grad_scale, sw_quirk=sw_quirk,
                             bf16_sigma=True)
    g8 = O89._e5m2_satfinite(G / grad_s)
    return losses, g8, g8.to(torch.float64) * grad_s


def loss_head(params, sign_table, input_seq, target_seq, windows, cfg: CfgHead, mtp_weights, prefix_weight=0.0,
              prefix_table: Tensor | None = None, **kw) -> Tensor:
    """Per-token training losses (T,) of the float64 forward; prefix targets = prefix_table[target_seq]
    (default: all -1, the warm-up state)."""
    h = forward_head(params, sign_table, input_seq, windows, cfg, **kw)
    y = torch.as_tensor(np.asarray(R89._as_int64_np(target_seq)), dtype=torch.int64)
    pt = None if prefix_table is None else prefix_table[y]
    return mtp_prefix_loss_head(logits_head(h, params), y, mtp_weights, pt, prefix_weight,
                                cfg.logit_cap, cfg.logit_shift, cfg.logit_temp)


# ----------------------------------------------------------------------------------------------------
# §1.2 / §2.7 schedule (1270 + 15)
# ----------------------------------------------------------------------------------------------------
N_HEAD, E_HEAD = 1270, 15
_PREFIX_START = (0.25, 0.25, 0.0, 0.0)
_PREFIX_END = (0.25, 0.0, 0.0, 0.0)


def stage_ends_head(N: int = N_HEAD, E: int = E_HEAD) -> list[int]:
    return R89.stage_ends89(N, E)


def warmup_steps_head(N: int = N_HEAD, E: int = E_HEAD) -> list[int]:
    return R89.warmup_steps89(N, E)


def val_steps_head(N: int = N_HEAD, E: int = E_HEAD, every: int = 250) -> list[int]:
    """validation before the step's training: steps s % 250 == 0 below N+E, and the final step N+E"""
    return sorted({s for s in range(0, N + E) if s % every == 0} | {N + E})


def prefix_weight_head(step: int, N: int = N_HEAD, E: int = E_HEAD) -> float:
    """start + (end - start) tau within the step's stage: stage 0 0.25; stage 1 0.25 -> 0; stage 2 / ext 0
    (steps >= N+E: the extension stage with tau = 1).  Python double (HEAD stores fp32, ``prefix_weight_fp32``)."""
    ends = stage_ends_head(N, E)
    for k, (a, b) in enumerate(zip(ends[:-1], ends[1:])):
        if step < b:
            tau = (step - a) / (b - a)
            return _PREFIX_START[k] + (_PREFIX_END[k] - _PREFIX_START[k]) * tau
    return _PREFIX_START[-1] + (_PREFIX_END[-1] - _PREFIX_START[-1]) * 1.0


def schedule_head(step: int, N: int = N_HEAD, E: int = E_HEAD, **kw) -> dict:
    """Everything training step ``step`` (0 .. N+E; N+E = final validation) uses: reference89.schedule89's keys
    (stage, tau, s, mu, windows, window_tokens, batch, doc_cut, mtp, attn_scale, freqs, adam, tied, untie_step,
    bootstrap_down, final_val, cooldown_start, stage_ends) at N = 1270, E = 15, plus
    prefix_weight / prefix_weight_fp32 ((1,) fp32), val (validation before this step), mom_cooldown_start,
    yarn_steps (stage starts where the long window changes), warmup_steps, val_steps."""
    d = R89.schedule89(step, N, E, **kw)
    ends = d["stage_ends"]
    pw = prefix_weight_head(step, N, E)
    d.update(
        prefix_weight=pw, prefix_weight_fp32=torch.tensor([pw], dtype=torch.float32),
        val=step in val_steps_head(N, E), mom_cooldown_start=N + E - 50,
        yarn_steps=[s for s in ends[1:-1]],
        warmup_steps=warmup_steps_head(N, E), val_steps=val_steps_head(N, E),
    )
    return d


# ----------------------------------------------------------------------------------------------------
# §2.10 optimizer table
# ----------------------------------------------------------------------------------------------------
SCATTER_ORDER_HEAD: list[str] = [
    "qk_bank", "vo_bank", "mlp_bank", "scalars", "smear_gate", "ve_gate_bank", "lm_head", "bigram_embed",
    "post_lambdas", "resid_lambdas", "value_embeds", "embed", "mudd_w1", "mudd_w2", "mudd_b2",
    "mudd_gate_w1", "mudd_gate_w2", "mudd_gate_b2", "_mudd_gate_scale",
]
WORK_ORDER_HEAD: list[str] = [
    "scalars", "smear_gate", "ve_gate_bank", "mudd_b2", "mudd_gate_b2", "_mudd_gate_scale", "post_lambdas",
    "resid_lambdas", "mudd_w2", "mudd_gate_w2", "value_embeds", "bigram_embed", "mudd_w1", "mudd_gate_w1",
    "lm_head", "embed", "qk_bank", "vo_bank", "mlp_bank",
]
_COMMS = {"qk_bank": "sharded", "vo_bank": "sharded", "mlp_bank": "sharded", "lm_head": "sharded",
          "embed": "sharded", "value_embeds": "sharded", "bigram_embed": "sharded_sparse"}


def param_table_head() -> dict[str, dict]:
    """The 19 rows of §2.10 in scatter order: #89's rows (reference89_optim.param_table89: opt, lr_mul [NorMuon:
    incl. the shape multiplier], lr, betas, wd_mul, weight_decay, eps, decay, per_matrix_lr_mul) minus the 5 removed,
    plus mudd_gate_w1 / w2 (Adam (0.9, 0.99), lr_mul 0.1, wd_mul 1.0), mudd_gate_b2 / _mudd_gate_scale (wd_mul 0);
    each row gains ``comms`` (sharded / sharded_sparse / replicated)."""
    t89 = O89.param_table89()
    rows: dict[str, dict] = {}
    for label in SCATTER_ORDER_HEAD:
        if label in t89:
            e = dict(t89[label])
        else:
            wd_mul = 1.0 if label in ("mudd_gate_w1", "mudd_gate_w2") else 0.0
            e = dict(opt="adam", lr_mul=0.1, lr=0.008 * 0.1, betas=(0.9, 0.99), wd_mul=wd_mul, weight_decay=0.005,
                     eps=1e-10, per_matrix_lr_mul=None,
                     decay="cautious (mask u*p > 0): u += lam*p, lam = lr_eff^2 * 0.005 * wd_mul"
                           if wd_mul else "none (wd_mul = 0)")
        e["comms"] = _COMMS.get(label, "replicated")
        rows[label] = e
    assert list(rows) == SCATTER_ORDER_HEAD and sorted(WORK_ORDER_HEAD) == sorted(SCATTER_ORDER_HEAD)
    return rows
