"""Independent eager reference of upstream's optimization track (track 3): the baseline of result #36
(train_gpt_simple.py: a 12 x 768 GPT, Muon + AdamW, 3,250 steps) and the Adam-only result #2 (5,625 steps).

Written from upstream's two scripts and the track's README; single process (world size 1 unless a function takes a
rank), eager (upstream compiles the model and muon_update; compiled bf16 chains may round intermediates differently,
so the math here is the same order of operations, not promised bit-equal to a compiled run), CPU-runnable at any size.

Dtypes as upstream: embed.weight is bf16, every other parameter fp32; the forward runs in bf16 (every Linear and gain
is cast to the activations' dtype), rotary in fp32, the logits in fp32 from the soft-cap on.

"recipe" names the two setups: "baseline" (result #36) and "adam" (result #2, whose RMSNorm computes in fp32, whose
init only zeroes the "proj" parameters, with a 250-step warmup on every group and validation every 125 steps).
"""
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

RECIPES = ("baseline", "adam")
SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
VAL_TOKENS = 20 * 524288  # both scripts' val_tokens
BATCH_TOKENS = 8 * 64 * 1024  # both scripts' global batch: 512 sequences of 1024
MBS = 64  # sequences a micro-batch, both scripts
SEQ_LEN = 1024
BASELINE_STEPS = 3250
ADAM_STEPS = 5625
COOLDOWN_FRAC = 0.7
ADAM_WARMUP_STEPS = 250
SOFTCAP = 15
ATTN_SCALE = 0.12


def _check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")


# ----------------------------------------------------------------------------------------------------- model


class _Norm(nn.Module):
    """RMSNorm with gains. Result #36 normalises in the input's dtype with the gains cast to it; result #2 normalises
    in fp32, multiplies by the fp32 gains and casts back."""

    def __init__(self, dim: int, fp32: bool):
        super().__init__()
        self.gains = nn.Parameter(torch.ones(dim))
        self.fp32 = fp32

    def forward(self, x: Tensor) -> Tensor:
        if self.fp32:
            return (F.rms_norm(x.float(), (x.size(-1),)) * self.gains).type_as(x)
        return F.rms_norm(x, (x.size(-1),), weight=self.gains.type_as(x))


class _Linear(nn.Linear):
    """nn.Linear with a bias (so construction draws torch's default init, as upstream) run in the input's dtype."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.type_as(x), self.bias.type_as(x))


class _Rotary(nn.Module):
    """Half-truncated RoPE: frequencies (1/1024)^(i/(n-1)) on the first head_dim/4 dims of each half, zero (no
    rotation) on the last head_dim/4; dim i turns with dim i + head_dim/2."""

    def __init__(self, head_dim: int):
        super().__init__()
        freqs = (1 / 1024) ** torch.linspace(0, 1, steps=head_dim // 4, dtype=torch.float32)
        self.register_buffer("angular_freq", torch.cat([freqs, freqs.new_zeros(head_dim // 4)]))

    def forward(self, x_bthd: Tensor) -> Tensor:
        positions = torch.arange(x_bthd.size(1), dtype=torch.float32, device=x_bthd.device)
        theta = torch.outer(positions, self.angular_freq)[None, :, None, :]
        cos, sin = theta.cos(), theta.sin()
        first, second = x_bthd.to(dtype=torch.float32).chunk(2, dim=-1)
        turned_first = first * cos + second * sin
        turned_second = first * (-sin) + second * cos
        return torch.cat((turned_first, turned_second), 3).type_as(x_bthd)


class _Attention(nn.Module):
    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.num_heads = dim // head_dim
        self.head_dim = head_dim
        inner = self.num_heads * head_dim
        self.q = _Linear(dim, inner)
        self.k = _Linear(dim, inner)
        self.v = _Linear(dim, inner)
        self.proj = _Linear(inner, dim)
        self.rotary = _Rotary(head_dim)

    def forward(self, x: Tensor) -> Tensor:
        batch, time = x.size(0), x.size(1)
        shape = (batch, time, self.num_heads, self.head_dim)
        q, k, v = self.q(x).view(shape), self.k(x).view(shape), self.v(x).view(shape)
        q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))  # no gains: QK-norm
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           scale=ATTN_SCALE, is_causal=True).transpose(1, 2)
        return self.proj(y.contiguous().view(batch, time, self.num_heads * self.head_dim))


class _MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc = _Linear(dim, 4 * dim)
        self.proj = _Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.fc(x).relu().square())


class _Block(nn.Module):
    def __init__(self, dim: int, head_dim: int, fp32_norms: bool):
        super().__init__()
        self.attn = _Attention(dim, head_dim)
        self.mlp = _MLP(dim)
        self.norm1 = _Norm(dim, fp32_norms)
        self.norm2 = _Norm(dim, fp32_norms)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class RefGPT(nn.Module):
    """Upstream's GPT; modules are built in upstream's order, so construction draws the global RNG as upstream's."""

    def __init__(self, vocab_size: int = 50304, num_layers: int = 12, model_dim: int = 768, head_dim: int = 128,
                 recipe: str = "baseline"):
        super().__init__()
        _check_recipe(recipe)
        fp32_norms = recipe == "adam"
        self.embed = nn.Embedding(vocab_size, model_dim).bfloat16()
        self.blocks = nn.ModuleList([_Block(model_dim, head_dim, fp32_norms) for _ in range(num_layers)])
        self.proj = _Linear(model_dim, vocab_size)
        self.norm1 = _Norm(model_dim, fp32_norms)
        self.norm2 = _Norm(model_dim, fp32_norms)

    def forward(self, inputs: Tensor, targets: Tensor) -> Tensor:
        x = self.norm1(self.embed(inputs))
        for block in self.blocks:
            x = block(x)
        logits = self.proj(self.norm2(x)).float()
        logits = SOFTCAP * logits * (logits.square() + SOFTCAP**2).rsqrt()
        return F.cross_entropy(logits.view(targets.numel(), -1), targets.view(-1), reduction="sum")


