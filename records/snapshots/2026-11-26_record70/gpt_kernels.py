"""The custom ops of train_gpt.py's model: the FP8 head's matmuls and record #70's Triton kernels.

Each is a torch.library op under torch.ops.speedrun with a fake kernel (what torch.compile traces) and an
autograd rule; the torch path each one replaces stays in train_gpt.py's model as the reference. Importing this
module registers the ops and nothing else: triton is imported when a kernel is first launched, and the FP8
bodies are compiled on first call. records/sm90_kernels.py compiles the Triton kernels for the H100 offline.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

# FP8 LM head (training only): x and W are scaled into float8_e4m3 and multiplied by torch._scaled_mm into
# bf16; backward casts the output gradient to float8_e5m2. The scales are train_gpt.py's Config fields (#51/#55's:
# x / (100/448), W / (1.6/448), the gradient / (0.75/448) before the loss scale folds in).
# Each op's body is compiled (the casts fuse with the scaling and the transposes _scaled_mm needs); the
# backward recasts the saved x and W rather than keeping fp8 copies (same memory, and every op input is a
# dtype torch.library.opcheck can compare). A value past a format's range saturates to its largest, as the
# record's compiled casts do on the GPU (Triton's); torch < 2.12 casts e4m3 overflow to NaN, e5m2's to inf.
FP8_MAX_E4M3 = torch.finfo(torch.float8_e4m3fn).max  # 448


def _to_fp8(t: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    # The quotient in fp32, so it rounds once, into fp8 (a bf16 one would round to bf16 first).
    limit = torch.finfo(dtype).max
    return t.float().div(scale).clamp(-limit, limit).to(dtype)


def _scales(values: list[float] | tuple[float, ...], like: Tensor) -> list[Tensor]:
    # Tensors, not floats, into the compiled bodies: a float there is a constant of the graph, a new graph for each
    # value. Made once per run's scales and device, not per micro-step.
    return list(_scale_tensors(tuple(values), like.device))


@functools.cache
def _scale_tensors(values: tuple[float, ...], device: torch.device) -> tuple[Tensor, ...]:
    # Fill kernels, not host-to-device copies: a copy of a Python scalar would synchronize the host.
    return tuple(torch.full((), v, dtype=torch.float32, device=device) for v in values)


def compiled_on_first_call(fn: Callable) -> Callable:
    """fn under torch.compile (fullgraph, dynamic shapes), built when first called: torch.compile imports dynamo,
    over a second of every process's start-up that a run without the FP8 head (a CPU run, --help) never needs.
    Dynamic shapes and tensor arguments only, so a run's staged lengths and a process's many tests share a graph
    per device and autograd context, far below dynamo's recompile limit (a hard failure)."""
    build = functools.cache(lambda: torch.compile(fn, dynamic=True, fullgraph=True))

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        return build()(*args)
    return call


@compiled_on_first_call
def _fp8_matmul(x: Tensor, w: Tensor, x_s: Tensor, w_s: Tensor) -> Tensor:
    x_f8 = _to_fp8(x, x_s, torch.float8_e4m3fn)
    w_f8 = _to_fp8(w, w_s, torch.float8_e4m3fn)
    return torch._scaled_mm(x_f8, w_f8.T, out_dtype=torch.bfloat16, use_fast_accum=True, scale_a=x_s, scale_b=w_s)


@compiled_on_first_call
def _fp8_matmul_grads(g: Tensor, x: Tensor, w: Tensor, x_s: Tensor, w_s: Tensor, grad_s: Tensor
                      ) -> tuple[Tensor, Tensor]:
    # _scaled_mm takes its first operand row-major and its second column-major: hence the transposed copies.
    g_f8 = _to_fp8(g, grad_s, torch.float8_e5m2)
    x_f8 = _to_fp8(x, x_s, torch.float8_e4m3fn)
    w_f8 = _to_fp8(w, w_s, torch.float8_e4m3fn)
    grad_x = torch._scaled_mm(g_f8, w_f8.T.contiguous().T, out_dtype=torch.bfloat16,
                              scale_a=grad_s, scale_b=w_s)
    # (x^T g)^T rather than g^T x: the long dimension (tokens) is the reduction, and grad_w comes out column-major.
    grad_w = torch._scaled_mm(x_f8.T.contiguous(), g_f8.T.contiguous().T, out_dtype=torch.float32,
                              scale_a=x_s, scale_b=grad_s).T
    return grad_x, grad_w


