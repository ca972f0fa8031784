"""Speedrun GPT trainer: the NanoGPT speedrun's current recipe (upstream's f411b3d: record #89 with #85-#88) in one
file, the FP8 ops, Triton kernels and device paths beside it in gpt_kernels.py (the two go together). Launch with
`torchrun --standalone --nproc_per_node=N train_gpt.py [--field=value ...]` (N in 1, 2, 4, 8) or `python train_gpt.py
--preset=tiny` on a CPU. Importing it has no side effects; earlier recipes live in records/."""

from __future__ import annotations

import ast, base64, binascii, collections, contextlib, dataclasses, datetime, difflib, errno, fcntl, functools, glob
import hashlib, importlib.util, inspect, io, itertools, json, math, os, platform, queue, random, re, resource, shutil
import signal, subprocess, sys, textwrap, threading, time, uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
import torch.distributed as dist
# Imported before any process group exists: torch._dynamo's lazy import later would hold group.WORLD (its functions'
# default argument) past destroy_process_group, and gloo's threads would race the exit (SIGABRT, one CPU run in a few).
import torch.distributed.nn  # noqa: F401
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

try:  # the FP8 ops, the Triton kernels (custom ops under torch.ops.speedrun) and the device paths: half of this program
    import gpt_kernels
except ModuleNotFoundError as e:
    if e.name != "gpt_kernels":
        raise
    raise SystemExit("error: train_gpt.py needs gpt_kernels.py beside it: copy the two files together") from None
from gpt_kernels import eager_sum, gpu_runs, load_fa3, native_bf16_gemm

if sys.version_info < (3, 11):  # main's error notes (BaseException.add_note) are 3.11's
    raise SystemExit(f"error: train_gpt.py needs Python 3.11 or newer (this is {platform.python_version()})")

class UsageError(Exception):
    """A problem the user can fix (config, launch, data); printed as one line, no traceback."""

class OutOfMemory(UsageError):
    """A GPU ran out of memory: one line on the rank it happened on, saying which setting fits (exit code 2)."""

class RankLost(Exception):
    """Another rank's process is gone: one line on every rank left (rank 0 may be the one gone), exit code 1."""

# -----------------------------------------------------------------------------
# Hyperparameters
# Upstream modded-nanogpt f411b3d (2026-08-01, 8xH100): record #89 with #85 v3's MUDD gates and DC attention, #86's
# XSA, #87's ReLU^2 backward, #88's prefix-token loss, each knob a --field=value; earlier: records/snapshots/*_record*/.

@dataclass(frozen=True)
class Stage:
    """A row of the stage table: one of the equal stages of the scheduled steps, or (the last row) the extension."""
    seq_len: int  # tokens per training sequence (#46)
    doc_len: int  # documents are cut to this many tokens (#29, #72)
    windows: tuple[int, int]  # the short and long layers' attention windows, blocks back in a document (0: itself)
    lr_mul: float  # of every lr (#46); the cooldown falls from it
    mtp_start: tuple[float, ...]  # the loss weights of the next 1, 2, ... tokens at the row's start (#53)
    mtp_end: tuple[float, ...]  # ... at its end
    prefix_start: float  # the loss weight of the next token's prefix token at the row's start (#88)
    prefix_end: float  # ... at its end

RECIPE_STAGES = (  # #89's: batches of 8 x 16k, 32k, 48k tokens, then the extension's longer windows
    Stage(16384, 896, (1, 3), 1.0, (1.0, 0.5, 0.25), (1.0, 0.5, 0.0), 0.25, 0.25),
    Stage(32768, 2048, (3, 7), 1.52, (1.0, 0.5), (1.0, 0.0), 0.25, 0.0),
    Stage(49152, 2048, (5, 11), 1.73, (1.0,), (1.0,), 0.0, 0.0),
    Stage(49152, 2048, (6, 13), 1.73, (1.0,), (1.0,), 0.0, 0.0),  # the extension: lr at final_lr_frac by then
)

@dataclass
class Config:
    # data
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"  # training shards (glob; relative: also under this folder)
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"  # validation shards (glob)
    train_epochs: int = 1  # passes over the training files, in order
    train_seq_len: int = 48 * 1024  # the longest training sequence (--stage_seq_len's longest); buffers fit it
    global_batch_seqs: int = 8  # sequences per optimizer step, summed over ranks and micro-steps
    micro_split: int = 1  # N micro-steps per sequence: less memory (tools/memory_estimate.py); attention stops at a cut
    val_seq_len: int = 4 * 64 * 1024  # tokens per validation sequence (contiguous, not document-aligned)
    val_tokens: int = 10_485_760  # validation tokens: the first ones of the val shards
    # model
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 128
    num_layers: int = 11  # transformer blocks
    model_dim: int = 768  # residual width; num_heads x head_dim
    num_heads: int = 6  # attention heads
    head_dim: int = 128  # width of a head
    mlp_ratio: int = 4  # MLP hidden width / model_dim
    attn_pattern: str = "SSSLSS-SSSL"  # per layer: L long window, S short window, - no attention
    paired_layers: str = "0,2,5,9"  # short-window layers whose heads j, j + H/2 attend as pairs (#58); "": none
    value_embeds: str = "-01-----234"  # per layer: the value-embedding table (0-9) its values add, - none (#63)
    skip: str = "3:6"  # A:B: A's output joins attention-less layer B, gated (#45/#55); MUDD gate block 1 reads it (#85)
    attn_input_layer: int = 7  # later layers attend over this layer's normed output (#77); the MUDD mixes read it
    xsa_layers: str = "1,3,4,7"  # unpaired attention layers that subtract a gated share of their output along v (#82)
    attn_gate_layers: str = "3,10"  # attention layers whose heads' outputs a MUDD gate scales (#85)
    bigram_rows: int = 50304 * 15 // 2  # rows of the bigram hash embedding added at every layer (#62; #85: d wide)
    bigram_sign_rows: int = 8192  # rows of the +-1 table its rows are multiplied by, per token pair (#83)
    mudd_dim: int = 64  # hidden width of the MUDD coefficient MLPs and of the MUDD gate network (#81/#85)
    attn_scale: float = 0.1  # attention logit scale (in place of 1/sqrt(head_dim))
    gate_channels: int = 12  # leading channels of the attention input that drive the head and VE gates
    logit_cap: float = 23.0  # logits are logit_cap * sigmoid((z + logit_shift) / logit_temp) (#54)
    logit_temp: float = 7.5  # see logit_cap
    logit_shift: float = 5.0  # see logit_cap
    block_size: int = 128  # attention block granularity (FlexAttention tile; a multiple of 128 on CUDA)
    # optimizer
    muon_lr: float = 0.023  # Muon (block matrices), Polar Express orthogonalization (#38)
    muon_momentum_start: float = 0.85  # Muon momentum at step 0
    muon_momentum_end: float = 0.95  # ... after muon_momentum_warmup_steps
    normuon_beta2: float = 0.9  # NorMuon (#41): decay of the per-row (wide: per-column) second moment of the update
    mlp_down_lr_mul: float = 2.0  # Muon lr multiplier of W_proj over W_fc's (both x2 for their 4:1 shape) (#48)
    muon_wd: float = 1.2  # cautious weight decay (#43): wd*lr*(lr*lr_mul) where update and weight agree in sign
    embed_lr: float = 0.6  # Adam: value embeddings and the bigram table
    head_lr: float = 0.008  # Adam: LM head, and the embedding (tied to it, then its own)
    scalar_lr: float = 0.04  # Adam: the scalar vector (attention lambdas, smear, skip) and the residual lambdas
    lambda_lr: float = 0.008  # Adam: the post lambdas, with lambda_betas
    mudd_lr: float = 0.002  # Adam: the MUDD MLPs (#81), with the scalars' betas
    mudd_gate_lr: float = 8e-4  # Adam: the MUDD gate network and its scale (#85: 0.008 x 0.1), the scalars' betas
    gate_lr: float = 0.008  # Adam: the VE gates, with the scalars' betas
    smear_gate_lr: float = 8e-5  # Adam: the smear's gate (#52: 0.008 x 0.01), with the scalars' betas
    adam_beta1: float = 0.75  # Adam's first-moment decay (value embeddings, bigram table)
    adam_beta2: float = 0.95  # Adam's second-moment decay
    head_beta1: float = 0.5  # ... beta1 of the LM head and the embedding
    scalar_beta1: float = 0.9  # ... of the scalar vector, the gates, MUDD and the per-layer lambdas (#52)
    scalar_beta2: float = 0.99  # ... and their beta2
    adam_eps: float = 1e-10  # Adam's epsilon (added to the raw sqrt(v))
    adam_wd: float = 0.005  # cautious weight decay for Adam (#50): (lr)^2*adam_wd*wd_mul where step and weight agree
    embed_wd_mul: float = 150.0  # adam_wd multiplier of the token embedding (#55; the scalars never decay)
    value_embed_wd_mul: float = 5.0  # ... of the value embeddings and the bigram table
    head_wd_mul: float = 150.0  # ... of the LM head
    adam_every: int = 2  # Adam steps every N steps, on the gradients summed since its last step (#39)
    grad_scale: float = 1.0  # gradients are this x the mean over the step's sequences (#89: 1 / its grad_accum_steps)
    # schedule
    num_steps: int = 1285  # optimizer steps: the scheduled ones, then the extension
    extension_steps: int = 15  # the last N of num_steps run at final_lr_frac after the cooldown (#35/#46)
    cooldown_frac: float = 0.6  # of the scheduled steps: lr falls linearly from the stage's to final_lr_frac
    final_lr_frac: float = 0.15  # lr multiplier at the end of the cooldown (#72)
    muon_momentum_warmup_steps: int = 300  # steps over which Muon's momentum rises from start to end
    muon_momentum_cooldown_steps: int = 50  # Muon momentum falls back to its start over the last N steps (#39)
    stages: tuple[Stage, ...] = RECIPE_STAGES  # the stage table (Stage), a row per stage, the extension last
    final_val_windows: str = "6/20"  # SHORT/LONG: the last validation's windows in blocks (#35, #62)
    untie_stage: int = 2  # the embedding, a lookup into the head until then, unties after this stage's first Adam step
    vocab_file: str = "data/tokenizer/0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4"  # GPT-2's BPE: the prefix table
    # systems
    device: str = "auto"  # auto | cuda | cpu
    compile: bool | None = None  # torch.compile the model and the orthogonalization; auto: on for CUDA, off for CPU
    fp8_head: bool | None = None  # FP8 LM-head matmul in training; auto: on for CUDA (DISABLE_FP8=1: off)
    fp8_mlp: bool | None = None  # FP8 MLP matmuls in training (#84, #89); auto: on for CUDA (DISABLE_FP8=1: off)
    relu2_kernel: bool | None = None  # MLP up-projection + ReLU^2 in one Triton kernel (#59); auto: on for CUDA
    dc_kernel: bool | None = None  # DC attention in Triton kernels (#85; deterministic gradients); auto: on for CUDA
    fused_head: bool | None = None  # head + (MTP) softcapped CE by row chunks in one Triton kernel (#60); auto: CUDA
    attention: str = "auto"  # fa3: #89's FA3 varlen kernel (Hopper, the kernels package) | flex | auto: fa3 if it loads
    fp8_x_scale: float = 100 / 448  # the FP8 head's input scale (value = fp8 x scale) (#51)
    fp8_w_scale: float = 1.6 / 448  # ... of its weight (#55)
    fp8_grad_scale: float = 0.75 / 448  # ... of the logits' gradient, before train_loss_scale folds in (#51)
    fp8_down_w_headroom: float = 1.12  # the MLP down-projection's weight scale: last step's amax x this / 448 (#89)
    fp8_down_act_headroom: float = 1.8  # ... its input's scale: the last training forward's amax x this / 448
    fp8_down_exact_steps: int = 16  # the weight scale is the current amax (no headroom) after the first N steps
    prefetch_depth: int = 2  # batches prepared ahead on a background thread; 0 = synchronous, main thread
    bucket_mb: float = 25.0  # MiB of gradients per reduce-scatter (the sharded optimizer's unit of work)
    peak_tflops: float = 0.0  # peak dense bf16 TFLOP/s per device for MFU; 0 looks the GPU name up
    cpu_bf16_gemm: str = "auto"  # CPU runs' bf16 matmuls: native (oneDNN) | fp32 (fp32 GEMM, bf16 result) | auto
    # run
    preset: str = ""  # named sets of fields (A,B: in order), applied before explicit flags
    seed: int = -1  # -1 draws a random seed (printed first, with the run id)
    run_id: str = ""  # a plain name (no '/', '\', whitespace or control characters, not '..'); default: a fresh one
    log_dir: str = "logs"  # <run_id>.txt, .jsonl, .json and <run_id>/ (traces, checkpoints); not empty (.: here)
    val_every: int = 250  # validate every N steps; 0: only at the start and the end
    warmup_steps: int = 10  # untimed steps that compile and autotune; model and optimizer are restored after
    log_every: int = 1  # train metrics every N steps (and the last); N never changes training
    profile: str = ""  # START:END traces training steps START..END-1 to <log_dir>/<run_id>/trace_rank<R>.json.gz
    bench: bool = False  # a short benchmark instead of the run; report in <log_dir>/<run_id>_bench.json
    bench_steps: int = 20  # --bench: timed steps, then as many traced steps
    save_every: int = 0  # checkpoint every N steps to <log_dir>/<run_id>/ckpt_<step>/; 0 = off
    save_final: bool = False  # checkpoint after the last step
    save_minutes: float = 5.0  # with --resume=auto, also a checkpoint after each N minutes of training (0: none)
    resume: str = ""  # auto: carry on run --run_id from its newest checkpoint (the same command, run again); or a
    #                   ckpt_<step> directory: continue that run exactly (same shapes and data; own --run_id)

PRESETS: dict[str, dict[str, object]] = {
    # The recipe scaled down to the bundled sample: every stage, the untie and the extension in about a minute on 2 CPU
    # cores (few large steps: the logits dominate a CPU's cost). block_size 128 (FlexAttention's H100 tile): GPUs too.
    "tiny": dict(
        seed=1337, train_files="data/sample/sample_train_*.bin", val_files="data/sample/sample_val_*.bin",
        train_seq_len=512, val_seq_len=1024, val_tokens=16384,
        num_layers=5, model_dim=128, num_heads=2, head_dim=64, attn_pattern="SL-SL", paired_layers="0",
        value_embeds="0--12", skip="1:2", attn_input_layer=3, xsa_layers="1,3", attn_gate_layers="1,4",
        bigram_rows=50304, mudd_dim=16, block_size=128,
        num_steps=40, extension_steps=2, muon_momentum_warmup_steps=10, muon_momentum_cooldown_steps=5,
        stages=(Stage(256, 224, (0, 1), 1.0, (1.0, 0.5, 0.25), (1.0, 0.5, 0.0), 0.25, 0.25),
                Stage(384, 512, (1, 2), 1.52, (1.0, 0.5), (1.0, 0.0), 0.25, 0.0),
                Stage(512, 512, (1, 3), 1.73, (1.0,), (1.0,), 0.0, 0.0),
                Stage(512, 512, (2, 4), 1.73, (1.0,), (1.0,), 0.0, 0.0)),
        final_val_windows="2/6", val_every=20, warmup_steps=2,
    ),
}

# -----------------------------------------------------------------------------
# Model
# Upstream's current GPT: token, value and bigram embeddings, residual lambdas, per-token gates from a small network,
# QK-norm, half-truncated RoPE with YaRN, paired-head, key-offset, XSA and (last layer) DC attention, MUDD mixes, ReLU^2
# MLP (FP8 in training), soft-capped multi-token and prefix-token loss. One mask rule (FA3's token windows within
# documents), two kernels: FlexAttention block masks on CUDA, a dense SDPA mask on CPU (no CPU backward in flex).

BIGRAM_MUL = (36313, 27191)  # the bigram hash's multipliers of the token and the previous one (#62)
YARN_ALPHA, YARN_BETA = 1.0, 32.0  # a frequency's turns in the old window: below alpha interpolated, above beta kept
YARN_SCALE_GROWTH = 0.2  # the attention scale's growth per e-fold of the window (#31; YaRN's own is 0.1)

RMS_EPS = torch.finfo(torch.float32).eps  # what F.rms_norm adds for bf16 and fp32 inputs (a float64 copy: the same)

def norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.size(-1),), eps=RMS_EPS)

@torch.no_grad()
def init_matrix_(w: Tensor, bound: float) -> None:
    """U(-bound, bound) rounded to bf16, as #89 draws its banks in fp32 and stores them in bf16 with zero mantissas."""
    w.copy_(w.uniform_(-bound, bound).bfloat16())

def bigram_index(input_seq: Tensor | np.ndarray, rows: int) -> Tensor | np.ndarray:
    """Each position's row of the bigram table (#62): (36313 x_t xor 27191 x_(t-1)) mod (rows - 1), products wrapping
    around int32 (in int64: inductor's must not overflow); the last row at position 0 (#89 writes it into x_0 first)."""
    xp = torch if isinstance(input_seq, Tensor) else np
    x = input_seq.long() if xp is torch else input_seq.astype(np.int64)
    x = xp.concatenate([x[..., :1] * 0 + (rows - 1), x[..., 1:]], -1)
    cur, prev = ((mul * t + 2**31) % 2**32 - 2**31 for mul, t in zip(BIGRAM_MUL, (x[..., 1:], x[..., :-1])))
    return xp.concatenate([x[..., :1], (cur ^ prev) % (rows - 1)], -1)

def sign_index(input_seq: Tensor, rows: int) -> Tensor:
    """Each position's row of the bigram sign table (#83): (x_(t-1) xor x_t) mod rows; row 0 at position 0."""
    return torch.cat([input_seq.new_zeros(1), (input_seq[:-1] ^ input_seq[1:]) % rows])

def may_attend(q_idx: Tensor, kv_idx: Tensor, first_key: Tensor) -> Tensor:
    """Causal, and no key before first_key[q]: the later of q's document start and its window's reach (FA3's)."""
    return (q_idx >= kv_idx) & (kv_idx >= first_key[q_idx])

