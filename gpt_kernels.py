"""The custom ops of train_gpt.py's model and optimizer: the FP8 head's matmuls, record #89's FP8 MLP and its weight
quantizer, and the Triton kernels (#89's: the MLP's persistent ReLU^2 GEMM in FP8 and bf16, its down-weight quantizer,
the softcapped cross-entropy, the tiled transpose and the symmetric GEMMs of its Polar Express).

Each is a torch.library op under torch.ops.speedrun with a fake kernel (what torch.compile traces) and an
autograd rule; the torch path each one replaces stays in train_gpt.py's model as the reference. Importing this
module registers the ops and nothing else: triton is imported when a kernel is first launched, and the FP8
bodies are compiled on first call. tools/sm90_kernels.py compiles the Triton kernels offline for each GPU generation
(RUNS_ON: what runs where). Also the device paths train_gpt.py resolves: which path runs on a GPU (gpu_runs), FA3's
loader, the CPU's bf16 GEMM paths (Fp32Gemms) and the optimizer's fixed-order sum (eager_sum).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

# What runs where, the facts train_gpt's `auto` (resolve_for_device) and tools/sm90_kernels.py's compile matrix both
# read. The GPU generations measured, by compute capability: A100 (sm80), RTX 3090 and A6000 (sm86), L40S and RTX 4090
# (sm89), H100 and H200 (sm90), B200 (sm100), RTX 5090 (sm120); a capability not here is not measured and takes the
# torch paths, flex attention and no FP8.
TARGETS = {"sm80": (8, 0), "sm86": (8, 6), "sm89": (8, 9), "sm90": (9, 0), "sm100": (10, 0), "sm120": (12, 0)}
FP8_MIN = (8, 9)  # FP8 tensor cores and torch._scaled_mm: Ada (sm89) and later
# Each path's Triton kernels (the compile matrix's groups: launch_group). The FP8 modes of the ReLU^2 GEMM and of the
# cross-entropy run only with --fp8_mlp and --fp8_head: their own rows ("relu2_kernel+fp8_mlp", ...).
PATH_KERNELS = {"fp8_head": ("transpose_copy",), "fp8_mlp": ("quantize_mlp_down", "amax_scales"),
                "relu2_kernel": ("linear_relu_square bf16",), "relu2_kernel+fp8_mlp": ("linear_relu_square fp8",),
                "fused_head": ("softcap_ce",), "fused_head+fp8_head": ("softcap_ce e5m2",),
                "dc_kernel": ("dc_attention",), "polar_express": ("xxt", "xtx", "ba_plus_caa")}
# Where every launch of each path's kernels compiles within the target's shared memory per block and without spills,
# as measured offline by `python tools/sm90_kernels.py --targets=all` (Triton 3.6.0's compiler and ptxas; it exits 1
# where this table claims a target on which a launch fails); the FP8 paths also need FP8_MIN.
SM80, SM86, SM89, SM90, SM100, SM120 = TARGETS.values()
EVERY_TARGET = frozenset(TARGETS.values())
FP8_TARGETS = frozenset(c for c in EVERY_TARGET if c >= FP8_MIN)  # not sm80, sm86: no e4m3
RUNS_ON: dict[str, frozenset[tuple[int, int]]] = {
    "fp8_head": FP8_TARGETS, "fp8_mlp": FP8_TARGETS,
    "relu2_kernel": EVERY_TARGET,  # each at its own configuration (MLP_CONFIGS)
    "relu2_kernel+fp8_mlp": FP8_TARGETS - {SM100},  # sm100: PassManager::run failed, or spills (MLP_CONFIGS)
    "fused_head": EVERY_TARGET, "fused_head+fp8_head": FP8_TARGETS,
    "dc_kernel": EVERY_TARGET, "polar_express": EVERY_TARGET}


def launch_group(name: str) -> str:
    """The compile matrix's kernel (a PATH_KERNELS entry) of one of its launches, by the launch's name."""
    words = name.split()
    if words[0] == "linear_relu_square":
        return f"linear_relu_square {'fp8' if words[1] == 'fp8' else 'bf16'}"
    return "softcap_ce e5m2" if words[0] == "softcap_ce" and "e5m2" in words else words[0]


def gpu_runs(path: str, capability: tuple[int, int] | None, cfg: Any = None,
             fp8: str | None = None) -> tuple[bool | None, str]:
    """Whether a path (a RUNS_ON key) runs on this GPU, and why not: False where it cannot (no FP8 before sm89, Triton
    kernels that fail or spill), None where unmeasured (auto: torch); `fp8` on in cfg (a Config): its kernels too."""
    if capability is None:
        return True, ""
    target = f"sm{capability[0]}{capability[1]}"
    if "fp8" in path and capability < FP8_MIN:
        return False, f"{target} has no FP8 tensor cores (torch._scaled_mm: sm89 and later)"
    if capability not in TARGETS.values():
        return None, f"{target} is not in the compile matrix (tools/sm90_kernels.py: {', '.join(TARGETS)})"
    if capability not in RUNS_ON[path]:
        return False, (f"its Triton kernels ({', '.join(PATH_KERNELS[path])}) do not compile for {target} "
                       f"within its shared memory and without spills (tools/sm90_kernels.py)")
    if fp8 and getattr(cfg, fp8):
        runs, why = gpu_runs(f"{path}+{fp8}", capability)
        return runs, why and f"{why} (its FP8 mode, with --{fp8})"
    return True, ""


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
    per device and autograd context, far below dynamo's recompile limit (a hard failure). Every bf16 value is
    rounded where eager rounds it (emulate_precision_casts): fused, Inductor would carry it on in fp32 (the FP8
    MLP's post8 from an unrounded post)."""
    build = functools.cache(lambda: torch.compile(fn, dynamic=True, fullgraph=True,
                                                  options={"emulate_precision_casts": True}))

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        return build()(*args)
    return call


@compiled_on_first_call
def _fp8_matmul(x: Tensor, w: Tensor, x_s: Tensor, w_s: Tensor) -> Tensor:
    x_f8 = _to_fp8(x, x_s, torch.float8_e4m3fn)
    w_f8 = _to_fp8(w, w_s, torch.float8_e4m3fn)
    return torch._scaled_mm(x_f8, w_f8.T, out_dtype=torch.bfloat16, use_fast_accum=True, scale_a=x_s, scale_b=w_s)


def _transposed(t: Tensor) -> Tensor:
    """t^T (2-D) as a row-major copy: #89's tiled kernel on CUDA (inductor's copy of a transposed view reads it
    strided), torch's copy elsewhere."""
    return torch.ops.speedrun.transpose_copy(t) if t.is_cuda else t.T.contiguous()


def _fp8_grads_of_codes(g_f8: Tensor, x: Tensor, w: Tensor, x_s: Tensor, w_s: Tensor, grad_s: Tensor
                        ) -> tuple[Tensor, Tensor]:
    # _scaled_mm takes its first operand row-major and its second column-major: hence the transposed copies.
    # Both GEMMs accumulate exactly (fast accumulation off), as #51's and #89's backward do.
    x_f8 = _to_fp8(x, x_s, torch.float8_e4m3fn)
    w_f8 = _to_fp8(w, w_s, torch.float8_e4m3fn)
    grad_x = torch._scaled_mm(g_f8, w_f8.T.contiguous().T, out_dtype=torch.bfloat16,
                              scale_a=grad_s, scale_b=w_s)
    # (x^T g)^T rather than g^T x: the long dimension (tokens) is the reduction, and grad_w comes out column-major.
    grad_w = torch._scaled_mm(_transposed(x_f8), _transposed(g_f8).T, out_dtype=torch.float32,
                              scale_a=x_s, scale_b=grad_s).T
    return grad_x, grad_w


@compiled_on_first_call
def _fp8_matmul_grads(g: Tensor, x: Tensor, w: Tensor, x_s: Tensor, w_s: Tensor, grad_s: Tensor
                      ) -> tuple[Tensor, Tensor]:
    return _fp8_grads_of_codes(_to_fp8(g, grad_s, torch.float8_e5m2), x, w, x_s, w_s, grad_s)


_fp8_head_grads = compiled_on_first_call(_fp8_grads_of_codes)  # softcap_ce's kernel writes the e5m2 codes itself


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


# The MLP's ReLU^2 GEMM (#89's linear_relu_square, after #59 and #87): one persistent Triton GEMM, A (M, K) times
# B (N, K)^T, whose epilogue makes the MLP's activations, in three modes. FP8 forward (training): e4m3 x8 and W8_fc,
# the fp32 accumulator times the dequant scale, pre = bf16 (in registers only), post = bf16(relu(pre)^2), post8 =
# e4m3(min(post / s_act, 448)) for the down-projection, and each program's max(post) for the next step's s_act.
# bf16 forward (validation, or training without FP8): post alone. Backward: dpre = bf16(2 bf16(g W_proj^T)
# sqrt(post)), aux = post (upstream's #87: pre is never stored; relu(pre) comes back as sqrt(post), within 2^-9 of
# it, so about one entry of dpre in eight is a bf16 step from #89's 2 bf16(g W_proj^T) relu(pre)). #89's tiles (128
# x 256, K blocks of 128 in FP8, 64 in bf16; other GPUs': MLP_CONFIGS) through TMA descriptors; a grid of one
# program per SM, each looping over tiles (persistent), its epilogue in two halves of N (half the registers live).
# Built on first use (triton imported then); with TRITON_INTERPRET=1 it runs on CPU tensors, which is how the tests
# check it.
# (BLOCK_K, num_stages) of each mode, #89's: K blocks of 128 bytes; fewer stages where the epilogue's stores (post,
# post8) or the backward's read of post need shared memory too (tools/sm90_kernels.py: each within sm90's).
MLP_GEMM_MODES = {"fp8 forward": (128, 3), "bf16 forward": (64, 4), "backward": (64, 3)}


class MLPConfig(NamedTuple):
    """One GPU generation's launch parameters of the ReLU^2 GEMM: tile (block_m x block_n), warps, and each mode's
    (BLOCK_K, num_stages)."""
    block_m: int
    block_n: int
    num_warps: int
    modes: dict[str, tuple[int, int]]