@torch.library.custom_op("speedrun::fp8_mm", mutates_args=())
def fp8_mm(x: Tensor, w: Tensor, x_s: float, w_s: float, grad_s: float) -> Tensor:
    """x @ w.T in bf16, with both operands scaled into float8_e4m3 (grad_s is the backward's gradient scale)."""
    return _fp8_matmul(x, w, *_scales((x_s, w_s), x))


@fp8_mm.register_fake
def _(x: Tensor, w: Tensor, x_s: float, w_s: float, grad_s: float) -> Tensor:
    return x.new_empty(x.size(0), w.size(0), dtype=torch.bfloat16)


@torch.library.custom_op("speedrun::fp8_mm_backward", mutates_args=())
def fp8_mm_backward(g: Tensor, x: Tensor, w: Tensor, x_s: float, w_s: float, grad_s: float) -> tuple[Tensor, Tensor]:
    """Gradients of fp8_mm: g / grad_s in float8_e5m2; grad_x in bf16, grad_w in fp32 (column-major)."""
    return _fp8_matmul_grads(g, x, w, *_scales((x_s, w_s, grad_s), g))


@fp8_mm_backward.register_fake
def _(g: Tensor, x: Tensor, w: Tensor, x_s: float, w_s: float, grad_s: float) -> tuple[Tensor, Tensor]:
    # The strides the real op returns: compiled callers check them (grad_w is a transposed row-major result).
    return x.new_empty(x.shape, dtype=torch.bfloat16), w.new_empty(w.shape[::-1], dtype=torch.float32).T


def _fp8_mm_setup(ctx, inputs: tuple, output: Tensor) -> None:
    ctx.scales = inputs[2:]
    ctx.save_for_backward(inputs[0], inputs[1])


def _fp8_mm_grad(ctx, grad_out: Tensor) -> tuple:
    x, w = ctx.saved_tensors
    grad_x, grad_w = torch.ops.speedrun.fp8_mm_backward(grad_out, x, w, *ctx.scales)
    return grad_x, grad_w, None, None, None


fp8_mm.register_autograd(_fp8_mm_grad, setup_context=_fp8_mm_setup)


# Fused linear + ReLU^2 (#59, #87), for --relu2_kernel: one Triton GEMM whose epilogue squares the ReLU, so
# the pre-activation never reaches memory; backward recovers relu(pre) = sqrt(post) (#87: nothing else saved)
# and runs the two GEMMs in torch. Built on first use (triton is imported only then; with TRITON_INTERPRET=1
# the kernel runs on CPU tensors, which is how the tests check it). K is a compile-time constant (model_dim).
# On CUDA, Triton autotunes the tile per (M, N) over RELU2_CONFIGS during warmup (each stage's shape is warmed
# up, so no timed step tunes); the interpreter runs the first config (autotuning would time the interpreter).
RELU2_CONFIGS = (  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): H100 bf16 GEMM tiles, all within sm90's
    (128, 256, 64, 8, 3),  # 227 KB of shared memory (records/sm90_kernels.py compiles each for sm90)
    (256, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 64, 4, 3),
    (128, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 128, 32, 4, 4),
    (64, 64, 64, 4, 5),
)


@functools.cache
def relu2_launcher() -> Callable:
    global tl  # a module global, as Triton (its interpreter too) resolves the kernel's names there
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, w_ptr, out_ptr, M, N, K: tl.constexpr, sxm, sxk, swk, swn, som, son,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in range(0, tl.cdiv(K, BLOCK_K)):  # fp32 accumulation over K, masked tails
            rk = i * BLOCK_K + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=(rm[:, None] < M) & (rk[None, :] < K),
                        other=0.0)
            b = tl.load(w_ptr + rk[:, None] * swk + rn[None, :] * swn, mask=(rk[:, None] < K) & (rn[None, :] < N),
                        other=0.0)
            acc += tl.dot(a, b)
        acc = tl.maximum(acc, 0.0)
        tl.store(out_ptr + rm[:, None] * som + rn[None, :] * son, (acc * acc).to(out_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    tuned = triton.autotune([triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                             for bm, bn, bk, w, s in RELU2_CONFIGS], key=["M", "N"])(kernel)

    def launch(x: Tensor, w: Tensor, out: Tensor, config: tuple[int, ...] | None = None) -> None:
        """config: one of RELU2_CONFIGS; None autotunes on CUDA and takes the first config elsewhere."""
        (M, K), N = x.shape, w.size(1)
        args = (x, w, out, M, N, K, *x.stride(), *w.stride(), *out.stride())
        if config is None and x.is_cuda:
            tuned[lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))](*args)
            return
        bm, bn, bk, warps, stages = config or RELU2_CONFIGS[0]
        kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](*args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                                         num_warps=warps, num_stages=stages)

    launch.kernel = kernel  # records/sm90_kernels.py compiles it for the H100 offline
    return launch


