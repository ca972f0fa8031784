"""The optimization track (upstream's track 3): fewest steps to 3.28 val loss at a fixed model, data and batch, any
optimizer. Upstream's baseline (records/track_3_optimization/train_gpt_simple.py, result #36: Muon + AdamW, 3,250
steps) with this project's systems: prefetched batches, device-side metrics, logs holding every source file,
checkpoints, --resume=auto. Launch with `./run.sh train_optim.py [--optimizer=NAME] [--trials=N]` (every visible GPU;
without one, the tiny preset on the CPU's record path) or `torchrun --standalone --nproc_per_node=N train_optim.py ...`
(N in 1, 2, 4, 8). A new optimizer: a class in "Optimization", a recipe function in "Init & optimizer
hyperparameters" and its line in OPTIMIZERS."""

from __future__ import annotations

import dataclasses, datetime, difflib, functools, inspect, json, math, os, random, re, shutil, sys, textwrap, uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import AdamW

from train_gpt import (AUTO, CKPT_FORMAT, CKPT_META, CKPT_MODEL, EXIT_CODES, OutOfMemory, PrefetchLoader, RankLost,
                       RunLog, Runtime, SEPARATOR, STOP, STOPS, TrainClock, UsageError, _parse_value, all_gather_into,
                       bf16_gemm_path, carry_on, check_shared_folder, continuation_error, cpu_math, environment_report,
                       find_shards, load_shard, more_data_hint, newest_checkpoint, on_rank0, one_line_error, print0,
                       rank_file, read_checkpoint_meta, read_options, read_part, remove_stale, rule_holds, save_atomic,
                       seed_of, shard_token_count, source_digests, source_files, write_json_atomic)

# -----------------------------------------------------------------------------
# Architecture
# Upstream's baseline model, which the track fixes: a GPT of 12 blocks of 768 with QK-norm, half-truncated RoPE,
# ReLU^2 MLPs, RMSNorm gains and Linear biases, a soft-capped untied head. The embedding is stored in bf16, every other
# parameter in fp32; the forward runs in bf16 (weights cast), the logits in fp32. The loss is summed, not averaged.

class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gains = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.size(-1),), weight=self.gains.type_as(x))

class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.type_as(x), self.bias.type_as(x))