# Each target's configuration, by compute capability: the launcher, mlp_programs (and so the fake kernels' partial
# maxima) and tools/sm90_kernels.py's compiles of each target all read mlp_config. sm90 and sm100: #89's, 128 x 256
# tiles. sm80, sm86 and sm89 (mma.sync, no TMA: the descriptors become plain loads, 16-20 KB of shared memory at any
# num_stages) spill at 128 x 256 (the fp32 accumulator alone is 128 registers a thread); 128 x 128 with 8 warps
# compiles without spills in every launch (255 registers in the bf16 modes; the FP8 forward, sm89 only, 212 with K
# blocks of 64: at 128 it spills 100 B). sm120 (mma.sync, but TMA: each stage's tiles in shared memory, 99 KB a
# block): sm89's bf16 forward (K blocks of 64, 4 stages) needs 112 KB there, and 3 stages (80 KB) spill 76 B; K
# blocks of 32 at 5 stages take 80 KB and 142 registers, no spill. Its FP8 forward takes #89's K blocks of 128 (90 KB,
# 174 registers), its backward sm89's (96 KB, 145 registers). A tile's shape decides only which program computes an
# output element, and the K loop chains the same k-steps of the tensor core instruction into the accumulator in the
# same order at K blocks of 32, 64 or 128, so neither changes an element's arithmetic on a given GPU (by
# construction, and under the interpreter at each configuration; not run on any GPU but the H100's yet; another
# GPU's instructions may round differently). sm100's FP8 forward does not compile at 128 x 256 (at 3 or 2 stages, 8
# or 4 warps) nor at 128 x 128 (Triton 3.6.0's TMEM layout pass fails); at 64 x 128 with 8 warps it compiles and
# spills 8 B (128 registers), with 4 warps it fails too.
MLP_CONFIGS: dict[tuple[int, int], MLPConfig] = {
    SM80: MLPConfig(128, 128, 8, MLP_GEMM_MODES),  # its FP8 mode never runs (no e4m3 before sm89)
    SM86: MLPConfig(128, 128, 8, MLP_GEMM_MODES),  # sm80's (no FP8 either)
    SM89: MLPConfig(128, 128, 8, {**MLP_GEMM_MODES, "fp8 forward": (64, 3)}),
    SM90: MLPConfig(128, 256, 8, MLP_GEMM_MODES),
    SM100: MLPConfig(128, 256, 8, MLP_GEMM_MODES),
    SM120: MLPConfig(128, 128, 8, {"fp8 forward": (128, 3), "bf16 forward": (32, 5), "backward": (64, 3)}),
}
MLP_PROGRAMS_OFF_GPU = 4  # the persistent grid off a GPU (the interpreter): small, so that programs loop over tiles


def mlp_config(device: torch.device | tuple[int, int]) -> MLPConfig:
    """The ReLU^2 GEMM's configuration for a device (a CUDA device: by its capability; off a GPU, the interpreter's
    CPU tensors and fake CUDA tensors without a GPU (the GPU path's traces): sm90's, the recipe's) or a capability.
    A capability not measured (sm87, sm103, sm121, ...; auto leaves the kernel off there, an explicit flag runs it)
    takes the measured configuration of least shared memory for how Triton loads its tiles there: sm120's through
    TMA (sm90 on: within 99 KB), sm89's without (16-20 KB)."""
    if isinstance(device, torch.device):
        if device.type != "cuda" or not torch.cuda.is_available():
            return MLP_CONFIGS[SM90]
        device = tuple(torch.cuda.get_device_capability(device))
    return MLP_CONFIGS.get(device, MLP_CONFIGS[SM120] if device >= SM90 else MLP_CONFIGS[SM89])


def _persistent_width(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else \
        MLP_PROGRAMS_OFF_GPU


def mlp_programs(rows: int, hidden: int, device: torch.device, width: int | None = None,
                 config: MLPConfig | None = None) -> int:
    """Programs the ReLU^2 GEMM launches for (rows, hidden) outputs: one per SM (width), or one per tile where
    fewer. The FP8 forward's partial maxima are one per program: the fake kernels size them by this too."""
    config = config or mlp_config(device)  # the launcher passes the one it launches with
    return torch.sym_min(width or _persistent_width(device),
                         -(-rows // config.block_m) * -(-hidden // config.block_n))


@functools.cache
def linear_relu_square_launcher() -> Callable:
    global tl, relu2_epilogue  # module globals, as Triton (its interpreter too) resolves a kernel's names there
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    # One half tile: the activations from its fp32 accumulator acc. Every product is formed in fp32 from bf16
    # values (exact: 8 x 8 significant bits) and rounded once to bf16, which is what bf16 arithmetic computes.
    # Forward: c = pre = bf16(acc) lives in registers only, post goes out through c_desc. Backward: c = bf16(g
    # W_proj^T), aux_desc reads post; sqrt_rn (IEEE, as torch's sqrt) where tl.sqrt would be approximate on the GPU,
    # so that the kernel's dpre is the torch path's bit for bit. post = 0 (pre <= 0) gives dpre = 0.
    @triton.jit
    def relu2_epilogue(acc, m0, n0, c_desc, aux_desc, post8_desc, inv_act_scale, amax, FORWARD: tl.constexpr,
                       FP8: tl.constexpr):
        c = acc.to(c_desc.dtype)
        if FORWARD:
            r = tl.maximum(c.to(tl.float32), 0.0)
            post = (r * r).to(c_desc.dtype)
            c_desc.store([m0, n0], post)
            if FP8:  # post >= 0: only the upper clamp (and the cast saturates too)
                post32 = post.to(tl.float32)
                post8_desc.store([m0, n0], tl.minimum(post32 * inv_act_scale, 448.0).to(post8_desc.dtype))
                amax = tl.maximum(amax, tl.max(tl.max(post32, axis=1), axis=0))
        else:
            post = aux_desc.load([m0, n0]).to(tl.float32)
            c_desc.store([m0, n0], (2 * c.to(tl.float32) * tl.sqrt_rn(post)).to(c_desc.dtype))
        return amax

    # The scales are one fp32 each, s_act a layer's element of a buffer: no alignment specialization (one compile
    # for every layer, not one per alignment of its offset).
    @triton.jit(do_not_specialize_on_alignment=["dequant_ptr", "act_scale_ptr"])
    def kernel(a_desc, b_desc, c_desc, aux_desc, post8_desc, amax_ptr, dequant_ptr, act_scale_ptr, M, N, K,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_SMS: tl.constexpr,
               FORWARD: tl.constexpr, FP8: tl.constexpr):
        # Program p runs tiles p, p + NUM_SMS, ... in row-major order (its neighbours share A's rows in L2). The
        # descriptors zero-fill reads past M, N, K and drop writes there: the tails need no masks. 1 / s_act by
        # IEEE division (Triton's / is approximate on the GPU), as the torch path computes it.
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(N, BLOCK_N)
        amax = 0.0
        inv_act_scale = 1.0
        dequant = 1.0
        if FP8:
            inv_act_scale = tl.math.div_rn(1.0, tl.load(act_scale_ptr))
            dequant = tl.load(dequant_ptr)
        for tile in tl.range(pid, tl.cdiv(M, BLOCK_M) * tiles_n, NUM_SMS, flatten=True):
            m0 = tile // tiles_n * BLOCK_M
            n0 = tile % tiles_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                acc = tl.dot(a_desc.load([m0, k0]), b_desc.load([n0, k0]).T, acc)
            if FP8:
                acc = acc * dequant  # one fp32 multiply, then one rounding to bf16
            lo, hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            amax = relu2_epilogue(lo, m0, n0, c_desc, aux_desc, post8_desc, inv_act_scale, amax, FORWARD, FP8)
            amax = relu2_epilogue(hi, m0, n0 + BLOCK_N // 2, c_desc, aux_desc, post8_desc, inv_act_scale, amax,
                                  FORWARD, FP8)
        if FP8:
            tl.store(amax_ptr + pid, amax)

    def launch(a: Tensor, b: Tensor, aux: Tensor | None = None, scales: tuple[Tensor, Tensor] | None = None,
               num_sms: int | None = None) -> tuple[Tensor, ...]:
        """a (M, K) @ b (N, K)^T, row-major. FP8 forward: scales = (dequant, act_scale), fp32 0-d, a and b e4m3;
        returns (post, post8, partial maxima (programs,)). bf16 forward (no aux, no scales): (post,). Backward:
        aux = post, a = g, b = W_proj; returns (dpre,). num_sms: the persistent grid's width (default: the GPU's
        SMs). Rows of 16 bytes (TMA): K a multiple of 16 in FP8, of 8 in bf16; N of 16."""
        a, b = a.contiguous(), b.contiguous()
        (M, K), N = a.shape, b.size(0)
        fp8, forward = scales is not None, aux is None
        if (K * a.element_size()) % 16 or N % 16:
            raise ValueError(f"the ReLU^2 GEMM reads rows of 16 bytes: K={K} ({a.dtype}) and N={N} do not fit")
        config = mlp_config(a.device)  # the tiles of this GPU generation (MLP_CONFIGS)
        bk, stages = config.modes["fp8 forward" if fp8 else "bf16 forward" if forward else "backward"]
        width = num_sms or _persistent_width(a.device)  # the loop's stride: a constant per GPU, one compile
        programs = mlp_programs(M, N, a.device, width, config)
        out_dtype = torch.bfloat16 if fp8 else a.dtype
        c = a.new_empty(M, N, dtype=out_dtype)
        aux = None if forward else aux.contiguous()  # the forward reads none: a None descriptor, a constant
        post8 = a.new_empty(M, N, dtype=torch.float8_e4m3fn) if fp8 else None
        amax = a.new_empty(programs, dtype=torch.float32) if fp8 else None  # every slot written: one per program
        half = [config.block_m, config.block_n // 2]
        descs = [TensorDescriptor.from_tensor(t, block) if t is not None else None for t, block in (
            (a, [config.block_m, bk]), (b, [config.block_n, bk]), (c, half), (aux, half), (post8, half))]
        kernel[(programs,)](*descs, amax, *(scales or (None, None)), M, N, K, BLOCK_M=config.block_m,
                            BLOCK_N=config.block_n, BLOCK_K=bk, NUM_SMS=width, FORWARD=forward, FP8=fp8,
                            num_warps=config.num_warps, num_stages=stages)
        return (c, post8, amax) if fp8 else (c,)

    launch.kernel = kernel  # tools/sm90_kernels.py compiles it for the H100 offline
    return launch


# #89's tiled transpose (transpose_copy), for the FP8 head's backward on CUDA (_transposed): dst = src^T, an exact
# copy of any dtype. Each program moves one tile: read along src's rows, written along dst's rows, Triton staging the
# tile's transpose through shared memory, so both sides are coalesced. Offsets in int64: the head's e5m2 gradient
# (49,152 x 50,304 a rank) has more elements than int32 counts.
TRANSPOSE_CONFIG = (64, 128, 8, 2)  # (BLOCK_M, BLOCK_N, num_warps, num_stages): #89's


@functools.cache
def transpose_launcher() -> Callable:
    global tl  # a module global, as Triton (its interpreter too) resolves the kernel's names there
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(src_ptr, dst_ptr, M, N, ssm, ssn, sdn, sdm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        tile = tl.load(src_ptr + rm[:, None] * ssm + rn[None, :] * ssn, mask=(rm[:, None] < M) & (rn[None, :] < N))
        tl.store(dst_ptr + rn[:, None] * sdn + rm[None, :] * sdm, tl.trans(tile),
                 mask=(rn[:, None] < N) & (rm[None, :] < M))

    def launch(src: Tensor, dst: Tensor) -> None:
        (M, N), (bm, bn, warps, stages) = src.shape, TRANSPOSE_CONFIG
        kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](src, dst, M, N, *src.stride(), *dst.stride(), BLOCK_M=bm,
                                                         BLOCK_N=bn, num_warps=warps, num_stages=stages)

    launch.kernel = kernel  # tools/sm90_kernels.py compiles it for the H100 offline
    return launch


@torch.library.custom_op("speedrun::transpose_copy", mutates_args=())
def transpose_copy(x: Tensor) -> Tensor:
    """x^T for a 2-D x of any dtype, as a new row-major tensor, by the tiled Triton kernel."""
    out = x.new_empty(x.size(1), x.size(0))
    transpose_launcher()(x, out)
    return out


@transpose_copy.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty(x.size(1), x.size(0))


# Polar Express's symmetric GEMMs (#89's XXT, XTX and ba_plus_cAA), the Muon step's kernels on CUDA (train_gpt.py's
# polar_express). One kernel: C = alpha G G^T (+ beta A), G the rows of A (xxt) or its columns read in place (xtx: a
# tall block's A^T A without a transposed copy), fp32 accumulation, alpha acc + beta fp32(A) in fp32, one rounding
# to bf16. C is symmetric: only the tiles on and below the diagonal are computed, each stored twice (itself and its
# mirror), the diagonal's once: about half a GEMM's work. Rows past the edge are read wrapped (valid memory, never
# stored), the reduction's tail masked. Batched over matrices by the grid's third axis.
GRAM_CONFIG = (128, 64, 8, 4)  # (BLOCK: square output tiles, BLOCK_K, num_warps, num_stages): #89's H100 tuning


@functools.cache
def gram_launcher() -> Callable:
    global tl  # a module global, as Triton (its interpreter too) resolves the kernel's names there
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(a_ptr, c_ptr, N, K: tl.constexpr, sab, san, sak, scb, scn, scm, alpha, beta, BLOCK: tl.constexpr,
               BLOCK_K: tl.constexpr, ADD: tl.constexpr):
        # C[i, j] = alpha sum_k G[i, k] G[j, k] (+ beta A[i, j]), G[n, k] at a_ptr + n san + k sak. K, the reduction's
        # length, a constant: a block's width or height (256, 768, 3072), and the interpreter's loops need one.
        ti, tj, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if tj > ti:
            return
        a = a_ptr + batch.to(tl.int64) * sab
        ri = ti * BLOCK + tl.arange(0, BLOCK)
        rj = tj * BLOCK + tl.arange(0, BLOCK)
        gi, gj = a + (ri % N)[:, None] * san, a + (rj % N)[:, None] * san
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(gi + ks[None, :] * sak, mask=ks[None, :] < K, other=0.0)
            y = tl.load(gj + ks[None, :] * sak, mask=ks[None, :] < K, other=0.0)
            acc = tl.dot(x, tl.trans(y), acc)
        inside = (ri[:, None] < N) & (rj[None, :] < N)
        if ADD:
            acc = acc * alpha + beta * tl.load(a + ri[:, None] * san + rj[None, :] * sak, mask=inside,
                                               other=0.0).to(tl.float32)
        c = acc.to(c_ptr.dtype.element_ty)
        out = c_ptr + batch.to(tl.int64) * scb
        tl.store(out + ri[:, None] * scn + rj[None, :] * scm, c, mask=inside)
        if ti != tj:  # the mirror tile
            tl.store(out + rj[:, None] * scn + ri[None, :] * scm, tl.trans(c),
                     mask=(rj[:, None] < N) & (ri[None, :] < N))

    def launch(a: Tensor, out: Tensor, columns: bool = False, alpha: float = 1.0, beta: float | None = None) -> None:
        """out = alpha G G^T (+ beta a) for a (n, k) or (b, n, k): G = a's rows, or with columns=True its columns
        (out = alpha a^T a); beta: the epilogue's term, for a square symmetric a (ba_plus_cAA)."""
        a3, out3 = (a[None], out[None]) if a.dim() == 2 else (a, out)
        rows, cols = a3.shape[1:]
        sab, sr, sc = a3.stride()
        N, K, san, sak = (cols, rows, sc, sr) if columns else (rows, cols, sr, sc)
        block, block_k, warps, stages = GRAM_CONFIG
        tiles = triton.cdiv(N, block)
        kernel[(tiles, tiles, a3.size(0))](a3, out3, N, K, sab, san, sak, *out3.stride(), alpha,
                                           0.0 if beta is None else beta, BLOCK=block, BLOCK_K=block_k,
                                           ADD=beta is not None, num_warps=warps, num_stages=stages)

    launch.kernel = kernel  # tools/sm90_kernels.py compiles it for the H100 offline
    return launch


def _gram(a: Tensor, columns: bool, alpha: float = 1.0, beta: float | None = None) -> Tensor:
    n = a.size(-1) if columns else a.size(-2)
    out = a.new_empty(*a.shape[:-2], n, n)
    gram_launcher()(a, out, columns, alpha, beta)
    return out


@torch.library.custom_op("speedrun::xxt", mutates_args=())
def xxt(x: Tensor) -> Tensor:
    """x x^T for x (n, k) or (b, n, k) bf16 (a wide or square block): fp32 accumulation, rounded once to bf16."""
    return _gram(x, columns=False)


@torch.library.custom_op("speedrun::xtx", mutates_args=())
def xtx(x: Tensor) -> Tensor:
    """x^T x for x (n, k) or (b, n, k) bf16 (a tall block), read in place: fp32 accumulation, one rounding."""
    return _gram(x, columns=True)


@torch.library.custom_op("speedrun::ba_plus_caa", mutates_args=())
def ba_plus_caa(a: Tensor, b: float, c: float) -> Tensor:
    """b a + c a^2 for a symmetric a (n, n) or (b, n, n) bf16: c (a a^T) + b a in fp32, one rounding to bf16."""
    return _gram(a, columns=False, alpha=c, beta=b)


@xxt.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], x.size(-2))


@xtx.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-2], x.size(-1), x.size(-1))