def block_window_selection(docs: Tensor, block_size: int, window: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per query block, the key blocks it reads, nearest first: (partial count, partial idx, full count, full idx).
    Visible: at most `window` blocks back, documents overlapping; full (no per-token mask): fewer, in one document."""
    blocks = docs.view(-1, block_size)
    nb, first, last = blocks.size(0), blocks[:, 0], blocks[:, -1]
    q, k = torch.arange(nb, device=docs.device)[:, None], torch.arange(nb, device=docs.device)[None, :]
    visible = (q >= k) & (first[:, None] <= last[None, :]) & (q - k <= window)
    full = (q > k) & (last[:, None] == first[None, :]) & (q - k < window)
    partial = visible & ~full

    def nearest_first(mask: Tensor) -> tuple[Tensor, Tensor]:
        order = torch.argsort(torch.where(mask, k, -1), dim=-1, descending=True, stable=True)
        return mask.sum(-1, dtype=torch.int32), order.to(torch.int32)

    return *nearest_first(partial), *nearest_first(full)

def document_blocks(input_seq: Tensor, block_size: int, window: Tensor, paired: bool
                    ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor, Tensor]]:
    """may_attend's first key and block_window_selection over the tokens, or (paired) the 2T positions (i: token i//2).
    Both bounds only grow: one running max, one buffer (the CPU's compiled flex refuses an elementwise max of two)."""
    bos, docs = input_seq == BOS_ID, (input_seq == BOS_ID).cumsum(0)
    if paired:
        bos, docs = torch.stack([bos, torch.zeros_like(bos)], 1).flatten(), docs.repeat_interleave(2)
    pos = torch.arange(bos.numel(), device=bos.device)
    first_key = torch.cummax(torch.maximum(torch.where(bos, pos, 0), pos - window * block_size), 0).values
    return first_key, block_window_selection(docs, block_size, window)

def block_mask(input_seq: Tensor, block_size: int, window: Tensor, paired: bool = False) -> BlockMask:
    first_key, (partial_n, partial_idx, full_n, full_idx) = document_blocks(input_seq, block_size, window, paired)
    return BlockMask.from_kv_blocks(partial_n[None, None], partial_idx[None, None], full_n[None, None],
                                    full_idx[None, None], BLOCK_SIZE=block_size,
                                    mask_mod=lambda b, h, q_idx, kv_idx: may_attend(q_idx, kv_idx, first_key))

def dense_mask(input_seq: Tensor, block_size: int, window: Tensor, paired: bool = False) -> Tensor:
    """The same mask as block_mask, as a (T, T) (paired: (2T, 2T)) boolean for scaled_dot_product_attention: may_attend
    alone (block_mask's block choice never drops a key it allows: the tests compare the two)."""
    first_key, _ = document_blocks(input_seq, block_size, window, paired)
    pos = torch.arange(first_key.numel(), device=first_key.device)
    return may_attend(pos[:, None], pos[None, :], first_key)

# FA3 (#89's kernel, on Hopper) takes the same rule as one varlen call per layer (cu_seqlens, causal, (w, 0) windows);
# each distinct VarlenPlan is a graph, as in #89: one per training stage and per validation, sized from the run's data.
VARLEN_SLOTS = {16384: 64, 32768: 96, 49152: 128}  # #89's cu_seqlens lengths per micro-step length (#78: FineWeb's)

@dataclass(frozen=True)
class VarlenPlan:
    long_window: int  # tokens
    short_window: int
    max_seqlen: int  # the longest document FA3 can meet: the cut in training, the whole sequence validating
    slots: int  # cu_seqlens' length: more than the most documents a sequence of this shape holds in the run's data
    scale: float  # the softmax scale: attn_scale times YaRN's growth so far

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]  # q, k, v (1, positions, heads, D) -> attention's output, alike

def varlen_slots(seq_len: int, most_documents: int) -> int:
    """cu_seqlens' length for seq_len tokens holding at most most_documents documents: #89's (its table, else
    seq_len // 300 rounded up to 128) where they fit, else (where #89 crashes) the next multiple of 16 that does."""
    record = VARLEN_SLOTS.get(seq_len, -(-(seq_len // 300) // 128) * 128)
    return max(record, -(-(most_documents + 1) // 16) * 16)

def cu_seqlens(input_seq: Tensor, slots: int) -> Tensor:
    """#89's layout: 0, each later document's start, then T up to `slots` entries (static shape: no host sync)."""
    T = input_seq.numel()
    starts = (input_seq == BOS_ID) | (torch.arange(T, device=input_seq.device) == 0)
    return torch.nonzero_static(starts, size=slots, fill_value=T).flatten().int()

def yarn_scale(long_windows: tuple[int, ...], base: float) -> float:
    """base times YaRN's scale growth, 1 + 0.2 ln(W' / W) per change W -> W' of the long window (#31), #89's order."""
    for old, new in zip(long_windows, long_windows[1:]):
        base *= 1 + YARN_SCALE_GROWTH * math.log(new / old)
    return base

class Rotary(nn.Module):
    """Half-truncated RoPE in #89's layout (dim pairs (2i, 2i + 1)), bf16 tables from fp32 angles, as #89's."""

    def __init__(self, head_dim: int, max_len: int):
        super().__init__()
        turning = (1 / 1024) ** torch.linspace(0, 1, head_dim // 4)
        self.base = torch.cat([turning.repeat_interleave(2), torch.zeros(head_dim // 2)])  # per dim, fp32
        self.register_buffer("cos", torch.empty(max_len, head_dim, dtype=torch.bfloat16), persistent=False)
        self.register_buffer("sin", torch.empty_like(self.cos), persistent=False)  # odd dims negated
        self.register_buffer("stationary", self.base == 0, persistent=False)  # the dims never turned
        self.set_frequencies(self.base)

    @torch.no_grad()
    def set_frequencies(self, freqs: Tensor) -> None:
        # Built where the tables live, with #89's fp32 ops: a GPU run's tables are #89's, bit for bit.
        positions = torch.arange(self.cos.size(0), dtype=torch.float32, device=self.cos.device)
        theta = torch.outer(positions, freqs.to(self.cos.device, torch.float32))
        self.cos.copy_(theta.cos())
        self.sin.copy_(theta.sin())
        self.sin[:, 1::2] *= -1

    def forward(self, x: Tensor, paired: bool = False) -> Tensor:  # (1, T, H, D)
        """Token t at position t; paired (a table of 2T positions): head h of token t at 2t + h % 2, as #89 does."""
        T = x.size(-3)
        if paired:  # heads as (H/2, 2): the parity broadcasts over rows 2t and 2t + 1 of the table, no copy
            cos, sin = (t[: 2 * T].view(1, T, 1, 2, -1) for t in (self.cos, self.sin))
            x = x.unflatten(-2, (-1, 2))
        else:
            cos, sin = self.cos[None, :T, None, :], self.sin[None, :T, None, :]
        swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x1, x0, x3, x2, ...)
        y = (x.float() * cos + swapped.float() * sin).type_as(x)  # one rounding, as #89's compiled kernel
        return y.flatten(-3, -2) if paired else y

MUDD_SCALE = 0.1  # the MUDD MLPs' outputs times this are the coefficients; their biases are stored divided by it
MUDD_COEFS = (14, 5)  # block 0 (at the last layer's input) and block 1 (after the last layer): their coefficients
DC_WINDOW = 112  # DC attention's keys per query: itself and the 111 before it in its document (#85)

def dc_attention(base: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, cu_seqlens: Tensor,
                 scale: float | Tensor, window: int = DC_WINDOW, block: int = 64) -> Tensor:
    """DC attention (#85; gpt_kernels' op's torch path) on attention's output base (T, H, D): per token t and head h a
    softmax P_h of scale q_t.k_j over the keys j of its window in its document, A = sum_h w1_h P_h, out_h = base_h +
    sum_j bf16(w2_h A_j) v_j, in fp32 rounded once. Query blocks against the keys they reach: never T x T memory."""
    T = base.size(0)
    acc = torch.promote_types(base.dtype, torch.float32)  # fp32 sums (float64 in the tests)
    n, keys = -(-T // block), block + window - 1
    pos = torch.arange(n * block, device=base.device)
    start = cu_seqlens[torch.searchsorted(cu_seqlens[:-1], pos[:T].to(cu_seqlens.dtype), right=True) - 1]
    start = torch.cat([start.long(), pos[T:]])  # the padding's queries see only themselves

    def queries(x: Tensor) -> Tensor:  # (1, T, ...) -> (n, block, ...), zero-padded
        return F.pad(x[0].to(acc), (0, 0) * (x.dim() - 2) + (0, n * block - T)).unflatten(0, (n, block))

    def reach(x: Tensor) -> Tensor:  # (1, T, H, D) -> (n, H, D, keys): block b's keys b block - window + 1 onwards
        return F.pad(x[0].to(acc), (0, 0, 0, 0, window - 1, n * block - T)).unfold(0, keys, block)

    key_pos = pos.view(n, block)[:, :1] - (window - 1) + torch.arange(keys, device=base.device)  # (n, keys)
    back = pos.view(n, block, 1) - key_pos[:, None]  # (n, block, keys): how far back each key lies
    valid = (back >= 0) & (back < window) & (key_pos[:, None] >= start.view(n, block, 1))
    scores = torch.einsum("bqhd,bhdk->bhqk", queries(q), reach(k)) * scale
    probs = scores.masked_fill(~valid[:, None], -torch.inf).softmax(-1)  # (n, H, block, keys)
    mix = torch.einsum("bqh,bhqk->bqk", queries(w1), probs)
    weights = queries(w2).transpose(1, 2)[..., None] * mix[:, None]
    weights = weights + (weights.to(base.dtype).to(acc) - weights).detach()  # rounded as the kernel's, fp32 gradient
    correction = torch.einsum("bhqk,bhdk->bqhd", weights, reach(v)).flatten(0, 1)[:T]
    return (base.to(acc) + correction).to(base.dtype)

@dataclass(frozen=True)
class GateSlots:
    """Layer -> (block, first slot) of its per-token gates in the gate network's outputs (#85 v3): block 0 reads x0,
    gates the layers up to the skip's source; block 1 reads its output, gates the rest, the skip and DC."""
    xsa: dict[int, tuple[int, int]]
    attn_gate: dict[int, tuple[int, int]]
    inject: dict[int, tuple[int, int]]  # x0's gate at the slot, the bigram's after it (not the last layer: MUDD's)
    skip: int  # in block 1
    dc: int  # in block 1: w1 at dc .. dc + H - 1, w2 after
    sizes: tuple[int, int]

def gate_slots(cfg: Config, plans: list[LayerPlan], second_from: int) -> GateSlots:
    H, last, slots, sizes = cfg.num_heads, len(plans) - 1, GateSlots({}, {}, {}, 0, 0, (0, 0)), []
    for block, span in enumerate((range(second_from), range(second_from, len(plans)))):
        layers, n = [i for i in span if plans[i].attn is not None], 0
        for table, width, chosen in ((slots.xsa, H, [i for i in layers if plans[i].xsa]),
                                     (slots.attn_gate, H, [i for i in layers if plans[i].attn_gate]),
                                     (slots.inject, 2, [i for i in layers if i != last])):
            for i in chosen:
                table[i], n = (block, n), n + width
        sizes.append(n)
    return dataclasses.replace(slots, skip=sizes[1], dc=sizes[1] + 1, sizes=(sizes[0], sizes[1] + 1 + 2 * H))

def gate_bias_init(slots: GateSlots, cfg: Config) -> Tensor:
    """The gate network's biases (stored / MUDD_SCALE); the rest 0 (DC's w2 too: DC adds nothing at init)."""
    b = torch.zeros(2, max(slots.sizes))
    for block, slot in slots.attn_gate.values():
        b[block, slot: slot + cfg.num_heads] = 0.25 / MUDD_SCALE
    for block, slot in slots.inject.values():
        b[block, slot + 1] = 0.05 / MUDD_SCALE
    b[1, slots.skip] = 0.5 / MUDD_SCALE
    b[1, slots.dc: slots.dc + cfg.num_heads] = 1.0 / MUDD_SCALE
    return b

@dataclass(frozen=True)
class LayerPlan:
    """What one layer does, read off the config once (#89: layers 0-10 of "SSSLSS-SSSL")."""
    attn: int | None  # its index among the attention layers (its rows of the banks); None: the skip lands here
    window: str  # "long" or "short": which of the step's two windows it attends within
    paired: bool  # heads j and j + H/2 attend as one over 2T positions (#58)
    xsa: bool  # subtracts a gated share of its output along v (#82, #86)
    attn_gate: bool  # its heads' outputs are scaled by a gate (#85)
    ve_table: int | None  # the value-embedding table its values add (#63)
    ve_gate: int | None  # its VE gate's row of ve_gate_bank (the last layer's row goes unused: MUDD gates it)

def layer_plans(cfg: Config) -> list[LayerPlan]:
    paired, tables = paired_layers(cfg), [None if c == "-" else int(c) for c in cfg.value_embeds]
    xsa, gated = layer_list(cfg, "xsa_layers"), layer_list(cfg, "attn_gate_layers")
    plans: list[LayerPlan] = []
    for i, kind in enumerate(cfg.attn_pattern):
        attn = sum(k != "-" for k in cfg.attn_pattern[:i]) if kind != "-" else None
        gate = sum(t is not None for t in tables[:i]) if tables[i] is not None else None
        plans.append(LayerPlan(attn, {"L": "long", "S": "short"}.get(kind, ""), i in paired, i in xsa, i in gated,
                               tables[i], gate))
    return plans

def mudd_bias_init() -> Tensor:
    """The MUDD biases (stored / MUDD_SCALE): at init the last layer's mixes are the other layers' defaults (VE gate 2,
    residual sqrt(1.1), output 1, bigram 0.05) and the final mix is #40's backout, -0.5 x the attention input layer."""
    b = torch.zeros(2, max(MUDD_COEFS))
    for k, value in {6: 2.0, 7: 2.0, 8: 1.1**0.5, 9: 1.0, 11: 0.05, 12: 1.1**0.5, 13: 1.0}.items():
        b[0, k] = value / MUDD_SCALE
    b[1, 1] = -0.5 / MUDD_SCALE
    return b.bfloat16()

def mudd_w1_init(cfg: Config) -> Tensor:
    """A MUDD MLP's first layers (two blocks): each nn.Linear's default init, U(+-1/sqrt(model_dim)), stored bf16."""
    w1 = torch.empty(2, cfg.mudd_dim, cfg.model_dim)
    for block in w1:
        nn.init.kaiming_uniform_(block, a=math.sqrt(5))
    return w1.bfloat16()

class ReluSquare(torch.autograd.Function):
    """relu(pre)^2 that saves only its output: the backward reads relu(pre) as sqrt(post), 2 g sqrt(fp32 post) rounded
    once (#87; post = bf16(pre^2), so an ulp of the gradient differs from 2 g relu(pre) in about one entry in eight)."""

    @staticmethod
    def forward(ctx, pre: Tensor) -> Tensor:
        post = F.relu(pre).square()
        ctx.save_for_backward(post)
        return post

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (post,) = ctx.saved_tensors
        return (2 * grad.float() * sqrt32(post.float())).to(grad.dtype)

def softcap(logits: Tensor, cfg: Config) -> Tensor:
    """The head's logits in fp32, squashed into (0, logit_cap): cap sigmoid((z + shift) / temp) (#54's rescale)."""
    return cfg.logit_cap * torch.sigmoid((logits.float() + cfg.logit_shift) / cfg.logit_temp)

class SoftcappedMTPLoss(torch.autograd.Function):
    """The loss as gpt_kernels' softcap_ce (upstream's fused kernel) computes it: per position t, sum_k w_k CE(z_t,
    y_(t+k)) over the k inside the sequence (#53), plus w_p CE(z_t, prefix_t) where y_t has a prefix token (#88). Its
    gradient's softmax term weighs every w_k, also past the sequence's end: the last K - 1 positions' (#89's quirk)."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, weights: Tensor, prefix: Tensor, prefix_weight: Tensor,
                cap: float, shift: float, temp: float) -> Tensor:
        # In place where it can: five (T, vocab) fp32 passes, not a dozen (most of a CPU tiny run's step is here).
        s = torch.sigmoid((logits.float() + shift).div_(temp)).bfloat16().float()
        z = s * cap
        lse = z.logsumexp(dim=-1)
        T, rows = targets.numel(), torch.arange(targets.numel(), device=targets.device)
        prefix_w = prefix_weight * (prefix >= 0)  # (T,): 0 where there is no prefix token
        losses = torch.zeros_like(lse)
        for k in range(weights.numel()):
            losses[: T - k] += weights[k] * (lse[: T - k] - z[rows[: T - k], targets[k:]])
        losses += prefix_w * (lse - z[rows, prefix.clamp_min(0)])
        grad = z.sub_(lse[:, None]).exp_().mul_((weights.sum() + prefix_w)[:, None])  # the softmax, times S_w
        for k in range(weights.numel()):
            grad.index_put_((rows[: T - k], targets[k:]), -weights[k].expand(T - k), accumulate=True)
        grad.index_put_((rows, prefix.clamp_min(0)), -prefix_w, accumulate=True)
        ctx.save_for_backward(grad.mul_(s.sub_(s.square())).mul_(cap / temp))
        ctx.dtype = logits.dtype
        return losses

    @staticmethod
    def backward(ctx, grad_losses: Tensor) -> tuple:
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_losses[:, None]).to(ctx.dtype), None, None, None, None, None, None, None

def read_vocabulary(cfg: Config) -> list[bytes]:
    """GPT-2's BPE tokens by id from --vocab_file (tiktoken's r50k_base: a base64 token and its rank per line)."""
    path = Path(cfg.vocab_file) if Path(cfg.vocab_file).exists() else HERE / cfg.vocab_file  # relative: also here
    fix = "`git checkout data/tokenizer`, or point it at tiktoken's r50k_base file"
    try:
        pairs = [line.split() for line in path.read_text().splitlines() if line]
        tokens = {int(rank): base64.b64decode(token, validate=True) for token, rank in pairs}
    except (OSError, ValueError, binascii.Error) as e:
        raise UsageError(f"--vocab_file={cfg.vocab_file}: cannot read GPT-2's BPE tokens ({e}); the prefix-token loss "
                         f"needs them: {fix}") from None
    if sorted(tokens) != list(range(BOS_ID)) or BOS_ID > cfg.vocab_size:  # <|endoftext|> follows the BPE's tokens
        raise UsageError(f"--vocab_file={cfg.vocab_file}: {len(tokens):,} BPE ranks, where the prefix-token loss needs "
                         f"GPT-2's {BOS_ID:,} (ids 0..{BOS_ID - 1}, within --vocab_size={cfg.vocab_size}): {fix}")
    return [tokens[i] for i in range(BOS_ID)]

def prefix_table(tokens: list[bytes], vocab_size: int) -> Tensor:
    """Each token's prefix token (#88): its longest proper byte prefix that is a token; -1: none, or past the BPE's."""
    ids = {token: i for i, token in enumerate(tokens)}
    prefixes = [next((ids[t[:n]] for n in range(len(t) - 1, 0, -1) if t[:n] in ids), -1) for t in tokens]
    return torch.tensor(prefixes + [-1] * (vocab_size - len(tokens)))

def train_loss_scale(cfg: Config) -> float:
    """Each micro-step's summed loss times this: the gradient summed over micro-steps and ranks is grad_scale x mean."""
    return cfg.grad_scale / cfg.global_batch_seqs

def fp8_scales(cfg: Config, loss_scale: float) -> list[float]:
    """The FP8 head's (x, W, gradient) scales; loss_scale in the gradient's keeps its e5m2 values the record's."""
    return [cfg.fp8_x_scale, cfg.fp8_w_scale, cfg.fp8_grad_scale * loss_scale]

class GPT(nn.Module):
    """Attention: fa3 (flash_attn_varlen_func or a stand-in), else use_flex (FlexAttention), else SDPA with a dense
    mask; compile_flex: flex_attention compiled alone (unfused, it would materialize the scores). Parameter names are
    upstream's optimizer labels; the Muon banks are bf16, their fp32 masters completed by the optimizer's state."""

    def __init__(self, cfg: Config, use_flex: bool, fp8_head: bool, compile_flex: bool = False,
                 fa3: Callable | None = None):
        super().__init__()
        self.cfg, self.use_flex, self.fp8_head, self.fa3 = cfg, use_flex, fp8_head, fa3
        L, d, H, D = cfg.num_layers, cfg.model_dim, cfg.num_heads, cfg.head_dim
        self.plans = layer_plans(cfg)
        self.skip_from, self.skip_to = skip_layers(cfg)
        n_attn = sum(p.attn is not None for p in self.plans)
        n_tables, n_ve = len(set(cfg.value_embeds) - {"-"}), sum(p.ve_table is not None for p in self.plans)
        max_len = max(cfg.train_seq_len, cfg.val_seq_len)
        self.flex = torch.compile(flex_attention, dynamic=False) if compile_flex else flex_attention
        bound = math.sqrt(3) * 0.5 / math.sqrt(d)  # U(-bound, bound): the std of 0.5 / sqrt(d)
        # The head is also the embedding until the untie (#51), so it starts away from zero.
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False, dtype=torch.bfloat16)
        nn.init.normal_(self.lm_head.weight, std=0.005)
        self.embed = nn.Embedding(cfg.vocab_size, d, dtype=torch.bfloat16)
        with torch.no_grad():
            self.embed.weight.copy_(self.lm_head.weight)
        self.value_embeds = nn.Parameter(0.01 * torch.randn(n_tables, cfg.vocab_size, d, dtype=torch.bfloat16))
        # The bigram hash table (#62), times a fixed +-1 row per token pair (#83).
        self.bigram_embed = nn.Embedding(cfg.bigram_rows, d, dtype=torch.bfloat16)
        nn.init.zeros_(self.bigram_embed.weight)
        self.register_buffer("bigram_sign_table", torch.randn(cfg.bigram_sign_rows, d).sign().bfloat16())
        self.smear_gate = nn.Linear(cfg.gate_channels, 1, bias=False, dtype=torch.bfloat16)
        nn.init.zeros_(self.smear_gate.weight)  # the smear's input gate (#34): zero, open
        # Per VE layer: the VE gates, 2 sigmoid(W [u, ve]) (#55, #70).
        self.ve_gate_bank = nn.Parameter(torch.zeros(n_ve, H, cfg.gate_channels, dtype=torch.bfloat16))
        # Muon's banks (#80), drawn in fp32, stored bf16 as #89's (muon_state keeps the low 16 bits): per attention
        # layer H/2 head pairs (2D, d) of Q then H/2 of K, V and W_o (HD, d) each; per layer W_fc, W_proj (4d, d).
        qk, vo, mlp = torch.empty(n_attn * H, 2 * D, d), torch.empty(2 * n_attn, H * D, d), torch.zeros(
            L, 2, cfg.mlp_ratio * d, d)
        for bank in (qk, vo, mlp[:, 0]):
            init_matrix_(bank, bound)
        self.qk_bank, self.vo_bank, self.mlp_bank = (nn.Parameter(bank.bfloat16()) for bank in (qk, vo, mlp))
        # Per layer (lambda_qkv, lambda_o), folded into attention's weights (#47/#48); the smear's lambda; the skip's s.
        self.scalars = nn.Parameter(torch.cat([torch.tensor((0.5, 1.0)).repeat(L), torch.tensor((0.0, -1.5))]))
        # Per layer and sublayer (attention, MLP): the residual's scale (sqrt(1.1): 1.1 a layer) and the output's.
        self.resid_lambdas = nn.Parameter(torch.full((L, 2), 1.1**0.5))
        self.post_lambdas = nn.Parameter(torch.ones(L, 2))
        # MUDD (#81, #85): coefficients per token from the residual by a small MLP, (gelu(x W1^T) W2^T + b) x 0.1.
        self.mudd_w1 = nn.Parameter(mudd_w1_init(cfg))
        self.mudd_w2 = nn.Parameter(torch.zeros(2, max(MUDD_COEFS), cfg.mudd_dim, dtype=torch.bfloat16))
        self.mudd_b2 = nn.Parameter(mudd_bias_init())
        self.rotary = Rotary(D, max_len)
        self.rotary_paired = Rotary(D, 2 * max_len) if any(p.paired for p in self.plans) else None
        self.register_buffer("q_gain", torch.ones(()), persistent=False)  # YaRN's scale, on q: never recompiles
        self.yarn_windows: tuple[int, ...] = ()  # the long windows apply_yarn last set RoPE for
        # 1 while the embedding reads the head: a buffer tie_embedding writes in place, so untying never recompiles.
        self.register_buffer("embed_tied", torch.ones(()), persistent=False)
        self.embed_tied_now = True  # what tie_embedding last wrote into embed_tied
        # FP8 MLP state (#84, #89), checkpointed: e4m3 W_fc (current scale), W_proj^T (delayed scale), per-layer scales.
        self.register_buffer("fp8_w_fc", torch.zeros(L, cfg.mlp_ratio * d, d, dtype=torch.float8_e4m3fn))
        self.register_buffer("fp8_w_proj_t", torch.zeros(L, d, cfg.mlp_ratio * d, dtype=torch.float8_e4m3fn))
        for name in ("fp8_up_scales", "fp8_down_scales", "fp8_down_next_scales", "fp8_act_scales"):
            self.register_buffer(name, torch.ones(L))
        # The prefix-token loss's targets (#88), filled by train() once the clock starts, as upstream.
        self.register_buffer("prefix_table", torch.full((cfg.vocab_size,), -1), persistent=False)
        # The MUDD gate network (#85 v3), registered last as upstream's; one scale for both blocks (fp32, read in bf16).
        self.slots = gate_slots(cfg, self.plans, self.skip_from + 1)
        self._mudd_gate_scale = nn.Parameter(torch.tensor(MUDD_SCALE))
        self.mudd_gate_w1 = nn.Parameter(mudd_w1_init(cfg))
        self.mudd_gate_w2 = nn.Parameter(torch.zeros(2, max(self.slots.sizes), cfg.mudd_dim, dtype=torch.bfloat16))
        self.mudd_gate_b2 = nn.Parameter(gate_bias_init(self.slots, cfg).bfloat16())

    @torch.no_grad()
    def apply_yarn(self, long_windows: tuple[int, ...]) -> None:
        """YaRN (#31) at each change W -> W' of the long window (blocks): RoPE's frequencies and q_gain, in fp32."""
        if long_windows[1:] == self.yarn_windows[1:]:
            return
        freqs = self.rotary.base.to(self.rotary.cos.device)  # fp32 throughout, #89's order of operations
        for old, new in zip(long_windows, long_windows[1:]):
            old_len, new_len = self.cfg.block_size * old, self.cfg.block_size * new
            g = ((old_len * freqs / (2 * math.pi) - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0, 1)
            freqs = freqs * (old_len / new_len + g * (1 - old_len / new_len))
        for rotary in filter(None, (self.rotary, self.rotary_paired)):
            rotary.set_frequencies(freqs)
        self.q_gain.fill_(yarn_scale(long_windows, 1.0))  # FA3 takes its own from the plan (VarlenPlan.scale)
        self.yarn_windows = long_windows

    @torch.no_grad()
    def tie_embedding(self, tied: bool) -> None:
        if self.embed_tied_now != tied:
            self.embed_tied.fill_(float(tied))
            self.embed_tied_now = tied

    @torch.no_grad()
    def quantize_mlp_(self, bootstrap_down: bool) -> None:
        """The FP8 MLP weights after each optimizer step (#84, #89); bootstrap_down: the down-weight's at its amax."""
        gpt_kernels.quantize_mlp_weights_(self.mlp_bank, self.fp8_w_fc, self.fp8_up_scales, self.fp8_w_proj_t,
                                          self.fp8_down_scales, self.fp8_down_next_scales, bootstrap_down,
                                          self.cfg.fp8_down_w_headroom)

    def mudd(self, x: Tensor, block: int) -> list[Tensor]:
        """MUDD block's coefficients for each token of x, (1, T, 1) each."""
        h, n = F.gelu(F.linear(x, self.mudd_w1[block])), MUDD_COEFS[block]
        return ((F.linear(h, self.mudd_w2[block, :n]) + self.mudd_b2[block, :n]) * MUDD_SCALE).split(1, dim=-1)

    def gates(self, x: Tensor, block: int) -> Tensor:
        """The gate network's block of gates for each token of x, (1, T, slots)."""
        h = F.gelu(F.linear(x, self.mudd_gate_w1[block]))
        n, scale = self.slots.sizes[block], self._mudd_gate_scale.type_as(x)
        return (F.linear(h, self.mudd_gate_w2[block, :n]) + self.mudd_gate_b2[block, :n]) * scale

    def attention_kernels(self, input_seq: Tensor, windows: Tensor | VarlenPlan, cu: Tensor) -> dict[str, Attend]:
        """Per window kind (long, short, paired: the short window over 2T positions) an Attend: FA3's varlen call, else
        may_attend's masks (windows: (long, short) blocks) with YaRN's gain on q, by FlexAttention or SDPA."""
        if self.fa3 is not None:
            def varlen(window: int, paired: bool) -> Attend:
                n = 1 + paired  # paired: every position twice, so are the offsets and the longest document
                return lambda q, k, v: self.fa3(q[0], k[0], v[0], n * cu, n * cu, n * windows.max_seqlen,
                                                n * windows.max_seqlen, softmax_scale=windows.scale, causal=True,
                                                window_size=(window, 0))[None]

            return {"long": varlen(windows.long_window, False), "short": varlen(windows.short_window, False),
                    "paired": varlen(windows.short_window, True)}

        def masked(mask: BlockMask | Tensor, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            q, k, v = (t.transpose(1, 2) for t in (q * self.q_gain, k, v))
            if isinstance(mask, BlockMask):
                return self.flex(q, k, v, block_mask=mask, scale=self.cfg.attn_scale).transpose(1, 2)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.cfg.attn_scale).transpose(1, 2)

        build = functools.partial(block_mask if self.use_flex else dense_mask, input_seq, self.cfg.block_size)
        kinds = {"long": (windows[0], False), "short": (windows[1], False), "paired": (windows[1], True)}
        if self.rotary_paired is None:  # (the short window, in blocks of block_size positions of 2T)
            del kinds["paired"]
        return {kind: functools.partial(masked, build(w, paired=paired)) for kind, (w, paired) in kinds.items()}

    def attention(self, u: Tensor, i: int, aux_v: Tensor | None, attend: dict[str, Attend], gates: dict[str, Tensor],
                  windows: Tensor | VarlenPlan, cu: Tensor) -> Tensor:
        """Layer i's attention over u (normed), aux_v added to its values; gates: its own; windows, cu: for DC's."""
        plan, (T, H, D) = self.plans[i], (u.size(1), self.cfg.num_heads, self.cfg.head_dim)
        a, lambdas = plan.attn, self.scalars[2 * i: 2 * i + 2]
        w_qkv = torch.cat([self.qk_bank[a * H:(a + 1) * H].flatten(0, 1), self.vo_bank[2 * a]])  # Q, K (head pairs), V
        q, k, v = F.linear(u, lambdas[0] * w_qkv).view(1, T, 3 * H, D).chunk(3, dim=-2)
        q, k = norm(q), norm(k)
        if aux_v is not None:
            v = v + aux_v.view_as(v)
        rotary = self.rotary_paired if plan.paired else self.rotary
        q, k = rotary(q, plan.paired), rotary(k, plan.paired)
        if plan.paired:  # (1, T, H, D) -> (1, 2T, H/2, D): position 2t holds heads 0 .. H/2-1 of token t, 2t+1 the rest
            q, k, v = (t.reshape(1, 2 * T, H // 2, D) for t in (q, k, v))  # (never XSA's, nor the last layer's)
        if plan.window == "long":  # the un-rotated dims of each key from the previous position (#49; across documents)
            k = torch.where(rotary.stationary, torch.cat([k[:, :1], k[:, :-1]], dim=1), k)
        y = attend["paired" if plan.paired else plan.window](q, k, v).reshape(1, T, H, D)
        if i == len(self.plans) - 1:  # DC (#85) at attention's scale; its w1 RMS-normed over the heads (fp32), in bf16
            w1, w2 = F.rms_norm(gates["dc_w1"].float(), (H,), eps=1e-6).type_as(y), gates["dc_w2"]
            q, scale = (q, windows.scale) if self.fa3 is not None else (q * self.q_gain, self.cfg.attn_scale)
            if self.cfg.dc_kernel:  # the Triton kernels
                y = torch.ops.speedrun.dc_attention(y[0], q, k, v, w1, w2, cu, scale, DC_WINDOW)[0][None]
            else:
                y = dc_attention(y[0], q, k, v, w1, w2, cu, scale)[None]
        if plan.xsa:  # y minus tanh(gate) of its component along v, per token and head (#82, #86's form)
            share = torch.tanh(gates["xsa"]).type_as(y)[..., None]
            y = y - share * ((y * v).sum(-1, keepdim=True) / v.square().sum(-1, keepdim=True).clamp_min(1e-8)) * v
        if plan.attn_gate:  # a linear gate per token and head (#85)
            y = y * gates["attn"].type_as(y)[..., None]
        return F.linear(y.flatten(-2), lambdas[1] * self.vo_bank[2 * a + 1])

    def mlp(self, x: Tensor, i: int, amaxes: list[Tensor]) -> Tensor:
        """relu(x W_fc^T)^2 W_proj; fp8_mlp in training: #89's FP8 GEMMs, post's maxima to amaxes (the next scale's)."""
        w_fc, w_proj = self.mlp_bank[i, 0], self.mlp_bank[i, 1]
        if self.training and self.cfg.fp8_mlp:
            out, amax = torch.ops.speedrun.mlp_fp8(x.flatten(0, 1), w_fc, w_proj, self.fp8_w_fc[i],
                                                   self.fp8_up_scales[i], self.fp8_w_proj_t[i],
                                                   self.fp8_down_scales[i], self.fp8_act_scales[i],
                                                   bool(self.cfg.relu2_kernel))
            amaxes.append(amax)
            return out.view_as(x)
        if self.cfg.relu2_kernel:
            return torch.ops.speedrun.mlp_relu2(x.flatten(0, 1), w_fc, w_proj).view_as(x)
        return ReluSquare.apply(F.linear(x, w_fc)) @ w_proj

    def layer_gates(self, gates: Tensor, block: int) -> dict[int, dict[str, Tensor]]:
        """A block's gates (1, T, slots) by layer and kind: "xsa", "attn" (1, T, H); "x0", "bigram" (1, T, 1); the last
        layer's "dc_w1", "dc_w2" (1, T, H) in block 1."""
        H, s, out = self.cfg.num_heads, self.slots, collections.defaultdict(dict)
        dc = {len(self.plans) - 1: (1, s.dc)}  # DC attention's, the last layer's
        for table, kinds, w in ((s.xsa, ("xsa",), H), (s.attn_gate, ("attn",), H), (s.inject, ("x0", "bigram"), 1),
                                (dc, ("dc_w1", "dc_w2"), H)):
            for i, (b, slot) in table.items():
                if b == block:
                    out[i].update({kind: gates[..., slot + j * w: slot + (j + 1) * w] for j, kind in enumerate(kinds)})
        return dict(out)

    def hidden(self, input_seq: Tensor, windows: Tensor | VarlenPlan) -> Tensor:
        """The head's input (T, model_dim) for one packed (T,) sequence; windows as attention_kernels takes them."""
        cfg, L, H, D = self.cfg, self.cfg.num_layers, self.cfg.num_heads, self.cfg.head_dim
        T, last, half = input_seq.numel(), self.cfg.num_layers - 1, self.cfg.gate_channels // 2
        cu = cu_seqlens(input_seq, windows.slots if self.fa3 is not None else T + 1)  # for FA3 and DC attention
        attend = self.attention_kernels(input_seq, windows, cu)
        # Both lookups, weighted by the tie flag: the same graph tied and untied.
        e = self.embed(input_seq)
        e = self.embed_tied * F.embedding(input_seq, self.lm_head.weight) + (1 - self.embed_tied) * e
        # The smear (#34): e_t += lambda sigmoid(w e_t[:gate_channels]) e_(t-1), across documents.
        gate = self.scalars[2 * L] * torch.sigmoid(self.smear_gate(e[1:, : cfg.gate_channels]))
        e = torch.cat([e[:1], e[1:] + gate * e[:-1]])
        # The lambdas in bf16, as upstream reads them (a float copy of the model reads them rounded the same way).
        resid, post = self.resid_lambdas.bfloat16().unbind(1), self.post_lambdas.bfloat16().unbind(1)
        signs = self.bigram_sign_table[sign_index(input_seq, cfg.bigram_sign_rows)]
        bigram = (self.bigram_embed(bigram_index(input_seq, cfg.bigram_rows)) * signs)[None]
        x0 = norm(e[None])
        gates = self.layer_gates(self.gates(x0, 0), 0)  # block 0 reads x0 without the bigram (#85)
        x = stream0 = x0 + bigram * gates[0]["bigram"]  # the MUDD mixes' first stream
        ves = self.value_embeds[:, input_seq]
        saved: dict[int, Tensor] = {}  # the skip's source and the attention input layer's output
        amaxes: list[Tensor] = []
        for i, plan in enumerate(self.plans):
            mu = None
            if i == self.skip_from + 1:  # block 1 reads the skip's source's output, not normed
                block = self.gates(x, 1)
                gates.update(self.layer_gates(block, 1))
                skip_gate = block[..., self.slots.skip: self.slots.skip + 1]
            if plan.attn is None:
                x = x + torch.sigmoid(self.scalars[2 * L + 1]) * skip_gate * saved[self.skip_from]
            else:
                u = norm(saved.get(cfg.attn_input_layer, x))  # #77: past that layer, all attend over its output
                ve = None if plan.ve_table is None else ves[plan.ve_table][None].view(1, T, H, D)
                aux_v = None
                if i == last:  # MUDD block 0 (#81, #85): V, residual, VE gate and this layer's lambdas, per token
                    last_input, mu = x, self.mudd(x, 0)
                    src = saved[cfg.attn_input_layer]
                    aux_v = (mu[0] * stream0 + mu[1] * src + mu[2] * x).view(1, T, H, D)
                    x = (1 + mu[5]) * x + mu[3] * stream0 + mu[4] * src
                    if ve is not None:
                        aux_v = aux_v + torch.cat([mu[6], mu[7]], dim=-1).repeat_interleave(H // 2, -1)[..., None] * ve
                elif ve is not None:
                    gate_in = torch.cat([u[..., :half], ve.flatten(-2)[..., :half]], dim=-1)
                    aux_v = 2 * torch.sigmoid(F.linear(gate_in, self.ve_gate_bank[plan.ve_gate]))[..., None] * ve
                out = self.attention(u, i, aux_v, attend, gates.get(i, {}), windows, cu)
                if mu is not None:
                    x = mu[8] * x + mu[9] * out + mu[10] * stream0 + mu[11] * bigram
                else:
                    x = resid[0][i] * x + post[0][i] * out + x0 * gates[i]["x0"]
                    x = x + bigram * gates[i]["bigram"] if i > 0 else x
            out = self.mlp(norm(x), i, amaxes)
            x = mu[12] * x + mu[13] * out if mu is not None else resid[1][i] * x + post[1][i] * out
            if i in (self.skip_from, cfg.attn_input_layer):
                saved[i] = x
        if amaxes:  # each down-projection's input scale for the next training step (#89), from post's partial maxima
            self.fp8_act_scales.copy_(torch.stack(amaxes).amax(1).clamp_min(1e-12) * (cfg.fp8_down_act_headroom / 448))
        nu = self.mudd(x, 1)  # MUDD block 1 (#81): the last mix, in place of #70's backout
        x = (x + nu[0] * stream0 + nu[1] * saved[cfg.attn_input_layer] + nu[2] * last_input + nu[3] * ves[0][None]
             + nu[4] * saved[self.skip_from])
        return norm(x).flatten(0, 1)

    def head(self, x: Tensor) -> Tensor:
        """The head's raw logits, (T, vocab). The FP8 head serves training only."""
        if self.training and self.fp8_head:  # the gradient reaching the head carries train_loss_scale
            return torch.ops.speedrun.fp8_mm(x, self.lm_head.weight, *fp8_scales(self.cfg, train_loss_scale(self.cfg)))
        return F.linear(x, self.lm_head.weight)

    def logits(self, input_seq: Tensor, windows: Tensor | VarlenPlan) -> Tensor:
        """Soft-capped logits (T, vocab) in fp32 for validation's cross-entropy (#89 rounds them to the head's dtype)"""
        raw = self.head(self.hidden(input_seq, windows))
        return softcap(raw, self.cfg).to(raw.dtype).float()

    def forward(self, input_seq: Tensor, target_seq: Tensor, windows: Tensor | VarlenPlan, mtp: Tensor | None = None,
                prefix_weight: Tensor | None = None) -> Tensor:
        """Training: the summed multi-token and prefix-token loss; eval: mean cross-entropy; --fused_head: no logits."""
        cfg = self.cfg
        if not self.training or mtp is None:
            mtp = target_seq.new_ones(1, dtype=torch.float32)
        if not self.training or prefix_weight is None:
            prefix_weight = target_seq.new_zeros(1, dtype=torch.float32)
        prefix = self.prefix_table[target_seq]  # the next token's prefix token (#88), -1: none
        if cfg.fused_head:  # validation too: its logits are the largest tensor of a run (val_seq_len x vocab)
            scales = fp8_scales(cfg, 1.0) if self.training and self.fp8_head else []
            loss = torch.ops.speedrun.softcap_ce(self.hidden(input_seq, windows), self.lm_head.weight, target_seq,
                                                 mtp, prefix, prefix_weight, cfg.logit_cap, cfg.logit_shift,
                                                 cfg.logit_temp, scales, self.training)[0]
            return loss if self.training else loss / target_seq.numel()
        if self.training:
            return SoftcappedMTPLoss.apply(self.head(self.hidden(input_seq, windows)), target_seq, mtp, prefix,
                                           prefix_weight, cfg.logit_cap, cfg.logit_shift, cfg.logit_temp).sum()
        return F.cross_entropy(self.logits(input_seq, windows), target_seq)

# -----------------------------------------------------------------------------
# Schedule
# Everything that varies with the step, rounded as #89 rounds it: the optimizer's settings, the model's windows and
# loss weights (rows of device tables: a new value never recompiles), the FLOP model's and the metrics' values.

@dataclass(frozen=True)
class StepSchedule:
    lr_mult: float  # of every lr: the stage's, cooled down linearly to final_lr_frac (cooldown_frac), then kept
    muon_momentum: float  # start -> end over muon_momentum_warmup_steps; back over muon_momentum_cooldown_steps
    long_window: int  # attention window of the long layers, in blocks
    short_window: int  # of the short layers
    adam_step: bool  # Adam updates at the end of this step (every adam_every-th step), on the summed gradients
    seq_len: int  # tokens per training sequence (global_batch_seqs of them per step)
    micro_len: int  # tokens per micro-step: seq_len / micro_split
    max_doc_len: int  # documents are cut to this many tokens in training
    yarn_windows: tuple[int, ...]  # the long windows trained at so far, in order (GPT.apply_yarn)
    mtp_weights: tuple[float, ...]  # loss weights of the next 1, 2, ... tokens (as many every step)
    prefix_weight: float  # loss weight of the next token's prefix token (#88)
    tied: bool  # the embedding still reads the head (untied after the last tied step's update)

def stage_starts(cfg: Config) -> list[int]:
    """The first step of each row of the stage table, then num_steps: stage k of n at round(N (1/n + ... + 1/n)), k
    float terms, ties to even, N = num_steps - extension_steps, as #89 rounds; the extension at N."""
    n, scheduled = len(cfg.stages) - 1, cfg.num_steps - cfg.extension_steps
    return [0, *(round(f * scheduled) for f in itertools.accumulate([1 / n] * (n - 1))), scheduled, cfg.num_steps]

def schedule(step: int, cfg: Config) -> StepSchedule:
    """The values for training step `step` (0-based: the step about to be trained; validation reads its step's)."""
    scheduled, starts = cfg.num_steps - cfg.extension_steps, stage_starts(cfg)
    # The row whose steps hold this one, and the share of them done (1 at the final validation), as #89 looks it up.
    k, t = next(((k, (step - a) / (b - a)) for k, (a, b) in enumerate(itertools.pairwise(starts)) if step < b),
                (len(cfg.stages) - 1, 1.0))
    stage = cfg.stages[k]
    # The cooldown counts in steps from int(N (1 - cooldown_frac)), as #89's does (cooldown_frac 0: none).
    cooldown_start = int(scheduled * (1 - cfg.cooldown_frac))
    c = min(1.0, (step - cooldown_start) / max(scheduled - cooldown_start, 1))
    lr_mult = stage.lr_mul * (1 - c) + cfg.final_lr_frac * c if step >= cooldown_start else stage.lr_mul
    momentum_range = cfg.muon_momentum_end - cfg.muon_momentum_start
    momentum_fall = cfg.num_steps - cfg.muon_momentum_cooldown_steps
    if step < cfg.muon_momentum_warmup_steps:
        momentum = cfg.muon_momentum_start + step / cfg.muon_momentum_warmup_steps * momentum_range
    elif cfg.muon_momentum_cooldown_steps and step > momentum_fall:
        momentum = cfg.muon_momentum_end - (step - momentum_fall) / cfg.muon_momentum_cooldown_steps * momentum_range
    else:
        momentum = cfg.muon_momentum_end
    # The last validation (step num_steps, no training step) has its own windows; YaRN follows the training ones.
    short, long = final_val_windows(cfg) if step == cfg.num_steps else stage.windows
    yarn_windows = tuple(dict.fromkeys(s.windows[1] for s in cfg.stages[: k + 1]))
    # Each weight from its start to its end value as #89 interpolates, a + (b - a) t, bit for bit; the multi-token
    # weights padded with zeros to the most a row has (as many every step).
    mtp = tuple(a + (b - a) * t for a, b in zip(stage.mtp_start, stage.mtp_end))
    mtp += (0.0,) * (max(len(s.mtp_start) for s in cfg.stages) - len(mtp))
    prefix = stage.prefix_start + (stage.prefix_end - stage.prefix_start) * t
    # The last tied step is the first Adam step at or after the untie stage's start.
    split = starts[cfg.untie_stage]
    tied = step <= split + (-(split + 1) % cfg.adam_every)
    return StepSchedule(lr_mult, momentum, long, short, (step + 1) % cfg.adam_every == 0, stage.seq_len,
                        stage.seq_len // cfg.micro_split, stage.doc_len, yarn_windows, mtp, prefix, tied)

def schedule_table(cfg: Config) -> list[StepSchedule]:
    """schedule() of every step, 0 .. num_steps (the last: the final validation's), computed once per run."""
    return [schedule(step, cfg) for step in range(cfg.num_steps + 1)]

@dataclass(frozen=True)
class DocumentCounts:
    """The most documents one sequence of the run's data holds (load_data), per training shape and in validation."""
    train: dict[tuple[int, int], int]
    val: int

class StepKnobs:
    """The schedule's inputs to the model: rows of device tables made once per run, or with FA3 a VarlenPlan."""

    def __init__(self, cfg: Config, schedules: list[StepSchedule], device: torch.device,
                 documents: DocumentCounts | None = None):
        self.cfg, self.schedules, self.documents = cfg, schedules, documents
        self.windows = torch.tensor([(s.long_window, s.short_window) for s in schedules], dtype=torch.int32,
                                    device=device)
        self.mtp = torch.tensor([s.mtp_weights for s in schedules], device=device)
        self.prefix = torch.tensor([[s.prefix_weight] for s in schedules], device=device)

    def train_slots(self, seq_len: int, max_doc_len: int) -> int:
        """cu_seqlens' length for a micro-step of this shape (a piece: its sequence's documents + 1 across a cut)."""
        split = self.cfg.micro_split
        return varlen_slots(seq_len // split, self.documents.train[seq_len, max_doc_len] + (split > 1))

    def plan(self, step: int, training: bool) -> VarlenPlan:
        """FA3's numbers for training step `step` or the validation before it."""
        s, cfg = self.schedules[step], self.cfg
        max_seqlen, slots = ((min(s.max_doc_len, s.micro_len), self.train_slots(s.seq_len, s.max_doc_len)) if training
                            else (cfg.val_seq_len, varlen_slots(cfg.val_seq_len, self.documents.val)))
        return VarlenPlan(cfg.block_size * s.long_window, cfg.block_size * s.short_window, max_seqlen, slots,
                          yarn_scale(s.yarn_windows, cfg.attn_scale))

    def train(self, step: int) -> tuple[Tensor | VarlenPlan, Tensor, Tensor]:
        windows = self.windows[step] if self.documents is None else self.plan(step, True)
        return windows, self.mtp[step], self.prefix[step]

    def val(self, step: int) -> Tensor | VarlenPlan:
        return self.windows[step] if self.documents is None else self.plan(step, False)

def graph_key(cfg: Config, s: StepSchedule, training: bool) -> tuple:
    """What the compiled model's graph for this step depends on (dynamic=False; FA3's slots follow the shape)."""
    shape = (s.seq_len, s.max_doc_len) if training else ()
    return shape[:1] if cfg.attention != "fa3" else (*shape, s.long_window, s.short_window, s.yarn_windows)

def validates_at(cfg: Config, step: int) -> bool:
    """Whether the run validates before training step `step` (at run_length: its last validation)."""
    return not cfg.bench and (step in (0, run_length(cfg)) or bool(cfg.val_every) and step % cfg.val_every == 0)

# -----------------------------------------------------------------------------
# Optimizer
# Muon (momentum, Polar Express, NorMuon) for the block matrices, Adam for the rest, sharded ZeRO-1 style: gradients
# reduce-scattered bucket by bucket after backward (#89's order), each rank updates its own shard (whole matrices for
# Muon), the shards all-gathered back into the parameters, awaited only where next read.

# Polar Express (Amsel et al. 2025, record #38): per-iteration coefficients for five iterations, 2% safety factor.
POLAR_EXPRESS = ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))
SPLIT_ROWS = 1024  # #89: a block of more rows forms its product, then adds a X to it (two roundings; the MLP's)

# The update functions round once per op, in fp32 (bf16 where stored), so that their compiled graphs (compile_ns)
# compute eager's bits: eager's CPU kernels fuse a multiply-add into one rounding (lerp, addcmul, add(alpha=)) where
# inductor's C++ rounds twice, eager's fp32 sqrt is an ulp off in one value in six (inductor's correctly rounded),
# inductor's reductions sum in another order. Hence explicit products (in place where eager's memory wants it),
# sqrt32 and eager_sum. (The GPU's compiled graphs fuse multiply-adds as #89's did.)

def sqrt32(x: Tensor) -> Tensor:
    """Correctly rounded fp32 sqrt: numpy's for an eager CPU fp32 tensor, else torch's (a fake tensor has no numpy)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or torch.compiler.is_compiling() or type(x) is not Tensor:
        return x.sqrt()
    return torch.as_tensor(np.sqrt(x.numpy()))

def polar_express(G: Tensor, kernels: bool = False) -> Tensor:
    """Orthogonalize each matrix of G (batched) approximately, as #89: X <- a X + (b A + c A^2) X, A = X X^T (X^T X and
    X B for a tall X), each product rounded to bf16 once (kernels: gpt_kernels' Triton GEMMs, as #89's)."""
    X = G.bfloat16()
    norm = sqrt32(eager_sum(X.float().square(), [-2, -1])).bfloat16()
    X = (X.float() / (norm.float() * 1.02 + 1e-6)).bfloat16()
    shape, (rows, cols) = X.shape, X.shape[-2:]
    tall, split = rows > cols, rows > SPLIT_ROWS
    X = X.reshape(-1, rows, cols)  # baddbmm takes one batch dimension
    for a, b, c in POLAR_EXPRESS:
        if kernels:
            A = torch.ops.speedrun.xtx(X) if tall else torch.ops.speedrun.xxt(X)
            B = torch.ops.speedrun.ba_plus_caa(A, b, c)
        else:
            A = X.mT @ X if tall else X @ X.mT
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        if split:
            X = ((X @ B if tall else B @ X).float() + X.float() * a).bfloat16()
        else:
            X = torch.baddbmm(X, X, B, beta=a) if tall else torch.baddbmm(X, B, X, beta=a)
    return X.view(shape)

def lerp(start: Tensor, end: Tensor, weight: Tensor) -> Tensor:
    """torch.lerp's two formulas (exact at both ends), one rounding per op so that compiled and eager agree."""
    diff = end - start
    return torch.where(weight < 0.5, start + weight * diff, end - diff * (1 - weight))

def nesterov_(grad: Tensor, buf: Tensor, momentum: Tensor) -> Tensor:
    """Nesterov momentum in fp32 as #89's two lerps (1 - mu in fp32, as #89's); buf is updated in place."""
    buf.copy_(lerp(buf, grad, 1 - momentum))
    return lerp(grad, buf, momentum)

def momentum_polar_express(grad: Tensor, buf: Tensor, momentum: Tensor, kernels: bool = False) -> Tensor:
    """nesterov_ then polar_express: #89's graph (compiled, the fp32 Nesterov update never reaches memory)."""
    return polar_express(nesterov_(grad, buf, momentum), kernels)

def muon_state(p: Tensor) -> dict[str, Tensor]:
    """Muon's state for the matrices p: fp32 momentum, NorMuon's second moment and, for a bf16 p, its mantissa."""
    state = {"momentum": torch.zeros(p.shape, dtype=torch.float32, device=p.device),
             "v": torch.zeros(normuon_state_shape(p.shape), device=p.device)}
    if p.dtype == torch.bfloat16:
        state["mantissa"] = torch.zeros(p.shape, dtype=torch.int16, device=p.device)
    return state

def normuon_state_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    rows, cols = shape[-2:]
    return (*shape[:-2], rows, 1) if rows >= cols else (*shape[:-2], 1, cols)

def normuon_(O: Tensor, v: Tensor, beta2: float) -> Tensor:
    """NorMuon (#41) in #89's algebra: v <- v + (r - v)(1 - beta2), r the mean square of each row of O (of a wide O:
    column, as Q's and K's head pairs, #80); O's rows scaled by v^-1/2 and back to O's Frobenius norm, in bf16."""
    dim = -1 if v.size(-1) == 1 else -2
    n = O.size(dim)
    mean_sq = eager_sum(O.float().square(), [dim]) / n
    norm = sqrt32(eager_sum(mean_sq, [-2, -1]) * n)
    v.add_((mean_sq - v) * (1 - beta2))
    scale = v.clamp_min(1e-10).rsqrt()
    new_norm = sqrt32(eager_sum(mean_sq * n * scale.square(), [-2, -1]))
    return O * (scale * (norm / new_norm.clamp_min(1e-10))).type_as(O)

def master_of(p: Tensor, mantissa: Tensor) -> Tensor:
    """#89's fp32 master weight, never stored whole: the bf16 p's bits above its int16 mantissa's."""
    return ((p.view(torch.int16).to(torch.int32) << 16) | (mantissa.to(torch.int32) & 0xFFFF)).view(torch.float32)

def split_master_(p: Tensor, mantissa: Tensor, master: Tensor) -> None:
    """Store an fp32 master back as the bf16 parameter (its upper bits: truncated, as #89) and the mantissa."""
    bits = master.view(torch.int32)
    p.view(torch.int16).copy_((bits >> 16).to(torch.int16))
    mantissa.copy_(((bits << 16) >> 16).to(torch.int16))  # the low 16 bits, sign-extended: exact in int16

def cautious_update_(p: Tensor, update: Tensor, decay: Tensor, step_lr: Tensor, mantissa: Tensor | None = None) -> None:
    """#89's step on the fp32 master (p, or the bf16 p and its mantissa): cautious weight decay, then the update."""
    master = p if mantissa is None else master_of(p, mantissa)
    update = update.float()
    new = master - master * (update * master >= 0) * decay * step_lr - update * step_lr
    if mantissa is None:
        p.copy_(new)
    else:
        split_master_(p, mantissa, new)

def adam_step_(p: Tensor, grad: Tensor, m: Tensor, v: Tensor, beta1: float, beta2: float, eps: float,
               step_size: Tensor, decay: Tensor) -> None:
    """Adam in #89's order, fp32 state (#56), eps added to the raw sqrt(v), cautious decay (#50); p rounds once."""
    grad = grad.float()
    m.mul_(beta1).add_(grad * (1 - beta1))
    v.mul_(beta2).add_(grad.mul(1 - beta2).mul_(grad))
    update = m.div(sqrt32(v).add_(eps)).mul_(step_size)
    p32 = p.float()
    update.add_(p32.mul(decay).mul_(update * p32 > 0))
    p.sub_(update)

@dataclass(frozen=True)
class UpdateSteps:
    """The functions one optimizer step runs: eager, or compiled by update_steps (tests swap orthogonalize)."""
    orthogonalize: Callable[[Tensor, Tensor, Tensor], Tensor] = momentum_polar_express  # (grad, buf, mu) -> bf16
    normuon: Callable[[Tensor, Tensor, float], Tensor] = normuon_
    cautious_update: Callable[[Tensor, Tensor, Tensor, Tensor], None] = cautious_update_
    adam: Callable[..., None] = adam_step_

EAGER_STEPS = UpdateSteps()

def polar_express_kernels(device: torch.device) -> bool:
    """Whether Polar Express runs gpt_kernels' Triton GEMMs: on CUDA, where they compile for the GPU (gpu_runs)."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None \
        and gpu_runs("polar_express", gpu_capability(True))[0] is True

def update_steps(compiled: bool, kernels: bool) -> UpdateSteps:
    """Each function compiled as #89's (the per-step scalars are 0-d tensors: only a new shape compiles a graph)."""
    def wrap(fn: Callable) -> Callable:
        return (torch.compile(fn, dynamic=False, fullgraph=True, options={"emulate_precision_casts": True})
                if compiled else fn)
    return UpdateSteps(functools.partial(wrap(momentum_polar_express), kernels=kernels), wrap(normuon_),
                       wrap(cautious_update_), wrap(adam_step_))

def scalar(x: float) -> Tensor:
    """A per-step number as a 0-d fp32 CPU tensor: an input of the compiled graphs, read without a host sync."""
    return torch.tensor(x, dtype=torch.float32)

def muon_update_(p: Tensor, grad: Tensor, state: dict[str, Tensor], lr: float, momentum: float, normuon_beta2: float,
                 lr_mul: float | Tensor = 1.0, wd: float = 0.0, steps: UpdateSteps = EAGER_STEPS) -> None:
    """Nesterov momentum, orthogonalization and NorMuon, then cautious_update_ (state: muon_state(p)), as #89's."""
    assert (p.dtype == torch.bfloat16) == ("mantissa" in state), "a bf16 bank updates with its mantissa (muon_state)"
    O = steps.orthogonalize(grad.float(), state["momentum"], scalar(momentum))
    update = steps.normuon(O, state["v"], normuon_beta2)
    step_lr = torch.as_tensor(lr_mul * (lr * math.sqrt(max(1.0, p.size(-2) / p.size(-1))))).float()  # no host sync
    steps.cautious_update(p, update, scalar(wd * lr), step_lr, state.get("mantissa"))

def adam_update_(p: Tensor, grad: Tensor, m: Tensor, v: Tensor, step: int, lr: float, beta1: float, beta2: float,
                 eps: float, wd: float = 0.0, steps: UpdateSteps = EAGER_STEPS) -> None:
    """adam_step_ at Adam step `step`, the bias-corrected step size and decay lr^2 wd in double, passed in fp32."""
    steps.adam(p, grad, m, v, beta1, beta2, eps, scalar(lr * ((1 - beta2**step) ** 0.5 / (1 - beta1**step))),
               scalar(lr * lr * wd))

@dataclass
class ParamGroup:
    kind: str  # "muon" or "adam"
    lr: float
    params: list[nn.Parameter]
    names: list[str] = field(default_factory=list)
    lr_muls: list[list[float]] = field(default_factory=list)  # per parameter, per matrix (Muon); Adam: one lr
    wd: float = 0.0  # cautious weight decay
    betas: tuple[float, float] = (0.0, 0.0)  # Adam's

TIED_EMBEDDING = "embed.weight"  # reads the head's weight until the untie (#51): no gradient of its own till then
BIGRAM_TABLE = "bigram_embed.weight"  # a bucket of its own: only the rows a rank touched are exchanged (RowBucket)
# Upstream's orders: gradients reduce-scattered in its parameter table's order, updates (each followed by its
# all-gather) small parameters first and the Muon banks last, so the large reductions finish while the rest updates.
SCATTER_ORDER = ("qk_bank", "vo_bank", "mlp_bank", "scalars", "smear_gate.weight", "ve_gate_bank", "lm_head.weight",
                 BIGRAM_TABLE, "post_lambdas", "resid_lambdas", "value_embeds", TIED_EMBEDDING, "mudd_w1", "mudd_w2",
                 "mudd_b2", "mudd_gate_w1", "mudd_gate_w2", "mudd_gate_b2", "_mudd_gate_scale")
WORK_ORDER = ("scalars", "smear_gate.weight", "ve_gate_bank", "mudd_b2", "mudd_gate_b2", "_mudd_gate_scale",
              "post_lambdas", "resid_lambdas", "mudd_w2", "mudd_gate_w2", "value_embeds", BIGRAM_TABLE, "mudd_w1",
              "mudd_gate_w1", "lm_head.weight", TIED_EMBEDDING, "qk_bank", "vo_bank", "mlp_bank")

def build_param_groups(model: GPT, cfg: Config) -> list[ParamGroup]:
    """Upstream's table: Muon for the three banks (W_proj at mlp_down_lr_mul), Adam for the rest by kind."""
    named = dict(model.named_parameters())
    betas, scalar_betas = (cfg.adam_beta1, cfg.adam_beta2), (cfg.scalar_beta1, cfg.scalar_beta2)
    head_betas, lambda_betas = (cfg.head_beta1, cfg.adam_beta2), (cfg.scalar_beta1, cfg.adam_beta2)
    muon = ["qk_bank", "vo_bank", "mlp_bank"]
    per_matrix = {"mlp_bank": [1.0, cfg.mlp_down_lr_mul] * cfg.num_layers}  # (W_fc, W_proj) per layer
    def group(kind: str, lr: float, names: list[str], **kw: object) -> ParamGroup:
        return ParamGroup(kind, lr, [named[n] for n in names], names, **kw)
    groups = [group("muon", cfg.muon_lr, muon, wd=cfg.muon_wd,
                    lr_muls=[per_matrix.get(n, [1.0] * math.prod(named[n].shape[:-2])) for n in muon]),
              group("adam", cfg.head_lr, [TIED_EMBEDDING], wd=cfg.adam_wd * cfg.embed_wd_mul, betas=head_betas),
              group("adam", cfg.embed_lr, ["value_embeds"], wd=cfg.adam_wd * cfg.value_embed_wd_mul, betas=betas),
              group("adam", cfg.embed_lr, [BIGRAM_TABLE], wd=cfg.adam_wd * cfg.value_embed_wd_mul, betas=betas),
              group("adam", cfg.head_lr, ["lm_head.weight"], wd=cfg.adam_wd * cfg.head_wd_mul, betas=head_betas),
              group("adam", cfg.scalar_lr, ["scalars"], betas=scalar_betas),
              group("adam", cfg.scalar_lr, ["resid_lambdas"], betas=lambda_betas),
              group("adam", cfg.lambda_lr, ["post_lambdas"], betas=lambda_betas),
              group("adam", cfg.gate_lr, ["ve_gate_bank"], wd=cfg.adam_wd, betas=scalar_betas),
              group("adam", cfg.smear_gate_lr, ["smear_gate.weight"], betas=scalar_betas),
              group("adam", cfg.mudd_lr, ["mudd_w1", "mudd_w2"], wd=cfg.adam_wd, betas=scalar_betas),
              group("adam", cfg.mudd_lr, ["mudd_b2"], betas=scalar_betas),
              group("adam", cfg.mudd_gate_lr, ["mudd_gate_w1", "mudd_gate_w2"], wd=cfg.adam_wd, betas=scalar_betas),
              group("adam", cfg.mudd_gate_lr, ["mudd_gate_b2", "_mudd_gate_scale"], betas=scalar_betas)]
    assert sum(len(g.params) for g in groups) == len(named), "every parameter belongs to exactly one group"
    return groups

def _reduce_scatter(out: Tensor, inp: Tensor) -> dist.Work:
    """Async SUM reduce-scatter (the loss is already scaled; gloo has no AVG). torch 2.13 renamed the collectives."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, op=dist.ReduceOp.SUM, async_op=True)

def all_gather_into(out: Tensor, inp: Tensor, async_op: bool = False) -> dist.Work | None:
    """All-gather into one tensor; inp may be this rank's slice of out (in place)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, async_op=async_op)

def plan_buckets(groups: list[ParamGroup], order: list[str], bucket_mb: float,
                 world_size: int) -> list[tuple[ParamGroup, list[str]]]:
    """Buckets of one group, dtype and (Muon) matrix shape of about bucket_mb, filled in `order`, no parameter split, a
    Muon bucket a multiple of world_size matrices where it can; sorted by last parameter: every rank's launch order."""
    entries = sorted(((g, n, p) for g in groups for n, p in zip(g.names, g.params)), key=lambda e: order.index(e[1]))
    open_buckets: dict[tuple, tuple[ParamGroup, list[str], int]] = {}
    closed: list[tuple[ParamGroup, list[str]]] = []
    for g, name, p in entries:
        unit = tuple(p.shape[-2:]) if g.kind == "muon" else ()
        unit_bytes, units = math.prod(unit) * p.element_size(), p.numel() // math.prod(unit)
        limit = max(1, int(bucket_mb * 2**20) // unit_bytes)
        if g.kind == "muon":
            limit = max(world_size, limit // world_size * world_size)
        key = (id(g), p.dtype, unit)
        _, names, held = open_buckets.pop(key, (g, [], 0))
        if names and held + units > limit:
            closed.append((g, names))
            names, held = [], 0
        names, held = names + [name], held + units
        if held >= limit:
            closed.append((g, names))
        else:
            open_buckets[key] = (g, names, held)
    closed += [(g, names) for g, names, _ in open_buckets.values()]
    return sorted(closed, key=lambda c: order.index(c[1][-1]))

class Bucket:
    """One flat buffer of units (a matrix for Muon, an element for Adam), padded to a multiple of the world size: rank r
    owns units [r*k, (r+1)*k) and their state. Parameters and their .grad are views into it: no copies."""

    def __init__(self, group: ParamGroup, names: list[str], params: list[nn.Parameter], rank: int, world_size: int):
        self.kind, self.lr, self.wd, self.betas = group.kind, group.lr, group.wd, group.betas
        self.names, self.params, self.world_size = names, params, world_size
        self.unit = list(params[0].shape[-2:]) if self.kind == "muon" else []
        unit_numel = math.prod(self.unit)
        self.counts = [p.numel() // unit_numel for p in params]
        self.starts = [sum(self.counts[:j]) for j in range(len(params))]
        self.shard_units = -(-sum(self.counts) // world_size)
        self.data = params[0].new_zeros(self.shard_units * world_size * unit_numel)
        self.grad, self.grad_views = torch.zeros_like(self.data), []  # grad_views: each parameter's .grad
        with torch.no_grad():
            for p, start, count in zip(params, self.starts, self.counts):
                lo, hi = start * unit_numel, (start + count) * unit_numel
                self.data[lo:hi].copy_(p.flatten())
                p.data = self.data[lo:hi].view_as(p)
                self.grad_views.append(self.grad[lo:hi].view_as(p))
                p.grad = self.grad_views[-1]
        self.first_unit, shape = rank * self.shard_units, (self.shard_units, *self.unit)
        self.shard = self.data.view(world_size, -1)[rank].view(shape)
        # At W = 1 the whole buffer is the shard; otherwise the reduce-scatter needs its own output.
        self.grad_shard = self.grad.view(shape) if world_size == 1 else self.grad.new_empty(shape)
        if self.kind == "muon":
            self.state = muon_state(self.shard)
            muls = [m for n in names for m in group.lr_muls[group.names.index(n)]]  # lr multipliers (padding: 1)
            muls += [1.0] * (self.shard_units * world_size - len(muls))
            self.lr_mul = torch.tensor(muls[self.first_unit:self.first_unit + self.shard_units], dtype=torch.float64,
                                       device=self.data.device).view(-1, 1, 1)
        else:
            self.state = {k: torch.zeros(shape, dtype=torch.float32, device=self.data.device) for k in ("m", "v")}
        self.reduce_work: dist.Work | None = None
        self.gather_work: dist.Work | None = None

    def _bind_grads(self) -> None:
        """Bring back gradients that left the buffer (e.g. model.zero_grad(set_to_none=True)), at the cost of a copy."""
        for p, view in zip(self.params, self.grad_views):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view

    def reduce_grads(self) -> None:
        self._bind_grads()
        if self.world_size > 1:
            self.reduce_work = _reduce_scatter(self.grad_shard.view(-1), self.grad)

    def wait_grads(self) -> None:
        if self.reduce_work is not None:
            self.reduce_work.wait()
            self.reduce_work = None

    def gather_params(self) -> None:
        if self.world_size > 1:
            self.gather_work = all_gather_into(self.data, self.shard.view(-1), async_op=True)

    def wait_params(self) -> None:
        if self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work = None

    def zero_grad(self) -> None:
        self.grad.zero_()
        for p, view in zip(self.params, self.grad_views):
            p.grad = view

    def owned(self) -> Iterator[tuple[str, int, int, dict[str, Tensor]]]:
        """Per parameter with units in this rank's shard: name, its first and end unit, and views of their state."""
        end_unit = self.first_unit + self.shard_units
        for name, start, count in zip(self.names, self.starts, self.counts):
            lo, hi = max(start, self.first_unit), min(start + count, end_unit)
            if lo < hi:
                rows = slice(lo - self.first_unit, hi - self.first_unit)
                yield name, lo - start, hi - start, {k: t[rows] for k, t in self.state.items()}

class RowBucket(Bucket):
    """The bigram table, its gradient exchanged sparse as #89's (§5.6): each rank sends each owner the rows of its
    shard that its batches touched since the last update (known on the host; the rest are zero), added into the owner's
    gradient (another summation order than a reduce-scatter); gathered dense. A checkpoint holds no touched rows."""

    def __init__(self, group: ParamGroup, names: list[str], params: list[nn.Parameter], rank: int, world_size: int):
        super().__init__(group, names, params, rank, world_size)
        self.rank, (rows, self.dim) = rank, params[0].shape
        self.shard_rows, self.touched = rows // world_size, np.zeros(rows, dtype=bool)  # touched: since the update
        self.grad_shard = self.grad.view(world_size, -1)[rank]  # its own rows of its local gradient
        # The touched rows' ids go up from here (pinned on CUDA: an asynchronous upload, as #89's send_idxes_buffer).
        self.send_buffer = torch.empty(rows, dtype=torch.int32, pin_memory=self.grad.is_cuda)
        self.uploaded = torch.cuda.Event() if self.grad.is_cuda else None  # the last upload out of send_buffer
        self.counts_work: dist.Work | None = None  # announce()'s exchange of the counts, share_ids() waits for it
        self.ids_work: dist.Work | None = None  # share_ids()'s exchange of the row ids

    def announce(self) -> None:
        """Before the forward of an update's step (rows touched): start telling each rank how many rows it will get
        (an async all-to-all of host counts, gloo's) and the upload of their ids, as #89's sparse_comms_start."""
        ids = np.flatnonzero(self.touched)  # sorted: grouped by owner
        owner = ids // self.shard_rows
        ids, owner = ids[owner != self.rank], owner[owner != self.rank]  # its own rows are in its gradient already
        self.numbers = torch.from_numpy(np.bincount(owner, minlength=self.world_size)), torch.zeros(self.world_size,
                                                                                                     dtype=torch.int64)
        self.counts_work = dist.all_to_all_single(self.numbers[1], self.numbers[0], async_op=True)
        if self.uploaded is not None:
            self.uploaded.synchronize()  # done long ago: the previous update's exchange has read it
        self.send_buffer[: len(ids)].numpy()[:] = ids
        self.send_ids = self.send_buffer[: len(ids)].to(self.grad.device, non_blocking=True)
        if self.uploaded is not None:
            self.uploaded.record()

    def share_ids(self) -> None:
        """After the step's first forward: once the counts are in, start the row ids' exchange (behind the backward)."""
        self.counts_work.wait()
        self.send_counts, self.recv_counts = (t.tolist() for t in self.numbers)
        self.recv_ids = torch.empty(sum(self.recv_counts), dtype=torch.int32, device=self.grad.device)
        self.ids_work = dist.all_to_all_single(self.recv_ids, self.send_ids, self.recv_counts, self.send_counts,
                                               async_op=True)

    def reduce_grads(self) -> None:
        if self.ids_work is None:
            raise RuntimeError("the bigram table's update needs begin_step() before its step's forward and "
                               "forward_done() after it")
        self._bind_grads()
        send = self.grad.view(-1, self.dim)[self.send_ids]
        self.recv_rows = send.new_empty(sum(self.recv_counts), self.dim)
        self.reduce_work = dist.all_to_all_single(self.recv_rows, send, self.recv_counts, self.send_counts,
                                                  async_op=True)

    def wait_grads(self) -> None:
        for work in (self.ids_work, self.reduce_work):
            work.wait()
        self.ids_work = self.reduce_work = None
        self.grad.view(-1, self.dim).index_add_(0, self.recv_ids, self.recv_rows)  # all in this rank's shard

    def zero_grad(self) -> None:
        super().zero_grad()
        self.touched[:] = False

def exchanges_rows(rows: int, world_size: int) -> bool:
    """Whether the bigram table's gradient goes as touched rows (RowBucket): several ranks, each shard whole rows."""
    return world_size > 1 and rows % world_size == 0

class ShardedMuonAdam:
    """Muon + Adam, ZeRO-1 (see the section's comment; buckets reduce-scattered in SCATTER_ORDER). Between Adam steps
    the Adam gradients accumulate in place on every rank. Call wait_for_params() before anything reads a parameter."""

    def __init__(self, model: nn.Module, cfg: Config, rank: int, world_size: int, compile_ns: bool):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.steps = update_steps(compile_ns, polar_express_kernels(next(model.parameters()).device))
        self.lr_mult, self.momentum, self.adam_step, self.tied = 1.0, cfg.muon_momentum_start, True, False  # set_step()
        self.step_count, self.adam_steps = 0, 0
        named = dict(model.named_parameters())
        plan = plan_buckets(build_param_groups(model, cfg), list(SCATTER_ORDER), cfg.bucket_mb, world_size)
        rows_exchanged = exchanges_rows(named[BIGRAM_TABLE].size(0), world_size)
        self.buckets = [(RowBucket if rows_exchanged and names == [BIGRAM_TABLE] else Bucket)(
            g, names, [named[n] for n in names], rank, world_size) for g, names in plan]
        self.work_order = sorted(self.buckets, key=lambda b: min(WORK_ORDER.index(n) for n in b.names))
        self.row_bucket = next((b for b in self.buckets if isinstance(b, RowBucket)), None)

    def set_step(self, s: StepSchedule) -> None:
        """Take the schedule's values for the step about to be trained (before its first backward)."""
        self.lr_mult, self.momentum, self.adam_step, self.tied = s.lr_mult, s.muon_momentum, s.adam_step, s.tied

    def batch_rows(self) -> Callable[[np.ndarray], np.ndarray] | None:
        """For begin_step(), computed by the loader: a host batch's bigram rows; None where no rows are exchanged."""
        rows = None if self.row_bucket is None else self.row_bucket.touched.size
        return None if rows is None else lambda batch: bigram_index(batch[:, :-1], rows)

    def begin_step(self, rows: np.ndarray | None) -> None:
        """After set_step(), before the step's first forward: batch_rows() of its batch (None where that is None)
        marks the bigram rows touched; on an Adam step their exchange begins, overlapping the forward."""
        if self.row_bucket is not None:
            self.row_bucket.touched[rows] = True
            if self.adam_step:
                self.row_bucket.announce()

    def forward_done(self) -> None:
        """After the step's first forward: the bigram rows' ids start their exchange (on an Adam step)."""
        if self.row_bucket is not None and self.adam_step:
            self.row_bucket.share_ids()

    def _updates(self, bucket: Bucket) -> bool:
        # While tied the embedding's gradient is exactly zero and so is its Adam update (m = v = 0, no decay where
        # u p = 0): its bucket (its group's alone) is neither reduced, updated nor gathered, as #89 skips it.
        if bucket.names == [TIED_EMBEDDING]:
            return self.adam_step and not self.tied
        return bucket.kind == "muon" or self.adam_step

    @torch.no_grad()
    def step(self) -> None:
        for b in self.buckets:  # every rank launches its collectives in the same order
            if self._updates(b):
                b.reduce_grads()
        self.step_count += 1
        self.adam_steps += self.adam_step
        for b in self.work_order:
            if not self._updates(b):
                continue
            b.wait_grads()
            lr = b.lr * self.lr_mult
            if b.kind == "muon":
                muon_update_(b.shard, b.grad_shard, b.state, lr, self.momentum, self.cfg.normuon_beta2, b.lr_mul, b.wd,
                             self.steps)
            else:
                adam_update_(b.shard, b.grad_shard, b.state["m"], b.state["v"], self.adam_steps, lr, *b.betas,
                             self.cfg.adam_eps, b.wd, self.steps)
            b.gather_params()

    def wait_for_params(self) -> None:
        for b in self.buckets:
            b.wait_params()

    @torch.no_grad()
    def zero_grad(self, everything: bool = False) -> None:
        """Zero the gradient buffers of the buckets just updated (or all), in place."""
        for b in self.buckets:
            if everything or self._updates(b):
                b.zero_grad()

    @torch.no_grad()
    def copy_param(self, src: str, dst: str) -> None:
        """Make parameter dst a copy of src, optimizer state too (the untie, #53); each rank owns the same units."""
        self.wait_for_params()
        params = {n: p for b in self.buckets for n, p in zip(b.names, b.params)}
        params[dst].copy_(params[src])
        owned = {name: (lo, hi, state) for b in self.buckets for name, lo, hi, state in b.owned()}
        if (src in owned) != (dst in owned) or src in owned and owned[src][:2] != owned[dst][:2]:
            raise ValueError(f"{src} and {dst} are sharded differently: cannot copy the optimizer state")
        if src in owned:
            for k, t in owned[dst][2].items():
                t.copy_(owned[src][2][k].view_as(t))

    def state_tensors(self) -> list[Tensor]:
        return [t for b in self.buckets for t in b.state.values()]

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_tensors())

    def state_dict(self, copy: Callable[[Tensor], Tensor] = torch.clone) -> dict:
        """This rank's shard and the bucket layout a load checks, each tensor through `copy` (the checkpointer's)."""
        params = {name: {"bucket": i, "units": (lo, hi), **{k: copy(t) for k, t in state.items()}}
                  for i, b in enumerate(self.buckets) for name, lo, hi, state in b.owned()}
        layouts = [{"kind": b.kind, "dtype": str(b.data.dtype), "unit": b.unit, "names": b.names, "counts": b.counts,
                    "shard_units": b.shard_units} for b in self.buckets]
        return {"world_size": self.world_size, "rank": self.rank, "step_count": self.step_count,
                "adam_steps": self.adam_steps, "buckets": layouts, "params": params}

    @torch.no_grad()
    def load_state_dict(self, shards: list[dict]) -> None:
        """Load every saving rank's state_dict() at any world size and bucket layout; ValueError: what does not fit."""
        saved = {n: (lay["kind"], lay["unit"], c) for lay in shards[0]["buckets"]
                 for n, c in zip(lay["names"], lay["counts"])}
        mine = {n: (b.kind, b.unit, c) for b in self.buckets for n, c in zip(b.names, b.counts)}
        if saved != mine:
            raise ValueError("the optimizer state has other parameters or units than this model")
        pieces: dict[str, list[tuple[int, int, dict[str, Tensor]]]] = {n: [] for n in mine}
        for shard in shards:
            for name, entry in shard["params"].items():
                pieces[name].append((*entry["units"], {k: v for k, v in entry.items() if k not in ("bucket", "units")}))
        kinds = {n: set(state) for b in self.buckets for n, _, _, state in b.owned()}
        if any(set(parts[0][2]) != kinds[n] for n, parts in pieces.items() if n in kinds and parts):
            raise ValueError("the optimizer state holds other statistics (e.g. NorMuon's) than this optimizer's")
        full: dict[str, dict[str, Tensor]] = {}
        for name, parts in pieces.items():
            parts.sort(key=lambda p: p[0])
            edges = [0] + [e for lo, hi, _ in parts for e in (lo, hi)] + [mine[name][2]]
            if edges[0::2] != edges[1::2]:  # each piece starts where the previous one ended, from 0 to the end
                raise ValueError(f"the optimizer state does not cover {name} exactly once")
            full[name] = {k: torch.cat([p[2][k] for p in parts]) for k in parts[0][2]}
        for b in self.buckets:
            for name, lo, hi, state in b.owned():
                for k, t in state.items():
                    t.copy_(full[name][k][lo:hi])
        self.step_count, self.adam_steps = shards[0]["step_count"], shards[0]["adam_steps"]

# -----------------------------------------------------------------------------
# Data
# Shards are a 256-int32 header (magic, version, token count) then uint16 GPT-2 tokens; every document starts with
# BOS (50256). Each step's sequences start at a BOS, in one global order: any world size sees the same token stream.

SHARD_MAGIC, SHARD_VERSION, HEADER_INTS, BOS_ID = 20240520, 1, 256, 50256
HERE = Path(__file__).resolve().parent  # the repository: where data/ and tools/ are

@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "wb") -> Iterator[IO]:
    """Write beside path, fsync, rename over it: a reader sees the old file or the new one, a failure nothing."""
    tmp = path.with_name(f"{path.name}.tmp")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)

def shard_token_count(path: Path) -> int:
    try:
        size, header = os.path.getsize(path), np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    except OSError as e:
        raise UsageError(f"cannot read shard {path}: {e.strerror}") from None
    if len(header) < HEADER_INTS:
        raise UsageError(f"shard {path} is truncated: {size} bytes, shorter than the {4 * HEADER_INTS}-byte header")
    if header[0] != SHARD_MAGIC:
        raise UsageError(f"shard {path} has magic {header[0]}, expected {SHARD_MAGIC}: not a token shard")
    if header[1] != SHARD_VERSION:
        raise UsageError(f"shard {path} has version {header[1]}, expected {SHARD_VERSION}")
    count = int(header[2])
    if size != (expected := 4 * HEADER_INTS + 2 * count):
        raise UsageError(f"shard {path} header says {count} tokens ({expected} bytes) but the file has {size} bytes; "
                         f"it is truncated or corrupt: delete it and download or tokenize it again")
    return count

def load_shard(path: Path, vocab_size: int) -> np.ndarray:
    count = shard_token_count(path)
    tokens = np.fromfile(path, dtype="<u2", offset=4 * HEADER_INTS, count=count)
    if count and int(tokens.max()) >= vocab_size:
        bad = int(np.argmax(tokens >= vocab_size))
        raise UsageError(f"shard {path} holds token id {int(tokens[bad])} at position {bad}, "
                         f"outside the vocabulary (< {vocab_size})")
    return tokens

def find_shards(pattern: str) -> list[Path]:
    """The shards a glob names, in order; a relative one is also tried under this file's folder."""
    files = sorted(map(Path, glob.glob(pattern))) or sorted(map(Path, glob.glob(str(HERE / pattern))))
    if not files:
        hint = ("the bundled sample is missing from this checkout: restore it with `git checkout data/sample`"
                if pattern in (PRESETS["tiny"]["train_files"], PRESETS["tiny"]["val_files"])
                else more_data_hint(pattern, missing=True))
        raise UsageError(f"no files match {pattern!r} (here or under {HERE}); {hint}")
    return files

def more_data_hint(pattern: str, missing: bool = False) -> str:
    if "fineweb10B" in pattern:
        return f"download {'' if missing else 'more '}FineWeb shards with `python data/cached_fineweb10B.py 8`"
    return ("check the glob (quote it in the shell), or make shards from text with data/tokenize_text.py" if missing
            else "make more shards from text with data/tokenize_text.py")

class DataExhausted(UsageError):
    """The training files ran out before the run's last step."""

Pieces = list[tuple[int, int]]  # one sequence: (start, end) token ranges of the shard, concatenated
POSITIONS_KEPT = 64  # recent steps whose stream position is kept: far more than a prefetch runs ahead

class TrainTokenStream:
    """Step k: global_batch_seqs sequences of step_shape(k) = (seq_len, max_doc_len), in one order for any world size,
    each seq_len + 1 tokens of one shard: documents in order from a BOS, each cut to max_doc_len, the last to fit."""

    def __init__(self, files: list[Path], seq_len: int, batch_seqs: int, vocab_size: int,
                 step_shape: Callable[[int], tuple[int, int]], epochs: int = 1, preload: bool = False):
        self.files, self.step_shape = files * epochs, step_shape
        self.seq_len, self.batch_seqs, self.vocab_size = seq_len, batch_seqs, vocab_size  # seq_len: the longest
        self.next_file, self.steps_served, self.pos = 0, 0, 0
        self.tokens, self.bos = np.zeros(0, dtype=np.uint16), np.zeros(0, dtype=np.int64)
        self.long_docs: dict[int, np.ndarray] = {}  # max_doc_len -> indices (into bos) of longer documents
        # step -> (next file, shard position) after it, where a checkpoint resumes; written ahead by the producer thread
        self.positions: dict[int, tuple[int, int]] = {0: (0, 0)}
        # Reading and scanning a 100M-token shard takes a large fraction of a second: do it ahead, off the loop.
        self.preloader = ThreadPoolExecutor(1, thread_name_prefix="shard-preload") if preload else None
        self.upcoming: Future | None = None

    def _read(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = load_shard(self.files[index], self.vocab_size)
        return tokens, np.flatnonzero(tokens == BOS_ID)

    def _load_next_shard(self) -> None:
        if self.next_file >= len(self.files):
            held = sum(shard_token_count(p) for p in self.files)
            raise DataExhausted(f"training data exhausted at step {self.steps_served}: {len(self.files)} shard(s) "
                                f"(with epochs) hold {held:,} tokens, less than the run consumes; add shards, "
                                f"raise --train_epochs or lower --num_steps")
        self.tokens, self.bos = self.upcoming.result() if self.upcoming is not None else self._read(self.next_file)
        self.next_file, self.pos, self.long_docs = self.next_file + 1, 0, {}
        has_next = self.next_file < len(self.files)
        self.upcoming = self.preloader.submit(self._read, self.next_file) if self.preloader and has_next else None

    def close(self) -> None:
        if self.preloader is not None:
            self.preloader.shutdown(wait=True, cancel_futures=True)

    def _take(self, seq_len: int, max_doc_len: int) -> list[Pieces] | None:
        """The step's sequences from self.pos as pieces, or None when the shard cannot supply them. #89's rule: a
        sequence starts at the document after the previous one's last, even when only its BOS was taken."""
        if max_doc_len not in self.long_docs:
            self.long_docs[max_doc_len] = np.flatnonzero(np.diff(self.bos, append=len(self.tokens)) > max_doc_len)
        long_docs, step = self.long_docs[max_doc_len], []
        i = int(np.searchsorted(self.bos, self.pos))
        while len(step) < self.batch_seqs:
            pieces, need, j = [], seq_len + 1, i
            while need:
                if j >= len(self.bos):
                    return None
                start, k = int(self.bos[j]), int(np.searchsorted(long_docs, j))
                cut = int(long_docs[k]) if k < len(long_docs) else len(self.bos)  # the next document to cut
                end = int(self.bos[cut]) + max_doc_len if cut < len(self.bos) else len(self.tokens)
                take = min(end - start, need)
                pieces.append((start, start + take))
                need, j = need - take, cut + 1
            i = int(np.searchsorted(self.bos, pieces[-1][1] - 1, side="right"))
            step.append(pieces)
        self.pos = int(self.bos[i]) if i < len(self.bos) else len(self.tokens)
        return step

    def next_step(self) -> list[Pieces]:
        """This step's global_batch_seqs sequences, in global order, as pieces of self.tokens."""
        shape = self.step_shape(self.steps_served)
        while (step := self._take(*shape)) is None:
            self._load_next_shard()
        self.steps_served += 1
        self.positions[self.steps_served] = (self.next_file, self.pos)
        self.positions.pop(self.steps_served - POSITIONS_KEPT, None)
        return step

    def seek(self, steps: int, position: tuple[int, int]) -> None:
        """Continue after `steps` steps from position(steps) of the run that consumed them, whatever its shapes."""
        next_file, pos = position
        self.steps_served, self.next_file = steps, max(next_file - 1, 0)
        if next_file:
            self._load_next_shard()
        self.pos, self.positions = pos, {steps: (next_file, pos)}

    def position(self, steps: int) -> tuple[int, int]:
        return self.positions[steps]

    def most_documents(self, step: list[Pieces]) -> int:
        """The most documents (BOS tokens) among the inputs (all but the last token) of one of a step's sequences."""
        def documents(pieces: Pieces) -> int:
            starts, ends = [s for s, _ in pieces], [e for _, e in pieces[:-1]] + [pieces[-1][1] - 1]
            return int(np.searchsorted(self.bos, ends).sum() - np.searchsorted(self.bos, starts).sum())
        return max(map(documents, step))

class TrainBatches:
    """This rank's rows of each training step: global sequences r, r + W, ... in order, each cut into `split` pieces of
    seq_len / split inputs (a piece's last input is the next one's first target): a row, a micro-step, each."""

    def __init__(self, stream: TrainTokenStream, rank: int, world_size: int, steps: int | None = None, split: int = 1):
        self.stream, self.rank, self.world_size, self.split = stream, rank, world_size, split
        self.shape = (stream.batch_seqs // world_size * split, stream.seq_len // split + 1)  # the longest step's
        # None: until the data runs out; a run asks for exactly what it trains on
        self.steps = itertools.count() if steps is None else iter(range(steps))

    def fill(self, buffer: np.ndarray) -> tuple[int, int] | None:
        """Write the next step's rows into the front of a flat buffer; their shape (rows, seq_len + 1), or None."""
        if next(self.steps, None) is None:
            return None
        step = self.stream.next_step()[self.rank::self.world_size]
        piece = (sum(end - start for start, end in step[0]) - 1) // self.split  # seq_len / split of this step's
        out = buffer[: len(step) * self.split * (piece + 1)].reshape(len(step) * self.split, piece + 1)
        for m, pieces in enumerate(step):  # piece j: tokens j piece .. (j + 1) piece, the last one shared with j + 1
            sequence = np.concatenate([self.stream.tokens[start:end] for start, end in pieces])
            out[m * self.split: (m + 1) * self.split] = np.lib.stride_tricks.sliding_window_view(
                sequence, piece + 1)[::piece]
        return out.shape

    def close(self) -> None:
        self.stream.close()

class ValTokens:
    """The first val_tokens tokens (+1 target) of the val shards, cut into contiguous chunks, not BOS-aligned."""

    def __init__(self, files: list[Path], val_tokens: int, vocab_size: int):
        need, parts, have = val_tokens + 1, [], 0
        for path in files:
            parts.append(load_shard(path, vocab_size)[: need - have])
            have += len(parts[-1])
            if have >= need:
                break
        if have < need:
            raise UsageError(f"validation needs {need} tokens but the val files hold {have}; lower --val_tokens")
        self.tokens = np.concatenate(parts)

    def most_documents(self, seq_len: int) -> int:
        """The most documents in one validation sequence of seq_len inputs: its BOSes, +1 if it starts mid-document."""
        chunks = self.tokens[: (len(self.tokens) - 1) // seq_len * seq_len].reshape(-1, seq_len)
        return int(((chunks == BOS_ID).sum(1) + (chunks[:, 0] != BOS_ID)).max())

class ValBatches:
    """This rank's validation chunks (rank, rank + W, ...), one (1, seq_len + 1) row per batch."""

    def __init__(self, val: ValTokens, seq_len: int, rank: int, world_size: int):
        self.val, self.seq_len, self.shape = val, seq_len, (1, seq_len + 1)
        self.chunks = iter(range(rank, (len(val.tokens) - 1) // seq_len, world_size))

    def fill(self, buffer: np.ndarray) -> tuple[int, int] | None:
        if (c := next(self.chunks, None)) is None:
            return None
        buffer[:] = self.val.tokens[c * self.seq_len: (c + 1) * self.seq_len + 1]
        return self.shape

    def close(self) -> None:
        pass

def count_documents(cfg: Config, files: list[Path], steps: int, step_shape: Callable[[int], tuple[int, int]]
                    ) -> tuple[int, dict[tuple[int, int], int]]:
    """How many of `steps` steps the files supply, served as a loader would; the most documents per sequence shape."""
    stream = TrainTokenStream(files, cfg.train_seq_len, cfg.global_batch_seqs, cfg.vocab_size, step_shape,
                              cfg.train_epochs)
    most: dict[tuple[int, int], int] = {}
    for k in range(steps):
        try:
            step = stream.next_step()
        except DataExhausted:
            break
        most[step_shape(k)] = max(most.get(step_shape(k), 0), stream.most_documents(step))
    return stream.steps_served, most

def bind_thread_to_device(device: torch.device) -> None:
    """First call of a thread making CUDA calls: a new thread's current device is GPU 0, which would get contexts."""
    if device.type == "cuda":
        torch.cuda.set_device(device)

Filled = tuple[int, tuple[int, int], object]  # a filled host buffer: its index, the batch's shape, the batch's digest

class PrefetchLoader(Iterator[Tensor], contextlib.AbstractContextManager):
    """Batches from a TrainBatches or ValBatches, filled by a thread (depth=0: the caller) into a ring of `depth` pinned
    buffers; batch N+1's copy runs on a copy stream while N computes. digest: what the host needs of a batch."""

    def __init__(self, source: TrainBatches | ValBatches, depth: int, device: torch.device,
                 digest: Callable[[np.ndarray], object] | None = None):
        self.source, self.depth, self.device, self.make_digest = source, depth, device, digest
        cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        # Flat, for the longest batch; filled through numpy only: a thread's torch op can crash a stopping profiler
        self.buffers = [torch.empty(math.prod(source.shape), dtype=torch.int32, pin_memory=cuda)
                        for _ in range(max(depth, 1))]
        self.arrays = [b.numpy() for b in self.buffers]
        self.digest: object = None
        self.copied = [torch.cuda.Event() if cuda else None for _ in self.buffers]
        # The next batch, in flight (copy, its event, its digest); or the error preparing it, raised when asked for
        self.pending: tuple[Tensor, torch.cuda.Event | None, object] | Exception | None = None
        self.done = False
        if depth:
            self.free: queue.Queue[int] = queue.Queue()
            self.ready: queue.Queue[Filled | BaseException | None] = queue.Queue()
            for i in range(depth):
                self.free.put(i)
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self._produce, name="prefetch", daemon=True)
            self.thread.start()

    def _fill(self, i: int) -> Filled | None:
        if self.copied[i] is not None:
            self.copied[i].synchronize()  # the previous copy out of this buffer has finished
        if (shape := self.source.fill(self.arrays[i])) is None:
            return None
        batch = self.arrays[i][: math.prod(shape)].reshape(shape)
        return i, shape, None if self.make_digest is None else self.make_digest(batch)

    def _produce(self) -> None:
        try:
            bind_thread_to_device(self.device)
            while not self.stop.is_set():
                try:
                    i = self.free.get(timeout=0.1)
                except queue.Empty:
                    continue
                self.ready.put(filled := self._fill(i))
                if filled is None:
                    return
        except BaseException as e:  # handed to the main thread, which re-raises it
            self.ready.put(e)

    def _start_copy(self) -> tuple[Tensor, torch.cuda.Event | None, object] | None:
        """Issue the copy of the next host batch (the thread's, or its error raised); never on the compute stream."""
        filled = None if self.depth else self._fill(0)
        while self.depth:
            try:
                filled = self.ready.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.thread.is_alive():
                    raise RuntimeError("prefetch thread stopped without a batch or an error") from None
        if isinstance(filled, BaseException):
            raise filled
        if filled is None:
            self.done = True
            return None
        i, shape, digest = filled
        host = self.buffers[i][: math.prod(shape)].view(shape)
        if self.copy_stream is None:
            batch, event = host.clone(), None
        else:
            with torch.cuda.stream(self.copy_stream):
                batch = host.to(self.device, non_blocking=True)
                event = self.copied[i]
                event.record(self.copy_stream)
        if self.depth:
            self.free.put(i)
        return batch, event, digest

    def __next__(self) -> Tensor:
        """The next (rows, seq_len + 1) int32 device batch, safe to read on the current stream."""
        current = self.pending if self.pending is not None or self.done else self._start_copy()
        if isinstance(current, Exception):
            raise current
        if current is None:
            raise StopIteration
        batch, event, self.digest = current
        if event is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(event)
            batch.record_stream(compute)
        self.pending = None
        if self.depth:  # batch N+1's copy runs while batch N computes
            try:
                self.pending = self._start_copy()
            except Exception as e:
                self.pending = e
        return batch

    def close(self) -> None:
        if self.depth and self.thread.is_alive():
            self.stop.set()
            self.thread.join()
        self.source.close()

    def __exit__(self, *exc: object) -> None:
        self.close()

# -----------------------------------------------------------------------------
# Command line
# --field=value parsing, --help from the Config's own comments, and validate_config, which refuses in one line any
# value the run cannot use.

BENCH_SETTLE_STEPS = 2  # --bench: untimed steps between the warmup and the timed ones
AUTO = "auto"  # the text of a `bool | None` field: None, left to the device
BOOL_WORDS = ("1", "true", "yes", "on", "0", "false", "no", "off", AUTO)  # what may follow a bare bool flag
# Each flag's type: a Config field's (int, float, str, bool, bool | None), or a column of the stage table's.
FIELD_KINDS: dict[str, str] = {f.name: f.type for f in dataclasses.fields(Config) if f.name != "stages"}
STAGE_FLAGS: dict[str, str] = {f"stage_{f.name}": f.type for f in dataclasses.fields(Stage)}

def _parse_value(name: str, kind: str, text: str) -> object:
    if kind not in ("bool", "bool | None"):
        try:
            return {"int": int, "float": float, "str": str}[kind](text)
        except ValueError:
            raise UsageError(f"--{name} expects {kind}, got {text!r}") from None
    low = text.lower()
    if low not in BOOL_WORDS[:8] + ("",) and (kind == "bool" or low != AUTO):
        raise UsageError(f"--{name} expects true or false{'' if kind == 'bool' else ' or auto'}, got {text!r}")
    return None if low == AUTO else low in ("1", "true", "yes", "on", "")

def read_options(argv: list[str], kinds: dict[str, str] | None = None) -> dict[str, str]:
    """{field: text}, read as argparse reads them: --field=value, --field value, a bool field alone (true); kinds: the
    fields and their types (default: Config's and the stage columns'; train_optim.py passes its own)."""
    kinds, options, args = kinds or FIELD_KINDS | STAGE_FLAGS, {}, list(argv)
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            raise UsageError(f"unexpected argument {arg!r}: options look like --field=value (see --help)")
        name, eq, text = arg[2:].partition("=")
        if name not in kinds:  # the closest spelling, else the fields ending in it (--lr: the lrs) or sharing a word
            near = (difflib.get_close_matches(name, kinds, n=1) or [k for k in kinds if k.endswith(f"_{name}")][:6]
                    or [k for k in kinds if set(name.split("_")) & set(k.split("_"))][:6])
            hint = f"; did you mean --{' or --'.join(near)}?" if near else ""
            raise UsageError(f"unknown option --{name}{hint} (see --help)")
        flag = kinds[name] in ("bool", "bool | None")
        if not eq and args and not args[0].startswith("--") and (not flag or args[0].lower() in BOOL_WORDS):
            text = args.pop(0)
        elif not eq and not flag:
            raise UsageError(f"--{name} needs a value: --{name}=VALUE")
        elif not eq:
            text = "true"
        if name in options:
            raise UsageError(f"--{name} is given twice ({options[name]!r} and {text!r}): give it once")
        options[name] = text
    return options

def parse_config(argv: list[str]) -> Config:
    """Defaults, then the presets' fields, then explicit --field=value overrides (a stage column: the table's)."""
    options = read_options(argv)
    columns = {name.removeprefix("stage_"): options.pop(name) for name in STAGE_FLAGS if name in options}
    overrides = {name: _parse_value(name, FIELD_KINDS[name], text) for name, text in options.items()}
    fields: dict[str, object] = {}
    for preset in filter(None, str(overrides.get("preset", "")).split(",")):  # in order: later ones win
        if preset not in PRESETS:
            raise UsageError(f"unknown preset {preset!r}; choose from: {', '.join(PRESETS)} (several: --preset=A,B)")
        fields.update(PRESETS[preset])
    cfg = Config(**{**fields, **overrides})
    cfg.stages = with_columns(cfg.stages, columns)
    return cfg

def field_comments(cls: type) -> list[tuple[str, list[list[str]]]]:
    """A dataclass's fields in its '# group' groups, each with its comment (continued on lines indented past '#')."""
    groups: list[tuple[str, list[list[str]]]] = [("", [])]
    names = {f.name for f in dataclasses.fields(cls)}
    for line in inspect.getsource(cls).splitlines():
        code, _, comment = line.strip().partition("  # ")
        if code.startswith("#  "):
            groups[-1][1][-1][1] += f" {code[1:].strip()}"
        elif code.startswith("# "):
            groups.append((code[2:], []))
        elif code.split(":")[0] in names:
            groups[-1][1].append([code.split(":")[0], comment])
    return [group for group in groups if group[1]]

def help_entry(flag: str, comment: str, rule: str) -> str:
    """A flag, its comment from column 44 wrapped at 120, and its rule whole, on the last line or one of its own."""
    body = textwrap.wrap(comment, width=120, initial_indent=" " * 44, subsequent_indent=" " * 44,
                         break_on_hyphens=False)
    if rule:
        body[-1:] = [f"{body[-1]}; {rule}"] if len(body[-1]) + len(rule) < 118 else [f"{body[-1]};", f"{'':<44}{rule}"]
    return (f"{flag:<44}" if len(flag) < 44 else f"{flag}\n{'':<44}") + "\n".join(body)[44:]

def stage_table_lines(stages: tuple[Stage, ...], indent: str) -> list[str]:
    """The stage table as a table: a row per stage, the extension last, a column per --stage_<column> flag."""
    names = [f.name for f in dataclasses.fields(Stage)]
    cells = [["", *names], *([f"stage {k + 1}" if k < len(stages) - 1 else "extension",
                              *(entry_text(getattr(s, n)) for n in names)] for k, s in enumerate(stages))]
    widths = [max(len(row[i]) for row in cells) for i in range(len(names) + 1)]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]

def config_json(cfg: Config) -> dict[str, Any]:
    """The config as a log and a checkpoint hold it: JSON (the stage table a list of rows, each a dict of lists)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))

def config_help() -> str:
    """--help from Config's source: its group comments and each field's comment; the stage table as a table."""
    lines = ["usage: train_gpt.py [--field=value | --field value ...]     (on N GPUs: torchrun --standalone "
             "--nproc_per_node=N train_gpt.py ..., or ./run.sh ...)",
             "Every field of the Config dataclass, with its default and the range a number must be in (each given at "
             "most once; a bool field alone is true):"]
    defaults = {f.name: AUTO if f.default is None else f.default for f in dataclasses.fields(Config)}
    for group, fields in field_comments(Config):
        lines.append(f"\n{group}:")
        for name, comment in fields:
            if name != "stages":
                lines.append(help_entry(f"  --{name}={defaults[name]}", comment,
                                        f"must be {FIELD_RULES[name]}" if name in FIELD_RULES else ""))
                continue
            lines += ["  the stage table: a row per stage (equal shares of the scheduled steps), the extension last; "
                      "each weight", "  goes from its start to its end value across its row's steps. A flag per "
                      "column lists an entry per row:", *stage_table_lines(RECIPE_STAGES, "    ")]
            lines += [help_entry(f"  --stage_{column}={column_text(RECIPE_STAGES, column)}", text,
                                 f"each: {STAGE_COLUMNS[column][0]}, {STAGE_COLUMNS[column][2]}")
                      for column, text in field_comments(Stage)[0][1]]
    lines.append("\npresets (--preset=NAME sets these fields, explicit flags win):")
    for name, fields in PRESETS.items():
        lines.append(textwrap.fill(", ".join(f"--{k}={AUTO if v is None else v}" for k, v in fields.items()
                                             if k != "stages"),
                                   width=116, initial_indent=f"  {name}: ", subsequent_indent="    "))
        if "stages" in fields:
            lines += ["    and the stage table:", *stage_table_lines(fields["stages"], "      ")]
    return "\n".join(lines)

def profile_steps(spec: str, num_steps: int) -> range:
    """--profile=START:END as the training steps it traces, range(START, END); UsageError when malformed."""
    start, _, end = spec.partition(":")
    try:
        a, b = int(start), int(end)
    except ValueError:
        raise UsageError(f"--profile expects START:END (0-based training steps, e.g. --profile=10:15), "
                         f"got {spec!r}") from None
    if not 0 <= a < b:  # (no ':' fails int() above)
        raise UsageError(f"--profile={spec}: needs 0 <= START < END (it traces steps START..END-1)")
    if b > num_steps:
        raise UsageError(f"--profile={spec}: END is beyond --num_steps={num_steps}")
    return range(a, b)

# The stage table on the command line: a flag per column, --stage_<column>=A,B,..., an entry per row (the stages, then
# the extension), an entry a number or numbers joined by '/'. A column given replaces the preset's (or the recipe's);
# a table of another number of rows needs every column. Column -> (what an entry is, how many numbers, each one's
# range as FIELD_RULES states it). lr: the records' 1 to 1.73; a window: at most 2**20 blocks, beyond any sequence.
STAGE_COLUMNS: dict[str, tuple[str, range, str]] = {
    **dict.fromkeys(("seq_len", "doc_len"), ("tokens", range(1, 2), "> 0")),
    "windows": ("SHORT/LONG blocks", range(2, 3), "in [0, 1048576]"),
    "lr_mul": ("a multiplier", range(1, 2), "in (0, 100]"),
    **dict.fromkeys(("mtp_start", "mtp_end"), ("1-64 weights W/W/...", range(1, 65), "in [0, 100]")),
    **dict.fromkeys(("prefix_start", "prefix_end"), ("a weight", range(1, 2), "in [0, 100]")),
}

def entry_text(value: object) -> str:
    """A column's entry as the command line writes it: 16384, 1/3, 0.25, 1/0.5/0."""
    return "/".join(repr(x).removesuffix(".0") for x in (value if isinstance(value, tuple) else (value,)))

def column_text(stages: tuple[Stage, ...], column: str) -> str:
    return ",".join(entry_text(getattr(s, column)) for s in stages)

def parse_entries(text: str, column: str) -> list | None:
    """A column's text as a value per row (a number, or a tuple: windows, weights); None where an entry is malformed."""
    kind, counts = STAGE_FLAGS[f"stage_{column}"], STAGE_COLUMNS[column][1]
    try:
        entries = [tuple((int if "int" in kind else float)(x) for x in entry.split("/")) for entry in text.split(",")]
    except ValueError:
        return None
    return None if any(len(e) not in counts for e in entries) else [e if "tuple" in kind else e[0] for e in entries]

def with_columns(stages: tuple[Stage, ...], columns: dict[str, str]) -> tuple[Stage, ...]:
    """The stage table with each given column (its flag's text) in place of the one it had."""
    given = {c: parse_entries(text, c) for c, text in columns.items()}
    if bad := next((c for c, values in given.items() if values is None), None):
        raise UsageError(f"--stage_{bad} expects {STAGE_COLUMNS[bad][0]} per row of the stage table, comma-separated "
                         f"(e.g. {column_text(RECIPE_STAGES, bad)}), got {columns[bad]!r}")
    rows = {len(values) for values in given.values()} | ({len(stages)} if len(given) < len(STAGE_COLUMNS) else set())
    if len(rows) > 1:
        said = ", ".join(f"--stage_{c}={columns[c]} lists {len(v)}" for c, v in given.items())
        raise UsageError(f"the stage table's columns must each list an entry per row (the stages, then the extension): "
                         f"{said}" + (f", the table has {len(stages)} rows; give every column to change the number of "
                                      f"stages" if len(given) < len(STAGE_COLUMNS) else ""))
    return tuple(Stage(**{**(dataclasses.asdict(stages[k]) if k < len(stages) else {}),
                          **{c: values[k] for c, values in given.items()}}) for k in range(min(rows, default=0)))

def entry_problem(column: str, value: object) -> str | None:
    """Why a value cannot be an entry of a column of the stage table (windows: also --final_val_windows'), or None."""
    what, counts, rule = STAGE_COLUMNS[column]
    entry = value if isinstance(value, tuple) else (value,)
    if len(entry) not in counts or not all(rule_holds(rule, x) for x in entry):
        return f"an entry is {what}{', each' if len(counts) > 1 or counts.start > 1 else ''} {rule}"
    if column == "windows" and entry[0] > entry[1]:
        return "the short window exceeds the long one (SHORT/LONG, in blocks)"
    if column == "windows" and entry[1] < 1:  # YaRN divides by it; a short window of 0 is the tiny preset's first
        return "a long window must be at least 1 block (0 would leave each token of the long layers only itself)"
    if column.startswith("mtp") and entry[0] == 0:
        return "its first weight (the next token's) must be above 0: without it the stage trains on nothing"
    return None

def final_val_windows(cfg: Config) -> tuple[int, int]:
    """--final_val_windows as (short, long) blocks; UsageError unless one pair the stage table's windows could be."""
    pairs = parse_entries(cfg.final_val_windows, "windows")
    if pairs is None or len(pairs) != 1:
        raise UsageError(f"--final_val_windows expects one SHORT/LONG pair of blocks (e.g. 6/20), got "
                         f"{cfg.final_val_windows!r}")
    if why := entry_problem("windows", pairs[0]):
        raise UsageError(f"--final_val_windows={cfg.final_val_windows}: {why}")
    return pairs[0]

def check_stages(cfg: Config) -> None:
    """Refuse a stage table the schedule cannot run, naming the column's flag with what it holds, and the row."""
    if len(cfg.stages) < 2:
        raise UsageError(f"the stage table needs a stage and the extension (its last row), got {len(cfg.stages)} "
                         f"row: {' '.join(f'--stage_{c}={column_text(cfg.stages, c)}' for c in STAGE_COLUMNS)}")
    for column in STAGE_COLUMNS:
        for k, stage in enumerate(cfg.stages, 1):
            value = getattr(stage, column)
            why = entry_problem(column, value) or (
                f"as many weights as --stage_mtp_start's ({len(stage.mtp_start)})"
                if column == "mtp_end" and len(value) != len(stage.mtp_start) else
                f"at most --train_seq_len={cfg.train_seq_len} (the longest), in --micro_split={cfg.micro_split} "
                f"pieces of a multiple of --block_size={cfg.block_size}" if column == "seq_len" and (
                    value > cfg.train_seq_len or value % (cfg.micro_split * cfg.block_size)) else None)
            if why:
                raise UsageError(f"--stage_{column}={column_text(cfg.stages, column)}: row {k} holds "
                                 f"{entry_text(value)}: {why}")

def paired_layers(cfg: Config) -> set[int]:
    return layer_list(cfg, "paired_layers")

def layer_list(cfg: Config, name: str) -> set[int]:
    """A layer list as a set; UsageError unless each has attention (XSA: unpaired, where v lines up with the output)."""
    spec = getattr(cfg, name)
    try:
        layers = {int(i) for i in spec.split(",")} if spec else set()
    except ValueError:
        layers = {-1}
    if name == "paired_layers" and (any(not 0 <= i < cfg.num_layers or cfg.attn_pattern[i] != "S" for i in layers)
                                    or layers and cfg.num_heads % 2):
        raise UsageError(f"--paired_layers={spec!r} must list short-window (S) layers of --attn_pattern="
                         f"{cfg.attn_pattern}, with an even --num_heads={cfg.num_heads}")
    if any(not 0 <= i < cfg.num_layers or cfg.attn_pattern[i] == "-" or name == "xsa_layers" and
           i in paired_layers(cfg) for i in layers):
        raise UsageError(f"--{name}={spec!r} must list layers with attention in --attn_pattern={cfg.attn_pattern}"
                         f"{', not paired ones' if name == 'xsa_layers' else ''}, e.g. 1,3")
    return layers

def skip_layers(cfg: Config) -> tuple[int, int]:
    """--skip=A:B as (A, B): block A's output joins block B's input. UsageError when malformed."""
    try:
        a, b = (int(x) for x in cfg.skip.split(":"))
    except ValueError:
        a = b = -1
    if not 0 <= a < b < cfg.num_layers:
        raise UsageError(f"--skip expects A:B with 0 <= A < B < num_layers={cfg.num_layers} (block A's "
                         f"output into block B's input, e.g. 3:6), got {cfg.skip!r}")
    return a, b

def bench_length(cfg: Config) -> int:
    """The steps a --bench run trains: settle, timed, one profiler warmup, traced."""
    return BENCH_SETTLE_STEPS + 2 * cfg.bench_steps + 1

def run_length(cfg: Config) -> int:
    return bench_length(cfg) if cfg.bench else cfg.num_steps

# Every numeric field's range (and a finite value): a NaN, a negative lr or a beta of 1.5 is one line at start-up,
# not a run. Float upper bounds lie far above any recipe's (lrs <= 0.6, weight decay multipliers 150) and keep each
# update's scalars finite in fp32; --num_steps, --train_epochs and --warmup_steps bound the start-up work (the step
# table, the shard list, the warmup's plan) before the corpus is read.
FIELD_RULES: dict[str, str] = {name: rule for rule, names in {
    "> 0": "train_seq_len global_batch_seqs val_seq_len val_tokens vocab_size num_layers model_dim num_heads head_dim "
           "mlp_ratio block_size log_every bench_steps adam_every gate_channels untie_stage bigram_sign_rows mudd_dim "
           "attn_input_layer micro_split",
    "in [1, 100000]": "num_steps", "in [1, 10000]": "train_epochs",
    ">= 0": "prefetch_depth muon_momentum_warmup_steps val_every save_every extension_steps "
            "muon_momentum_cooldown_steps fp8_down_exact_steps",
    "in [0, 10000]": "warmup_steps",
    "in [-1, 4294967295]": "seed",  # 32 bits: torch's generator overflows past 64
    "in (0, 10]": "muon_lr embed_lr head_lr scalar_lr gate_lr mudd_gate_lr smear_gate_lr lambda_lr mudd_lr",
    "in (0, 100]": "mlp_down_lr_mul attn_scale fp8_x_scale fp8_w_scale fp8_grad_scale grad_scale fp8_down_w_headroom "
                   "fp8_down_act_headroom",
    "in (0, 1000]": "logit_cap logit_temp", "in [-1000, 1000]": "logit_shift",
    "in [0, 1000]": "muon_wd adam_wd embed_wd_mul head_wd_mul value_embed_wd_mul", "in (0, 1]": "adam_eps",
    "in [0, 1]": "cooldown_frac final_lr_frac",
    "in [0, 1)": "muon_momentum_start muon_momentum_end adam_beta1 adam_beta2 scalar_beta1 scalar_beta2 head_beta1",
    "in (0, 1)": "normuon_beta2", "in (0, 100000]": "bucket_mb", "in [0, 100000]": "peak_tflops save_minutes",
}.items() for name in names.split()}

def rule_holds(rule: str, value: float) -> bool:
    """Whether a finite value meets a FIELD_RULES entry: "> B", ">= B" or an interval such as "in (0, 10]"."""
    if rule.startswith("in "):
        low, high = (float(x) for x in rule[4:-1].split(", "))
        return math.isfinite(value) and (low < value if rule[3] == "(" else low <= value) and (
            value < high if rule[-1] == ")" else value <= high)
    op, bound = rule.split()
    return math.isfinite(value) and (value > float(bound) if op == ">" else value >= float(bound))

# A run id names files inside --log_dir: a '/' or '..' would put them elsewhere, whitespace or a newline split names.
RUN_ID_MAX = 200  # with ".failed.jsonl" added, within the 255-byte file names of common file systems

def validate_config(cfg: Config, world_size: int) -> int:
    """Check the config alone (no files, no devices); returns the gradient accumulation steps."""
    for name, rule in FIELD_RULES.items():
        if not rule_holds(rule, getattr(cfg, name)):
            raise UsageError(f"--{name} must be {rule}, got {getattr(cfg, name)}")
    if len(cfg.attn_pattern) != cfg.num_layers or set(cfg.attn_pattern) - set("LS-"):
        raise UsageError(f"--attn_pattern={cfg.attn_pattern!r} needs one of L, S, - per layer "
                         f"({cfg.num_layers} layers)")
    check_stages(cfg)
    final_val_windows(cfg)
    if cfg.profile:
        profile_steps(cfg.profile, cfg.num_steps)
    tables, stages = sorted(set(cfg.value_embeds) - {"-"}), len(cfg.stages) - 1
    refusals = [  # (a problem, its line), in order
        (cfg.run_id in (".", "..") or len(cfg.run_id) > RUN_ID_MAX or any(  # "" (the default): a fresh one
            c in "/\\" or c.isspace() or not c.isprintable() for c in cfg.run_id),
         f"--run_id={cfg.run_id!r} names the run's files inside --log_dir: no '/' or '\\', no whitespace or control "
         f"characters, not '.' or '..', at most {RUN_ID_MAX} characters"),
        (not cfg.log_dir.strip(), "--log_dir is empty: give the folder for the run's logs (e.g. --log_dir=logs; "
         "--log_dir=. for this one)"),
        *((not getattr(cfg, n).strip(), f"--{n} is empty: give a glob of token shards, e.g. --{n}="
           f"'{PRESETS['tiny'][n]}'") for n in ("train_files", "val_files")),
        (cfg.global_batch_seqs % world_size, f"--global_batch_seqs={cfg.global_batch_seqs} is not divisible by the "
         f"world size {world_size}; launch with --nproc_per_node dividing it (1, 2, 4 or 8 for the recipe)"),
        (len(cfg.value_embeds) != cfg.num_layers or tables != [str(i) for i in range(len(tables))],
         f"--value_embeds={cfg.value_embeds!r} needs one character per layer ({cfg.num_layers}): the table it adds "
         f"(tables 0, 1, ... each used) or - for none, e.g. 012------012"),
        (not cfg.attn_input_layer < cfg.num_layers - 1 or cfg.attn_input_layer == skip_layers(cfg)[0],
         f"--attn_input_layer={cfg.attn_input_layer} must be a layer other than the skip's source, before the last "
         f"({cfg.num_layers - 1}): the MUDD mixes read it"),
        (cfg.attn_pattern[-1] == "-" or cfg.attn_pattern[0] == "-" or "0" not in cfg.value_embeds,
         "the first and last layers need attention (the bigram's first gate; MUDD's first block mixes the last's "
         "values, DC attends) and --value_embeds a table 0 (the last mix reads it)"),
        (cfg.attn_pattern[skip_layers(cfg)[1]] != "-",
         f"--skip={cfg.skip}: the skip lands in place of an attention, on a '-' layer of --attn_pattern"),
        (cfg.bigram_rows < 2, f"--bigram_rows={cfg.bigram_rows}: the table needs at least 2 rows (one is reserved for "
         f"position 0)"),
        (cfg.gate_channels % 2, f"the VE gates read half of --gate_channels={cfg.gate_channels} from x, half from the "
         f"VE: make it even"),
        (cfg.head_dim % 4, f"--head_dim={cfg.head_dim} must be a multiple of 4 (half-truncated RoPE)"),
        (cfg.gate_channels > cfg.model_dim, f"--gate_channels={cfg.gate_channels} exceeds --model_dim={cfg.model_dim}"),
        (cfg.num_heads * cfg.head_dim != cfg.model_dim, f"--num_heads={cfg.num_heads} x --head_dim={cfg.head_dim} "
         f"must equal --model_dim={cfg.model_dim} (value embeddings and skips add model_dim vectors to the values)"),
        # save_every: between Adam steps its summed gradients are pending, a checkpoint could not resume exactly.
        *((getattr(cfg, n) % getattr(cfg, m), f"--{n}={getattr(cfg, n)} must be a multiple of --{m}={getattr(cfg, m)}")
          for n, m in (("train_seq_len", "block_size"), ("val_seq_len", "block_size"), ("val_tokens", "val_seq_len"),
                       ("save_every", "adam_every"))),
        *((getattr(cfg, n) not in choices, f"--{n} must be {', '.join(choices)}, got {getattr(cfg, n)!r}")
          for n, choices in (("attention", ("auto", "fa3", "flex")), ("cpu_bf16_gemm", ("auto", "native", "fp32")))),
        (cfg.extension_steps >= cfg.num_steps, f"--extension_steps={cfg.extension_steps} must be below --num_steps="
         f"{cfg.num_steps} (the extension is the end of the run)"),
        (stages > cfg.num_steps - cfg.extension_steps, f"{stages} stages need at least as many scheduled steps, got "
         f"--num_steps={cfg.num_steps} with --extension_steps={cfg.extension_steps}: a stage would get no step; raise "
         f"--num_steps or list fewer stages"),
        (cfg.untie_stage > stages, f"--untie_stage={cfg.untie_stage}: the stages are 1 to {stages} (the last: the "
         f"extension)"),
        (cfg.save_final and cfg.num_steps % cfg.adam_every,
         f"--save_final needs --num_steps={cfg.num_steps} to be a multiple of --adam_every={cfg.adam_every}"),
        (cfg.device not in ("auto", "cuda", "cpu"), f"--device must be auto, cuda or cpu, got {cfg.device!r}"),
        (cfg.bench and cfg.profile, "--bench traces its own steps; leave out --profile"),
        (cfg.bench and bench_length(cfg) > cfg.num_steps, f"--bench with --bench_steps={cfg.bench_steps} runs "
         f"{bench_length(cfg)} steps but --num_steps is {cfg.num_steps}; lower --bench_steps or raise --num_steps"),
        (cfg.resume == AUTO and not cfg.run_id, "--resume=auto carries on the run named by --run_id: give one (the "
         "same in every launch of the run)"),
        (cfg.bench and (cfg.save_every or cfg.save_final or cfg.resume),
         "--bench neither saves nor resumes checkpoints; drop --save_every/--save_final/--resume"),
    ]
    for problem, line in refusals:
        if problem:
            raise UsageError(line)
    paired, _, _ = paired_layers(cfg), layer_list(cfg, "xsa_layers"), layer_list(cfg, "attn_gate_layers")
    if cfg.num_layers - 1 in paired:  # (skip_layers ran above, in the refusals' list)
        raise UsageError(f"--paired_layers={cfg.paired_layers}: the last layer runs DC attention over its own heads: "
                         f"leave it unpaired")
    return cfg.global_batch_seqs // world_size

# -----------------------------------------------------------------------------
# Devices
# What the device decides, settled before anything is built: on a GPU, the kernels and FP8 paths its kind runs (auto
# resolved, what cannot run refused); on a CPU, the GEMM path and the record path (the bundled records' arithmetic).

@dataclass
class Runtime:
    """Where this process runs (set up in main()), and the attention path resolve_for_device took, for the log."""
    rank: int
    world_size: int
    device: torch.device
    attention: str = ""
    gpu: str = ""  # on CUDA: the GPU and each path resolve_for_device took there (gpu_report)

FLEX_BLOCK_MULTIPLE = 128  # FlexAttention's tiles on H100 (sm90) divide no smaller block, forward or backward
FP8_DIM_MULTIPLE = 16  # torch._scaled_mm needs every matrix dimension divisible by 16
def gpu_capability(cuda: bool) -> tuple[int, int] | None:
    """The GPU's compute capability; None on the CPU; with no GPU visible (tests' traces), the recipe's H100's: sm90."""
    return None if not cuda else tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else (9, 0)

KERNEL_FLAGS = (("fp8_head", None), ("fp8_mlp", None), ("relu2_kernel", "fp8_mlp"), ("fused_head", "fp8_head"),
                ("dc_kernel", None))  # (flag, its FP8 mode's), resolved in this order: the kernels read the FP8 paths

def gpu_report(cfg: Config) -> str:
    """The log's line on the GPU: its name, capability and memory, each path as resolved (or given), why one is off."""
    capability, props = gpu_capability(True), torch.cuda.get_device_properties() if torch.cuda.is_available() else None
    name, memory = (props.name, f", {props.total_memory / 2**30:.0f} GiB") if props else (
        "no GPU visible (resolved as the H100's)", "")
    items = []
    for flag, fp8 in (*KERNEL_FLAGS, ("polar_express", None)):
        on = getattr(cfg, flag) if flag != "polar_express" else polar_express_kernels(torch.device("cuda"))
        runs, why = gpu_runs(flag, capability, cfg, fp8)
        if not on and runs and "fp8" in flag and os.environ.get("DISABLE_FP8"):
            why = "DISABLE_FP8"
        items.append(f"{flag} {'on' if on else 'off'}" + ("" if on or not (why or runs) else
                                                          f" ({why or 'given false'})"))
    return (f"gpu: {name} (sm{capability[0]}{capability[1]}{memory}): {'; '.join(items)}; attention {cfg.attention} "
            f"(FA3 on sm90 only)")

def resolve_for_device(cfg: Config, cuda: bool, capability: tuple[int, int] | None = None) -> str:
    """Replace auto (None) by the device's choice and apply DISABLE_FP8, so the config (and its log) says what the run
    does; refuse what it cannot run. capability: another GPU's (memory_estimate --cards). Returns the attention path."""
    cfg.compile = cuda if cfg.compile is None else cfg.compile
    if cuda and cfg.cpu_bf16_gemm == "fp32":
        raise UsageError("--cpu_bf16_gemm=fp32 routes a CPU run's matmuls; a CUDA run uses the GPU's bf16 GEMMs: "
                         "drop it (or use --device=cpu)")
    cfg.cpu_bf16_gemm = bf16_gemm_path(cfg.cpu_bf16_gemm, cuda)
    capability = capability or gpu_capability(cuda)
    triton = importlib.util.find_spec("triton") is not None
    dims = {"model_dim": cfg.model_dim, "train_seq_len": cfg.train_seq_len, "vocab_size": cfg.vocab_size}
    bad_dims = [f"--{k}={v}" for k, v in dims.items() if v % FP8_DIM_MULTIPLE]
    for name, fp8 in KERNEL_FLAGS:
        runs, why = gpu_runs(name, capability, cfg, fp8)
        on, ops = getattr(cfg, name), name.startswith("fp8")  # ops: gpt_kernels' FP8 ops; the others: Triton kernels
        if on and runs is False:
            raise UsageError(f"--{name}=true: {why}; use --{name}=false (or auto)")
        if on is None:  # auto: where the GPU runs it cleanly (gpu_runs), the torch path elsewhere
            on = cuda and (ops or triton) and bool(runs)
        on = on and not (ops and os.environ.get("DISABLE_FP8"))
        setattr(cfg, name, on)
        if on and not ops and (not triton or not (cuda or os.environ.get("TRITON_INTERPRET") == "1")):
            raise UsageError(f"--{name} runs a Triton kernel: it needs triton installed and a CUDA device (or "
                             f"TRITON_INTERPRET=1 on the CPU, slow); or use --{name}=false")
        if on and ops and bad_dims:
            raise UsageError(f"the FP8 {'head' if name == 'fp8_head' else 'MLP'} needs --{', --'.join(dims)} divisible "
                             f"by {FP8_DIM_MULTIPLE} (torch._scaled_mm), got {', '.join(bad_dims)}; change it or use "
                             f"--{name}=false")
    # Last, as auto may load FA3 from the hub: fa3 where it loads (a Hopper GPU with the kernels package), else flex.
    kernel, why = load_fa3() if cfg.attention == "fa3" or cuda and cfg.attention == AUTO else (None, "")
    if cfg.attention == "fa3" and kernel is None:
        raise UsageError(f"--attention=fa3: {why}; use --attention=flex (or auto: FA3 where it loads)")
    cfg.attention = "fa3" if kernel is not None else "flex"
    attention = ("fa3 ({} version {}, varlen)".format(*gpt_kernels.FA3_HUB_KERNEL) if kernel is not None else
                 "flex (FlexAttention block masks)" + (f"; FA3 not taken: {why}" if why else "") if cuda else
                 "flex (on the CPU: SDPA with the same masks, dense; FlexAttention has no CPU backward)")
    if cuda and cfg.attention == "flex" and cfg.block_size % FLEX_BLOCK_MULTIPLE:
        raise UsageError(f"--block_size={cfg.block_size}: FlexAttention on CUDA needs a multiple of "
                         f"{FLEX_BLOCK_MULTIPLE} (no H100 tile divides a smaller block); use --block_size=128 "
                         f"(or FA3, --attention=fa3, on a Hopper GPU)")
    return attention

CPU_GEMM_PATHS = {"native": "native (oneDNN bf16 GEMM; the reference loop where the CPU has no bf16 instructions)",
                  "fp32": "fp32 (fp32 GEMM of the bf16 inputs, result rounded to bf16)"}

def bf16_gemm_path(choice: str, cuda: bool) -> str:
    """--cpu_bf16_gemm resolved: native or fp32 (auto: fp32 where the CPU has no native bf16 GEMM)."""
    native = cuda or choice == "native" or choice == AUTO and native_bf16_gemm()
    return "native" if native else "fp32"

def cpu_math(gemm_path: str, compiled: bool = False) -> contextlib.AbstractContextManager:
    """The context a CPU run's work goes in: the record path's RecordMath, else Fp32Gemms on the fp32 GEMM path."""
    if cpu_path(gemm_path, compiled) == "record":
        return gpt_kernels.RecordMath()
    return gpt_kernels.Fp32Gemms() if gemm_path == "fp32" else contextlib.nullcontext()

def cpu_report() -> str:
    """The CPU's model, threads and the vector ISA torch's kernels use: what a CPU run's speed and bits depend on."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), model)
    return (f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, vector ISA "
            f"{torch.backends.cpu.get_cpu_capability()}, native bf16 GEMM {'yes' if native_bf16_gemm() else 'no'}")

# The bundled CPU records' arithmetic, the "record" path (gpt_kernels.RecordMath): torch's kernels at AVX2, no MKL
# or oneDNN function, GEMMs by numpy's OpenBLAS at its Haswell kernels on one thread (its result on one thread differs from its
# result on several); the same bits on every x86-64 CPU with AVX2, whoever made it, at the same torch, numpy, torch
# threads and world size. torch and numpy read these variables as they load: run.sh sets them (not CPU_PATH=native).
RECORD_PATH_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_NUM_THREADS": "1"}
CPU_PATHS = {"record": "record (torch's AVX2 kernels, no MKL or oneDNN: GEMMs by OpenBLAS's Haswell kernels, exp, log, tanh "
                       "in float64; the bundled CPU records' arithmetic, the same bits on any x86-64 CPU with AVX2)",
             "native": "native (this CPU's own kernels: faster with AVX-512 or bf16 GEMMs; the losses differ from "
                       "the record path's by rounding)"}

def cpu_path(gemm_path: str, compiled: bool = False) -> str:
    """record where this run computes the records' arithmetic (eager, fp32 GEMMs, the variables set), else native."""
    capped = all(os.environ.get(k, "").lower() == v.lower() for k, v in RECORD_PATH_ENV.items())
    avx2 = torch.backends.cpu.get_cpu_capability() == "AVX2"
    return "record" if capped and avx2 and gemm_path == "fp32" and not compiled else "native"

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

# -----------------------------------------------------------------------------
# Metrics
# Rank 0 writes logs/<run_id>.txt (source, environment, config, speedrun-grammar lines), a JSONL record per logged step
# and validation, and the run summary. Train metrics stay on the device: one collective per logging step, no host sync.

SEPARATOR = "=" * 100

def _rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))

def print0(*args: object, **kwargs: object) -> None:
    if _rank_and_world()[0] == 0:
        print(*args, **{"flush": True, **kwargs})

def environment_report(device: torch.device, cpu_bf16_gemm: str, compiled: bool = False) -> str:
    lines = [f"Running Python {sys.version.split()[0]} on {platform.platform()}",
             f"Running PyTorch {torch.__version__} compiled for CUDA {torch.version.cuda}",
             f"Running numpy {np.__version__}"]
    try:
        import triton
        lines.append(f"Running Triton version {triton.__version__}")
    except ImportError:
        lines.append("Triton not installed")
    if device.type == "cuda":
        lines += [f"GPUs: {', '.join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))}",
                  f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')}"]
    else:
        lines += [f"CPU run: {cpu_report()}", f"bf16 GEMM path: {CPU_GEMM_PATHS[cpu_bf16_gemm]}",
                  f"CPU path: {CPU_PATHS[cpu_path(cpu_bf16_gemm, compiled)]}"]
    if shutil.which("nvidia-smi"):
        lines.append(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout.rstrip())
    return "\n".join(lines)

SOURCE_MARK = "# source: {name} ({size} bytes)"  # a log's source block: this line, then exactly the file's bytes

def source_files(script: Path = Path(__file__)) -> list[Path]:
    """The project's files a run of script executes: script, then the modules beside it that it imports, theirs too
    (read from their import statements: the same files in any process); what a log holds and a checkpoint checks."""
    files = [script.resolve()]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if \
                isinstance(node, ast.ImportFrom) else []
            files += [f for m in modules if (f := HERE / f"{m.split('.')[0]}.py").exists() and f not in files]
    return files

def source_digests(files: list[Path]) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}

def recorded_event(timing: bool = True) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=timing)
    event.record()
    return event

class RunLog:
    """Console, text log and JSONL records on rank 0 (no files elsewhere). A value that is not finite is written as
    NaN or Infinity (Python's json reads it back); a failed write (a full disk) stops the run with one line. The text
    log is created exclusively and locked while the run lives: one launch per run id; with append (--resume=auto) an
    existing log is continued."""

    def __init__(self, path: Path | None, jsonl_path: Path | None = None, append: bool = False):
        self.paths = [p for p in (path, jsonl_path) if p is not None]
        self.records = 0  # JSONL entries written: none until the first validation or step
        self.file = self.jsonl = None
        if path is not None:
            self.file = self._io(path, lambda: self._claim(path, append))
            self.jsonl = self._io(jsonl_path, lambda: self._open(os.open(jsonl_path, os.O_RDWR | os.O_CREAT | (
                os.O_APPEND if append else os.O_TRUNC), 0o644)))

    @staticmethod
    def _claim(path: Path, append: bool) -> IO:
        try:
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | (0 if append else os.O_EXCL), 0o644)
        except FileExistsError:
            raise UsageError(f"run {path.stem} already has {path.name} in {path.parent}: use another --run_id, "
                             f"--resume=auto to continue that run, or delete or move those files") from None
        try:  # held until the process ends, however it ends (the kernel drops it at a kill -9)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(f"run {path.stem} is running in another process (it holds {path}'s lock); one launch "
                             f"per --run_id") from None
        return RunLog._open(fd)

    @staticmethod
    def _open(fd: int) -> IO:
        """A text file on fd, appending; a line a kill cut short is ended first (the next one starts its own)."""
        end = os.lseek(fd, 0, os.SEEK_END)
        if end and os.pread(fd, 1, end - 1) != b"\n":
            os.write(fd, b"\n")
        return open(fd, "a", encoding="utf-8", newline="", buffering=1 << 16)

    def truncate(self) -> None:
        for f in (self.file, self.jsonl):
            f.flush()
            os.ftruncate(f.fileno(), 0)

    def write_sources(self, files: list[Path]) -> None:
        """Each file whole after its SOURCE_MARK line (the bytes it names): tools/compare.py code writes them back."""
        for path in files:
            data = path.read_bytes()
            self(SOURCE_MARK.format(name=path.name, size=len(data)), console=False)
            text = data.decode()
            self._io(self.paths[0], lambda: self.file.write(text if text.endswith("\n") else text + "\n"))

    @staticmethod
    def _io(name: object, action: Callable[[], Any]) -> Any:
        try:
            return action()
        except OSError as e:
            raise UsageError(f"cannot write the log {name}: {e.strerror}") from None

    def __call__(self, line: str, console: bool = True, flush: bool = False) -> None:
        """Write a line (and with flush, everything so far to disk) before printing it: a line seen is kept."""
        if self.file is not None:
            self._io(self.paths[0], lambda: self.file.write(line + "\n"))
            if flush:
                self.flush()
            if console:
                print0(line)

    def flush(self) -> None:
        """Everything written so far pushed to the OS: a hard stop (kill -9, the OOM killer) loses none of it."""
        if self.file is not None:
            for f, path in zip((self.file, self.jsonl), self.paths):
                self._io(path, f.flush)

    def record(self, entry: dict[str, object]) -> None:
        if self.jsonl is not None:
            self._io(self.paths[1], lambda: self.jsonl.write(json.dumps(entry) + "\n"))
            self.records += 1

    def close(self, last_line: str | None = None) -> None:
        """Close the files, after a last line (why a run stopped early) when given."""
        if last_line is not None:
            with contextlib.suppress(UsageError):
                self(last_line, console=False)
        for f in filter(None, (self.file, self.jsonl)):
            with contextlib.suppress(OSError):
                f.close()
        self.file = self.jsonl = None

    def set_aside(self) -> Path | None:
        """Move a run's logs to <run_id>.failed.<ext> (kept, its run id free again); returns the text log's new path."""
        kept = None
        for path in self.paths:
            target = path.with_name(f"{path.stem}.failed{path.suffix}")
            with contextlib.suppress(OSError):
                path.replace(target)
                kept = kept or target
        return kept

# Peak dense bf16 tensor-core TFLOP/s by a substring of the CUDA device name, most specific first ("H100": the SXM part)
PEAK_BF16_TFLOPS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("GH200", 989.0), ("H200", 989.0), ("H100", 989.0),
                    ("H800", 989.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0),
                    ("L40", 181.0), ("L4", 121.0)]

def peak_tflops_for(gpu_name: str) -> float | None:
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key.lower() in gpu_name.lower()), None)

def peak_flops(device: torch.device, override_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of one device: --peak_tflops when set, else the table; None (MFU unknown) on a CPU."""
    tflops = override_tflops or (peak_tflops_for(torch.cuda.get_device_name(device)) if device.type == "cuda" else None)
    return None if tflops is None else tflops * 1e12

def mfu_pct(flops_per_tok: float, tokens_per_s: float | None, peak: float | None, world_size: int) -> float | None:
    """Model FLOPs utilization in percent: achieved model FLOP/s over the devices' peak; None when unknown."""
    return 100 * flops_per_tok * tokens_per_s / (peak * world_size) if peak and tokens_per_s else None

def peak_memory_mib(device: torch.device) -> dict[str, float | None]:
    """Peak memory allocated and reserved by torch on the device since the last reset, in MiB (None on a CPU)."""
    return {f"peak_memory_{kind}_mib": getattr(torch.cuda, f"max_memory_{kind}")(device) / 2**20
            if device.type == "cuda" else None for kind in ("allocated", "reserved")}

# GPT's parameters of two or more dimensions that feed no matmul: tables read by index, per-layer scalars, a bias
NO_MATMUL = ("embed.weight", "value_embeds", "bigram_embed.weight", "resid_lambdas", "post_lambdas", "mudd_b2",
             "mudd_gate_b2")

def matmul_weights(model: nn.Module) -> int:
    """Parameters feeding a matmul once per token: all of 2+ dimensions but NO_MATMUL's (a new layer counts itself)."""
    return sum(p.numel() for n, p in model.named_parameters() if p.ndim >= 2 and n not in NO_MATMUL)

def mean_keys_per_query(window_tokens: int, seq_len: int) -> float:
    """Mean over query positions t = 1..T of min(t, W): keys seen under a causal sliding window."""
    w = min(window_tokens, seq_len)
    return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len

def flops_per_token(model: GPT, s: StepSchedule) -> float:
    """Model FLOPs per trained token (forward + backward) at schedule entry `s`; an upper bound: masks are ignored."""
    cfg = model.cfg
    windows, per_key = {"long": s.long_window, "short": s.short_window}, 12 * cfg.num_heads * cfg.head_dim
    attention = sum(per_key * mean_keys_per_query(max(windows[p.window], 1) * cfg.block_size,
                                                  (2 if p.paired else 1) * s.micro_len)
                    for p in model.plans if p.attn is not None)  # paired heads: half the heads, twice the queries
    return 6 * matmul_weights(model) + attention + per_key * mean_keys_per_query(DC_WINDOW, s.micro_len)

def format_eta(seconds: float) -> str:
    seconds = max(0, round(seconds))
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"

@dataclass
class PendingLine:
    """A logging step whose rank statistics are on their way to host slot `slot` (done when event is)."""
    step: int
    train_time_ms: float
    slot: int
    event: torch.cuda.Event | None
    timers: list[tuple[torch.cuda.Event, torch.cuda.Event]]
    steps: int  # training steps since the previous line
    tokens: int  # tokens per rank in them
    schedule: StepSchedule  # of the last of them

class Metrics:
    """Train metrics: per step, device adds and two CUDA events. A logging step all-gathers RANK_STATS, reduces them
    on the device and copies them to a pinned host slot without blocking; rank 0 prints them once landed or at flush."""

    RANK_STATS = ("loss_sum", "host_ms", "peak_memory_allocated_mib", "train_time_ms")
    STATS = ("mean", "sum", "min", "max")
    SLOTS = 8  # pinned host slots; with all in flight, the oldest is waited for (GPU far behind)

    def __init__(self, cfg: Config, rt: Runtime, log: RunLog, model: GPT):
        self.cfg, self.rt, self.log, self.model = cfg, rt, log, model
        self.on_cuda, self.peak = rt.device.type == "cuda", peak_flops(rt.device, cfg.peak_tflops)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=rt.device)  # RANK_STATS[0], on the device
        self.tokens, self.steps, self.host_ms, self.t0, self.next_slot = 0, 0, 0.0, 0.0, 0
        self.timers: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.start: torch.cuda.Event | None = None
        self.host = torch.zeros(self.SLOTS, len(self.STATS), len(self.RANK_STATS), dtype=torch.float64,
                                pin_memory=self.on_cuda)
        self.host_view = self.host.numpy()  # read as numpy: no Tensor call on the host side
        self.pending: list[PendingLine] = []  # staged lines, printed (rank 0) once their copy has landed
        self.last: PendingLine | None = None  # the latest staged line: checked for a diverged loss
        self.agreed_ms = 0.0  # the slowest rank's train time at the last line every rank has read: the same on all

    def logs_at(self, step: int) -> bool:
        """Whether step (1-based: the step that `step:S/T` names) ends with a collective and a line."""
        return step % self.cfg.log_every == 0 or step == self.cfg.num_steps

    def begin_step(self, step: int) -> None:
        """Open step `step` (1-based; the argument is also the tests' hook to know where the loop is)."""
        self.start = recorded_event() if self.on_cuda else None
        self.t0 = time.perf_counter()

    def add_loss(self, loss_sum: Tensor, tokens: int) -> None:
        self.loss_sum += loss_sum
        self.tokens += tokens

    def end_step(self, step: int, train_time_ms: float, s: StepSchedule) -> None:
        """Close step `step` (trained with schedule entry s), staged at a logging step; print what has landed."""
        if self.on_cuda:
            self.timers.append((self.start, recorded_event()))
        self.host_ms += 1000 * (time.perf_counter() - self.t0)
        self.steps += 1
        if self.logs_at(step):
            self._gather(step, train_time_ms, s)
        self.poll()

    @staticmethod
    def reduce_ranks(local: Tensor, world_size: int) -> Tensor:
        """Rows mean, sum, min, max (STATS) over ranks of `local`: one all-gather (none at world size 1), on device."""
        if world_size == 1:
            return local.unsqueeze(0).repeat(len(Metrics.STATS), 1)
        gathered = local.new_empty(world_size * local.numel())  # flat: the one shape gloo accepts too
        all_gather_into(gathered, local)
        gathered = gathered.view(world_size, -1)
        return torch.stack([gathered.mean(0), gathered.sum(0), gathered.amin(0), gathered.amax(0)])

    def _gather(self, step: int, train_time_ms: float, s: StepSchedule) -> None:
        host = {"host_ms": self.host_ms, "train_time_ms": train_time_ms, **peak_memory_mib(self.rt.device)}
        local = torch.empty(len(self.RANK_STATS), dtype=torch.float64, device=self.rt.device)
        local[0].copy_(self.loss_sum)
        for i, name in enumerate(self.RANK_STATS[1:], 1):  # a host number is fill_'s kernel argument: no H2D copy
            local[i].fill_(host[name] or 0.0)
        stats = self.reduce_ranks(local, self.rt.world_size)
        if self.last is not None:  # every rank, at the same step: the previous line has long landed
            self._check_finite(self.last)
        if len(self.pending) == self.SLOTS:
            self._print(self.pending.pop(0), wait=True)
        slot, self.next_slot = self.next_slot, (self.next_slot + 1) % self.SLOTS
        self.host[slot].copy_(stats, non_blocking=self.on_cuda)
        event = recorded_event(timing=False) if self.on_cuda else None
        self.last = PendingLine(step, train_time_ms, slot, event, self.timers, self.steps, self.tokens, s)
        self.pending.append(self.last)
        self.loss_sum.zero_()
        self.tokens, self.steps, self.host_ms, self.timers = 0, 0, 0.0, []

    def poll(self, wait: bool = False) -> None:
        """Print, in order, the pending lines whose copy has landed, never waiting; with wait, all of them."""
        while self.pending and (wait or self.pending[0].event is None or self.pending[0].event.query()):
            self._print(self.pending.pop(0), wait=wait)

    def flush(self) -> None:
        """Wait for and print every pending line (before validation lines and at the end)."""
        self.poll(wait=True)
        if self.last is not None:
            self._check_finite(self.last)

    def _check_finite(self, p: PendingLine) -> None:
        """Stop a diverged run at the logging step after the one whose loss is not finite (or at a flush): every
        rank holds the line's statistics and checks them at the same point of the loop, so every rank stops."""
        if p.event is not None:
            p.event.synchronize()  # landed long ago: the line is a logging interval old
        loss = float(self.host_view[p.slot][self.STATS.index("sum")][self.RANK_STATS.index("loss_sum")])
        self.agreed_ms = float(self.host_view[p.slot][self.STATS.index("max")][self.RANK_STATS.index("train_time_ms")])
        if not math.isfinite(loss):
            self.poll(wait=True)
            raise UsageError(f"the train loss is {loss} at step {p.step}: the run diverged; lower the learning "
                             f"rates (--muon_lr, --embed_lr, --head_lr, --scalar_lr) or check the data")

    def _print(self, p: PendingLine, wait: bool = False) -> None:
        if wait and p.event is not None:
            p.event.synchronize()
        mean, total, low, high = (dict(zip(self.RANK_STATS, map(float, row))) for row in self.host_view[p.slot])
        cfg, tokens = self.cfg, p.tokens * self.rt.world_size
        time_ms = sum(a.elapsed_time(b) for a, b in p.timers) if p.timers else high["host_ms"]
        tok_s = tokens / (time_ms / 1000) if time_ms > 0 else None
        mfu = mfu_pct(flops_per_token(self.model, p.schedule), tok_s, self.peak, self.rt.world_size)
        train_loss, step_avg = total["loss_sum"] / max(tokens, 1), p.train_time_ms / p.step
        eta_s = step_avg * (cfg.num_steps - p.step) / 1000
        self.log.record({
            "step": p.step, "total": cfg.num_steps, "train_loss": train_loss, "train_time_ms": p.train_time_ms,
            "step_avg_ms": step_avg, "tokens_per_s": tok_s, "mfu_pct": mfu, "eta_s": eta_s,
            "step_ms": time_ms / max(p.steps, 1), "steps": p.steps, "tokens": tokens, "lr_mult": p.schedule.lr_mult,
            "muon_momentum": p.schedule.muon_momentum, "window_tokens": p.schedule.long_window * cfg.block_size,
            "peak_memory_allocated_mib": high["peak_memory_allocated_mib"] if self.on_cuda else None,
            "train_loss_rank_min": low["loss_sum"] / max(p.tokens, 1),
            "train_loss_rank_max": high["loss_sum"] / max(p.tokens, 1)})
        self.log(f"step:{p.step}/{cfg.num_steps} train_loss:{train_loss:.4f} train_time:{p.train_time_ms:.0f}ms "
                 f"step_avg:{step_avg:.2f}ms tok/s:{'-' if tok_s is None else f'{tok_s:.0f}'} "
                 f"mfu:{'-' if mfu is None else f'{mfu:.1f}%'} eta:{format_eta(eta_s)}", flush=True)

def git_commit(directory: Path) -> str | None:
    try:
        proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = proc.stdout.strip()
    ok = proc.returncode == 0 and len(commit) in (40, 64) and all(c in "0123456789abcdef" for c in commit)
    return commit if ok else None

def write_json_atomic(path: Path, data: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")

# -----------------------------------------------------------------------------
# Profiler
# Only what must run inside training: torch.profiler around the chosen steps, a --bench's timings, each rank's raw
# figures. tools/trace_report.py turns them into the report (medians, MFU, GPU idle, overlap); --bench runs it at end.

STEP_MARK = "train_step#"  # record_function name of a traced step: train_step#<step>
TRACE_REPORT = Path(__file__).resolve().parent / "tools" / "trace_report.py"

class StepProfiler:
    """The loop's --profile / --bench hooks (inert without them). --bench: BENCH_SETTLE_STEPS untimed steps, bench_steps
    timed (CUDA events; the CPU's clock), one profiler warmup, bench_steps traced and timed; no validation."""

    def __init__(self, cfg: Config, rt: Runtime):
        self.cfg, self.rt, self.cuda = cfg, rt, rt.device.type == "cuda"
        # --bench: the loop stops at run_length(cfg), the end of the traced steps
        self.timed = range(BENCH_SETTLE_STEPS, BENCH_SETTLE_STEPS + cfg.bench_steps) if cfg.bench else None
        self.traced = (range(self.timed.stop + 1, self.timed.stop + 1 + cfg.bench_steps) if cfg.bench else
                       profile_steps(cfg.profile, cfg.num_steps) if cfg.profile else None)
        self.folder = Path(cfg.log_dir) / cfg.run_id
        self.prof: torch.profiler.profile | None = None
        self.marks: dict[int, torch.cuda.Event | float] = {}  # step -> its start: CUDA event, or host clock

    def _export(self, prof: torch.profiler.profile) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.folder / f"trace_rank{self.rt.rank}.json.gz"))

    def close(self) -> None:
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.__exit__(None, None, None)

    @contextlib.contextmanager
    def step(self, step: int, settle: Callable[[], None] = lambda: None):
        """Around training step `step`; settle() runs before the trace stops: a gloo collective ending later crashes."""
        if self.traced is None:
            yield
            return
        last = step == self.traced.stop - 1
        if self.timed is not None and self.timed.start <= step < self.traced.stop:
            self.marks[step] = recorded_event() if self.cuda else time.perf_counter()
            if step == self.timed.start and self.cuda:
                torch.cuda.reset_peak_memory_stats(self.rt.device)
        if step == max(self.traced.start - 1, 0):  # the profiler's warmup step (none for --profile=0:END)
            activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * self.cuda
            steps = torch.profiler.schedule(wait=0, warmup=int(self.traced.start > 0), active=len(self.traced),
                                            repeat=1)
            self.prof = torch.profiler.profile(activities=activities, schedule=steps, on_trace_ready=self._export)
            self.prof.__enter__()
        try:
            with torch.profiler.record_function(f"{STEP_MARK}{step}") if self.prof else contextlib.nullcontext():
                yield
        except BaseException:
            self.close()
            raise
        if last and self.timed is not None:
            self.marks[step + 1] = recorded_event() if self.cuda else time.perf_counter()
        if self.prof is not None:
            if last:
                settle()
            self.prof.step()
        if last:
            self.close()

    def _step_ms(self, steps: range) -> list[float]:
        marks = [self.marks[s] for s in range(steps.start, steps.stop + 1)]
        return [a.elapsed_time(b) if self.cuda else 1000 * (b - a) for a, b in zip(marks, marks[1:])]

    def finish(self, log: RunLog, model: GPT) -> dict | None:
        """Close the profiler; with --bench, write this rank's raw figures and return (rank 0) trace_report's report."""
        self.close()
        if self.traced is None:
            return None
        if not self.cfg.bench:
            log(f"profile: steps {self.traced.start}..{self.traced.stop - 1} traced to {self.folder}/"
                f"trace_rank<R>.json.gz ({self.rt.world_size} file(s)); python tools/trace_report.py {self.folder}")
            return None
        synchronize(self.rt.device)
        cfg, rt = self.cfg, self.rt
        tokens = cfg.global_batch_seqs * schedule(self.traced.start, cfg).seq_len
        flops = float(np.mean([flops_per_token(model, schedule(step, cfg)) for step in self.traced]))
        peak, timed = peak_flops(rt.device, cfg.peak_tflops), self._step_ms(self.timed)
        write_json_atomic(self.folder / f"bench_rank{rt.rank}.json", {
            "run_id": cfg.run_id, "rank": rt.rank, "world_size": rt.world_size,
            "device": torch.cuda.get_device_name(rt.device) if self.cuda else
            f"CPU: {cpu_report()}; bf16 GEMM path {cfg.cpu_bf16_gemm}",
            "timed_steps": [self.timed.start, self.timed.stop - 1],
            "traced_steps": [self.traced.start, self.traced.stop - 1],
            "step_ms": timed, "traced_step_ms": self._step_ms(self.traced), "tokens_per_step": tokens,
            "flops_per_token": flops, "peak_flops_per_gpu": peak,
            "mfu_pct": [mfu_pct(flops, tokens / (ms / 1000), peak, rt.world_size) for ms in timed],
            **peak_memory_mib(rt.device), "trace": f"trace_rank{rt.rank}.json.gz",
            "config": {k: getattr(cfg, k) for k in ("train_seq_len", "global_batch_seqs", "num_steps", "compile",
                                                    "fp8_head", "prefetch_depth", "bench_steps")}})
        if rt.world_size > 1:
            dist.barrier()  # every rank's figures are on disk (the log dir is shared, as for checkpoints)
        if rt.rank != 0:
            return None
        if not TRACE_REPORT.exists():  # a copied train_gpt.py
            log(f"bench: raw figures in {self.folder}/bench_rank<R>.json; tools/trace_report.py reports on them")
            return None
        spec = importlib.util.spec_from_file_location("trace_report", TRACE_REPORT)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.bench_report(self.folder, print_line=log)

# -----------------------------------------------------------------------------
# Checkpoints
# --save_every / --save_final write <log_dir>/<run_id>/ckpt_<step>/ without stalling the loop; --resume continues a run
# exactly (bit for bit at the same world size, re-sharded at another), from a complete and matching checkpoint only.

CKPT_META, CKPT_MODEL = "meta.json", "model.pt"
CKPT_FORMAT = 11  # bumped whenever what is saved changes (10: every source file's sha256, "sources"; 11: "stages")
# The fields that fix the parameters' shapes, what they mean, the optimizer's units and the token stream.
CKPT_MATCH_FIELDS = ("vocab_size", "num_layers", "model_dim", "num_heads", "head_dim", "mlp_ratio", "value_embeds",
                     "attn_pattern", "gate_channels", "block_size", "skip", "attn_input_layer", "paired_layers",
                     "xsa_layers", "attn_gate_layers", "bigram_rows", "bigram_sign_rows", "mudd_dim",
                     "train_seq_len", "global_batch_seqs", "train_epochs")
CKPT_WAIT_S = 1800.0  # rank 0's writer waits at most this long for the other ranks' files
CKPT_ERROR_GRACE_S = 10.0  # after an error or a signal, how long it still waits for them

def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"

def train_files_identity(cfg: Config) -> list[list]:
    """[file name, token count] of each training shard: the token stream a saved data position refers to."""
    return [[p.name, shard_token_count(p)] for p in find_shards(cfg.train_files)]

def read_checkpoint_meta(folder: Path, taker: str = "--resume") -> dict:
    """A complete checkpoint's meta.json (each listed file there, at its size), else a UsageError; taker: its flag."""
    where, path = f"checkpoint {folder}", folder / CKPT_META
    if not folder.is_dir():
        raise UsageError(f"{where} is a file: {taker} takes a ckpt_<step> directory (the folder holding {CKPT_META})"
                         if folder.is_file() else f"{where} does not exist ({taker} takes a ckpt_<step> directory)")
    if not path.exists():  # a save that was cut short leaves its parts (or their .tmp files) but no meta.json
        cut = ", ".join(sorted(p.name for p in folder.glob("*.tmp")))  # half-written when the save stopped
        raise UsageError(f"{where} is incomplete: no {CKPT_META} (it is written last)"
                         f"{f'; {cut} half-written' * bool(cut)}; use an earlier checkpoint"
                         if any(p.name.startswith((CKPT_MODEL, "rank")) for p in folder.iterdir()) else
                         f"{folder} is not a checkpoint: {taker} takes a ckpt_<step> directory, as a run with "
                         f"--save_every or --save_final writes them under <log_dir>/<run_id>/")
    try:
        meta = json.loads(path.read_text())
        step, world_size, files = int(meta["step"]), int(meta["world_size"]), dict(meta["files"])
        if meta["format"] != CKPT_FORMAT or not isinstance(meta["config"], dict) or step < 0 or world_size < 1:
            raise ValueError
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"{where}: {CKPT_META} is unreadable or not of checkpoint format {CKPT_FORMAT}") from None
    if unlisted := [n for n in [CKPT_MODEL, *map(rank_file, range(world_size))] if n not in files]:
        raise UsageError(f"{where}: {CKPT_META} does not list {unlisted[0]}")
    for name, entry in files.items():
        if not (folder / name).is_file():
            raise UsageError(f"{where} is incomplete: {name} is missing")
        actual = (folder / name).stat().st_size
        if not isinstance(entry, dict) or actual != entry.get("bytes"):
            raise UsageError(f"{where}: {name} has {actual} bytes, {CKPT_META} says {entry}: truncated or corrupt")
    return meta

def check_resume(cfg: Config, folder: Path) -> None:
    """Check a checkpoint at start-up, on every rank before anything is written: intact, matching, in range."""
    meta = read_checkpoint_meta(folder)
    for name, entry in meta["files"].items():
        read_part(folder / name, entry.get("sha256"))
    saved = meta["config"]
    if cfg.resume == AUTO and (why := continuation_error(f"checkpoint {folder}", saved, meta.get("sources", {}), cfg)):
        raise UsageError(why)
    if diffs := [f"--{k}={saved.get(k)} (this run: {getattr(cfg, k)})" for k in CKPT_MATCH_FIELDS
                 if saved.get(k) != getattr(cfg, k)]:
        raise UsageError(f"checkpoint {folder} needs {', '.join(diffs)}: model shapes and data must match")
    if meta.get("train_files") != train_files_identity(cfg):
        raise UsageError(f"checkpoint {folder} was trained on other files than --train_files={cfg.train_files} "
                         f"(it needs {len(meta.get('train_files') or [])} shard(s) with the same names and sizes)")
    if meta["step"] > cfg.num_steps:
        raise UsageError(f"checkpoint {folder} is at step {meta['step']}, beyond --num_steps={cfg.num_steps}")

# What may change between the launches of one --resume=auto run: how often it saves and how it loads its data.
CONTINUATION_FREE = ("resume", "save_every", "save_final", "save_minutes", "prefetch_depth", "profile")

def continuation_error(what: str, config: dict, sources: dict[str, str], cfg: Config) -> str | None:
    """Why what (a log or a checkpoint of run --run_id, its config and source digests) cannot be continued exactly by
    this launch (another recipe, other code), or None: --resume=auto continues a run only as it began."""
    mine = config_json(cfg)
    changed = [f"--{k}={config.get(k)!r} (this launch: {v!r})" for k, v in mine.items()
               if k not in CONTINUATION_FREE and config.get(k) != v]
    now = source_digests(source_files(Path(sys.modules[type(cfg).__module__].__file__)))  # the trainer cfg is of
    changed += [f"other {name}" for name in sorted(set(now) | set(sources)) if now.get(name) != sources.get(name)]
    return None if not changed else (f"--resume=auto: {what} holds run {cfg.run_id} with {', '.join(changed[:4])}"
                                     f"{' and more' if len(changed) > 4 else ''}: it can only go on as it began; "
                                     f"launch it as before, or use another --run_id")

def logged_run(path: Path) -> tuple[dict, dict[str, str]] | None:
    """The config and source digests an existing log begins with; None where its header was cut short."""
    data, sources, pos = path.read_bytes(), {}, 0
    while m := re.match(rb"# source: (\S+) \((\d+) bytes\)\n", data[pos:pos + 300]):
        start, end = pos + m.end(), pos + m.end() + int(m[2])
        sources[m[1].decode()], pos = hashlib.sha256(data[start:end]).hexdigest(), end + (data[end - 1:end] != b"\n")
    config = re.search(rb"^config: (.*)$", data[pos:], re.M)
    return None if config is None else (json.loads(config[1]), sources)

def checkpoint_step(folder: Path) -> int:
    return int(folder.name[5:]) if re.fullmatch(r"ckpt_\d+", folder.name) else -1

def newest_checkpoint(cfg: Config, folders: list[Path] | None = None) -> tuple[Path | None, str, list[Path]]:
    """--resume=auto: the run's newest checkpoint whose files are all there and match their checksums, a line on the
    newer ones skipped (incomplete: a save a stop cut short; or corrupt), and those, for remove_stale. folders: the
    run's checkpoints, oldest first (by default its ckpt_<step> folders by step)."""
    if folders is None:
        folders = sorted((Path(cfg.log_dir) / cfg.run_id).glob("ckpt_*"), key=checkpoint_step)
    skipped: list[str] = []
    for folder in reversed(folders):
        try:
            meta = read_checkpoint_meta(folder, "--resume=auto")
            for name, entry in meta["files"].items():
                read_part(folder / name, entry.get("sha256"))
            break
        except UsageError as e:
            skipped.append(str(e).split("; use ")[0])
    else:
        folder = None
    taken = f"taking {folder.name}" if folder else "none before it"
    more = f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""
    stale = folders[folders.index(folder) + 1:] if folder else folders
    return folder, f"{skipped[0]}{more}: removed, {taken}" if skipped else "", stale

def remove_stale(folders: list[Path]) -> None:
    """newest_checkpoint's skipped folders, once this launch holds the run (its log's lock; a live launch's save would
    look incomplete too): a later save of their step writes the folder anew, where no stale part may stay."""
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)

def check_run_paths(cfg: Config) -> None:
    """Before anything is written: the log folder is writable, and no earlier run's logs or checkpoints are replaced."""
    log_dir = Path(cfg.log_dir)
    run_dir = log_dir / cfg.run_id
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--log_dir={cfg.log_dir}: cannot create it ({e.strerror}); give a writable folder") from None
    if not os.access(log_dir, os.W_OK | os.X_OK):
        raise UsageError(f"--log_dir={cfg.log_dir} is not writable; give a writable folder")
    if cfg.resume == AUTO:  # its logs and checkpoints are the run it continues
        return
    if logs := [p.name for p in (log_dir / f"{cfg.run_id}{ext}" for ext in (".txt", ".jsonl", ".json")) if p.exists()]:
        raise UsageError(f"run {cfg.run_id} already has {', '.join(logs)} in {log_dir}: use another --run_id, "
                         f"--resume=auto to continue that run, or delete or move those files")
    if cfg.resume and Path(cfg.resume).resolve().parent == run_dir.resolve():
        raise UsageError(f"--resume={cfg.resume} is a checkpoint of run {cfg.run_id}: a resumed run writes under "
                         f"its own --run_id (leave it unset for a fresh one; --resume=auto continues a run in place)")
    if (cfg.save_every or cfg.save_final) and run_dir.is_dir() and any(run_dir.glob("ckpt_*")):
        raise UsageError(f"{run_dir} already holds checkpoints and they are never overwritten; use another --run_id")

def rng_state(device: torch.device) -> dict:
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "python": random.getstate(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]]}

def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    (version, internal, gauss), (name, keys, *rest) = state["python"], state["numpy"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))

def save_atomic(obj: object, path: Path) -> str:
    """torch.save atomically, returning the sha256; in memory first: a failed write is the OS's error (ENOSPC)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with atomic_file(path) as f:
        f.write(buffer.getbuffer())
    return hashlib.sha256(buffer.getbuffer()).hexdigest()

def read_part(path: Path, sha256: str | None, load: bool = False) -> bytes | dict:
    """A checkpoint file's bytes (read once), checked against meta.json's checksum; with load, what torch.load makes."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UsageError(f"checkpoint file {path} cannot be read ({e.strerror}): incomplete checkpoint") from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise UsageError(f"checkpoint file {path} does not match its checksum in {CKPT_META}: corrupt or from "
                         f"another checkpoint; use another checkpoint")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True) if load else data
    except Exception as e:  # a file written under the right checksum but unloadable: a foreign pickle
        raise UsageError(f"checkpoint file {path} is unreadable ({type(e).__name__}); use another checkpoint") from None