@torch.no_grad()
def init_baseline_(model: RefGPT) -> None:
    """Result #36's init loop, in named_parameters() order (the order the global RNG is drawn in)."""
    for name, p in model.named_parameters():
        if name.endswith("weight"):
            if "proj" in name:  # both residual-branch outputs and the head
                p.zero_()
            elif "embed" in name:
                p.normal_()
            else:
                p.normal_(std=0.33**0.5 / p.size(-1) ** 0.5)
        elif name.endswith("bias"):
            p.zero_()
        elif name.endswith("gains"):
            # Upstream quirk kept: std=0 gives exactly 1, yet the call still draws from the RNG.
            p.normal_(mean=1, std=0)
        else:
            raise ValueError(f"uninitialized parameter: {name}")


@torch.no_grad()
def init_adam_(model: RefGPT) -> None:
    """Result #2's init: torch's default init from construction, then every parameter named "proj" (weights and
    biases, residual outputs and head) zeroed. No RNG drawn."""
    for name, p in model.named_parameters():
        if "proj" in name:
            p.zero_()


# ------------------------------------------------------------------------------------------------- optimizers


def newton_schulz(G: Tensor) -> Tensor:
    """zeropower_via_newtonschulz5: 12 iterations of (2, -1.5, 0.5) in bf16 on the wide orientation."""
    assert G.ndim >= 2
    X = G.bfloat16()
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # Frobenius norm bounds the spectral norm by 1
    a, b, c = 2, -1.5, 0.5
    for _ in range(12):
        A = X @ X.mT
        B = b * A + c * A @ A  # Python binds this as b*A + ((c*A) @ A), kept
        X = a * X + B @ X
    if tall:
        X = X.mT
    return X


def muon_update(grad: Tensor, momentum: Tensor, mu: float = 0.95, nesterov: bool = True) -> Tensor:
    """Upstream's muon_update, eager. Mutates as upstream: momentum <- lerp(momentum, grad, 1 - mu), and with
    Nesterov the gradient itself <- lerp(grad, momentum, mu), which is the orthogonalized update."""
    momentum.lerp_(grad, 1 - mu)
    update = grad.lerp_(momentum, mu) if nesterov else momentum
    update = newton_schulz(update)
    update *= max(1, grad.size(-2) / grad.size(-1)) ** 0.5
    return update