@ba_plus_caa.register_fake
def _(a: Tensor, b: float, c: float) -> Tensor:
    return torch.empty_like(a)


# Fused head + softcapped (multi-token) cross-entropy (#60, #67, #75) with #89's numerics, for --fused_head: the
# logits are made HEAD_CHUNK_ROWS rows at a time and one Triton kernel turns each chunk into its rows' losses and
# their gradient. The loss ends the graph, so its gradient is computed in the forward and backward only scales it:
# neither the (T, vocab) logits nor their fp32 softcap ever exist, one chunk at a time does (validation, loss only,
# too). #89's rounding: in training s = sigmoid((z + shift) / temp) is rounded to bf16 and u = cap s formed from
# it; each row's gradient weighs the softmax by all K weights (S_w) even where t + k is past the end, while the loss
# and the target term leave those k out (#89's tail quirk: the last K - 1 rows). Training adds upstream's prefix term
# (#88): w_pre (lse - u[T'_t]) with T'_t the longest proper prefix token of y_t, where 0 <= T'_t < vocab (else none),
# its weight in S_w and in the target term (targets outside [0, vocab) have neither loss nor target term); with
# w_pre = 0 or no valid T' every value is #89's, bit for bit. Validation rounds u = cap s to the
# logits' dtype (#89's compiled softcap: bf16). With FP8 scales the kernel writes the gradient as e5m2 codes of
# dloss/dz / grad_s (nearest, saturating at +-57344: #89's cvt.rn.satfinite), which the head's FP8 backward GEMMs
# take as they are.
HEAD_CHUNK_ROWS = 8192  # 8192 x 50304 bf16 logits: 0.8 GB in place of 4.9 GB per micro-step (26 GB validating)