@dataclass
class ResumePoint:
    step: int
    train_time_ms: float
    rng: dict
    data_position: tuple[int, int]  # the stream's (next file, position) after step

def load_checkpoint(cfg: Config, rt: Runtime, folder: Path, model: GPT, optimizer: ShardedMuonAdam, log: RunLog
                    ) -> ResumePoint:
    """Restore a checkpoint into model and optimizer (before the warmup snapshot); if any rank cannot, all raise."""
    error = None
    try:
        meta = read_checkpoint_meta(folder)  # its config was checked against this run's at start-up (check_resume)
        step, saved_world, files = meta["step"], meta["world_size"], meta["files"]
        params = model.state_dict()  # the parameters and the persistent buffers (the sign table, the FP8 MLP state)
        state = read_part(folder / CKPT_MODEL, files[CKPT_MODEL]["sha256"], load=True)
        if not isinstance(state, dict) or set(state) != set(params) or \
                any(state[n].shape != p.shape or state[n].dtype != p.dtype for n, p in params.items()):
            raise UsageError(f"checkpoint file {folder / CKPT_MODEL} does not hold this model's parameters")
        model.load_state_dict(state)
        try:
            parts = [read_part(folder / n, files[n]["sha256"], load=True) for n in map(rank_file, range(saved_world))]
            if any(p["step"] != step or p["optimizer"]["step_count"] != step for p in parts):
                raise ValueError
            optimizer.load_state_dict([p["optimizer"] for p in parts])
        except (KeyError, TypeError, ValueError, IndexError):
            raise UsageError(f"checkpoint {folder}: a rank file does not match {CKPT_META} or this model") from None
    except UsageError as e:
        error = str(e)
    if rt.world_size > 1:
        errors: list[object] = [None] * rt.world_size
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        raise UsageError(error)
    rng = parts[rt.rank if rt.rank < saved_world else 0]["rng"]  # a new rank takes rank 0's RNG states
    how = "as saved" if saved_world == rt.world_size else f"re-sharded from world size {saved_world} to {rt.world_size}"
    mine = config_json(cfg)
    changed = [f"{k} {v!r} -> {mine[k]!r}" for k, v in meta["config"].items()
               if k not in ("run_id", "resume") and k in mine and mine[k] != v]
    position = tuple(meta["data_position"])
    data = f"data from shard {position[0] - 1} token {position[1]:,}" if position[0] else "data from the start"
    log(f"resume: {folder} at step {step} of run {meta['config'].get('run_id')} (optimizer state {how}), "
        f"train_time so far {meta['train_time_ms']:.0f}ms, {data}")
    if changed:
        log(f"resume: config differs from the checkpoint's in {', '.join(changed)}")
    saved, now = meta.get("sources", {}), source_digests(source_files())
    if differ := [name for name in sorted(set(now) | set(saved)) if now.get(name) != saved.get(name)]:
        log(f"resume: the code differs from the checkpoint's in {', '.join(differ)}")
    if stale := sorted(folder.parent.glob("ckpt_*/*.tmp")):  # half-written by a killed save; not removed here:
        mib = sum(p.stat().st_size for p in stale) / 2**20    # the run that left them may still be running
        log(f"resume: {folder.parent} holds {len(stale)} temporary file(s), {mib:.0f} MiB, left by an interrupted "
            f"save (e.g. {stale[0]}); delete them once that run has stopped")
    return ResumePoint(step, float(meta["train_time_ms"]), rng, position)