@torch.library.custom_op("speedrun::relu2_mm", mutates_args=())
def relu2_mm(x: Tensor, w: Tensor) -> Tensor:
    """relu(x @ w)^2 for x (M, K) and w (K, N), in x's dtype, by the fused Triton kernel."""
    out = x.new_empty(x.size(0), w.size(1))
    relu2_launcher()(x, w.to(x.dtype), out)
    return out


@relu2_mm.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(x.size(0), w.size(1))


def _relu2_mm_setup(ctx, inputs: tuple, output: Tensor) -> None:
    ctx.save_for_backward(inputs[0], inputs[1], output)


def _relu2_mm_grad(ctx, grad_out: Tensor) -> tuple:
    x, w, post = ctx.saved_tensors
    grad_pre = 2 * post.sqrt() * grad_out  # d relu(pre)^2 = 2 relu(pre); relu(pre) = sqrt(post)
    return grad_pre @ w.to(grad_pre.dtype).T, (x.T @ grad_pre).to(w.dtype)


relu2_mm.register_autograd(_relu2_mm_grad, setup_context=_relu2_mm_setup)


# Fused head + softcapped (multi-token) cross-entropy (#60, #67, #75), for --fused_head: the logits are made
# HEAD_CHUNK_ROWS rows at a time and one Triton kernel turns each chunk into its rows' losses and, in place, its
# gradient. The loss ends the graph, so its gradient is computed in the forward and backward only scales it:
# neither the (T, vocab) logits nor their fp32 softcap ever exist, one chunk at a time does (validation, loss
# only, too). u = cap sigmoid((z + shift) / temp) lies in [0, cap], so lse = cap + log sum exp(u - cap) needs no
# running max.
HEAD_CHUNK_ROWS = 8192  # 8192 x 50304 bf16 logits: 0.8 GB in place of 4.9 GB per micro-step (26 GB validating)