class RefMuon(torch.optim.Optimizer):
    """Upstream's Muon at world size 1: every matrix updated locally, in the sorted order."""

    def __init__(self, params: list[nn.Parameter], lr: float = 0.02, weight_decay: float = 0, mu: float = 0.95):
        assert isinstance(params, list) and len(params) >= 1 and isinstance(params[0], nn.Parameter)
        # Largest shapes first (torch.Size compared as tuples); Python's sort is stable, so ties keep model order.
        params = sorted(params, key=lambda p: p.size(), reverse=True)
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, mu=mu))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    state["momentum"] = torch.zeros_like(p)
                update = muon_update(p.grad, state["momentum"], mu=group["mu"])
                p.mul_(1 - group["lr"] * group["weight_decay"])  # decoupled decay first, then the update
                p.add_(update, alpha=-group["lr"])


def _check_coverage(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    covered = set(p for opt in optimizers for group in opt.param_groups for p in group["params"])
    assert covered == set(model.parameters())


def _set_initial_lr(optimizers: list[torch.optim.Optimizer]) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]


def baseline_optimizers(model: RefGPT) -> list[torch.optim.Optimizer]:
    """Result #36: AdamW on embed / head / every vector (lr .7 / .004 / .015), Muon on the blocks' matrices."""
    adamw = torch.optim.AdamW([dict(params=[model.embed.weight], lr=0.7),
                               dict(params=[model.proj.weight], lr=0.004),
                               dict(params=[p for p in model.parameters() if p.ndim < 2], lr=0.015)],
                              betas=(0.8, 0.95), eps=1e-10, weight_decay=0.001, fused=True)
    muon = RefMuon([p for p in model.blocks.parameters() if p.ndim >= 2], lr=0.025, weight_decay=0.05)
    optimizers = [adamw, muon]
    _check_coverage(model, optimizers)
    _set_initial_lr(optimizers)
    return optimizers


def adam_optimizers(model: RefGPT) -> list[torch.optim.Optimizer]:
    """Result #2: the auxiliary AdamW (lr .3 / 1/320 / .01, no decay) and a second AdamW on the blocks' matrices
    (lr .0015, betas (.9, .95), decay .1)."""
    aux = torch.optim.AdamW([dict(params=[model.embed.weight], lr=0.3),
                             dict(params=[model.proj.weight], lr=1 / 320),
                             dict(params=[p for p in model.parameters() if p.ndim < 2], lr=0.01)],
                            betas=(0.8, 0.95), eps=1e-10, weight_decay=0, fused=True)
    blocks = torch.optim.AdamW([p for p in model.blocks.parameters() if p.ndim >= 2],
                               lr=0.0015, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.10, fused=True)
    optimizers = [aux, blocks]
    _check_coverage(model, optimizers)
    _set_initial_lr(optimizers)
    # Upstream quirk kept: named for the block AdamW, the 250-step warmup is set on every group, the aux ones too.
    for opt in optimizers:
        for group in opt.param_groups:
            group["warmup_steps"] = ADAM_WARMUP_STEPS
    return optimizers


# --------------------------------------------------------------------------------------------------- schedule


def _cooldown_eta(step: int, train_steps: int) -> float:
    """Stable, then linear decay to 0 over the last 70% (upstream compares progress with 1 - 0.7 in floats)."""
    progress = step / train_steps
    assert 0 <= progress < 1
    if progress < 1 - COOLDOWN_FRAC:
        return 1.0
    return (1 - progress) / COOLDOWN_FRAC


def set_hparams(optimizers: list[torch.optim.Optimizer], step: int, train_steps: int,
                recipe: str = "baseline") -> None:
    """Each group's lr for `step`: initial_lr * eta (result #36), initial_lr * warmup * eta with warmup =
    min(1, (step + 1) / warmup_steps) (result #2)."""
    _check_recipe(recipe)
    eta = _cooldown_eta(step, train_steps)
    for opt in optimizers:
        for group in opt.param_groups:
            if recipe == "baseline":
                group["lr"] = group["initial_lr"] * eta
            else:
                warmup_steps = group["warmup_steps"]
                warmup = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
                group["lr"] = group["initial_lr"] * warmup * eta