@dataclass
class PendingCheckpoint:
    step: int
    folder: Path
    stall_ms: float  # host time spent in save()
    issued: float  # perf_counter when save() handed it to the writer
    future: Future
    gpu_stall: tuple[torch.cuda.Event, torch.cuda.Event] | None  # around the compute stream's wait for the copies

class Checkpointer:
    """save() copies to pinned buffers on a side stream (the compute stream waits: the GPU stall); a writer thread
    writes model.pt (rank 0), rank<R>.pt, then (rank 0, once every rank's is there) meta.json, which completes it."""

    def __init__(self, cfg: Config, rt: Runtime, log: RunLog, model: GPT, optimizer: ShardedMuonAdam,
                 metrics: Metrics, start_step: int):
        self.cfg, self.rt, self.log, self.model, self.optimizer, self.metrics = cfg, rt, log, model, optimizer, metrics
        self.start_step = start_step  # a resumed run does not save its first step again
        self.saved_ms = metrics.agreed_ms  # the agreed train time at the last save (or start)
        self.pending: list[PendingCheckpoint] = []
        self.failures: list[str] = []  # checkpoints this rank could not write: the run ends with an error
        self.copy_stream = torch.cuda.Stream(rt.device) if rt.device.type == "cuda" else None
        self.host: dict[tuple, Tensor] = {}  # pinned host buffers, one per saved tensor, allocated once
        if cfg.save_every or cfg.save_final:  # now, not at the first save: the loop would stall on the allocation
            self._host_state(functools.partial(self._to_host, copy=False))
        self.sources = source_digests(source_files())
        self.train_files = train_files_identity(cfg) if rt.rank == 0 else None
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-writer", initializer=bind_thread_to_device,
                                         initargs=(rt.device,))
        self.give_up_at = math.inf  # time.monotonic() after which rank 0 stops waiting for the other ranks

    def _to_host(self, t: Tensor, copy: bool = True) -> Tensor:
        """t's host buffer (keyed by address: the saved tensors live for the whole run), with copy t copied into it."""
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if key not in self.host:
            self.host[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.copy_stream is not None)
        return self.host[key].copy_(t.detach(), non_blocking=self.copy_stream is not None) if copy else self.host[key]

    def _host_state(self, copy: Callable[[Tensor], Tensor]) -> tuple[dict[str, Tensor] | None, dict]:
        model = {n: copy(t) for n, t in self.model.state_dict().items()} if self.rt.rank == 0 else None
        return model, self.optimizer.state_dict(copy=copy)

    def due(self, step: int) -> bool:
        """--save_every's steps, the last with --save_final, and with --resume=auto the first Adam step after each
        save_minutes of training, by the train time every rank agrees on (Metrics.agreed_ms): all save, or none."""
        return step > self.start_step and (self.asked(step) or self.rolling(step))

    def asked(self, step: int) -> bool:
        cfg = self.cfg
        return bool(cfg.save_every and step % cfg.save_every == 0) or (cfg.save_final and step == cfg.num_steps)

    def rolling(self, step: int) -> bool:
        cfg, since = self.cfg, self.metrics.agreed_ms - self.saved_ms
        return bool(cfg.resume == AUTO and cfg.save_minutes and step % cfg.adam_every == 0 and not self.asked(step)
                    and since >= 60_000 * cfg.save_minutes)

    @torch.no_grad()
    def save(self, step: int, train_time_ms: float, data_position: tuple[int, int]) -> None:
        t0 = time.perf_counter()
        self.poll(block=True)  # the host buffers are reused: the previous write must be done with them
        self.optimizer.wait_for_params()  # the last step's all-gathers have written the parameters
        event, gpu_stall = None, None
        if self.copy_stream is None:
            model, optim = self._host_state(self._to_host)
        else:
            compute = torch.cuda.current_stream(self.rt.device)
            self.copy_stream.wait_stream(compute)
            with torch.cuda.stream(self.copy_stream):
                model, optim = self._host_state(self._to_host)
                event = recorded_event(timing=False)
            stall_start = recorded_event()
            compute.wait_event(event)  # the next step writes these tensors only after they are copied
            gpu_stall = (stall_start, recorded_event())
        common = {"format": CKPT_FORMAT, "step": step, "world_size": self.rt.world_size, "rolling": self.rolling(step),
                  "train_time_ms": train_time_ms, "data_position": list(data_position),
                  "config": dataclasses.asdict(self.cfg), "sources": self.sources}
        self.saved_ms = self.metrics.agreed_ms
        part = {**common, "rank": self.rt.rank, "optimizer": optim, "rng": rng_state(self.rt.device)}
        meta = None if self.rt.rank else {**common, "run_id": self.cfg.run_id, "train_files": self.train_files,
                                          "saved_at": datetime.datetime.now().isoformat(timespec="seconds")}
        folder = Path(self.cfg.log_dir) / self.cfg.run_id / f"ckpt_{step}"
        future = self.writer.submit(self._write, folder, event, part, model, meta)
        issued = time.perf_counter()
        self.pending.append(PendingCheckpoint(step, folder, 1000 * (issued - t0), issued, future, gpu_stall))

    def _write(self, folder: Path, event: torch.cuda.Event | None, part: dict, model: dict | None,
               meta: dict | None) -> float:
        """Writer thread: this rank's files; on rank 0 then meta.json once every rank's file is there."""
        rank, world_size = self.rt.rank, self.rt.world_size
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if event is not None:
                event.synchronize()
            sums = {CKPT_MODEL: save_atomic(model, folder / CKPT_MODEL)} if model is not None else {}
            sums[rank_file(rank)] = save_atomic(part, folder / rank_file(rank))
            if meta is not None:
                deadline = time.monotonic() + CKPT_WAIT_S
                for r in range(1, world_size):
                    while not (folder / rank_file(r)).exists():  # complete once renamed into place
                        if (failed := folder / f"rank{r}.failed").exists():
                            raise RuntimeError(f"rank {r} failed to write its part: {failed.read_text().strip()}")
                        if time.monotonic() > min(deadline, self.give_up_at):
                            raise RuntimeError(f"rank {r} did not write {rank_file(r)}")
                        time.sleep(0.01)
                    sums[rank_file(r)] = hashlib.sha256((folder / rank_file(r)).read_bytes()).hexdigest()
                meta["files"] = {n: {"bytes": (folder / n).stat().st_size, "sha256": h} for n, h in sums.items()}
                write_json_atomic(folder / CKPT_META, meta)
                if meta["rolling"]:
                    self._drop_old_rolling(folder.parent)
            return time.perf_counter()
        except BaseException as e:
            with contextlib.suppress(OSError):
                (folder / f"rank{rank}.failed").write_text(f"{type(e).__name__}: {e}\n")
            raise

    @staticmethod
    def _drop_old_rolling(run_dir: Path) -> None:
        """--resume=auto's timed checkpoints serve only to carry on: the newest two complete ones are kept."""
        def rolling(folder: Path) -> bool:
            with contextlib.suppress(OSError, ValueError):
                return json.loads((folder / CKPT_META).read_text()).get("rolling") is True
            return False
        for folder in sorted(filter(rolling, run_dir.glob("ckpt_*")), key=checkpoint_step)[:-2]:
            shutil.rmtree(folder, ignore_errors=True)

    def poll(self, block: bool = False) -> None:
        """Log, in order, the checkpoints written whose GPU stall can be read (its wait has passed); block: all."""
        while self.pending and (block or (self.pending[0].future.done() and
                                          (self.pending[0].gpu_stall is None or self.pending[0].gpu_stall[1].query()))):
            p = self.pending.pop(0)
            try:
                done = p.future.result()
            except Exception as e:  # training goes on; the checkpoint stays incomplete (no meta.json)
                why = f"no space left on {p.folder}" if getattr(e, "errno", None) == errno.ENOSPC else \
                    f"{type(e).__name__}: {e}"
                self.failures.append(f"{p.folder} ({why})")
                print(f"[rank {self.rt.rank}] checkpoint: {p.folder} FAILED ({why}); the run continues",
                      file=sys.stderr, flush=True)
                self.log(f"checkpoint: {p.folder} FAILED ({why})", console=False, flush=True)
                continue
            gpu_ms = None  # how long the compute stream waited for the device-to-host copies; None on the CPU
            if p.gpu_stall is not None:  # the writer saw the copies land: no wait in practice
                p.gpu_stall[1].synchronize()
                gpu_ms = p.gpu_stall[0].elapsed_time(p.gpu_stall[1])
            gpu = "" if gpu_ms is None else f", GPU stall {gpu_ms:.2f} ms"
            self.log.record({"step": p.step, "checkpoint": str(p.folder), "stall_ms": p.stall_ms,
                             "gpu_stall_ms": gpu_ms, "write_s": done - p.issued})
            self.log(f"checkpoint: {p.folder} (step {p.step}: loop stall {p.stall_ms:.2f} ms{gpu}, on disk "
                     f"{done - p.issued:.2f} s later)", flush=True)

    def close(self, error: bool = False) -> None:
        """Wait for every pending write; after an error, rank 0 waits CKPT_ERROR_GRACE_S at most for other ranks'."""
        if error:
            self.give_up_at = time.monotonic() + CKPT_ERROR_GRACE_S
        self.poll(block=True)
        self.writer.shutdown(wait=True)