@functools.cache
def softcap_ce_launcher() -> Callable:
    global tl  # a module global, as Triton (its interpreter too) resolves the kernel's names there
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(z_ptr, stride, targets_ptr, weights_ptr, loss_ptr, row0, T, cap, shift, temp,
               V: tl.constexpr, K: tl.constexpr, BLOCK_V: tl.constexpr, GRAD: tl.constexpr):
        # One program per row t = row0 + r: the loss sum_k w_k (lse - u[y_(t+k)]) over the k with t + k < T, then
        # dL/dz = (sum_k w_k softmax(u) - sum_k w_k onehot(y_(t+k))) * (cap / temp) s (1 - s), s = u / cap, over z.
        # sigmoid and cdiv written out: tl's are jit functions, which the interpreter re-patches at every call.
        r = tl.program_id(0)
        row = z_ptr + r.to(tl.int64) * stride
        sums = tl.zeros((BLOCK_V,), dtype=tl.float32)
        for i in range(0, (V + BLOCK_V - 1) // BLOCK_V):
            cols = i * BLOCK_V + tl.arange(0, BLOCK_V)
            z = tl.load(row + cols, mask=cols < V, other=0.0).to(tl.float32)
            sums += tl.where(cols < V, tl.exp(cap / (1 + tl.exp(-(z + shift) / temp)) - cap), 0.0)
        lse = cap + tl.log(tl.sum(sums, axis=0))
        ks = tl.arange(0, K)
        valid = row0 + r + ks < T
        ys = tl.load(targets_ptr + row0 + r + ks, mask=valid, other=-1)
        ws = tl.load(weights_ptr + ks, mask=valid, other=0.0)
        z_y = tl.load(row + ys, mask=valid, other=0.0).to(tl.float32)
        tl.store(loss_ptr + r, tl.sum(ws * (lse - cap / (1 + tl.exp(-(z_y + shift) / temp))), axis=0))
        coef = tl.sum(ws, axis=0)
        if GRAD:
            for i in range(0, (V + BLOCK_V - 1) // BLOCK_V):
                cols = i * BLOCK_V + tl.arange(0, BLOCK_V)
                a = (tl.load(row + cols, mask=cols < V, other=0.0).to(tl.float32) + shift) / temp
                s = 1 / (1 + tl.exp(-a))
                picked = tl.sum(tl.where(cols[:, None] == ys[None, :], ws[None, :], 0.0), axis=1)
                # 1 - s as sigmoid(-a) = 1 / (1 + exp(a)): no cancellation where the sigmoid saturates at cap
                grad = (coef * tl.exp(cap * s - lse) - picked) * (cap / temp) * s / (1 + tl.exp(a))
                tl.store(row + cols, grad.to(z_ptr.dtype.element_ty), mask=cols < V)

    def launch(z: Tensor, targets: Tensor, weights: Tensor, losses: Tensor, row0: int, cap: float, shift: float,
               temp: float, grad: bool = True, block_v: int = 1024) -> None:
        # weights: fp32, padded with zeros to a power of two (tl.arange's rule; softcap_ce pads them once)
        kernel[(z.size(0),)](z, z.stride(0), targets, weights, losses, row0, targets.numel(), cap, shift, temp,
                             V=z.size(1), K=weights.numel(), BLOCK_V=block_v, GRAD=grad)

    launch.kernel = kernel  # records/sm90_kernels.py compiles it for the H100 offline
    return launch


@torch.library.custom_op("speedrun::softcap_ce", mutates_args=())
def softcap_ce(x: Tensor, w: Tensor, targets: Tensor, weights: Tensor, cap: float, shift: float, temp: float,
               scales: list[float], with_grad: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, dloss/dx, dloss/dw) of sum_k weights[k] sum_t CE(u_t, targets[t + k]), u = cap sigmoid((x w^T +
    shift) / temp), the terms past the end left out. scales: fp8_scales(), the head's GEMMs in FP8 as fp8_mm runs
    them; [] runs them in x's dtype. with_grad=False (no autograd: validation) gives the loss alone, the
    gradients empty."""
    if not with_grad:
        grad_x, grad_w = x.new_empty(0), w.new_empty(0)
    else:
        grad_x, grad_w = torch.empty_like(x), torch.zeros_like(w, dtype=torch.float32)
    losses = torch.empty(x.size(0), dtype=torch.float32, device=x.device)  # per row, summed once at the end
    weights = F.pad(weights.float(), (0, max(2, 1 << (weights.numel() - 1).bit_length()) - weights.numel()))
    w_x = None if scales else w.type_as(x)  # the FP8 GEMMs cast w themselves
    scales = _scales(scales, x)
    for row0 in range(0, x.size(0), HEAD_CHUNK_ROWS):
        xc = x[row0: row0 + HEAD_CHUNK_ROWS]
        z = _fp8_matmul(xc, w, *scales[:2]) if scales else xc @ w_x.T
        softcap_ce_launcher()(z, targets, weights, losses[row0:], row0, cap, shift, temp, with_grad)  # z: dloss/dz
        if not with_grad:
            continue
        gx, gw = _fp8_matmul_grads(z, xc, w, *scales) if scales else (z @ w_x, z.T @ xc)
        grad_x[row0: row0 + HEAD_CHUNK_ROWS] = gx
        grad_w += gw
    return losses.sum(), grad_x, grad_w.to(w.dtype)


@softcap_ce.register_fake
def _(x: Tensor, w: Tensor, targets: Tensor, weights: Tensor, cap: float, shift: float, temp: float,
      scales: list[float], with_grad: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    grads = (torch.empty_like(x), torch.empty_like(w)) if with_grad else (x.new_empty(0), w.new_empty(0))
    return x.new_empty((), dtype=torch.float32), *grads


def _softcap_ce_setup(ctx, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(output[1], output[2])


def _softcap_ce_grad(ctx, grad_loss: Tensor, *_: Tensor) -> tuple:
    grad_x, grad_w = ctx.saved_tensors
    return grad_loss * grad_x, grad_loss * grad_w, None, None, None, None, None, None, None


softcap_ce.register_autograd(_softcap_ce_grad, setup_context=_softcap_ce_setup)