class Rotary(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        # half-truncated RoPE (with base frequency tuning): the last quarter of each half does not turn
        angular_freq = (1 / 1024) ** torch.linspace(0, 1, steps=dim // 4, dtype=torch.float32)
        self.register_buffer("angular_freq", torch.cat([angular_freq, angular_freq.new_zeros(dim // 4)]))

    def forward(self, x_BTHD: Tensor) -> Tensor:
        pos = torch.arange(x_BTHD.size(1), dtype=torch.float32, device=x_BTHD.device)
        theta = torch.outer(pos, self.angular_freq)[None, :, None, :]
        cos, sin = theta.cos(), theta.sin()
        x1, x2 = x_BTHD.to(dtype=torch.float32).chunk(2, dim=-1)
        y1 = x1 * cos + x2 * sin
        y2 = x1 * (-sin) + x2 * cos
        return torch.cat((y1, y2), 3).type_as(x_BTHD)

class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.num_heads = dim // head_dim
        self.head_dim = head_dim
        hdim = self.num_heads * self.head_dim
        self.q = Linear(dim, hdim)
        self.k = Linear(dim, hdim)
        self.v = Linear(dim, hdim)
        self.proj = Linear(hdim, dim)
        self.rotary = Rotary(head_dim)

    def forward(self, x: Tensor) -> Tensor:
        B, T = x.size(0), x.size(1)
        q = self.q(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k(x).view(B, T, self.num_heads, self.head_dim)
        v = self.v(x).view(B, T, self.num_heads, self.head_dim)
        q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.12,
                                           is_causal=True).transpose(1, 2)
        y = y.contiguous().view(B, T, self.num_heads * self.head_dim)
        return self.proj(y)

class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        hdim = 4 * dim
        self.fc = Linear(dim, hdim)
        self.proj = Linear(hdim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.fc(x).relu().square())

class Block(nn.Module):
    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.attn = CausalSelfAttention(dim, head_dim)
        self.mlp = MLP(dim)
        self.norm1 = RMSNorm(dim)
        self.norm2 = RMSNorm(dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))

class GPT(nn.Module):
    def __init__(self, vocab_size: int, num_layers: int, model_dim: int, head_dim: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, model_dim).bfloat16()
        self.blocks = nn.ModuleList([Block(model_dim, head_dim) for _ in range(num_layers)])
        self.proj = Linear(model_dim, vocab_size)
        self.norm1 = RMSNorm(model_dim)
        self.norm2 = RMSNorm(model_dim)

    def forward(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """The cross-entropy summed over the tokens (targets: int64, shaped as inputs)."""
        x = self.norm1(self.embed(inputs))
        for block in self.blocks:
            x = block(x)
        logits = self.proj(self.norm2(x)).float()
        logits = 15 * logits * (logits.square() + 15**2).rsqrt()
        return F.cross_entropy(logits.view(targets.numel(), -1), targets.view(-1), reduction="sum")

# -----------------------------------------------------------------------------
# Optimization
# The part a result changes. An optimizer is a torch.optim.Optimizer whose step() updates its parameters from their
# gradients, summed over every token of the step (all ranks, all micro-batches). Muon orthogonalizes the blocks'
# matrices, spread over the ranks (rank r takes matrices r, r + W, ...), then every rank gets them all.

class Compiled:
    """A function under torch.compile once a run turns compiling on (--compile: a GPU run's default), eager until then
    (a CPU run, the tests): upstream's @torch.compile, which a CPU run leaves out."""

    enabled = False

    def __init__(self, fn: Callable):
        self.fn, self.compiled = fn, torch.compile(fn)  # lazy: nothing compiles before the first compiled call
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return (self.compiled if Compiled.enabled else self.fn)(*args, **kwargs)

def zeropower_via_newtonschulz(G: Tensor) -> Tensor:
    """G's nearest semi-orthogonal matrix, roughly: 12 cubic Newton-Schulz iterations in bf16 on the wide side."""
    assert G.ndim >= 2
    X = G.bfloat16()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # the spectral norm at most 1
    a, b, c = 2, -1.5, 0.5  # not optimized for wall-clock
    for _ in range(12):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X

@Compiled
def muon_update(grad: Tensor, momentum: Tensor, mu: float = 0.95, nesterov: bool = True) -> Tensor:
    momentum.lerp_(grad, 1 - mu)
    update = grad.lerp_(momentum, mu) if nesterov else momentum
    update = zeropower_via_newtonschulz(update)
    update *= max(1, grad.size(-2) / grad.size(-1)) ** 0.5
    return update

def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

def share_updated(params: list[Tensor]) -> None:
    """After rank r updated params[r::W] (same dtype), every rank gets them all: one all-gather of flat copies."""
    rank, world_size = rank_and_world()
    if world_size == 1:
        return
    owned = [params[r::world_size] for r in range(world_size)]
    size = max(sum(p.numel() for p in mine) for mine in owned)
    gathered = params[0].new_empty(world_size * size)
    mine = gathered[rank * size:(rank + 1) * size]
    if owned[rank]:
        torch.cat([p.flatten() for p in owned[rank]], out=mine[:sum(p.numel() for p in owned[rank])])
    all_gather_into(gathered, mine)
    for r in range(world_size):
        offset = r * size
        for p in owned[r]:
            p.copy_(gathered[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

class Muon(torch.optim.Optimizer):
    def __init__(self, params: list[nn.Parameter], lr: float = 0.02, weight_decay: float = 0, mu: float = 0.95):
        assert isinstance(params, list) and len(params) >= 1 and isinstance(params[0], nn.Parameter)
        params = sorted(params, key=lambda x: x.size(), reverse=True)
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, mu=mu))

    @torch.no_grad()
    def step(self) -> None:
        rank, world_size = rank_and_world()
        for group in self.param_groups:
            for p in group["params"][rank::world_size]:
                state = self.state[p]
                if len(state) == 0:
                    state["momentum"] = torch.zeros_like(p)
                update = muon_update(p.grad, state["momentum"], mu=group["mu"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
            share_updated(group["params"])

# -----------------------------------------------------------------------------
# Init & optimizer hyperparameters
# A recipe (one per --optimizer) initializes the model and returns its optimizers, its step count and its schedule:
# upstream's "Init & Optim Hyperparams" section. Every parameter belongs to exactly one optimizer group; each group's
# lr is its initial lr times a linear warmup, then stable, then a linear decay to 0 (Recipe.set_hparams).

@dataclass
class Recipe:
    optimizers: list[torch.optim.Optimizer]
    train_steps: int  # we want to minimize this while still reaching 3.28 val loss
    warmup_steps: int = 0
    cooldown_frac: float = 0.7

    def set_hparams(self, step: int, train_steps: int) -> None:
        """Each group's lr for step: a linear warmup, stable, then a linear decay to 0 over the last cooldown_frac."""
        progress = step / train_steps
        assert 0 <= progress < 1
        warmup = min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps > 0 else 1.0
        eta = 1.0 if progress < 1 - self.cooldown_frac else (1 - progress) / self.cooldown_frac
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * warmup * eta

@torch.no_grad()
def init_baseline_(model: GPT) -> None:
    """Result #36's init: head and residual outputs zero, the rest a normal of torch's default variance, gains 1."""
    for name, w in model.named_parameters():
        if name.endswith("weight"):
            if "proj" in name:
                w.zero_()
            elif "embed" in name:
                w.normal_()  # default torch init
            else:
                w.normal_(std=0.33**0.5 / w.size(-1) ** 0.5)  # default torch init's variance
        elif name.endswith("bias"):
            w.zero_()
        elif name.endswith("gains"):
            w.normal_(mean=1, std=0)  # 1, drawn as upstream draws it
        else:
            raise ValueError(f"uninitialized parameter: {name}")

@torch.no_grad()
def init_torch_default_(model: GPT) -> None:
    """Result #2's init: torch's default init, drawn as the model's construction draws it, then "proj" zeroed."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):  # constructed in fp32, then cast to bf16
            module.weight.copy_(torch.empty_like(module.weight, dtype=torch.float32).normal_())
        elif isinstance(module, nn.Linear):
            module.reset_parameters()
        elif isinstance(module, RMSNorm):
            module.gains.fill_(1)
    for name, p in model.named_parameters():
        if "proj" in name:
            p.zero_()

def muon_recipe(model: GPT) -> Recipe:
    """Result #36, the baseline: Muon on the blocks' matrices, AdamW on the embedding, head and vectors (3.2787 at
    3,250 steps over 10 runs)."""
    init_baseline_(model)
    optimizer1 = AdamW([dict(params=[model.embed.weight], lr=0.7),
                        dict(params=[model.proj.weight], lr=0.004),
                        dict(params=[p for p in model.parameters() if p.ndim < 2], lr=0.015)],
                       betas=(0.8, 0.95), eps=1e-10, weight_decay=0.001, fused=True)
    optimizer2 = Muon([p for p in model.blocks.parameters() if p.ndim >= 2], lr=0.025, weight_decay=0.05)
    return Recipe([optimizer1, optimizer2], train_steps=3250)

def adam_recipe(model: GPT) -> Recipe:
    """Result #2: AdamW in place of Muon on the blocks' matrices, with its own auxiliary AdamW and init, a 250-step
    warmup on every group (3.2790 at 5,625 steps, one run)."""
    init_torch_default_(model)
    optimizer1 = AdamW([dict(params=[model.embed.weight], lr=0.3),
                        dict(params=[model.proj.weight], lr=1 / 320),
                        dict(params=[p for p in model.parameters() if p.ndim < 2], lr=0.01)],
                       betas=(0.8, 0.95), eps=1e-10, weight_decay=0, fused=True)
    optimizer2 = AdamW([p for p in model.blocks.parameters() if p.ndim >= 2],
                       lr=0.0015, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.10, fused=True)
    return Recipe([optimizer1, optimizer2], train_steps=5625, warmup_steps=250)

OPTIMIZERS: dict[str, Callable[[GPT], Recipe]] = {"muon": muon_recipe, "adam": adam_recipe}  # --optimizer=NAME

def build_recipe(name: str, model: GPT) -> Recipe:
    """The recipe `name` on model (initialized by it), each group's initial lr kept; every parameter optimized once."""
    recipe = OPTIMIZERS[name](model)
    taken = Counter(id(p) for opt in recipe.optimizers for group in opt.param_groups for p in group["params"])
    if wrong := [f"{n} ({taken[id(p)]}x)" for n, p in model.named_parameters() if taken[id(p)] != 1]:
        raise ValueError(f"recipe {name} must give every parameter to exactly one optimizer group: {', '.join(wrong)}")
    for opt in recipe.optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return recipe

# -----------------------------------------------------------------------------
# Data
# Upstream's order: the shards' tokens contiguously (not document-aligned), each step the next batch of a shard,
# moving to the next shard when one batch and a token no longer fit (the rest of the shard is skipped). Rank r takes
# the r-th slice of the batch (+1 target): with micro-batches of the same size, every world size sees the same ones.

def steps_in_shard(tokens: int, batch_tokens: int) -> int:
    """Batches a shard of `tokens` supplies: positions p = 0, B, 2B, ... with p + B + 1 < tokens."""
    return max(0, (tokens - batch_tokens - 2) // batch_tokens + 1)

class TokenBatches:
    """This rank's tokens of each step (batch_tokens / W + 1, contiguous) from `start` on: a PrefetchLoader's source."""

    def __init__(self, files: list[Path], batch_tokens: int, rank: int, world_size: int, vocab_size: int, steps: int,
                 start: int = 0):
        self.files, self.batch_tokens, self.vocab_size = files, batch_tokens, vocab_size
        self.local = batch_tokens // world_size
        self.offset, self.shape = rank * self.local, (self.local + 1,)
        self.remaining = steps - start
        self.shard, self.pos, self.tokens = 0, 0, None
        for count in map(shard_token_count, files):  # to step `start`'s shard and position
            if start < (n := steps_in_shard(count, batch_tokens)):
                break
            start -= n
            self.shard += 1
        self.pos = start * batch_tokens

    def fill(self, buffer: np.ndarray) -> tuple[int] | None:
        if self.remaining == 0:
            return None
        self.remaining -= 1
        if self.tokens is None:
            self.tokens = load_shard(self.files[self.shard], self.vocab_size)
        while self.pos + self.batch_tokens + 1 >= len(self.tokens):
            self.shard, self.pos = self.shard + 1, 0
            self.tokens = load_shard(self.files[self.shard], self.vocab_size)
        start = self.pos + self.offset
        buffer[:self.local + 1] = self.tokens[start:start + self.local + 1]
        self.pos += self.batch_tokens
        return self.shape

    def close(self) -> None:
        self.tokens = None

def split_batch(tokens: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """A rank's tokens (n * seq_len + 1) as upstream's inputs (int32) and targets (int64), each (n, seq_len)."""
    return tokens[:-1].view(-1, seq_len), tokens[1:].long().view(-1, seq_len)

# -----------------------------------------------------------------------------
# Training and validation
# A step: a forward-backward per micro-batch of mbs sequences (summed losses: their gradients add up), gradients summed
# over ranks (upstream's all-reduce), the lr set for the step, each optimizer's step. Validation: the summed loss of the
# first val_tokens tokens of the val shards over their count; at step 0, every val_every steps, every val_every_end in
# the last 10% and at the end.

def train_step(model: nn.Module, recipe: Recipe, inputs: Tensor, targets: Tensor, step: int, train_steps: int,
               mbs: int, losses: TrainLosses | None = None) -> None:
    for i in range(0, len(inputs), mbs):
        loss = model(inputs[i:i + mbs], targets[i:i + mbs])
        loss.backward()
        if losses is not None:
            losses.add(loss.detach())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        if dist.is_initialized():
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
    recipe.set_hparams(step, train_steps)
    for opt in recipe.optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)

@torch.no_grad()
def val_loss(model: nn.Module, inputs: Tensor, targets: Tensor, mbs: int, val_tokens: int) -> float:
    model.eval()
    loss = 0
    for i in range(0, len(inputs), mbs):
        loss += model(inputs[i:i + mbs], targets[i:i + mbs])
    if dist.is_initialized():
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
    model.train()
    return float(loss / val_tokens)

def validates_at(step: int, train_steps: int, every: int, every_end: int) -> bool:
    return step == train_steps or step % (every if step / train_steps < 0.9 else every_end) == 0

# -----------------------------------------------------------------------------
# Command line
# Every Config field is a flag (--field=value or --field value, as train_gpt.py reads them); --preset=tiny sets a
# few first. The track fixes the model, data and batch: those flags exist for the tiny preset and the tests.

@dataclass
class Config:
    # the recipe
    optimizer: str = "muon"  # the recipe (OPTIMIZERS): muon (result #36, the baseline) or adam (result #2)
    train_steps: int = 0  # steps per trial; 0: the recipe's own (muon 3,250, adam 5,625)
    trials: int = 1  # runs of the recipe in this process, seeds seed, seed + 1, ...; the model compiles once
    seed: int = -1  # the first trial's seed; -1: drawn (and logged)
    # the track's setup (fixed by its rules; the tiny preset shrinks it)
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 128
    num_layers: int = 12  # transformer blocks
    model_dim: int = 768  # residual width
    head_dim: int = 128  # width of an attention head (model_dim / head_dim heads)
    seq_len: int = 1024  # tokens per sequence
    batch_seqs: int = 512  # sequences per step over all ranks (8 x 64)
    mbs: int = 64  # sequences per forward-backward (micro-batch); a rank with more accumulates
    val_tokens: int = 20 * 524288  # validation tokens: the first ones of the val shards
    val_every: int = 125  # validation cadence
    val_every_end: int = 25  # validation cadence in the last 10% of the steps
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"  # training shards (glob; relative: also under this folder)
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"  # validation shards (glob)
    # systems
    device: str = "auto"  # auto (CUDA when visible), cuda or cpu
    compile: bool | None = None  # torch.compile the model and muon_update, as upstream; auto: on CUDA
    cpu_bf16_gemm: str = "auto"  # a CPU's bf16 GEMMs: native, fp32 (fp32 GEMM, rounded) or auto (fp32 unless native)
    prefetch_depth: int = 2  # batches a thread prepares ahead (0: none)
    log_every: int = 1  # steps between train-loss lines (one collective and one copy to the host each)
    log_dir: str = "logs"  # where <run_id>.txt, .jsonl, .json and the checkpoints go
    run_id: str = ""  # names the run's files; empty: a fresh one
    save_every: int = 0  # a checkpoint every N steps of each trial (0: none): <log_dir>/<run_id>/ckpt_<step>/
    save_minutes: float = 5.0  # with --resume=auto, also a checkpoint after each N minutes of a trial's training
    resume: str = ""  # auto: carry on run --run_id from its newest checkpoint; or a checkpoint to go on from (new id)
    preset: str = ""  # tiny: the baseline at 4 x 128 on the bundled sample, 20 steps, on the CPU

PRESETS: dict[str, dict[str, object]] = {
    # The baseline scaled down to the bundled sample: 8 micro-batches of 1 x 128 tokens a step as upstream's 8 of
    # 64 x 1,024, the validation cadence scaled with the steps, fp32 GEMMs (the CPU record path: records/README.md).
    "tiny": dict(train_steps=20, seed=1337, num_layers=4, model_dim=128, head_dim=64, seq_len=128, batch_seqs=8, mbs=1,
                 val_tokens=2048, val_every=8, val_every_end=2, train_files="data/sample/sample_train_*.bin",
                 val_files="data/sample/sample_val_*.bin", device="cpu", cpu_bf16_gemm="fp32"),
}
FIELD_KINDS = {f.name: f.type for f in dataclasses.fields(Config)}
FIELD_RULES = {name: rule for rule, names in {
    ">= 1": "trials vocab_size num_layers model_dim head_dim seq_len batch_seqs mbs val_tokens val_every val_every_end "
            "log_every",
    ">= 0": "train_steps save_every prefetch_depth", ">= -1": "seed", "in [0, 100000]": "save_minutes"}.items()
    for name in names.split()}
RUN_ID_MAX = 200  # with ".jsonl" added, within the 255-byte file names of common file systems

def parse_config(argv: list[str]) -> Config:
    """Defaults, then the preset's fields, then explicit --field=value overrides."""
    overrides = {name: _parse_value(name, FIELD_KINDS[name], text) for name, text in
                 read_options(argv, FIELD_KINDS).items()}
    preset = str(overrides.get("preset", ""))
    if preset and preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}; choose from: {', '.join(PRESETS)}")
    return Config(**{**PRESETS.get(preset, {}), **overrides})

def validate_config(cfg: Config, world_size: int) -> None:
    """Refuse, in one line, what the run cannot use: checked before any file or device is touched."""
    for name, rule in FIELD_RULES.items():
        if not rule_holds(rule, getattr(cfg, name)):
            raise UsageError(f"--{name} must be {rule}, got {getattr(cfg, name)}")
    rank_seqs, near = cfg.batch_seqs // world_size, difflib.get_close_matches(cfg.optimizer, OPTIMIZERS, 1)
    refusals = [
        (cfg.optimizer not in OPTIMIZERS, f"unknown --optimizer={cfg.optimizer!r}; choose from: "
         f"{', '.join(OPTIMIZERS)}{f' (did you mean {near[0]}?)' if near else ''}"),
        (cfg.batch_seqs % world_size or rank_seqs % cfg.mbs, f"--batch_seqs={cfg.batch_seqs} over {world_size} "
         f"rank(s) must give each a multiple of --mbs={cfg.mbs} sequences: launch 1, 2, 4 or 8 ranks for the track"),
        (cfg.val_tokens % (world_size * cfg.mbs * cfg.seq_len), f"--val_tokens={cfg.val_tokens} must split into "
         f"micro-batches of --mbs={cfg.mbs} x --seq_len={cfg.seq_len} tokens on each of {world_size} rank(s)"),
        (cfg.head_dim % 4 or cfg.model_dim % cfg.head_dim, f"--head_dim={cfg.head_dim} must be a multiple of 4 "
         f"(half-truncated RoPE) dividing --model_dim={cfg.model_dim}"),
        (cfg.device not in ("auto", "cuda", "cpu"), f"--device must be auto, cuda or cpu, got {cfg.device!r}"),
        (cfg.cpu_bf16_gemm not in ("auto", "native", "fp32"),
         f"--cpu_bf16_gemm must be auto, native or fp32, got {cfg.cpu_bf16_gemm!r}"),
        (cfg.run_id in (".", "..") or len(cfg.run_id) > RUN_ID_MAX or any(
            c in "/\\" or c.isspace() or not c.isprintable() for c in cfg.run_id),
         f"--run_id={cfg.run_id!r} names the run's files inside --log_dir: no '/' or '\\', no whitespace or control "
         f"characters, not '.' or '..', at most {RUN_ID_MAX} characters"),
        (not cfg.log_dir.strip(), "--log_dir is empty: give the folder for the run's logs (e.g. --log_dir=logs)"),
        (cfg.resume == AUTO and not cfg.run_id, "--resume=auto carries on the run named by --run_id: give one (the "
         "same in every launch of the run)"),
        *((not getattr(cfg, n).strip(), f"--{n} is empty: give a glob of token shards, e.g. --{n}="
           f"'{PRESETS['tiny'][n]}'") for n in ("train_files", "val_files")),
    ]
    for problem, line in refusals:
        if problem:
            raise UsageError(line)

def config_help() -> str:
    """--help from Config's source: its group comments and each field's default and comment."""
    lines = ["usage: train_optim.py [--field=value ...]   (on N GPUs: torchrun --standalone --nproc_per_node=N "
             "train_optim.py ...)"]
    defaults = {f.name: "auto" if f.default is None else f.default for f in dataclasses.fields(Config)}
    for line in inspect.getsource(Config).splitlines()[2:]:
        code, _, comment = line.strip().partition("  # ")
        if code.startswith("# "):
            lines.append(f"\n{code[2:]}:")
        elif ":" in code:
            flag = f"  --{(name := code.split(':')[0])}={defaults[name]}"
            body = textwrap.fill(comment, 120, initial_indent=" " * 40, subsequent_indent=" " * 40)
            lines.append(f"{flag:<40}{body[40:]}" if len(flag) < 40 else f"{flag}\n{body}")
    lines += ["\npresets:", *(textwrap.fill(", ".join(f"--{k}={v}" for k, v in fields.items()), 116,
                                            initial_indent=f"  {name}: ", subsequent_indent="    ")
                              for name, fields in PRESETS.items())]
    return "\n".join(lines)

# -----------------------------------------------------------------------------
# Metrics
# Rank 0 writes logs/<run_id>.txt (every source file, the environment, the config, then upstream's val lines, the
# trials one after another), a JSONL record per train-loss line and validation (full precision) and a summary. The
# train loss stays on the device: one all-reduce and one copy to a pinned host slot per logging step, no host sync.

@dataclass
class PendingLoss:
    step: int
    train_time_ms: float
    steps: int  # the steps its loss sums over
    slot: int
    event: torch.cuda.Event | None

class TrainLosses:
    """Each micro-batch's summed loss added on the device; a logging step's sum and the rank's train time are summed
    over the ranks by one all-reduce, staged to a host slot and printed once landed. The ranks' mean train time at the
    previous logging step (agreed_ms) is the same number on every rank: what --save_minutes counts."""

    SLOTS = 8  # pinned host slots; with all in flight, the oldest is waited for

    def __init__(self, log: RunLog, device: torch.device, trial: int, train_steps: int, tokens_per_step: int,
                 log_every: int, train_time_ms: float = 0.0):
        self.log, self.trial, self.train_steps, self.log_every = log, trial, train_steps, log_every
        self.tokens_per_step, self.steps, self.next_slot = tokens_per_step, 0, 0
        self.on_cuda = device.type == "cuda"
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.host = torch.zeros(self.SLOTS, 2, dtype=torch.float64, pin_memory=self.on_cuda)  # loss sum, time sum
        self.pending: list[PendingLoss] = []
        self.last: PendingLoss | None = None  # the latest staged line
        self.agreed_ms = train_time_ms

    def add(self, loss: Tensor) -> None:
        self.total += loss

    def end_step(self, step: int, train_time_ms: float) -> None:
        """Step `step` (1-based) is done; a logging step stages the mean loss of the steps since the last line."""
        self.steps += 1
        if step % self.log_every and step != self.train_steps:
            self.poll()
            return
        local = torch.empty(2, dtype=torch.float64, device=self.total.device)
        local[0].copy_(self.total)
        local[1].fill_(train_time_ms)  # a host number is fill_'s kernel argument: no copy to the device
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        if world_size > 1:
            dist.all_reduce(local, op=dist.ReduceOp.SUM)
        if self.last is not None:  # every rank, at the same step: the previous line landed long ago
            self._landed(self.last)
            self.agreed_ms = float(self.host[self.last.slot, 1]) / world_size
        if len(self.pending) == self.SLOTS:
            self._print(self.pending.pop(0))
        slot, self.next_slot = self.next_slot, (self.next_slot + 1) % self.SLOTS
        self.host[slot].copy_(local, non_blocking=self.on_cuda)
        event = torch.cuda.Event() if self.on_cuda else None
        if event is not None:
            event.record()
        self.last = PendingLoss(step, train_time_ms, self.steps, slot, event)
        self.pending.append(self.last)
        self.total.zero_()
        self.steps = 0
        self.poll()

    def poll(self, wait: bool = False) -> None:
        while self.pending and (wait or self.pending[0].event is None or self.pending[0].event.query()):
            self._print(self.pending.pop(0))

    @staticmethod
    def _landed(p: PendingLoss) -> None:
        if p.event is not None:
            p.event.synchronize()

    def _print(self, p: PendingLoss) -> None:
        """The line's loss into the .jsonl, pushed to the OS, then to the console: a line seen is kept."""
        self._landed(p)
        loss = float(self.host[p.slot, 0]) / (p.steps * self.tokens_per_step)
        self.log.record({"trial": self.trial, "step": p.step, "train_loss": loss, "train_time_ms": p.train_time_ms})
        self.log.flush()
        print0(f"step:{p.step}/{self.train_steps} train_loss:{loss:.4f} train_time:{p.train_time_ms / 1000:.3f}s "
               f"step_avg:{p.train_time_ms / p.step:.2f}ms")

    def state(self) -> dict[str, object]:
        """What a checkpoint keeps of it: the loss summed since the last line (this rank's), and over how many steps."""
        return {"total": self.total.cpu(), "steps": self.steps}

    def load_state(self, state: dict[str, object]) -> None:
        self.total.copy_(state["total"])
        self.steps = state["steps"]

def val_line(step: int, train_steps: int, loss: float, train_time_ms: float, step_avg_ms: float) -> str:
    """Upstream's validation line (step_avg: since the previous validation; nan at step 0)."""
    return (f"step:{step}/{train_steps} val_loss:{loss:.5f} train_time:{train_time_ms / 1000:.3f}s "
            f"step_avg:{step_avg_ms:.2f}ms")

def open_log(cfg: Config, rt: Runtime, gemm_path: str, parameters: int, continuing: bool, checkpoint: Path | None,
             skipped: str, stale: list[Path]) -> RunLog:
    """Rank 0's log: a new one, or (continuing, --resume=auto) the run's own, after a line saying where it starts."""
    path = Path(cfg.log_dir) / f"{cfg.run_id}.txt"
    log = RunLog(path, path.with_suffix(".jsonl"), append=cfg.resume == AUTO)
    remove_stale(stale)
    if not continuing:  # a log a stop cut short in its header holds no step yet: it begins anew
        log.truncate()
        log.write_sources(source_files(Path(__file__)))
    log(SEPARATOR, console=False)
    log(f"run {cfg.run_id} seed {cfg.seed}, log {path}")
    log(environment_report(rt.device, gemm_path, cfg.compile))
    if not continuing:
        log(f"config: {json.dumps(dataclasses.asdict(cfg))}", console=False)
    log(f"model: {parameters:,} parameters, compile {cfg.compile}, world size {rt.world_size}, grad accumulation "
        f"{cfg.batch_seqs // rt.world_size // cfg.mbs}, optimizer {cfg.optimizer}")
    if cfg.resume == AUTO:
        start = f"from {checkpoint}" if checkpoint else "no checkpoint yet: from step 0"
        log(f"resume: --resume=auto, launched {datetime.datetime.now():%Y-%m-%d %H:%M:%S}: {start}"
            f"{f'; {skipped}' if skipped else ''}")
    log(SEPARATOR)
    return log

# -----------------------------------------------------------------------------
# Checkpoints
# --save_every=N writes <log_dir>/<run_id>/ckpt_<step>/ (trial<T>_ckpt_<step> with several trials) as train_gpt.py
# does: model.pt, each rank's optimizer state in rank<R>.pt, then meta.json listing every file with its size and sha256
# (complete once it exists), and the run's val losses so far. --resume continues the trial exactly, bit for bit at the
# same world size. --resume=auto also saves after each --save_minutes of a trial's training and keeps the newest two
# of those; its next launch takes the newest complete checkpoint (train_gpt.newest_checkpoint).

TRAINER = "train_optim.py"
# The fields a checkpoint's run must share with the run resuming it: the model's shapes, the recipe and the data.
RESUME_MATCH = ("optimizer", "vocab_size", "num_layers", "model_dim", "head_dim", "seq_len", "batch_seqs",
                "val_tokens", "train_files", "val_files")
CKPT_NAME = re.compile(r"(?:trial(\d+)_)?ckpt_(\d+)")
ROLLING_KEPT = 2  # --save_minutes' checkpoints kept: the newest two (one may be cut short by a stop)

@dataclass
class Trial:
    seed: int
    val_losses: list[tuple[int, float, float]] = field(default_factory=list)  # (step, loss, train time ms)

@dataclass
class ResumePoint:
    folder: Path
    trial: int
    step: int
    train_time_ms: float
    trials: list[Trial]  # the run's trials up to this one, whose val losses so far come last

def checkpoint_folder(cfg: Config, trial: int, step: int) -> Path:
    name = f"ckpt_{step}" if cfg.trials == 1 else f"trial{trial + 1}_ckpt_{step}"
    return Path(cfg.log_dir) / cfg.run_id / name

def checkpoint_order(folder: Path) -> tuple[int, int]:
    """(trial, step) of a checkpoint folder's name: trials in order, then steps."""
    m = CKPT_NAME.fullmatch(folder.name)
    return int(m[1] or 1), int(m[2])

def checkpoints(cfg: Config) -> list[Path]:
    """The run's checkpoint folders, oldest first."""
    found = (Path(cfg.log_dir) / cfg.run_id).glob("*ckpt_*")
    return sorted((f for f in found if CKPT_NAME.fullmatch(f.name)), key=checkpoint_order)

def drop_old_rolling(cfg: Config) -> None:
    """--save_minutes' checkpoints serve only to carry a run on: all but the newest ROLLING_KEPT complete ones go."""
    def rolling(folder: Path) -> bool:
        try:
            return json.loads((folder / CKPT_META).read_text()).get("rolling") is True
        except (OSError, ValueError):
            return False
    for folder in list(filter(rolling, checkpoints(cfg)))[:-ROLLING_KEPT]:
        shutil.rmtree(folder, ignore_errors=True)

def save_checkpoint(cfg: Config, rt: Runtime, model: GPT, recipe: Recipe, losses: TrainLosses, trials: list[Trial],
                    step: int, train_time_ms: float, rolling: bool) -> Path:
    """Every rank's files, then meta.json (rank 0) once all are written: a folder without it is incomplete. trials:
    the run's so far, this one last."""
    trial = len(trials) - 1
    folder = checkpoint_folder(cfg, trial, step)
    folder.mkdir(parents=True, exist_ok=True)
    sums = {rank_file(rt.rank): save_atomic({"trial": trial, "step": step, "losses": losses.state(), "optimizers": [
        opt.state_dict() for opt in recipe.optimizers]}, folder / rank_file(rt.rank))}
    if rt.rank == 0:
        sums[CKPT_MODEL] = save_atomic({k: v.cpu() for k, v in model.state_dict().items()}, folder / CKPT_MODEL)
    every = [sums]
    if rt.world_size > 1:
        every = [None] * rt.world_size
        dist.all_gather_object(every, sums)
    if rt.rank == 0:
        files = {name: {"bytes": (folder / name).stat().st_size, "sha256": h} for part in every
                 for name, h in part.items()}
        write_json_atomic(folder / CKPT_META, {
            "format": CKPT_FORMAT, "trainer": TRAINER, "step": step, "trial": trial, "world_size": rt.world_size,
            "train_time_ms": train_time_ms, "run_id": cfg.run_id, "config": dataclasses.asdict(cfg),
            "sources": source_digests(source_files(Path(__file__))), "files": files, "rolling": rolling,
            "trials": [dataclasses.asdict(t) for t in trials],
            "saved_at": datetime.datetime.now().isoformat(timespec="seconds")})
        if rolling:
            drop_old_rolling(cfg)
    if rt.world_size > 1:
        dist.barrier()  # complete for every rank before any goes on
    return folder

def check_resume(cfg: Config, folder: Path, world_size: int) -> ResumePoint:
    """Before anything is written: the checkpoint is complete, intact, this trainer's and this run's (--resume=auto:
    of this config and code, all but CONTINUATION_FREE)."""
    meta = read_checkpoint_meta(folder)
    for name, entry in meta["files"].items():
        read_part(folder / name, entry.get("sha256"))
    saved = meta["config"]
    if meta.get("trainer") != TRAINER:
        raise UsageError(f"checkpoint {folder} is not {TRAINER}'s (train_gpt.py's resumes with train_gpt.py)")
    if cfg.resume == AUTO and (why := continuation_error(f"checkpoint {folder}", saved, meta.get("sources", {}), cfg)):
        raise UsageError(why)
    if meta["world_size"] != world_size:
        raise UsageError(f"checkpoint {folder} was saved by {meta['world_size']} rank(s): resume it with as many "
                         f"(this launch has {world_size}); Muon's momenta are spread over the ranks")
    if diffs := [f"--{k}={saved.get(k)} (this run: {getattr(cfg, k)})" for k in RESUME_MATCH
                 if saved.get(k) != getattr(cfg, k)]:
        raise UsageError(f"checkpoint {folder} needs {', '.join(diffs)}: the model, recipe and data must match")
    if cfg.seed not in (-1, saved["seed"]) or cfg.train_steps not in (0, saved["train_steps"]):
        raise UsageError(f"checkpoint {folder} is of a run with --seed={saved['seed']} --train_steps="
                         f"{saved['train_steps']}: leave them out or give these")
    if meta["trial"] >= cfg.trials:
        raise UsageError(f"checkpoint {folder} is of trial {meta['trial'] + 1}: give --trials={meta['trial'] + 1} "
                         f"or more")
    try:
        trials = [Trial(t["seed"], [tuple(v) for v in t["val_losses"]]) for t in meta["trials"]]
    except (KeyError, TypeError):
        raise UsageError(f"checkpoint {folder}: {CKPT_META} lacks the run's val losses (an older {TRAINER}'s)"
                         ) from None
    cfg.seed, cfg.train_steps = saved["seed"], saved["train_steps"]
    return ResumePoint(folder, meta["trial"], meta["step"], float(meta["train_time_ms"]), trials)

def load_checkpoint(point: ResumePoint, rt: Runtime, model: GPT, recipe: Recipe, losses: TrainLosses) -> None:
    meta = read_checkpoint_meta(point.folder)
    files = meta["files"]
    state = read_part(point.folder / CKPT_MODEL, files[CKPT_MODEL]["sha256"], load=True)
    model.load_state_dict(state)
    part = read_part(point.folder / rank_file(rt.rank), files[rank_file(rt.rank)]["sha256"], load=True)
    for opt, saved in zip(recipe.optimizers, part["optimizers"], strict=True):
        opt.load_state_dict(saved)
    losses.load_state(part["losses"])

# -----------------------------------------------------------------------------
# Main
# Reads the launch (torchrun's RANK / WORLD_SIZE / LOCAL_RANK), checks everything a run needs before writing anything,
# builds and compiles the model once, then runs the trials one after another, each from its own seed's init.

def setup_runtime(cfg: Config) -> Runtime:
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    want = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cpu")
    if want == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device=cuda but no CUDA GPU is visible; use --device=cpu (or --preset=tiny)")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    return Runtime(rank, world_size, device)

def check_data(cfg: Config, train_steps: int) -> tuple[list[Path], list[Path]]:
    """The shards exist, are intact and hold the run's steps and the validation tokens."""
    train_files, val_files = find_shards(cfg.train_files), find_shards(cfg.val_files)
    batch_tokens = cfg.batch_seqs * cfg.seq_len
    supplied = sum(steps_in_shard(shard_token_count(f), batch_tokens) for f in train_files)
    if supplied < train_steps:
        raise UsageError(f"the run needs {train_steps} steps of {batch_tokens:,} tokens but {len(train_files)} file(s) "
                         f"supply {supplied}; lower --train_steps or {more_data_hint(cfg.train_files)}")
    if not any(steps_in_shard(shard_token_count(f), cfg.val_tokens) for f in val_files):
        raise UsageError(f"validation needs {cfg.val_tokens + 2:,} tokens in one val shard; no file of "
                         f"{cfg.val_files!r} holds as many: lower --val_tokens")
    return train_files, val_files

def check_run_paths(cfg: Config) -> None:
    """The log folder is writable and no earlier run's logs or checkpoints would be replaced (--resume=auto: they are
    the run it continues)."""
    log_dir = Path(cfg.log_dir)
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--log_dir={cfg.log_dir}: cannot create it ({e.strerror}); give a writable folder") from None
    if not os.access(log_dir, os.W_OK | os.X_OK):
        raise UsageError(f"--log_dir={cfg.log_dir} is not writable; give a writable folder")
    if cfg.resume == AUTO:
        return
    if logs := [p.name for p in (log_dir / f"{cfg.run_id}{ext}" for ext in (".txt", ".jsonl", ".json")) if p.exists()]:
        raise UsageError(f"run {cfg.run_id} already has {', '.join(logs)} in {log_dir}: use another --run_id, "
                         f"--resume=auto to continue that run, or delete or move those files")
    if cfg.save_every and (log_dir / cfg.run_id).is_dir():
        raise UsageError(f"{log_dir / cfg.run_id} already exists and checkpoints are never overwritten; use another "
                         f"--run_id")

def saves_at(cfg: Config, step: int, agreed_ms: float, saved_ms: float) -> str | None:
    """Whether step saves a checkpoint: "asked" at --save_every's steps, "rolling" with --resume=auto once
    --save_minutes of training passed since the last save (by the train time every rank agrees on), else None."""
    if cfg.save_every and step % cfg.save_every == 0:
        return "asked"
    rolling = cfg.resume == AUTO and cfg.save_minutes and agreed_ms - saved_ms >= 60_000 * cfg.save_minutes
    return "rolling" if rolling else None

def run_trial(cfg: Config, rt: Runtime, log: RunLog, model: GPT, trials: list[Trial], train_files: list[Path],
              val: tuple[Tensor, Tensor], resumed: ResumePoint | None) -> Trial:
    """Trial len(trials) (after those done) from its seed's init, or a checkpoint: upstream's loop, validation lines
    into the log."""
    trial = len(trials)
    result = resumed.trials[-1] if resumed else Trial(cfg.seed + trial)
    torch.manual_seed(result.seed)
    recipe = build_recipe(cfg.optimizer, model)
    train_steps = cfg.train_steps or recipe.train_steps
    start, ms = (resumed.step, resumed.train_time_ms) if resumed else (0, 0.0)
    losses = TrainLosses(log, rt.device, trial, train_steps, cfg.batch_seqs * cfg.seq_len, cfg.log_every, ms)
    if resumed:
        load_checkpoint(resumed, rt, model, recipe, losses)
        log(f"resume: {resumed.folder} at step {start} of trial {trial + 1}, train_time so far {ms / 1000:.3f}s")
    elif rt.world_size > 1:
        for p in model.parameters():  # every rank starts from rank 0's init
            dist.broadcast(p.detach(), 0)
    log(f"trial {trial + 1}/{cfg.trials}: seed {result.seed}, --optimizer={cfg.optimizer}, {train_steps} steps",
        console=cfg.trials > 1)
    batches = TokenBatches(train_files, cfg.batch_seqs * cfg.seq_len, rt.rank, rt.world_size, cfg.vocab_size,
                           train_steps, start)
    last_val, _, last_val_ms = result.val_losses[-1] if result.val_losses else (start, None, ms)
    saved_ms = ms  # the agreed train time at the last checkpoint (or the start)
    with PrefetchLoader(batches, cfg.prefetch_depth, rt.device) as loader:
        clock = TrainClock(rt.device, ms)
        for step in range(start, train_steps + 1):
            if validates_at(step, train_steps, cfg.val_every, cfg.val_every_end) and not (resumed and step == start):
                if rt.world_size > 1:
                    dist.barrier()
                ms = clock.stop()
                losses.poll(wait=True)
                loss = val_loss(model, *val, cfg.mbs, cfg.val_tokens)
                step_avg = (ms - last_val_ms) / (step - last_val) if step > last_val else math.nan
                last_val, last_val_ms = step, ms
                log(val_line(step, train_steps, loss, ms, step_avg), flush=True)
                log.record({"trial": trial, "step": step, "val_loss": loss, "train_time_ms": ms})
                result.val_losses.append((step, loss, ms))
                if rt.world_size > 1:
                    dist.barrier()
                clock.start()
            if start < step < train_steps and (why := saves_at(cfg, step, losses.agreed_ms, saved_ms)):
                ms = clock.stop()
                losses.poll(wait=True)  # the lines up to this step on disk before the checkpoint that skips them
                log.flush()
                folder = save_checkpoint(cfg, rt, model, recipe, losses, [*trials, result], step, ms, why == "rolling")
                log(f"checkpoint: {folder} (step {step})", flush=True)
                saved_ms = losses.agreed_ms
                clock.start()
            if step == train_steps:
                break
            inputs, targets = split_batch(next(loader), cfg.seq_len)
            train_step(model, recipe, inputs, targets, step, train_steps, cfg.mbs, losses)
            losses.end_step(step + 1, clock.now())
        losses.poll(wait=True)
    return result

def load_val(cfg: Config, rt: Runtime, files: list[Path]) -> tuple[Tensor, Tensor]:
    """This rank's validation tokens on the device: the first batch of val_tokens of the val stream, as upstream."""
    source = TokenBatches(files, cfg.val_tokens, rt.rank, rt.world_size, cfg.vocab_size, steps=1)
    tokens = np.empty(source.shape, dtype=np.int32)
    source.fill(tokens)
    return split_batch(torch.from_numpy(tokens).to(rt.device), cfg.seq_len)

def write_summary(cfg: Config, rt: Runtime, trials: list[Trial]) -> None:
    summary = {"run_id": cfg.run_id, "optimizer": cfg.optimizer, "world_size": rt.world_size, "seed": cfg.seed,
               "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
               "gpu_names": [torch.cuda.get_device_name(rt.device)] if rt.device.type == "cuda" else [],
               "config": dataclasses.asdict(cfg),
               "trials": [{"seed": t.seed, "final_val_loss": t.val_losses[-1][1], "train_time_ms": t.val_losses[-1][2],
                           "steps": t.val_losses[-1][0], "val_losses": [list(v) for v in t.val_losses]}
                          for t in trials]}
    if len(trials) == 1:  # tools/compare.py's keys for one run
        summary |= {"final_val_loss": trials[0].val_losses[-1][1], "train_time_ms": trials[0].val_losses[-1][2],
                    "steps": trials[0].val_losses[-1][0], "val_losses": summary["trials"][0]["val_losses"]}
    write_json_atomic(Path(cfg.log_dir) / f"{cfg.run_id}.json", summary)

def out_of_memory(rt: Runtime | None) -> OutOfMemory:
    return OutOfMemory(f"rank {rt.rank if rt else 0} ran out of GPU memory: lower --mbs (micro-batches of fewer "
                       f"sequences, more of them: the same update up to summation order), or use more GPUs")

def carry_on_from(cfg: Config, rt: Runtime, world_size: int
                  ) -> tuple[bool, bool, ResumePoint | None, str, list[Path]]:
    """--resume=auto: whether the run has finished, whether it has a log to continue, its newest complete checkpoint
    (None: from step 0) and a line on the newer ones skipped; what cannot continue exactly is refused."""
    finished, continuing = on_rank0(rt, lambda: carry_on(cfg))
    if finished:
        return True, continuing, None, "", []
    folder, skipped, stale = on_rank0(rt, lambda: newest_checkpoint(cfg, checkpoints(cfg)))
    return False, continuing, check_resume(cfg, folder, world_size) if folder else None, skipped, stale

def run(argv: list[str]) -> list[Trial]:
    """Parse, check, set up and train every trial; a UsageError for what the user can fix, before anything is written.
    Returns this rank's trials (rank 0's hold the logged losses); none for a --resume=auto run that had finished."""
    rt, log, stop = None, RunLog(None), None
    try:
        cfg = parse_config(argv)
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        validate_config(cfg, world_size)
        auto = cfg.resume == AUTO
        resumed = check_resume(cfg, Path(cfg.resume), world_size) if cfg.resume and not auto else None
        rt = setup_runtime(cfg)
        cfg.compile = rt.device.type == "cuda" if cfg.compile is None else cfg.compile
        # The seed and the run id, unless given: rank 0 draws them, every rank uses rank 0's; a token names this launch.
        cfg.seed, cfg.run_id, token = on_rank0(rt, lambda: (
            cfg.seed if cfg.seed >= 0 else seed_of(cfg.run_id) if auto else random.SystemRandom().randrange(2**31),
            cfg.run_id or f"{datetime.datetime.now():%Y%m%d_%H%M%S}_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex))
        continuing, skipped, stale = False, "", []
        if auto:
            finished, continuing, resumed, skipped, stale = carry_on_from(cfg, rt, world_size)
            if finished:
                print0(f"run {cfg.run_id} has finished (its summary {cfg.log_dir}/{cfg.run_id}.json exists): nothing "
                       f"to carry on")
                return []
        model = GPT(cfg.vocab_size, cfg.num_layers, cfg.model_dim, cfg.head_dim).to(rt.device)
        train_files, val_files = check_data(cfg, cfg.train_steps or build_recipe(cfg.optimizer, model).train_steps)
        val = load_val(cfg, rt, val_files)
        on_rank0(rt, lambda: check_run_paths(cfg))
        gemm_path = bf16_gemm_path(cfg.cpu_bf16_gemm, rt.device.type == "cuda")
        parameters = sum(p.numel() for p in model.parameters())
        log = on_rank0(rt, lambda: open_log(cfg, rt, gemm_path, parameters, continuing,
                                            resumed.folder if auto and resumed else None, skipped, stale),
                       share=False) or log
        if cfg.save_every or cfg.resume:
            check_shared_folder(Path(cfg.log_dir) / cfg.run_id, rt, token)
        Compiled.enabled = cfg.compile
        if cfg.compile:
            model.compile(dynamic=False)
        trials = resumed.trials[:-1] if resumed else []
        with cpu_math(gemm_path, cfg.compile):
            while len(trials) < cfg.trials:
                here = resumed if resumed and len(trials) == resumed.trial else None
                trials.append(run_trial(cfg, rt, log, model, trials, train_files, val, here))
        if rt.rank == 0:
            write_summary(cfg, rt, trials)
            log(f"summary: {Path(cfg.log_dir) / cfg.run_id}.json")
        if rt.world_size > 1:  # no rank tears the process group down while another uses it
            dist.barrier()
        return trials
    except BaseException as e:
        STOP.ignored = True  # the run is ending: a signal now would cut the cleanup short
        error = out_of_memory(rt) if isinstance(e, torch.OutOfMemoryError) else one_line_error(e, rt)
        stop = f"error: {error}" if isinstance(error, (UsageError, RankLost)) else STOPS.get(
            type(error), f"failed: {type(error).__name__}: {error}")
        if error is not e:
            raise error from None
        raise
    finally:
        Compiled.enabled = False
        log.close(stop)
        if dist.is_initialized():
            dist.destroy_process_group()

def main(cli: bool = False) -> None:
    argv = sys.argv[1:]
    if "--help" in argv or "-h" in argv:
        print0(config_help())
        return
    try:
        with STOP.installed(cli):
            run(argv)
    except (UsageError, RankLost, KeyboardInterrupt) as e:
        say = print if isinstance(e, (OutOfMemory, RankLost)) else print0  # every rank its own; else rank 0 for all
        say(STOPS[type(e)] if isinstance(e, KeyboardInterrupt) else f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CODES.get(type(e), 2))

if __name__ == "__main__":
    main(cli=True)