# -----------------------------------------------------------------------------
# Training
# Untimed warmup (compiles, autotunes; state restored), a clock over training steps only. Each micro-step's summed
# loss is scaled by train_loss_scale and gradients are summed across ranks: every world size takes the same update.

@dataclass
class TrainResult:
    val_losses: list[tuple[int, float]]
    train_time_ms: float
    model: GPT
    summary: dict | None = None  # what rank 0 wrote to logs/<run_id>.json
    bench: dict | None = None  # --bench: the report (rank 0)

class TrainClock:
    """The official train time: stop()/start() synchronize around what is untimed; now() reads it without a sync."""

    def __init__(self, device: torch.device, ms: float = 0.0):
        self.device, self.ms = device, ms
        self.start()

    def start(self) -> None:
        synchronize(self.device)
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        synchronize(self.device)
        self.ms += 1000 * (time.perf_counter() - self.t0)
        return self.ms

    def now(self) -> float:
        return self.ms + 1000 * (time.perf_counter() - self.t0)

# The fields that size the model's tensors, by a part of a tensor's name (the rest: the vocabulary's tables).
SIZED_BY = {"rotary": "train_seq_len val_seq_len", "bigram_sign": "bigram_sign_rows model_dim", "bigram": "bigram_rows "
            "model_dim", "mudd": "mudd_dim model_dim", "bank": "model_dim num_layers mlp_ratio", "fp8_w": "model_dim "
            "num_layers mlp_ratio", "": "vocab_size model_dim"}