@functools.cache
def softcap_ce_launcher() -> Callable:
    global tl, round_bf16, capped, round_e5m2  # module globals, as Triton (its interpreter too) resolves a kernel's names there
    import triton
    import triton.language as tl

    # Roundings by the bits, kept in fp32, so that the store's cast is exact: the GPU's casts round to nearest even,
    # the interpreter's truncate (bf16) or round ties up and truncate subnormals (fp8). Finite x only.
    @triton.jit
    def round_bf16(x):
        b = x.to(tl.uint32, bitcast=True)
        b += 0x7FFF + ((b >> 16) & 1)
        return ((b >> 16) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def capped(s, cap, GRAD: tl.constexpr, dtype: tl.constexpr):
        # u = cap s: training rounds the sigmoid s to bf16 first (#89's kernel), validation u to the logits' dtype
        if GRAD:
            return cap * round_bf16(s)
        u = cap * s
        if dtype == tl.bfloat16:
            u = round_bf16(u)
        elif dtype == tl.float16:
            u = u.to(tl.float16).to(tl.float32)
        return u

    @triton.jit
    def round_e5m2(x):
        # 2 mantissa bits from 2^-14 up, saturating at 57344; below, multiples of 2^-16 (the fp32 ulp at 128)
        a = tl.minimum(tl.abs(x), 57344.0)
        b = a.to(tl.uint32, bitcast=True)
        b += 0xFFFFF + ((b >> 21) & 1)
        r = tl.where(a < 0.00006103515625, (a + 128.0) - 128.0, ((b >> 21) << 21).to(tl.float32, bitcast=True))
        return tl.where(x < 0, -r, r)

    # The prefix weight one fp32, possibly an element of a per-step schedule: no alignment specialization (one
    # compile for every step's, not one per alignment of its offset).
    @triton.jit(do_not_specialize_on_alignment=["prefix_weight_ptr"])
    def kernel(z_ptr, z_stride, g_ptr, g_stride, targets_ptr, weights_ptr, prefix_ptr, prefix_weight_ptr, loss_ptr,
               row0, T, cap, shift, temp, grad_s, V: tl.constexpr, K: tl.constexpr, BLOCK_V: tl.constexpr,
               GRAD: tl.constexpr):
        # One program per row t = row0 + r, u its softcap (above): the loss sum_k w_k (lse - u[y_(t+k)]) over the k
        # with t + k < T and 0 <= y_(t+k) < V; GRAD adds w_pre (lse - u[T'_t]) for a T'_t in [0, V) and makes g =
        # (S_w softmax(u) - sum_k w_k onehot(y_(t+k)) - w_pre onehot(T'_t)) (cap / temp) s (1 - s) / grad_s in
        # g_ptr's dtype, S_w = sum_k w_k + w_pre, the MTP sums' order #89's and the prefix's weight added after them
        # (adding zero changes no bit: without a prefix term the values are #89's). u <= cap, so lse = cap + log sum
        # exp(u - cap) needs no running max. sigmoid and cdiv written out: tl's are jit functions, which the
        # interpreter re-patches at every call.
        r = tl.program_id(0)
        row = z_ptr + r.to(tl.int64) * z_stride
        inv_temp = 1 / temp
        bias = shift * inv_temp
        sums = tl.zeros((BLOCK_V,), dtype=tl.float32)
        for i in range(0, (V + BLOCK_V - 1) // BLOCK_V):
            cols = i * BLOCK_V + tl.arange(0, BLOCK_V)
            s = 1 / (1 + tl.exp(-(tl.load(row + cols, mask=cols < V, other=0.0).to(tl.float32) * inv_temp + bias)))
            u = capped(s, cap, GRAD, z_ptr.dtype.element_ty)
            sums += tl.where(cols < V, tl.exp(u - cap), 0.0)
        lse = cap + tl.log(tl.sum(sums, axis=0))
        ks = tl.arange(0, K)
        ys = tl.load(targets_ptr + row0 + r + ks, mask=row0 + r + ks < T, other=-1)
        valid = (ys >= 0) & (ys < V)
        ys = tl.where(valid, ys, -1)  # -1 matches no column: an invalid target has no target term either
        ws = tl.load(weights_ptr + ks)
        s_y = 1 / (1 + tl.exp(-(tl.load(row + ys, mask=valid, other=0.0).to(tl.float32) * inv_temp + bias)))
        u_y = capped(s_y, cap, GRAD, z_ptr.dtype.element_ty)
        loss = tl.sum(tl.where(valid, ws * (lse - u_y), 0.0), axis=0)
        if GRAD:
            prefix = tl.load(prefix_ptr + row0 + r)
            has_prefix = (prefix >= 0) & (prefix < V)
            prefix = tl.where(has_prefix, prefix, -1)
            w_pre = tl.where(has_prefix, tl.load(prefix_weight_ptr), 0.0)
            s_p = 1 / (1 + tl.exp(-(tl.load(row + prefix, mask=has_prefix, other=0.0).to(tl.float32) * inv_temp
                                    + bias)))
            loss += w_pre * (lse - cap * round_bf16(s_p))
            coef = tl.sum(ws, axis=0) + w_pre  # S_w: every MTP weight (#89's tail quirk), the prefix's if valid
            scale = cap * inv_temp * (1 / grad_s)
            out = g_ptr + r.to(tl.int64) * g_stride
            for i in range(0, (V + BLOCK_V - 1) // BLOCK_V):
                cols = i * BLOCK_V + tl.arange(0, BLOCK_V)
                a = tl.load(row + cols, mask=cols < V, other=0.0).to(tl.float32) * inv_temp + bias
                s = round_bf16(1 / (1 + tl.exp(-a)))
                # the weights of every prediction whose target is this column (MTP's, then the prefix's)
                picked = (tl.sum(tl.where(cols[:, None] == ys[None, :], ws[None, :], 0.0), axis=1)
                          + tl.where(cols == prefix, w_pre, 0.0))
                g = scale * (coef * tl.exp(cap * s - lse) - picked) * s * (1 - s)
                if g_ptr.dtype.element_ty == tl.float8e5:
                    g = round_e5m2(g)
                elif g_ptr.dtype.element_ty == tl.bfloat16:
                    g = round_bf16(g)
                tl.store(out + cols, g.to(g_ptr.dtype.element_ty), mask=cols < V)
        tl.store(loss_ptr + r, loss)

    def launch(z: Tensor, targets: Tensor, weights: Tensor, prefix_targets: Tensor, prefix_weight: Tensor,
               losses: Tensor, row0: int, cap: float, shift: float, temp: float, grad: Tensor | None = None,
               grad_s: float = 1.0, block_v: int = 1024) -> None:
        """grad: where the gradient goes (z itself for the bf16 head; e5m2 codes for the FP8 one), None for the
        loss alone (validation's rounding, no prefix term: prefix_targets and prefix_weight unread). weights: fp32,
        padded with zeros to a power of two (tl.arange's rule; softcap_ce pads them once). prefix_targets: int64,
        one per target (row0 + r indexes both); prefix_weight: fp32, one element."""
        out = z if grad is None else grad
        kernel[(z.size(0),)](z, z.stride(0), out, out.stride(0), targets, weights, prefix_targets, prefix_weight,
                             losses, row0, targets.numel(), cap, shift, temp, grad_s, V=z.size(1), K=weights.numel(),
                             BLOCK_V=block_v, GRAD=grad is not None)

    launch.kernel = kernel  # tools/sm90_kernels.py compiles it for the H100 offline
    return launch


@torch.library.custom_op("speedrun::softcap_ce", mutates_args=())
def softcap_ce(x: Tensor, w: Tensor, targets: Tensor, weights: Tensor, prefix_targets: Tensor, prefix_weight: Tensor,
               cap: float, shift: float, temp: float, fp8_scales: list[float], training: bool = True
               ) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, dloss/dx, dloss/dw) of sum_k weights[k] sum_t CE(u_t, targets[t + k]) + prefix_weight sum_t CE(u_t,
    prefix_targets[t]), u #89's softcap of x w^T (above), the terms past the end and the targets outside [0, vocab)
    left out (a prefix target of -1: that row has no prefix term); dloss/dx in x's dtype, dloss/dw in fp32 (#89's).
    prefix_targets: int64, one per target; prefix_weight: fp32, one element (a tensor: a new weight is no new
    graph). fp8_scales: fp8_scales() of loss scale 1 (grad_s sets the e5m2 codes' range; the loss scale reaches the
    gradients through autograd): the head's GEMMs in FP8 as #89 runs them; [] runs them in x's dtype.
    training=False (no autograd: validation) gives the next-token losses alone, with validation's rounding and no
    prefix term, the gradients empty."""
    if training and (prefix_targets.shape != targets.shape or prefix_targets.dtype != torch.int64
                     or prefix_weight.numel() != 1):
        raise ValueError(f"softcap_ce: prefix_targets must be int64 of targets' shape {tuple(targets.shape)} and "
                         f"prefix_weight one element, not {prefix_targets.dtype} {tuple(prefix_targets.shape)} and "
                         f"{prefix_weight.numel()} elements")
    if not training:
        grad_x, grad_w = x.new_empty(0), w.new_empty(0, dtype=torch.float32)
    else:
        grad_x, grad_w = torch.empty_like(x), torch.zeros_like(w, dtype=torch.float32)
    losses = torch.empty(x.size(0), dtype=torch.float32, device=x.device)  # per row, summed once at the end
    weights = F.pad(weights.float(), (0, max(2, 1 << (weights.numel() - 1).bit_length()) - weights.numel()))
    prefix_targets, prefix_weight = prefix_targets.contiguous(), prefix_weight.float()
    w_x = None if fp8_scales else w.type_as(x)  # the FP8 GEMMs cast w themselves
    grad_s = fp8_scales[2] if fp8_scales else 1.0
    scale_tensors = _scales(fp8_scales, x)
    for row0 in range(0, x.size(0), HEAD_CHUNK_ROWS):
        xc = x[row0: row0 + HEAD_CHUNK_ROWS]
        z = _fp8_matmul(xc, w, *scale_tensors[:2]) if fp8_scales else xc @ w_x.T
        grad = None if not training else torch.empty_like(z, dtype=torch.float8_e5m2) if fp8_scales else z
        softcap_ce_launcher()(z, targets, weights, prefix_targets, prefix_weight, losses[row0:], row0, cap, shift,
                              temp, grad, grad_s)
        if grad is None:
            continue
        gx, gw = _fp8_head_grads(grad, xc, w, *scale_tensors) if fp8_scales else (z @ w_x, z.T @ xc)
        grad_x[row0: row0 + HEAD_CHUNK_ROWS] = gx
        grad_w += gw
    return losses.sum(), grad_x, grad_w


@softcap_ce.register_fake
def _(x: Tensor, w: Tensor, targets: Tensor, weights: Tensor, prefix_targets: Tensor, prefix_weight: Tensor,
      cap: float, shift: float, temp: float, fp8_scales: list[float], training: bool = True
      ) -> tuple[Tensor, Tensor, Tensor]:
    grads = ((torch.empty_like(x), torch.empty_like(w, dtype=torch.float32)) if training
             else (x.new_empty(0), w.new_empty(0, dtype=torch.float32)))
    return x.new_empty((), dtype=torch.float32), *grads


def _softcap_ce_setup(ctx, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(output[1], output[2])


def _softcap_ce_grad(ctx, grad_loss: Tensor, *_: Tensor) -> tuple:
    # grad_w stays fp32 through the loss scale; autograd rounds it once, to w's dtype. None for each of the other
    # nine inputs (targets, weights, prefix_targets, prefix_weight, cap, shift, temp, fp8_scales, training).
    grad_x, grad_w = ctx.saved_tensors
    return grad_loss * grad_x, grad_loss * grad_w, *[None] * 9


softcap_ce.register_autograd(_softcap_ce_grad, setup_context=_softcap_ce_setup)

# FP8 MLP (#84's up-projection, #89's down-projection), training only: relu(x W_fc^T)^2 W_proj with both GEMMs in
# float8_e4m3 (spec 4.8.2-4.8.3) and the backward in bf16 from the bf16 weights, x and post ("straight-through",
# 4.8.4), as upstream's FusedLinearReLUSquareFunction (#89's, with #87's post-only activations: relu(pre) is
# sqrt(post) in the backward, pre is never kept). The weights' codes and scales come from quantize_mlp_weights_ once
# per optimizer step; x's scale is its current amax, post's a delayed one (the caller's, from the partial maxima
# this op returned in the previous training forward). kernel=True (--relu2_kernel): the up-projection, ReLU^2 and
# post8 in linear_relu_square's FP8 mode and dpre in its backward mode, as #89; else the torch path, compiled on
# first call like the FP8 head's (the reference, and the CPU's). The down-projection is torch._scaled_mm either way.
def _mlp_input_codes(x: Tensor, up_scale: Tensor) -> tuple[Tensor, Tensor]:
    """x's e4m3 codes at its current scale, and the up-projection's dequant scale."""
    amax = x.abs().amax().clamp(min=1e-12).float()  # clamped in x's dtype, as #89's eager-written graph
    x8 = (x.float() * (FP8_MAX_E4M3 / amax)).to(torch.float8_e4m3fn)
    return x8, up_scale * amax / FP8_MAX_E4M3  # #89's buffer: s_up, times amax, over 448, fp32


def _down_projection(post8: Tensor, w8_proj_t: Tensor, act_scale: Tensor, down_scale: Tensor) -> Tensor:
    return torch._scaled_mm(post8, w8_proj_t.T, out_dtype=torch.bfloat16, use_fast_accum=True, scale_a=act_scale,
                            scale_b=down_scale)


_mlp_fp8_input = compiled_on_first_call(_mlp_input_codes)  # the kernel path's x8 (the GEMM kernel reads codes)


@compiled_on_first_call
def _mlp_fp8_forward(x: Tensor, w8_fc: Tensor, up_scale: Tensor, w8_proj_t: Tensor, down_scale: Tensor,
                     act_scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    x8, dequant = _mlp_input_codes(x, up_scale)
    # pre = bf16(dequant x the fast-accumulated dot) (Triton's fp8 default on sm90): one fp32 multiply, one rounding.
    # cuBLAS scales the fp32 accumulator so; torch's CPU _scaled_mm scales the operands first, so there the
    # accumulator comes out in fp32 and is scaled here.
    one = torch.ones_like(dequant)
    if x.is_cuda:
        pre = torch._scaled_mm(x8, w8_fc.T, out_dtype=torch.bfloat16, use_fast_accum=True, scale_a=dequant,
                               scale_b=one)
    else:
        pre = (torch._scaled_mm(x8, w8_fc.T, out_dtype=torch.float32, scale_a=one, scale_b=one) * dequant).bfloat16()
    post = torch.relu(pre).square()
    post8 = (post.float() * (1 / act_scale)).clamp(max=FP8_MAX_E4M3).to(torch.float8_e4m3fn)  # post >= 0
    return _down_projection(post8, w8_proj_t, act_scale, down_scale), post.amax().float().view(1), post


@compiled_on_first_call
def _mlp_grads(g: Tensor, x: Tensor, w_fc: Tensor, w_proj: Tensor, post: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    # relu(pre) as sqrt(post) (#87): 2h exact, its product with the fp32 root rounded once to fp32, then to bf16, as
    # the kernel's epilogue computes it (the IEEE root both sides)
    d_pre = (2 * (g @ w_proj.T).float() * post.float().sqrt()).bfloat16()
    return d_pre @ w_fc, d_pre.T @ x, post.T @ g


@torch.library.custom_op("speedrun::mlp_fp8_forward", mutates_args=())
def mlp_fp8_forward(x: Tensor, w_fc: Tensor, w_proj: Tensor, w8_fc: Tensor, up_scale: Tensor, w8_proj_t: Tensor,
                    down_scale: Tensor, act_scale: Tensor, kernel: bool) -> tuple[Tensor, Tensor, Tensor]:
    """mlp_fp8's (out, post's partial maxima) and the bf16 post (M, hidden) its backward keeps (no pre: #87)."""
    if not kernel:
        return _mlp_fp8_forward(x, w8_fc, up_scale, w8_proj_t, down_scale, act_scale)
    x8, dequant = _mlp_fp8_input(x, up_scale)
    post, post8, maxima = linear_relu_square_launcher()(x8, w8_fc, scales=(dequant, act_scale))
    return _down_projection(post8, w8_proj_t, act_scale, down_scale), maxima, post


@mlp_fp8_forward.register_fake
def _(x: Tensor, w_fc: Tensor, w_proj: Tensor, w8_fc: Tensor, up_scale: Tensor, w8_proj_t: Tensor,
      down_scale: Tensor, act_scale: Tensor, kernel: bool) -> tuple[Tensor, Tensor, Tensor]:
    maxima = mlp_programs(x.size(0), w_fc.size(0), x.device) if kernel else 1
    return (x.new_empty(x.size(0), w_proj.size(1), dtype=torch.bfloat16), x.new_empty(maxima, dtype=torch.float32),
            x.new_empty(x.size(0), w_fc.size(0), dtype=torch.bfloat16))


def _mlp_fp8_setup(ctx, inputs: tuple, output: tuple) -> None:
    ctx.kernel = inputs[-1]
    ctx.save_for_backward(*inputs[:3], output[2])  # x, w_fc, w_proj, post
    ctx.mark_non_differentiable(*output[1:])


def _mlp_fp8_grad(ctx, grad_out: Tensor, *_: Tensor) -> tuple:
    return *torch.ops.speedrun.mlp_backward(grad_out, *ctx.saved_tensors, ctx.kernel), *[None] * 6


mlp_fp8_forward.register_autograd(_mlp_fp8_grad, setup_context=_mlp_fp8_setup)


# The bf16 MLP through the ReLU^2 GEMM (--relu2_kernel outside FP8 training: validation, a run without FP8): its
# bf16 forward mode makes post, torch multiplies it by W_proj; the backward is the FP8 MLP's (upstream's
# FusedLinearReLUSquareFunction without FP8). All bf16 (x and both weights).
@torch.library.custom_op("speedrun::mlp_relu2_forward", mutates_args=())
def mlp_relu2_forward(x: Tensor, w_fc: Tensor, w_proj: Tensor) -> tuple[Tensor, Tensor]:
    """mlp_relu2's output and the post (M, hidden) its backward keeps."""
    (post,) = linear_relu_square_launcher()(x, w_fc)
    return post @ w_proj, post


@mlp_relu2_forward.register_fake
def _(x: Tensor, w_fc: Tensor, w_proj: Tensor) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.size(0), w_proj.size(1)), x.new_empty(x.size(0), w_fc.size(0))