def validation_steps(train_steps: int, recipe: str = "baseline") -> list[int]:
    """Every step the loop validates at, step 0 and the end included. Result #36: every 125 steps while
    step / train_steps < 0.9, then every 25. Result #2 (its log's code): every 125 steps throughout."""
    _check_recipe(recipe)
    steps = []
    for step in range(train_steps + 1):
        freq = 125 if recipe == "adam" or step / train_steps < 0.9 else 25
        if step == train_steps or step % freq == 0:
            steps.append(step)
    return steps


# ------------------------------------------------------------------------------------------------------- data


def _load_shard(file: Path) -> Tensor:
    """A shard's uint16 tokens after its 256-int32 header (magic, version, token count)."""
    header = np.fromfile(file, dtype=np.int32, count=HEADER_INTS)
    assert header[0] == SHARD_MAGIC, "magic number mismatch in the data .bin file"
    assert header[1] == SHARD_VERSION, "unsupported version"
    num_tokens = int(header[2])
    tokens = np.fromfile(file, dtype=np.uint16, count=num_tokens, offset=HEADER_INTS * 4)
    assert len(tokens) == num_tokens, "number of tokens read does not match header"
    return torch.from_numpy(tokens)


def data_batches(files: list[Path], batch_tokens: int, seq_len: int, rank: int, world_size: int
                 ) -> Iterator[tuple[Tensor, Tensor]]:
    """distributed_data_generator for one rank: files in sorted order (upstream sorts its glob), each global batch
    of batch_tokens, this rank's contiguous slice of batch_tokens / world_size (+1 for the shifted targets).
    Inputs int32, targets int64, shaped (-1, seq_len)."""
    assert batch_tokens % world_size == 0
    local_tokens = batch_tokens // world_size
    file_iter = iter(sorted(files))
    # Upstream quirk kept: running out of files raises StopIteration inside the generator, a RuntimeError.
    tokens, pos = _load_shard(next(file_iter)), 0
    while True:
        # Upstream quirk kept: ">=" moves on when exactly batch_tokens + 1 tokens are left, which would have
        # sufficed; and the new shard is not checked again.
        if pos + batch_tokens + 1 >= len(tokens):
            tokens, pos = _load_shard(next(file_iter)), 0
        buf = tokens[pos + rank * local_tokens:][:local_tokens + 1]
        inputs = buf[:-1].to(dtype=torch.int32)
        targets = buf[1:].to(dtype=torch.int64)
        pos += batch_tokens
        yield inputs.view(-1, seq_len), targets.view(-1, seq_len)


def val_batch(files: list[Path], val_tokens: int, seq_len: int, rank: int, world_size: int) -> tuple[Tensor, Tensor]:
    """The validation tokens: the generator's first batch with val_tokens as its batch size."""
    return next(data_batches(files, val_tokens, seq_len, rank, world_size))


# -------------------------------------------------------------------------------------------------- the loop


def train_step(model: RefGPT, optimizers: list[torch.optim.Optimizer], inputs: Tensor, targets: Tensor, step: int,
               train_steps: int, mbs: int, recipe: str = "baseline") -> float:
    """One step of upstream's loop at world size 1: backward of each micro-batch's summed loss (gradients sum, no
    averaging), hparams for `step`, each optimizer's step, grads freed. Returns the step's summed loss."""
    assert len(inputs) % mbs == 0
    total = torch.zeros((), dtype=torch.float32)
    for i in range(len(inputs) // mbs):
        loss = model(inputs[i * mbs:(i + 1) * mbs], targets[i * mbs:(i + 1) * mbs])
        loss.backward()
        total += loss.detach()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
    set_hparams(optimizers, step, train_steps, recipe)
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)
    return float(total)


def val_loss(model: RefGPT, inputs: Tensor, targets: Tensor, mbs: int) -> float:
    """Upstream's validation at world size 1: summed losses of micro-batches of mbs sequences, in order, divided by
    the tokens (upstream divides by the global val_tokens after an all-reduce; at world size 1 that is
    inputs.numel())."""
    model.eval()
    total = 0
    with torch.no_grad():
        assert len(inputs) % mbs == 0
        for i in range(len(inputs) // mbs):
            total += model(inputs[i * mbs:(i + 1) * mbs], targets[i * mbs:(i + 1) * mbs])
    total /= inputs.numel()
    model.train()
    return float(total)