def check_model_fits(cfg: Config, device: torch.device) -> None:
    """Refuse a model whose parameters, gradients and tables alone exceed the device's memory (sized on meta)."""
    with torch.device("meta"):
        model = GPT(cfg, use_flex=False, fp8_head=False)
    tensors = {**{n: (2, p) for n, p in model.named_parameters()}, **{n: (1, b) for n, b in model.named_buffers()}}
    sizes = {n: copies * t.numel() * t.element_size() for n, (copies, t) in tensors.items()}
    have = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else
            os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    if sum(sizes.values()) > have:
        big = max(sizes, key=sizes.get)
        flags = [f"--{n}={getattr(cfg, n)}" for n in next(v for k, v in SIZED_BY.items() if k in big).split()]
        raise UsageError(f"the model needs at least {sum(sizes.values()) / 1e9:,.1f} GB for its parameters, their "
                         f"gradients and tables ({big}: {sizes[big] / 1e9:,.1f} GB), more than the {device.type}'s "
                         f"{have / 1e9:,.1f} GB: check the sizes that make {big} ({', '.join(flags)})")

def build_model(cfg: Config, rt: Runtime, log: RunLog, knobs: StepKnobs) -> tuple[GPT, nn.Module, ShardedMuonAdam]:
    """The model, what the loop calls (compiled whole, fullgraph: a graph break fails loudly) and the optimizer."""
    flex = rt.device.type == "cuda" and cfg.attention == "flex"
    fa3 = load_fa3()[0] if cfg.attention == "fa3" else None
    raw = GPT(cfg, use_flex=flex, fp8_head=cfg.fp8_head, compile_flex=flex and not cfg.compile, fa3=fa3).to(rt.device)
    model = torch.compile(raw, dynamic=False, fullgraph=True) if cfg.compile else raw
    optimizer = ShardedMuonAdam(raw, cfg, rt.rank, rt.world_size, compile_ns=cfg.compile)
    if cfg.fp8_mlp:
        raw.quantize_mlp_(bootstrap_down=True)
    log(f"model: {sum(p.numel() for p in raw.parameters()):,} parameters, fp8 head {cfg.fp8_head}, fp8 mlp "
        f"{cfg.fp8_mlp}, compile {cfg.compile}, world size {rt.world_size}, "
        f"grad accumulation {cfg.global_batch_seqs // rt.world_size * cfg.micro_split}")
    for g in build_param_groups(raw, cfg):
        log(f"params: {g.kind} lr {g.lr:g}: {sum(p.numel() for p in g.params):,} in {', '.join(g.names)}")
    log(f"optimizer state: {optimizer.state_bytes() / 2**20:.1f} MiB per rank ({rt.world_size} ranks, "
        f"{len(optimizer.buckets)} buckets)")
    if rt.gpu:
        log(rt.gpu)
    need = knobs.documents  # with FA3: cu_seqlens' length per shape, and the data's need
    if need is None:
        log(f"attention: {rt.attention}")
    else:
        train = [f"{n}/{cut}: {knobs.train_slots(n, cut)} ({most})" for (n, cut), most in need.train.items()]
        val = f"{cfg.val_seq_len}: {varlen_slots(cfg.val_seq_len, need.val)} ({need.val})"
        log(f"attention: {rt.attention}; cu_seqlens slots per sequence (tokens/document cut: slots (most documents "
            f"in this run's data)): {', '.join(train)}; validating {val}")
    if cfg.compile:  # dynamo refuses a function's graph past its limit (8 by default, a hard error): size it
        graphs = compiled_graphs(cfg, optimizer)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, *graphs.values())
        log(f"compile: graphs per function: {', '.join(f'{k} {v}' for k, v in graphs.items())} (recompile limit "
            f"{torch._dynamo.config.recompile_limit})")
    return raw, model, optimizer