def _mlp_relu2_setup(ctx, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(*inputs, output[1])  # x, w_fc, w_proj, post
    ctx.mark_non_differentiable(output[1])


def _mlp_relu2_grad(ctx, grad_out: Tensor, *_: Tensor) -> tuple:
    return torch.ops.speedrun.mlp_backward(grad_out, *ctx.saved_tensors, True)


mlp_relu2_forward.register_autograd(_mlp_relu2_grad, setup_context=_mlp_relu2_setup)


@torch.library.custom_op("speedrun::mlp_backward", mutates_args=())
def mlp_backward(g: Tensor, x: Tensor, w_fc: Tensor, w_proj: Tensor, post: Tensor, kernel: bool
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of mlp_fp8 and mlp_relu2 (grad_x, grad_w_fc, grad_w_proj), bf16: dpre = bf16(2 bf16(g W_proj^T)
    sqrt(fp32(post))) (kernel: the ReLU^2 GEMM's backward mode), dpre W_fc, dpre^T x, post^T g. An op of its own,
    as fp8_mm_backward: a compiled caller traces it opaque."""
    if not kernel:
        return _mlp_grads(g, x, w_fc, w_proj, post)
    (d_pre,) = linear_relu_square_launcher()(g, w_proj, aux=post)
    return d_pre @ w_fc, d_pre.T @ x, post.T @ g


@mlp_backward.register_fake
def _(g: Tensor, x: Tensor, w_fc: Tensor, w_proj: Tensor, post: Tensor, kernel: bool
      ) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(w_fc), torch.empty_like(w_proj)


# The public ops, composite: each is its forward op, whose extra output (post) autograd keeps for the backward.
torch.library.define("speedrun::mlp_fp8", "(Tensor x, Tensor w_fc, Tensor w_proj, Tensor w8_fc, Tensor up_scale, "
                     "Tensor w8_proj_t, Tensor down_scale, Tensor act_scale, bool kernel) -> (Tensor, Tensor)")
torch.library.define("speedrun::mlp_relu2", "(Tensor x, Tensor w_fc, Tensor w_proj) -> Tensor")


@torch.library.impl("speedrun::mlp_fp8", "CompositeImplicitAutograd")
def mlp_fp8(x: Tensor, w_fc: Tensor, w_proj: Tensor, w8_fc: Tensor, up_scale: Tensor, w8_proj_t: Tensor,
            down_scale: Tensor, act_scale: Tensor, kernel: bool) -> tuple[Tensor, Tensor]:
    """(out, maxima): relu(x W_fc^T)^2 W_proj in FP8 for x (M, d) bf16, w_fc and w_proj (hidden, d) bf16 (the
    gradients' operands), w8_fc (hidden, d) and w8_proj_t (d, hidden) their e4m3 codes with their 0-d fp32 scales
    up_scale and down_scale (quantize_mlp_weights_'s up_scales[l], used_scales[l]), act_scale post's delayed
    scale; maxima: fp32 partial maxima of post (the kernel's, one per program; the torch path's one), whose max is
    the next step's act_scale's amax. kernel: linear_relu_square (above). Gradients reach x, w_fc and w_proj."""
    return tuple(torch.ops.speedrun.mlp_fp8_forward(x, w_fc, w_proj, w8_fc, up_scale, w8_proj_t, down_scale,
                                                    act_scale, kernel)[:2])


@torch.library.impl("speedrun::mlp_relu2", "CompositeImplicitAutograd")
def mlp_relu2(x: Tensor, w_fc: Tensor, w_proj: Tensor) -> Tensor:
    """relu(x W_fc^T)^2 W_proj for x (M, d), w_fc and w_proj (hidden, d), all bf16, by the ReLU^2 GEMM."""
    return torch.ops.speedrun.mlp_relu2_forward(x, w_fc, w_proj)[0]


# The down-projection's weight quantizer on the GPU (#89's quantize_transpose_mlp_down_weights and the scales'
# reduction): one program per layer and 64 x 64 tile of W_proj writes the tile's e4m3 codes transposed (W_proj^T
# row-major: _scaled_mm's column-major W_proj) and the tile's max |W|; a second kernel reduces each layer's tile
# maxima to its next scale. Division by IEEE rounding and the saturating cast: the torch path's codes, bit for bit.
@functools.cache
def amax_scales_launcher() -> Callable:
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(maxima_ptr, scales_ptr, stride, COUNT: tl.constexpr, HEADROOM: tl.constexpr, BLOCK: tl.constexpr):
        # scale[l] = max(max_j maxima[l, j], 1e-12) x fp32(headroom / 448), as torch's fp32 tensor x Python float
        offsets = tl.arange(0, BLOCK)
        values = tl.load(maxima_ptr + tl.program_id(0) * stride + offsets, mask=offsets < COUNT, other=0.0)
        tl.store(scales_ptr + tl.program_id(0), tl.maximum(tl.max(values, axis=0), 1e-12) * (HEADROOM / 448.0))

    def launch(maxima: Tensor, scales: Tensor, headroom: float) -> None:
        """scales (L,) fp32 := max(max of each row of maxima (L, P) >= 0, 1e-12) x headroom / 448."""
        layers, count = maxima.shape
        kernel[(layers,)](maxima, scales, maxima.stride(0), COUNT=count, HEADROOM=headroom,
                          BLOCK=triton.next_power_of_2(count), num_warps=4, num_stages=1)

    launch.kernel = kernel  # tools/sm90_kernels.py compiles it for the H100 offline
    return launch


QUANT_BLOCK = 64  # #89's tiles: 48 x 12 = 576 per 3072 x 768 layer


@functools.cache
def quantize_mlp_down_launcher() -> Callable:
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(w_ptr, out_ptr, next_ptr, used_ptr, maxima_ptr, layer_stride, row_stride, HIDDEN: tl.constexpr,
               DIM: tl.constexpr, BLOCK: tl.constexpr):
        layer, tile = tl.program_id(0), tl.program_id(1)
        tiles_d = (DIM + BLOCK - 1) // BLOCK
        h = tile // tiles_d * BLOCK + tl.arange(0, BLOCK)
        d = tile % tiles_d * BLOCK + tl.arange(0, BLOCK)
        inside = (h[:, None] < HIDDEN) & (d[None, :] < DIM)
        w = tl.load(w_ptr + layer * layer_stride + h[:, None] * row_stride + d[None, :], mask=inside,
                    other=0.0).to(tl.float32)
        scale = tl.load(next_ptr + layer)
        q = tl.math.div_rn(w, tl.broadcast_to(scale, (BLOCK, BLOCK)))
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        tl.store(out_ptr + layer * HIDDEN * DIM + d[:, None] * HIDDEN + h[None, :],
                 tl.trans(q).to(out_ptr.dtype.element_ty), mask=tl.trans(inside))
        tl.store(maxima_ptr + layer * tl.num_programs(1) + tile, tl.max(tl.max(tl.abs(w), axis=1), axis=0))
        if tile == 0:
            tl.store(used_ptr + layer, scale)

    reduce = amax_scales_launcher()

    def launch(w_proj: Tensor, w8_proj_t: Tensor, used_scales: Tensor, next_scales: Tensor, headroom: float) -> None:
        """w_proj (L, hidden, d) bf16, rows contiguous; w8_proj_t (L, d, hidden) e4m3, contiguous: codes of
        clamp(W / next, +-448); used := next; next := max(max |W|, 1e-12) headroom / 448 (fp32, per layer)."""
        layers, hidden, dim = w_proj.shape
        assert w_proj.stride(2) == 1 and w8_proj_t.is_contiguous() and w8_proj_t.shape == (layers, dim, hidden)
        tiles = triton.cdiv(hidden, QUANT_BLOCK) * triton.cdiv(dim, QUANT_BLOCK)
        maxima = w_proj.new_empty(layers, tiles, dtype=torch.float32)  # every slot written: one per program
        kernel[(layers, tiles)](w_proj, w8_proj_t, next_scales, used_scales, maxima, w_proj.stride(0),
                                w_proj.stride(1), HIDDEN=hidden, DIM=dim, BLOCK=QUANT_BLOCK, num_warps=4,
                                num_stages=1)
        reduce(maxima, next_scales, headroom)

    launch.kernel = kernel  # tools/sm90_kernels.py compiles it for the H100 offline
    return launch


def quantize_mlp_weights_(bank: Tensor, w8_fc: Tensor, up_scales: Tensor, w8_proj_t: Tensor, used_scales: Tensor,
                          next_scales: Tensor, bootstrap: bool, headroom: float = 1.12, kernel: bool | None = None
                          ) -> None:
    """#89's quantize_mlp_fp8 (spec 4.8.1), after every optimizer step, in place and without a host sync. bank (L,
    2, hidden, d) bf16: [W_fc, W_proj] per layer. Up, current scaling: up_scales = bf16(bf16(amax) / 448) (bf16
    ops), w8_fc = e4m3(bf16(W_fc / s)). Down, delayed: bootstrap sets next_scales as the up scale; w8_proj_t (L, d,
    hidden) = e4m3(clamp(W_proj / next, +-448)) transposed (fp32 quotient); used_scales := next_scales; next_scales
    := max(amax, 1e-12) headroom / 448 in fp32, for the next call (a weight grown past it saturates). kernel: the
    down-projection's part by quantize_mlp_down_launcher's kernels (default: on CUDA), the up one eager as #89's."""
    with torch.no_grad():
        w_fc, w_proj = bank[:, 0], bank[:, 1]
        up = w_fc.flatten(1).abs().amax(1).clamp(min=1e-12) / FP8_MAX_E4M3
        up_scales.copy_(up)
        w8_fc.copy_((w_fc / up[:, None, None]).to(torch.float8_e4m3fn))
        kernel = bank.is_cuda if kernel is None else kernel
        amax = w_proj.flatten(1).abs().amax(1) if bootstrap or not kernel else None
        if bootstrap:
            next_scales.copy_(amax.clamp(min=1e-12) / FP8_MAX_E4M3)
        if kernel:
            quantize_mlp_down_launcher()(w_proj, w8_proj_t, used_scales, next_scales, headroom)
            return
        w8_proj_t.copy_(_to_fp8(w_proj, next_scales[:, None, None], torch.float8_e4m3fn).transpose(1, 2))
        used_scales.copy_(next_scales)
        next_scales.copy_(amax.float().clamp(min=1e-12) * (headroom / FP8_MAX_E4M3))


# DC attention (upstream f411b3d's layer-10 correction, spec §3; train_gpt.dc_attention is its torch path): out = base +
# sum_j round(w2[t, h] A[t, j]) v[j, h], A = sum_h w1[t, h] P_h[t, j], P_h a fresh softmax of scale q.k over the
# window V(t) = {j : s(t) <= j <= t, t - j < window} inside t's document. The forward: one program per DC_BLOCK_M
# queries and every head, against the key slots k0 ... k0 + BLOCK_K - 1, k0 = max(0, q0 - (window - 1)), which hold
# every query's window; it keeps each row's log-sum-exp (T, H) fp32 for the backward. The backward, deterministic
# (no atomics, every sum in one program in a fixed order, each gradient rounded once): a query-major kernel
# recomputes P_h from the LSE and writes dq, dw1, dw2 and, per (t, offset t - j), the softmax gradient dS_h (in the
# input dtype, the operand the dots take) and the mixture A (fp32); a key-major kernel then forms dk = scale sum_t
# dS_h q and dv = sum_t round(w2 A) dO per DC_BLOCK_N keys from them. T and the number of cu_seqlens entries are
# runtime arguments: one compile serves every stage and validation. The scores' dots take fp32 operands in IEEE
# precision (the fp32 tests), 16-bit ones exactly with fp32 accumulation, as upstream's tf32 dots do.
DC_BLOCK_M, DC_BLOCK_N = 16, 16  # queries per forward / first backward program; keys per second backward program
# 8 warps, and the heads in a loop the compiler keeps (range, not static_range): unrolled, the six heads' loads were
# hoisted together and the backward kernels spilled at 4 or 8 warps (tools/sm90_kernels.py)
DC_NUM_WARPS = 8


def dc_slots(window: int, block: int) -> int:
    """A tile's second dimension: the key slots (or, key-major, the query slots) a block of `block` rows reaches
    through a window, block + window - 1, as a power of two (tl.arange's rule); 128 at the recipe's 112."""
    return max(16, 1 << (window + block - 2).bit_length())


@functools.cache
def dc_attention_launcher() -> Callable:
    global tl, dc_window, dc_probs  # module globals, as Triton (its interpreter too) resolves a kernel's names there
    import triton
    import triton.language as tl

    @triton.jit
    def dc_window(cu_ptr, n_docs, search_steps, t, j, T, WINDOW: tl.constexpr):
        # (BLOCK_M, slots) mask of V(t) and t's rows inside T. s(t) = cu[c - 1], c the number of the first n_docs
        # entries at or before t, by a binary search of search_steps = n_docs.bit_length() halvings (the padding's
        # repeated T and zero-length segments need no special case).
        inside = t < T
        lo = tl.zeros_like(t)
        hi = lo + n_docs
        for _ in range(search_steps):
            active = lo < hi
            mid = (lo + hi) // 2
            at = tl.load(cu_ptr + mid, mask=active, other=0)
            lo = tl.where(active & (at <= t), mid + 1, lo)
            hi = tl.where(active & (at > t), mid, hi)
        start = tl.load(cu_ptr + tl.maximum(lo - 1, 0))
        back = t[:, None] - j[None, :]
        valid = inside[:, None] & (j[None, :] >= start[:, None]) & (back >= 0) & (back < WINDOW)
        return valid, inside

    @triton.jit
    def dc_probs(q_ptr, k_ptr, t, j, d, h, valid, inside, lse, T, scale, H: tl.constexpr, D: tl.constexpr,
                 PRECISION: tl.constexpr, FROM_LSE: tl.constexpr):
        # P_h over the tile (0 off V(t)) and each row's LSE: computed (forward) or given (FROM_LSE, the backward).
        # A row past T has no valid slot: its sum is taken as 1 (upstream's rule), its P and LSE are never stored.
        q = tl.load(q_ptr + (t.to(tl.int64)[:, None] * H + h) * D + d[None, :], mask=inside[:, None], other=0.0)
        k = tl.load(k_ptr + (j.to(tl.int64)[:, None] * H + h) * D + d[None, :], mask=(j < T)[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if not FROM_LSE:
            top = tl.max(tl.where(valid, s, float("-inf")), axis=1)
            top = tl.where(inside, top, 0.0)
            total = tl.sum(tl.where(valid, tl.exp(s - top[:, None]), 0.0), axis=1)
            lse = top + tl.log(tl.where(total > 0, total, 1.0))
        return tl.where(valid, tl.exp(s - lse[:, None]), 0.0), lse

    @triton.jit
    def forward_kernel(base_ptr, q_ptr, k_ptr, v_ptr, w1_ptr, w2_ptr, cu_ptr, out_ptr, lse_ptr, T, n_docs,
                       search_steps, scale, H: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr,
                       BLOCK_M: tl.constexpr, SLOTS: tl.constexpr, PRECISION: tl.constexpr):
        q0 = tl.program_id(0) * BLOCK_M
        t = q0 + tl.arange(0, BLOCK_M)
        j = tl.maximum(q0 - (WINDOW - 1), 0) + tl.arange(0, SLOTS)
        d = tl.arange(0, D)
        valid, inside = dc_window(cu_ptr, n_docs, search_steps, t, j, T, WINDOW)
        rows = t.to(tl.int64) * H  # the (t, h) entries of w1, w2 and the LSE: rows + h
        mix = tl.zeros((BLOCK_M, SLOTS), dtype=tl.float32)
        for h in range(H):
            p, lse = dc_probs(q_ptr, k_ptr, t, j, d, h, valid, inside, None, T, scale, H, D, PRECISION, False)
            tl.store(lse_ptr + rows + h, lse, mask=inside)
            mix += tl.load(w1_ptr + rows + h, mask=inside, other=0.0).to(tl.float32)[:, None] * p
        for h in range(H):
            # the weight rounded to the input dtype before its dot with v (spec §3.2 step 4)
            w2 = tl.load(w2_ptr + rows + h, mask=inside, other=0.0).to(tl.float32)
            weight = (w2[:, None] * mix).to(v_ptr.dtype.element_ty)
            v = tl.load(v_ptr + (j.to(tl.int64)[:, None] * H + h) * D + d[None, :], mask=(j < T)[:, None], other=0.0)
            correction = tl.dot(weight, v, input_precision=PRECISION)
            at = (rows[:, None] + h) * D + d[None, :]
            base = tl.load(base_ptr + at, mask=inside[:, None], other=0.0).to(tl.float32)
            tl.store(out_ptr + at, (base + correction).to(out_ptr.dtype.element_ty), mask=inside[:, None])

    @triton.jit
    def backward_queries_kernel(grad_ptr, q_ptr, k_ptr, v_ptr, w1_ptr, w2_ptr, cu_ptr, lse_ptr, dq_ptr, dw1_ptr,
                                dw2_ptr, ds_ptr, mix_ptr, T, n_docs, search_steps, scale, H: tl.constexpr,
                                D: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, SLOTS: tl.constexpr,
                                PRECISION: tl.constexpr):
        # With dO = grad: dm_h = dO_h . v_h, dA = sum_h w2_h dm_h, dw2_h = sum_j dm_h A, dw1_h = sum_j dA P_h,
        # dS_h = P_h w1_h (dA - dw1_h), dq_h = scale round(dS_h) k_h (spec §3.3). Two passes over the heads: A and dA
        # need every head's P and dm first; the second recomputes them (registers hold one head's tiles at a time).
        q0 = tl.program_id(0) * BLOCK_M
        t = q0 + tl.arange(0, BLOCK_M)
        j = tl.maximum(q0 - (WINDOW - 1), 0) + tl.arange(0, SLOTS)
        d = tl.arange(0, D)
        valid, inside = dc_window(cu_ptr, n_docs, search_steps, t, j, T, WINDOW)
        rows = t.to(tl.int64) * H
        v_at = (j.to(tl.int64)[:, None] * H) * D + d[None, :]
        mix = tl.zeros((BLOCK_M, SLOTS), dtype=tl.float32)
        dmix = tl.zeros((BLOCK_M, SLOTS), dtype=tl.float32)
        for h in range(H):
            lse = tl.load(lse_ptr + rows + h, mask=inside, other=0.0)
            p, _ = dc_probs(q_ptr, k_ptr, t, j, d, h, valid, inside, lse, T, scale, H, D, PRECISION, True)
            mix += tl.load(w1_ptr + rows + h, mask=inside, other=0.0).to(tl.float32)[:, None] * p
            g = tl.load(grad_ptr + (rows[:, None] + h) * D + d[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(v_ptr + v_at + h * D, mask=(j < T)[:, None], other=0.0)
            dm = tl.dot(g, tl.trans(v), input_precision=PRECISION)
            dmix += tl.load(w2_ptr + rows + h, mask=inside, other=0.0).to(tl.float32)[:, None] * dm
        # A and dS by (t, t - j): every offset of [0, WINDOW) with j >= 0 is in this tile (SLOTS >= BLOCK_M +
        # WINDOW - 1); those off V(t) are stored as 0, so the key-major kernel reads no unwritten entry.
        back = t[:, None] - j[None, :]
        kept = inside[:, None] & (back >= 0) & (back < WINDOW)
        by_offset = t.to(tl.int64)[:, None] * WINDOW + back
        tl.store(mix_ptr + by_offset, mix, mask=kept)
        for h in range(H):
            lse = tl.load(lse_ptr + rows + h, mask=inside, other=0.0)
            p, _ = dc_probs(q_ptr, k_ptr, t, j, d, h, valid, inside, lse, T, scale, H, D, PRECISION, True)
            g = tl.load(grad_ptr + (rows[:, None] + h) * D + d[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(v_ptr + v_at + h * D, mask=(j < T)[:, None], other=0.0)
            dm = tl.dot(g, tl.trans(v), input_precision=PRECISION)
            dw2 = tl.sum(dm * mix, axis=1)
            dw1 = tl.sum(dmix * p, axis=1)
            w1 = tl.load(w1_ptr + rows + h, mask=inside, other=0.0).to(tl.float32)
            ds = (p * w1[:, None] * (dmix - dw1[:, None])).to(ds_ptr.dtype.element_ty)
            tl.store(ds_ptr + (rows[:, None] + h) * WINDOW + back, ds, mask=kept)
            k = tl.load(k_ptr + v_at + h * D, mask=(j < T)[:, None], other=0.0)
            dq = tl.dot(ds, k, input_precision=PRECISION) * scale
            tl.store(dq_ptr + (rows[:, None] + h) * D + d[None, :], dq.to(dq_ptr.dtype.element_ty),
                     mask=inside[:, None])
            tl.store(dw1_ptr + rows + h, dw1.to(dw1_ptr.dtype.element_ty), mask=inside)
            tl.store(dw2_ptr + rows + h, dw2.to(dw2_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def backward_keys_kernel(grad_ptr, q_ptr, w2_ptr, ds_ptr, mix_ptr, dk_ptr, dv_ptr, T, scale, H: tl.constexpr,
                             D: tl.constexpr, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, SLOTS: tl.constexpr,
                             PRECISION: tl.constexpr):
        # Keys j0 ... j0 + BLOCK_N - 1 against the queries that can see them, t = j0 ... j0 + SLOTS - 1 (a window's
        # reach: BLOCK_N + WINDOW - 1 of them): dk_h = scale sum_t dS_h[t, j] q_h[t], dv_h = sum_t round(w2[t, h]
        # A[t, j]) dO_h[t], each one dot in one program, rounded once.
        j0 = tl.program_id(0) * BLOCK_N
        j = j0 + tl.arange(0, BLOCK_N)
        t = j0 + tl.arange(0, SLOTS)
        d = tl.arange(0, D)
        back = t[None, :] - j[:, None]
        kept = (t < T)[None, :] & (back >= 0) & (back < WINDOW)
        by_offset = t.to(tl.int64)[None, :] * WINDOW + back
        mix = tl.load(mix_ptr + by_offset, mask=kept, other=0.0)
        rows = t.to(tl.int64) * H
        keys = j < T
        for h in range(H):
            ds = tl.load(ds_ptr + (rows[None, :] + h) * WINDOW + back, mask=kept, other=0.0)
            q = tl.load(q_ptr + (rows[:, None] + h) * D + d[None, :], mask=(t < T)[:, None], other=0.0)
            dk = tl.dot(ds, q, input_precision=PRECISION) * scale
            w2 = tl.load(w2_ptr + rows + h, mask=t < T, other=0.0).to(tl.float32)
            weight = (w2[None, :] * mix).to(q_ptr.dtype.element_ty)
            g = tl.load(grad_ptr + (rows[:, None] + h) * D + d[None, :], mask=(t < T)[:, None], other=0.0)
            dv = tl.dot(weight, g, input_precision=PRECISION)
            at = (j.to(tl.int64)[:, None] * H + h) * D + d[None, :]
            tl.store(dk_ptr + at, dk.to(dk_ptr.dtype.element_ty), mask=keys[:, None])
            tl.store(dv_ptr + at, dv.to(dv_ptr.dtype.element_ty), mask=keys[:, None])

    def sizes(q: Tensor, cu_seqlens: Tensor) -> dict:
        # the launches' shared arguments: T, the cu_seqlens entries' count and its binary search's length
        n_docs = cu_seqlens.numel() - 1
        return {"T": q.size(1), "n_docs": n_docs, "search_steps": max(1, n_docs.bit_length())}

    def options(q: Tensor, window: int) -> dict:
        _, _, H, D = q.shape
        return {"H": H, "D": D, "WINDOW": window, "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
                "num_warps": DC_NUM_WARPS, "num_stages": 1}

    def forward(base: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, cu_seqlens: Tensor,
                scale: float, window: int) -> tuple[Tensor, Tensor]:
        """(out (T, H, D) in base's dtype, LSE (T, H) fp32); every tensor contiguous."""
        T, H, D = base.shape
        out = torch.empty_like(base)
        lse = base.new_empty(T, H, dtype=torch.float32)
        n = sizes(q, cu_seqlens)
        forward_kernel[(triton.cdiv(T, DC_BLOCK_M),)](
            base, q, k, v, w1, w2, cu_seqlens, out, lse, n["T"], n["n_docs"], n["search_steps"], scale,
            BLOCK_M=DC_BLOCK_M, SLOTS=dc_slots(window, DC_BLOCK_M), **options(q, window))
        return out, lse

    def backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, cu_seqlens: Tensor,
                 lse: Tensor, scale: float, window: int) -> tuple[Tensor, ...]:
        """(dq, dk, dv, dw1, dw2) in their inputs' dtypes; every tensor contiguous."""
        T = q.size(1)
        dq, dk, dv, dw1, dw2 = (torch.empty_like(x) for x in (q, k, v, w1, w2))
        ds = q.new_empty(T, q.size(2), window)  # dS_h[t, t - j], the dots' operand: in the input dtype
        mix = q.new_empty(T, window, dtype=torch.float32)  # A[t, t - j]
        n, opts = sizes(q, cu_seqlens), options(q, window)
        backward_queries_kernel[(triton.cdiv(T, DC_BLOCK_M),)](
            grad, q, k, v, w1, w2, cu_seqlens, lse, dq, dw1, dw2, ds, mix, n["T"], n["n_docs"], n["search_steps"],
            scale, BLOCK_M=DC_BLOCK_M, SLOTS=dc_slots(window, DC_BLOCK_M), **opts)
        backward_keys_kernel[(triton.cdiv(T, DC_BLOCK_N),)](
            grad, q, w2, ds, mix, dk, dv, n["T"], scale, BLOCK_N=DC_BLOCK_N, SLOTS=dc_slots(window, DC_BLOCK_N),
            **opts)
        return dq, dk, dv, dw1, dw2

    # tools/sm90_kernels.py compiles these for the H100 offline
    forward.kernel, backward.kernels = forward_kernel, (backward_queries_kernel, backward_keys_kernel)
    return forward, backward


def _dc_check(base: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, cu_seqlens: Tensor,
              window: int) -> None:
    T, H, D = base.shape
    if q.shape != (1, T, H, D) or k.shape != q.shape or v.shape != q.shape or w1.shape != (1, T, H) or \
            w2.shape != w1.shape:
        raise ValueError(f"dc_attention: base (T, H, D), q, k, v (1, T, H, D), w1, w2 (1, T, H); got {base.shape}, "
                         f"{q.shape}, {k.shape}, {v.shape}, {w1.shape}, {w2.shape}")
    if len({x.dtype for x in (base, q, k, v, w1, w2)}) != 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError("dc_attention: one float dtype for base, q, k, v, w1, w2 and int32 cu_seqlens")
    if D < 16 or D & (D - 1) or window < 1:
        raise ValueError(f"dc_attention's kernels take a head dim that is a power of two >= 16 (got {D}), window >= 1")


@torch.library.custom_op("speedrun::dc_attention", mutates_args=())
def dc_attention(base: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, cu_seqlens: Tensor,
                 scale: float, window: int = 112) -> tuple[Tensor, Tensor]:
    """(out, LSE): train_gpt.dc_attention's out by the Triton kernels (shapes and dtype as there), and
    each (t, h) row's log-sum-exp (T, H) fp32, which the backward recomputes P from."""
    _dc_check(base, q, k, v, w1, w2, cu_seqlens, window)
    forward, _ = dc_attention_launcher()
    return forward(*(x.contiguous() for x in (base, q, k, v, w1, w2, cu_seqlens)), scale, window)


@dc_attention.register_fake
def _(base: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, cu_seqlens: Tensor, scale: float,
      window: int = 112) -> tuple[Tensor, Tensor]:
    return torch.empty_like(base), base.new_empty(base.shape[:2], dtype=torch.float32)


@torch.library.custom_op("speedrun::dc_attention_backward", mutates_args=())
def dc_attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor,
                          cu_seqlens: Tensor, lse: Tensor, scale: float, window: int
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dw1, dw2) of dc_attention for the output's gradient grad (T, H, D), deterministic."""
    _, backward = dc_attention_launcher()
    return backward(*(x.contiguous() for x in (grad.to(q.dtype), q, k, v, w1, w2, cu_seqlens, lse)), scale, window)


@dc_attention_backward.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, cu_seqlens: Tensor, lse: Tensor,
      scale: float, window: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return tuple(torch.empty_like(x) for x in (q, k, v, w1, w2))


def _dc_attention_setup(ctx, inputs: tuple, output: tuple) -> None:
    _, q, k, v, w1, w2, cu_seqlens, ctx.scale, ctx.window = inputs
    ctx.save_for_backward(q, k, v, w1, w2, cu_seqlens, output[1])
    ctx.mark_non_differentiable(output[1])


def _dc_attention_grad(ctx, grad_out: Tensor, _: Tensor) -> tuple:
    # base's gradient is the output's (out = base + C); the rest from the two kernels
    q, k, v, w1, w2, cu_seqlens, lse = ctx.saved_tensors
    dq, dk, dv, dw1, dw2 = torch.ops.speedrun.dc_attention_backward(grad_out, q, k, v, w1, w2, cu_seqlens, lse,
                                                                    ctx.scale, ctx.window)
    return grad_out, dq, dk, dv, dw1, dw2, None, None, None


dc_attention.register_autograd(_dc_attention_grad, setup_context=_dc_attention_setup)


FA3_HUB_KERNEL = ("kernels-community/flash-attn3", 1)  # the hub kernel and version #89 loads FA3 from


@functools.cache
def load_fa3() -> tuple[Callable | None, str]:
    """(FA3's flash_attn_varlen_func, "") from #89's hub kernel, or (None, why it cannot run here)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return None, "FA3 runs on Hopper GPUs (sm90) only"
    try:
        from kernels import get_kernel
    except ImportError:
        return None, "FA3 comes from the `kernels` package, which is not installed (pip install kernels)"
    name, version = FA3_HUB_KERNEL
    try:
        return get_kernel(name, version=version).flash_attn_interface.flash_attn_varlen_func, ""
    except Exception as e:  # the hub (offline, no build for this torch) or the build itself: say which
        return None, f"{name} version {version} did not load: {type(e).__name__}: {e}"


# CPU bf16 matmuls run through oneDNN where the CPU has bf16 instructions (AVX-512 BF16, AMX), else through a scalar
# reference loop (AVX2-only CPUs: tens to hundreds of times slower than fp32). There they can run as fp32 GEMMs of the
# same bf16 values rounded once to bf16: fp32 accumulation, as on the GPU (--cpu_bf16_gemm, eager and compiled).
GEMM_OPS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm, torch.ops.aten.mv,
            torch.ops.aten.addmv, torch.ops.aten.dot)


class Fp32Gemms(TorchDispatchMode):
    """Inside it, every bf16 mm/addmm/bmm/baddbmm (or out=) on the CPU runs in fp32, its result rounded to bf16. As it
    ignores compile internals, torch.compile compiles under it: compiled code's extern GEMMs come through here."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func.overloadpacket not in GEMM_OPS or func._overloadname not in ("default", "out")
                or not any(isinstance(a, Tensor) and a.dtype == torch.bfloat16 and a.device.type == "cpu"
                           for a in args)):
            return func(*args, **kwargs)
        wide = [a.float() if isinstance(a, Tensor) and a.dtype == torch.bfloat16 else a for a in args]
        out = kwargs.pop("out", None)
        result = func.overloadpacket.default(*wide, **kwargs)
        return result.bfloat16() if out is None else out.copy_(result)


# The record path: arithmetic that is the same on every x86-64 CPU with AVX2, whoever made it. torch's own kernels run
# at AVX2 (ATEN_CPU_CAPABILITY=avx2). What torch hands to MKL follows the CPU model, not only its vector width (MKL's
# GEMM blocking and its vector math library's exp, log, tanh, ... differ between an Intel Xeon and an AMD EPYC, with
# MKL_CBWR or without): here no MKL function runs. GEMMs run in fp32 (fp64 for fp64) by numpy's OpenBLAS held to its
# Haswell kernels (OPENBLAS_CORETYPE=Haswell: fixed blocking; threads split the output, never a sum), the vector math
# in float64 by functions torch computes itself (SLEEF, glibc), rounded once to the tensor's dtype; attention by SDPA's
# math path (its fused CPU kernel calls MKL's GEMMs), which torch.nn.attention.sdpa_kernel selects around it. oneDNN is
# off: it picks its own ISA whatever ATEN_CPU_CAPABILITY says (F.gelu went to its AVX-512 kernel), torch's kernels run.
LOG2E = 1 / math.log(2)


def _expm1_tanh(x: Tensor) -> Tensor:
    e = torch.expm1(x.clamp(-40, 40) * 2)  # tanh(40) is 1 in float64: no overflow to inf / inf
    return e / (e + 2)


# torch's vml.h: the float ops MKL computes, and a formulation of each the record path uses (in float64).
MKL_MATH: dict[str, Callable[[Tensor], Tensor] | None] = {
    "exp": lambda x: torch.exp2(x * LOG2E), "log": lambda x: torch.special.xlogy(1.0, x), "tanh": _expm1_tanh,
    "sin": lambda x: torch.polar(torch.ones_like(x), x).imag, "cos": lambda x: torch.polar(torch.ones_like(x), x).real,
    "sqrt": lambda x: torch.from_numpy(np.sqrt(x.numpy())),  # IEEE: correctly rounded on every CPU
    **dict.fromkeys(("acos", "asin", "atan", "erf", "erfc", "erfinv", "log10", "log2", "tan"))}  # none used: refused


def _record_logsumexp(x: Tensor, dim: list[int], keepdim: bool = False) -> Tensor:
    """torch's logsumexp (one op whose inner exp and log no mode sees), from MKL_MATH's exp and log."""
    top = x.amax(dim, keepdim=True)
    top = torch.where(top.isinf(), 0, top)
    out = MKL_MATH["log"](MKL_MATH["exp"](x.double() - top).sum(dim, keepdim=True)) + top
    return (out if keepdim else out.squeeze(dim)).to(x.dtype)


class RecordMath(Fp32Gemms):
    """Inside it, the CPU record path's arithmetic (above): every float GEMM by numpy's OpenBLAS (bf16 operands in fp32,
    the result rounded to bf16), MKL_MATH's ops in float64, SDPA's math path, no oneDNN. An MKL op it has no
    formulation for is refused, loudly."""

    def __enter__(self) -> RecordMath:
        self.math_sdpa = sdpa_kernel([SDPBackend.MATH])
        self.math_sdpa.__enter__()
        self.onednn, torch.backends.mkldnn.enabled = torch.backends.mkldnn.enabled, False
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        torch.backends.mkldnn.enabled = self.onednn
        self.math_sdpa.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs, name = kwargs or {}, func.overloadpacket.__name__
        x = args[0] if args and isinstance(args[0], Tensor) and args[0].device.type == "cpu" else None
        if func.overloadpacket in GEMM_OPS and func._overloadname in ("default", "out"):
            return self.gemm(func, args, kwargs)
        if x is None or x.dtype not in (torch.float32, torch.float64):
            return func(*args, **kwargs)
        if name == "logsumexp":
            return _record_logsumexp(x.detach(), *args[1:], **kwargs)
        if name.rstrip("_") not in MKL_MATH or func._overloadname not in ("default", "out"):
            return func(*args, **kwargs)
        formula = MKL_MATH[name.rstrip("_")]
        if formula is None:
            raise NotImplementedError(f"{func} on the CPU record path: MKL computes it, differently per CPU model; "
                                      f"give it a formulation in gpt_kernels.MKL_MATH")
        result = formula(x.detach().double()).to(x.dtype)
        target = kwargs.get("out", x if name.endswith("_") else None)
        return result if target is None else target.copy_(result)

    def gemm(self, func, args, kwargs) -> Tensor:
        """An mm, addmm, bmm or baddbmm (or mv, addmv, dot) as numpy's product of the operands in fp32, then
        beta * c + alpha * product in torch; out= and bf16 as Fp32Gemms."""
        added = func.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.baddbmm, torch.ops.aten.addmv)
        c, a, b = args if added else (None, *args)
        alpha, beta, out = kwargs.get("alpha", 1), kwargs.get("beta", 1), kwargs.get("out")
        wide = torch.float64 if a.dtype == torch.float64 else torch.float32
        product = torch.from_numpy(np.asarray(np.matmul(*(t.detach().to(wide).numpy() for t in (a, b)))))
        result = product * alpha if alpha != 1 else product
        if c is not None and beta != 0:
            result = result + (c.to(wide) if beta == 1 else c.to(wide) * beta)
        result = result.to(a.dtype)
        return result if out is None else out.copy_(result)


def native_bf16_gemm() -> bool:
    """Whether torch's CPU bf16 matmul runs oneDNN's bf16 kernel (false: the reference loop)."""
    return (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@torch.library.custom_op("speedrun::eager_sum", mutates_args=())
def eager_sum(x: Tensor, dims: list[int]) -> Tensor:
    """x.sum(dims, keepdim=True) by torch's kernel, compiled code too (an op inductor does not fuse or reorder)."""
    return x.sum(dim=dims, keepdim=True)


@eager_sum.register_fake
def _(x: Tensor, dims: list[int]) -> Tensor:
    return x.sum(dim=dims, keepdim=True)  # a fake tensor's: the shape only