def compiled_graphs(cfg: Config, optimizer: ShardedMuonAdam) -> dict[str, int]:
    """The graphs torch.compile builds per function (Adam's betas are graph constants)."""
    schedules = schedule_table(cfg)
    training = {graph_key(cfg, s, True) for s in schedules[:-1]}
    validating = {graph_key(cfg, schedules[k], False) for k in range(run_length(cfg) + 1) if validates_at(cfg, k)}
    muon = len({(b.shard.shape, b.shard.dtype) for b in optimizer.buckets if b.kind == "muon"})
    return {"model": len(training) + max(len(validating), 1),
            "orthogonalize": muon, "normuon": muon, "cautious update": muon,
            "adam": len({(b.shard.shape, b.shard.dtype, b.betas) for b in optimizer.buckets if b.kind == "adam"}),
            "fp8 ops": 2 if cfg.fp8_head or cfg.fp8_mlp else 0}

def step_shape(schedules: list[StepSchedule]) -> Callable[[int], tuple[int, int]]:
    """Training step -> (seq_len, max_doc_len): the data stream's view of the schedule."""
    return lambda step: (schedules[step].seq_len, schedules[step].max_doc_len)

def train_loader(cfg: Config, rt: Runtime, files: list[Path], steps: int, shape: Callable[[int], tuple[int, int]],
                 digest: Callable[[np.ndarray], object] | None, resumed: ResumePoint | None = None) -> PrefetchLoader:
    """This rank's batches for `steps` steps: from the start, or where a resumed run's checkpoint left the stream."""
    stream = TrainTokenStream(files, cfg.train_seq_len, cfg.global_batch_seqs, cfg.vocab_size, shape, cfg.train_epochs,
                              preload=cfg.prefetch_depth > 0)
    if resumed is not None:
        stream.seek(resumed.step, resumed.data_position)
    return PrefetchLoader(TrainBatches(stream, rt.rank, rt.world_size, steps, cfg.micro_split), cfg.prefetch_depth,
                          rt.device, digest)

def train_step(model: nn.Module, optimizer: ShardedMuonAdam, batch: Tensor, rows: np.ndarray | None,
               knobs: tuple[Tensor, Tensor], loss_scale: float, metrics: Metrics | None = None,
               fp8_mlp: GPT | None = None, bootstrap_down: bool = True) -> None:
    """One optimizer step on a (micro-steps, micro_len + 1) batch; rows: its bigram rows; fp8_mlp: the model whose FP8
    MLP weights are requantized after it (bootstrap_down: the down-projection's at its amax, as #89's first steps)."""
    optimizer.wait_for_params()  # the previous step's all-gathers ran behind the batch hand-off
    optimizer.begin_step(rows)
    for m in range(batch.size(0)):
        loss = model(batch[m, :-1], batch[m, 1:].long(), *knobs)
        if m == 0:
            optimizer.forward_done()
        (loss * loss_scale).backward()
        if metrics is not None:
            metrics.add_loss(loss.detach(), batch.size(1) - 1)
    optimizer.step()
    optimizer.zero_grad()
    if fp8_mlp is not None:
        optimizer.wait_for_params()
        fp8_mlp.quantize_mlp_(bootstrap_down)

@torch.no_grad()
def validate(model: nn.Module, val: ValTokens, cfg: Config, rt: Runtime, log: RunLog, windows: Tensor | VarlenPlan,
             step: int, train_time_ms: float) -> tuple[int, float, float]:
    """The mean cross-entropy over the val tokens (one all-reduce), logged: (step, val loss, train time so far)."""
    model.eval()
    totals = torch.zeros(2, device=rt.device)  # loss sum, batches
    with PrefetchLoader(ValBatches(val, cfg.val_seq_len, rt.rank, rt.world_size), cfg.prefetch_depth,
                        rt.device) as batches:
        for batch in batches:
            totals[0] += model(batch[0, :-1], batch[0, 1:].long(), windows)
            totals[1] += 1
    if rt.world_size > 1:
        dist.all_reduce(totals)
    model.train()
    loss = (totals[0] / totals[1]).item()
    step_avg = train_time_ms / max(step, 1)
    log.record({"step": step, "total": cfg.num_steps, "val_loss": loss, "train_time_ms": train_time_ms,
                "step_avg_ms": step_avg})
    log(f"step:{step}/{cfg.num_steps} val_loss:{loss:.4f} train_time:{train_time_ms:.0f}ms step_avg:{step_avg:.2f}ms",
        flush=True)
    return step, loss, train_time_ms

def log_stage_plan(cfg: Config, schedules: list[StepSchedule], log: RunLog) -> None:
    """One line per span of training steps with the same shapes and windows: a staged run's plan."""
    keys = [(s.seq_len, s.max_doc_len, s.short_window, s.long_window) for s in schedules[:cfg.num_steps]]
    spans = [0] + [k for k in range(1, cfg.num_steps) if keys[k] != keys[k - 1]] + [cfg.num_steps]
    for a, b in zip(spans, spans[1:]):
        s = schedules[a]
        cut = f" cut into {cfg.micro_split} x {s.micro_len}" if cfg.micro_split > 1 else ""
        log(f"stage: steps {a}-{b - 1}: {cfg.global_batch_seqs} x {s.seq_len} tokens{cut} "
            f"({cfg.global_batch_seqs * s.seq_len:,}/step), documents cut at {s.max_doc_len}, "
            f"windows {s.short_window}/{s.long_window} blocks, lr x{s.lr_mult:.3g} at its start")

def warmup_plan(cfg: Config, schedules: list[StepSchedule]) -> list[int]:
    """The steps the warmup replays: warmup_steps at the first step of each training graph (dynamic=False: each compiles
    its own), and the first Adam step if none of those is one (the compiled Adam graphs are built there)."""
    first: dict[tuple, int] = {}
    for step, s in enumerate(schedules[:-1]):
        first.setdefault(graph_key(cfg, s, True), step)
    plan = [step for step in first.values() for _ in range(cfg.warmup_steps)]
    adam = next((step for step, s in enumerate(schedules[:-1]) if s.adam_step), None)
    if plan and adam is not None and not any(schedules[step].adam_step for step in plan):
        plan.append(adam)
    return sorted(plan)

def warmup(cfg: Config, rt: Runtime, log: RunLog, model: GPT, optimizer: ShardedMuonAdam,
           loader: PrefetchLoader, plan: list[int], step: Callable[[Tensor, object, int], None]) -> None:
    """Untimed steps on real batches, one micro-step each, at `plan`'s shapes; then what training writes (the bucket
    buffers, each parameter a view into one; the optimizer state; persistent buffers) is restored from device clones."""
    buffers = [b.data for b in optimizer.buckets]
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in buffers]
    for name, p in model.named_parameters():
        assert any(lo <= p.data_ptr() < hi for lo, hi in spans), f"parameter {name} is not in a bucket buffer"
    params = dict(model.named_parameters())
    persistent = [t for n, t in model.state_dict().items() if n not in params]  # the sign table, the FP8 MLP state
    written = buffers + optimizer.state_tensors() + persistent
    counts = optimizer.step_count, optimizer.adam_steps
    times: list[float] = []

    def lap() -> None:  # the device is idle at each mark: the laps time the snapshot, the steps, the restore
        synchronize(rt.device)
        times.append(time.perf_counter())

    lap()
    saved = [t.detach().clone() for t in written]
    lap()
    with loader:
        for train_step_index in plan:
            batch = next(loader)[:1]  # its digest holds every micro-step's rows: more than needed, never fewer
            step(batch, loader.digest, train_step_index)
    optimizer.wait_for_params()
    lap()
    with torch.no_grad():
        for t, clone in zip(written, saved):
            t.copy_(clone)
    optimizer.zero_grad(everything=True)
    optimizer.step_count, optimizer.adam_steps = counts
    del saved
    lap()
    snapshot, steps, restore = (b - a for a, b in zip(times, times[1:]))
    log(f"warmup: snapshot {1000 * snapshot:.1f} ms, {len(plan)} steps {steps:.1f} s, restore {1000 * restore:.1f} ms "
        f"(untimed; state restored)")

def finish(cfg: Config, rt: Runtime, log: RunLog, model: GPT, profiler: StepProfiler, failures: list[str],
           val_points: list[tuple[int, float, float]], train_time_ms: float, schedules: list[StepSchedule]
           ) -> TrainResult:
    """After the last step: peak memory, the --bench report, the summary (rank 0); any rank's failed save: an error."""
    memory = peak_memory_mib(rt.device)
    if rt.device.type == "cuda":
        log(f"peak memory allocated: {int(memory['peak_memory_allocated_mib'])} MiB "
            f"reserved: {int(memory['peak_memory_reserved_mib'])} MiB")
    else:  # torch allocates from the process heap on a CPU: its peak resident size is what there is
        log(f"peak memory: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB resident (CPU run)")
    bench = profiler.finish(log, model)
    mine = (torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "", failures)
    every = [mine] * rt.world_size  # each rank's GPU name and failed checkpoints
    if rt.world_size > 1:
        dist.all_gather_object(every, mine)
    failures = [f for _, rank_failures in every for f in rank_failures]
    summary = None
    if rt.rank == 0:  # the run summary (tools/compare.py reads these keys)
        tokens = sum(cfg.global_batch_seqs * s.seq_len for s in schedules[:cfg.num_steps])
        summary = {"run_id": cfg.run_id, "final_val_loss": val_points[-1][1] if val_points else None,
                   "train_time_ms": train_time_ms, "steps": cfg.num_steps, "step_avg_ms": train_time_ms / cfg.num_steps,
                   "tokens_per_s": tokens / (train_time_ms / 1000) if train_time_ms > 0 else None,
                   **peak_memory_mib(rt.device), "world_size": rt.world_size,
                   "gpu_names": [name for name, _ in every if name], "torch_version": torch.__version__,
                   "cuda_version": torch.version.cuda, "git_commit": git_commit(HERE), "seed": cfg.seed,
                   "config": config_json(cfg), "val_losses": [list(p) for p in val_points]}
        write_json_atomic(Path(cfg.log_dir) / f"{cfg.run_id}.json", summary)
        log(f"summary: {cfg.log_dir}/{cfg.run_id}.json")
    if failures:
        raise UsageError(f"the run finished, but {len(failures)} requested checkpoint(s) failed: {failures[0]}"
                         f"{' and more (see the log)' if len(failures) > 1 else ''}")
    return TrainResult([(s, v) for s, v, _ in val_points], train_time_ms, model, summary, bench)

def load_data(cfg: Config, device: torch.device) -> tuple[list[Path], ValTokens, DocumentCounts]:
    """Train shards (checked to suffice), val tokens, most documents per sequence: read before anything is written."""
    try:
        train_files = find_shards(cfg.train_files)
    except UsageError:
        if device.type == "cpu" and "fineweb10B" in cfg.train_files:  # the recipe's data, without a GPU: tiny first
            raise UsageError(f"no FineWeb shards match {cfg.train_files!r} and this run is on the CPU: try the tiny "
                             f"preset on the bundled sample (--preset=tiny, as ./run.sh does without a GPU); for "
                             f"the recipe, {more_data_hint(cfg.train_files, missing=True)}") from None
        raise
    val_files = find_shards(cfg.val_files)

    def shape(step: int) -> tuple[int, int]:  # step by step: a run the corpus cannot hold is refused at the corpus's
        s = schedule(step, cfg)                # end, before anything of every step's (schedule_table) is built
        return s.seq_len, s.max_doc_len

    steps = run_length(cfg)
    supplied, most = count_documents(cfg, train_files, steps, shape)
    if supplied < steps:
        raise UsageError(f"the run needs {steps} steps of {cfg.global_batch_seqs} sequences, each starting at a "
                         f"document, but {len(train_files)} file(s) x {cfg.train_epochs} epoch(s) supply {supplied}; "
                         f"raise --train_epochs, lower --num_steps or {more_data_hint(cfg.train_files)}")
    plan = warmup_plan(cfg, schedule_table(cfg))  # the warmup's batches: the first steps' data at the plan's shapes
    supplied, warm = count_documents(cfg, train_files, len(plan), lambda k: shape(plan[k]))
    if supplied < len(plan):
        raise UsageError(f"the warmup ({len(plan)} steps of --warmup_steps={cfg.warmup_steps} per compiled shape) "
                         f"needs more data than the run: lower --warmup_steps or {more_data_hint(cfg.train_files)}")
    for key, count in warm.items():
        most[key] = max(most.get(key, 0), count)
    val = ValTokens(val_files, cfg.val_tokens, cfg.vocab_size)
    return train_files, val, DocumentCounts(most, val.most_documents(cfg.val_seq_len))

def train(cfg: Config, rt: Runtime, log: RunLog, train_files: list[Path], val: ValTokens, documents: DocumentCounts,
          vocabulary: list[bytes], checkpoint: Path | None = None) -> TrainResult:
    """From the first (or checkpoint's) step to the summary; documents size FA3's buffers, vocabulary the prefixes."""
    last_step = run_length(cfg)
    profiler = StepProfiler(cfg, rt)  # --profile / --bench; inert otherwise
    schedules = schedule_table(cfg)
    knobs = StepKnobs(cfg, schedules, rt.device, documents if cfg.attention == "fa3" else None)
    raw_model, model, optimizer = build_model(cfg, rt, log, knobs)
    resumed = load_checkpoint(cfg, rt, checkpoint, raw_model, optimizer, log) if checkpoint else None
    start_step = resumed.step if resumed else 0
    loss_scale, fp8_mlp = train_loss_scale(cfg), raw_model if cfg.fp8_mlp else None
    plan, shape = warmup_plan(cfg, schedules), step_shape(schedules)
    warmup(cfg, rt, log, raw_model, optimizer,
           train_loader(cfg, rt, train_files, len(plan), lambda k: shape(plan[k]), optimizer.batch_rows()), plan,
           lambda batch, rows, step: train_step(model, optimizer, batch, rows, knobs.train(step), loss_scale,
                                                fp8_mlp=fp8_mlp))
    metrics = Metrics(cfg, rt, log, raw_model)
    peak = "unknown" if metrics.peak is None else f"{metrics.peak / 1e12:g} TFLOP/s"
    log(f"metrics: every {cfg.log_every} step(s); {flops_per_token(raw_model, schedules[-1]):.4g} FLOPs/token at "
        f"the final window; peak {peak} per device")
    log_stage_plan(cfg, schedules, log)
    metrics.agreed_ms = resumed.train_time_ms if resumed else 0.0
    checkpointer = Checkpointer(cfg, rt, log, raw_model, optimizer, metrics, start_step)
    loader = train_loader(cfg, rt, train_files, last_step - start_step, shape, optimizer.batch_rows(), resumed)
    val_points: list[tuple[int, float, float]] = []
    if resumed:
        set_rng_state(resumed.rng, rt.device)
    clock = TrainClock(rt.device, resumed.train_time_ms if resumed else 0.0)
    raw_model.prefix_table.copy_(prefix_table(vocabulary, cfg.vocab_size))  # timed, after the warmup, as upstream's
    try:
        for step in range(start_step, last_step + 1):
            if step and schedules[step - 1].tied and not schedules[step].tied:  # #53: untie, state and all
                optimizer.copy_param("lm_head.weight", TIED_EMBEDDING)
            raw_model.tie_embedding(schedules[step].tied)
            raw_model.apply_yarn(schedules[step].yarn_windows)
            if validates_at(cfg, step):
                optimizer.wait_for_params()  # before the clock stops: the gathers are part of the last step
                train_time_ms = clock.stop()
                metrics.flush()  # already synchronized: costs nothing, keeps the lines in order
                val_points.append(validate(model, val, cfg, rt, log, knobs.val(step), step, train_time_ms))
                clock.start()
            if checkpointer.due(step):
                checkpointer.save(step, clock.now(), loader.source.stream.position(step))
            if step == last_step:
                break
            optimizer.set_step(schedules[step])
            metrics.begin_step(step + 1)
            with profiler.step(step, settle=optimizer.wait_for_params):
                batch = next(loader)
                train_step(model, optimizer, batch, loader.digest, knobs.train(step), loss_scale, metrics, fp8_mlp,
                           bootstrap_down=step < cfg.fp8_down_exact_steps)
            metrics.end_step(step + 1, clock.now(), schedules[step])
            checkpointer.poll()
        metrics.flush()
    except BaseException:
        STOP.ignored = True  # the run is ending: a signal now (torchrun's, after a rank died) would cut the wait short
        checkpointer.close(error=True)  # pending writes finish before the error leaves train()
        raise
    finally:
        loader.close()  # the prefetch thread stops at the end, on errors and on Ctrl-C
    checkpointer.close()
    optimizer.wait_for_params()
    return finish(cfg, rt, log, raw_model, profiler, checkpointer.failures, val_points, clock.ms, schedules)

# -----------------------------------------------------------------------------
# Main
# Reads the launch environment (torchrun sets RANK/WORLD_SIZE/LOCAL_RANK), picks the device and the
# process-group backend (NCCL and gloo on CUDA, gloo on CPU), seeds every rank alike, and runs training.

# Expandable segments let validation's logits (val_seq_len x vocab, ~26 GB at the recipe's shape) reuse
# the memory of training's (~5 GB each) without fragmenting fixed-size segments; the record sets it too.
CUDA_ALLOC_CONF = "expandable_segments:True"

def setup_runtime(cfg: Config) -> Runtime:
    """The process's rank and device, and the process group; resolves the config's device-dependent fields."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if cfg.device != "cpu":  # read when CUDA initialises: before any CUDA call; a user's own setting wins
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)
    cuda = cfg.device == "cuda" or cfg.device == AUTO and torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        if not torch.cuda.is_available():
            raise UsageError("--device=cuda but no CUDA GPU is visible; use --device=cpu (or --preset=tiny)")
        visible = torch.cuda.device_count()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if local_world > visible:
            raise UsageError(f"{local_world} processes per node but only {visible} GPU(s) visible; "
                             f"launch with --nproc_per_node={visible} or fewer")
        torch.cuda.set_device(device)
    attention = resolve_for_device(cfg, cuda)
    if world_size > 1:
        # gloo beside NCCL on CUDA, as #89: the bigram rows' counts are exchanged from host memory (RowBucket)
        dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", device_id=device if cuda else None)
        paths: list[object] = [None] * world_size
        dist.all_gather_object(paths, cfg.attention)
        if len(set(paths)) > 1:  # auto found FA3 on some ranks only: they would call different collectives' graphs
            raise UsageError(f"--attention=auto resolved differently across ranks ({', '.join(map(str, paths))}): "
                             f"give --attention=fa3 or --attention=flex")
    return Runtime(rank, world_size, device, attention, gpu_report(cfg) if cuda else "")

class Terminated(KeyboardInterrupt):
    """SIGTERM, as SLURM, Kubernetes and torchrun stop a job: handled as Ctrl-C is."""

STOPS = {KeyboardInterrupt: "interrupted", Terminated: "terminated"}  # the last line of the log and of stderr
EXIT_CODES = {KeyboardInterrupt: 130, Terminated: 143, RankLost: 1}  # 128 + SIGINT, 128 + SIGTERM; a UsageError: 2

class StopSignal:
    """The first SIGINT or SIGTERM (as Terminated) stops the run at once; later ones cannot break into the cleanup."""

    ignored = False  # the run is ending (an error or a signal): a signal now changes nothing

    def __call__(self, signum: int, frame: object) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if not self.ignored:
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    @contextlib.contextmanager
    def installed(self, cli: bool = False) -> Iterator[None]:
        """Handle SIGINT and SIGTERM for one run, then hand them back: a process calling main() keeps its own. The
        command line (cli) ignores SIGINT from then on: a later Ctrl-C cannot cut its exit short (SIGTERM: a launcher
        still stops a rank waiting for rank 0 to say why)."""
        self.ignored = False
        previous = {s: signal.signal(s, self) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, signal.SIG_IGN if cli and s == signal.SIGINT else handler)
            self.ignored = False  # a signal belongs to its run: a later one starts afresh

STOP = StopSignal()

def one_line_error(e: BaseException, rt: Runtime | None) -> BaseException:
    """A collective's error for a lost peer, or torch's out-of-memory one, as one line saying what to do; else e."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if rt is not None and rt.world_size > 1 and (isinstance(e, dist.DistError) or
                                                 isinstance(e, RuntimeError) and "gloo/transport" in text):
        detail = text.split("] ", 1)[-1].split(". This is typically")[0][:200]
        return RankLost(f"rank {rt.rank} lost the connection to another rank ({detail}): a rank stopped or died; its "
                        f"own output says why")
    if not isinstance(e, torch.OutOfMemoryError):
        return e
    return OutOfMemory(f"rank {rt.rank if rt else 0} ran out of GPU memory: `python tools/memory_estimate.py --cards` "
                       f"gives the peak per rank on each card at 1 and 8 GPUs and the --micro_split=N that fits (each "
                       f"sequence cut into N micro-steps: less memory, an update measured close to the record's), "
                       f"or use more GPUs")

def on_rank0(rt: Runtime, fn: Callable[[], Any], share: bool = True) -> Any:
    """fn() on rank 0, its value (with share) sent to every rank; its UsageError raised on every rank: a refusal there
    stops them all with its one line, where a rank left waiting would only see its peer gone."""
    value, error = None, None
    if rt.rank == 0:
        try:
            value = fn()
        except UsageError as e:
            error = str(e)
    if rt.world_size > 1:
        box = [value if share else None, error]
        dist.broadcast_object_list(box, src=0)
        value, error = box[0] if share or rt.rank else value, box[1]
    if error is not None:
        raise UsageError(error)
    return value

def carry_on(cfg: Config) -> tuple[bool, bool]:
    """--resume=auto: whether run --run_id has finished (its summary written), and whether it has a log to continue;
    refused where that log holds another recipe or other code."""
    path = Path(cfg.log_dir) / f"{cfg.run_id}.txt"
    before = logged_run(path) if path.is_file() else None
    if before is not None and (why := continuation_error(str(path), *before, cfg)):
        raise UsageError(why)
    return path.with_suffix(".json").exists(), before is not None

def open_log(cfg: Config, stale: list[Path]) -> RunLog:
    """Rank 0's log, in a folder it checked (check_run_paths), held: a new one, or (--resume=auto) the run's own.
    The checkpoints --resume=auto passed over go only now, once no other launch can hold the run."""
    check_run_paths(cfg)
    path = Path(cfg.log_dir) / f"{cfg.run_id}.txt"
    log = RunLog(path, path.with_suffix(".jsonl"), append=cfg.resume == AUTO)
    remove_stale(stale)
    return log

def write_log_head(log: RunLog, cfg: Config, rt: Runtime, continuing: bool, checkpoint: Path | None,
                   skipped: str) -> None:
    """The log's head: the sources, environment and config of a new run, or (continuing) a line saying where this
    launch starts."""
    path = log.paths[0]
    if not continuing:  # a log a stop cut short in its header holds no step yet: it begins anew
        log.truncate()
        log.write_sources(source_files() + [TRACE_REPORT] * cfg.bench)
    log(SEPARATOR, console=False)
    # The console's first line: what names the run's files (the config, one long line, is the log's alone).
    log(f"run {cfg.run_id} seed {cfg.seed}, log {path}")
    log(environment_report(rt.device, cfg.cpu_bf16_gemm, cfg.compile))
    if not continuing:
        log(f"config: {json.dumps(dataclasses.asdict(cfg))}", console=False)
    if cfg.resume == AUTO:
        start = f"from {checkpoint}" if checkpoint else "no checkpoint yet: from step 0"
        log(f"resume: --resume=auto, launched {datetime.datetime.now():%Y-%m-%d %H:%M:%S}: {start}"
            f"{f'; {skipped}' if skipped else ''}")
    log(SEPARATOR)

def check_shared_folder(run_dir: Path, rt: Runtime, token: str) -> None:
    """A checkpoint is every rank's files in one folder (run_dir), which rank 0 completes and every rank reads to
    resume: for a run that saves or resumes, refuse at start-up ranks that do not see rank 0's files there (no shared
    disk)."""
    if rt.world_size == 1:
        return
    probe = run_dir / f".probe_{token}"
    if rt.rank == 0:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.touch()
    dist.barrier()
    seen: list[object] = [None] * rt.world_size
    dist.all_gather_object(seen, probe.exists())
    dist.barrier()
    probe.unlink(missing_ok=True)
    if blind := [r for r, s in enumerate(seen) if not s]:
        raise UsageError(f"rank(s) {', '.join(map(str, blind))} do not see rank 0's files in {probe.parent}: a "
                         f"checkpoint needs one folder every rank writes and reads (a shared file system); give "
                         f"--log_dir on one, or run without saving or resuming checkpoints")

def seed_of(run_id: str) -> int:
    """--resume=auto's seed when none is given: from the run id, so that every launch of the run draws the same."""
    return int.from_bytes(hashlib.sha256(run_id.encode()).digest()[:4], "little") % 2**31

def run(argv: list[str]) -> TrainResult | None:
    """Parse, set up and train; UsageError for what the user can fix, all checked before anything is written. A run
    stopped after its log opened says why there; its logs go to <run_id>.failed.* unless it finished, a signal stopped
    it after it recorded something, or it carries on (--resume=auto). None: a --resume=auto run that had finished."""
    rt, log, stop, error, auto = None, RunLog(None), None, None, False
    try:
        cfg = parse_config(argv)
        validate_config(cfg, int(os.environ.get("WORLD_SIZE", 1)))
        auto = cfg.resume == AUTO
        if cfg.resume and not auto:
            check_resume(cfg, Path(cfg.resume))
        rt = setup_runtime(cfg)
        # The seed and the run id, unless given: rank 0 draws them, every rank uses rank 0's; a token names this launch.
        cfg.seed, cfg.run_id, token = on_rank0(rt, lambda: (
            cfg.seed if cfg.seed >= 0 else seed_of(cfg.run_id) if auto else random.SystemRandom().randrange(2**31),
            cfg.run_id or f"{datetime.datetime.now():%Y%m%d_%H%M%S}_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex))
        checkpoint, skipped, stale, continuing = Path(cfg.resume) if cfg.resume and not auto else None, "", [], False
        if auto:
            finished, continuing = on_rank0(rt, lambda: carry_on(cfg))
            if finished:
                print0(f"run {cfg.run_id} has finished (its summary {cfg.log_dir}/{cfg.run_id}.json exists): nothing "
                       f"to carry on")
                return None
            checkpoint, skipped, stale = on_rank0(rt, lambda: newest_checkpoint(cfg))
            if checkpoint is not None:
                check_resume(cfg, checkpoint)
        check_model_fits(cfg, rt.device)
        vocabulary = read_vocabulary(cfg)
        train_files, val, documents = load_data(cfg, rt.device)
        torch.manual_seed(cfg.seed)
        log = on_rank0(rt, lambda: open_log(cfg, stale), share=False) or log  # held from here: set aside if need be
        on_rank0(rt, lambda: write_log_head(log, cfg, rt, continuing, checkpoint, skipped))
        if cfg.save_every or cfg.save_final or cfg.resume:
            check_shared_folder(Path(cfg.log_dir) / cfg.run_id, rt, token)
        with cpu_math(cfg.cpu_bf16_gemm, cfg.compile):
            result = train(cfg, rt, log, train_files, val, documents, vocabulary, checkpoint)
        if rt.world_size > 1:  # no rank tears the process group down while another uses it: that would abort its peer
            dist.barrier()
        return result
    except BaseException as e:
        STOP.ignored = True  # the run is ending: a signal now (torchrun's, after a rank died) would cut cleanup short
        error = one_line_error(e, rt)
        stop = f"error: {error}" if isinstance(error, (UsageError, RankLost)) else STOPS.get(
            type(error), f"failed: {type(error).__name__}: {error}")
        if error is not e:
            raise error from None
        raise
    finally:
        log.close(stop)
        finished = any(path.with_suffix(".json").exists() for path in log.paths)  # its summary (only rank 0's)
        kept = finished or auto or log.records and isinstance(error, KeyboardInterrupt)
        if error is not None and not kept and (aside := log.set_aside()) is not None:
            run_dir = log.paths[0].with_suffix("")
            free = "" if any(run_dir.glob("ckpt_*")) else "; the run id is free for a rerun"
            error.add_note(f"(its log is kept as {aside}{free})")  # a rerun with the same --run_id must not be refused
        if dist.is_initialized():
            dist.destroy_process_group()

SAID_WAIT_S = 30.0  # the most another rank waits for rank 0's line (it comes at once: every rank met the same error)

def rank0_said() -> None:
    """Rank 0 alone says why a run is refused, and the others exit only once it has (one exiting first would have
    torchrun stop rank 0 before it could): rank 0 marks its line printed in torchrun's store, which outlives the
    process group, and the others wait for the mark, at most SAID_WAIT_S."""
    rank, world_size = _rank_and_world()
    if world_size == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    key = f"train_gpt/rank0_said/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    with contextlib.suppress(RuntimeError, KeyError, ValueError):  # no store, or no mark in time: no more to wait
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=SAID_WAIT_S))
        if rank == 0:
            store.set(key, "")
        else:
            store.wait([key])

def main(cli: bool = False) -> None:
    argv = sys.argv[1:]
    if "--help" in argv or "-h" in argv:
        print0(config_help())
        return
    try:
        with STOP.installed(cli):
            run(argv)
    except (UsageError, RankLost, KeyboardInterrupt) as e:  # the loaders and checkpoint writers were closed by now
        say = print if isinstance(e, (OutOfMemory, RankLost)) else print0  # every rank its own; else rank 0 for all
        first = STOPS[type(e)] if isinstance(e, KeyboardInterrupt) else f"error: {e}"
        say("\n".join([first, *getattr(e, "__notes__", [])]), file=sys.stderr, flush=True)
        if isinstance(e, UsageError) and say is print0:
            rank0_said()
        sys.exit(EXIT_CODES.get(type(e), 2))

if __name__ == "__main__":
    main(cli=True)
