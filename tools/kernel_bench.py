"""The Triton kernels against the torch path they replace, at one micro-step's shapes: forward + backward time
(median over --repeats, after two untimed calls that compile and autotune) and peak memory above the inputs.

    python tools/kernel_bench.py [--out FILE.json] [--repeats N] [--small]

On a GPU, bf16 at the recipe's shapes, each torch path compiled as the trainer compiles it: the MLP's ReLU^2 GEMM
(--relu2_kernel, gpt_kernels.linear_relu_square) in the bf16 MLP (49,152 x 768 -> 3,072 -> 768, forward and
backward; and validation's forward alone over one 262,144-token sequence), and where the GPU has FP8 in #89's FP8
MLP (gpt_kernels.mlp_fp8, the kernel against its torch path) and its down-weight quantizer (12 layers of 3,072 x
768, a delayed-scale call); --fused_head (49,152 x 768 @ 768 x 50,304 with v2's softcap 23 sigmoid((z + 5) / 7.5)
and three next tokens, FP8 where the GPU has it; and validation's loss alone over one 262,144-token sequence). And
Polar Express with its momentum on one rank's Muon blocks at 8 GPUs (qk 8 x 256 x 768, vo 3 x 768 x 768, mlp 3 x
3072 x 768): gpt_kernels' symmetric GEMMs against torch's, both compiled as the optimizer compiles them. And layer
10's DC attention (speedrun::dc_attention against train_gpt.dc_attention's, compiled), forward and backward.
--small runs shapes that Triton's interpreter manages on a CPU (TRITON_INTERPRET=1): that checks the script, its
times say nothing. The whole step before and after: train_gpt.py --bench with and without the flags, then
tools/compare.py on the two logs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gpt_kernels as K  # noqa: E402
import train_gpt as T  # noqa: E402

MTP = [1.0, 0.5, 0.25]  # v2's first stage: three next tokens


def timed(fn: Callable[[], object], repeats: int, device: torch.device) -> dict[str, float | None]:
    """Median milliseconds of fn() and its peak memory above what was allocated before it (None on a CPU)."""
    cuda = device.type == "cuda"
    for _ in range(2):
        fn()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    return {"ms": statistics.median(times), "peak_mib_above_inputs": peak}


Cases = tuple[tuple[torch.Tensor, torch.Tensor], dict[str, Callable[[], object]]]  # (x, w), {path: a call}


def mlp_weights(cfg: T.Config, layers: int, device: torch.device) -> torch.Tensor:
    """An MLP bank (layers, 2, hidden, d) in bf16: [W_fc, W_proj] per layer, N(0, 0.05^2)."""
    g = torch.Generator(device=device).manual_seed(1)
    hidden = cfg.mlp_ratio * cfg.model_dim
    return (0.05 * torch.randn(layers, 2, hidden, cfg.model_dim, device=device, generator=g)).bfloat16()


def relu2_cases(cfg: T.Config, rows: int, dtype: torch.dtype, device: torch.device, compile_: Callable) -> Cases:
    """The bf16 MLP (GPT.mlp outside FP8 training), forward and backward: the ReLU^2 GEMM's bf16 forward and
    backward modes (speedrun::mlp_relu2) against the compiled torch MLP."""
    g = torch.Generator(device=device).manual_seed(0)
    x = T.norm(torch.randn(rows, cfg.model_dim, device=device, generator=g)).to(dtype).requires_grad_()
    w_fc, w_proj = (w.clone().requires_grad_() for w in mlp_weights(cfg, 1, device)[0])
    grad = torch.randn(rows, cfg.model_dim, device=device, generator=g).to(dtype)
    torch_path = compile_(lambda: F.relu(F.linear(x, w_fc)).square() @ w_proj)
    return (x, w_fc), {"torch": lambda: torch_path().backward(grad),
                       "kernel": lambda: torch.ops.speedrun.mlp_relu2(x, w_fc, w_proj).backward(grad)}


def relu2_eval_cases(cfg: T.Config, rows: int, dtype: torch.dtype, device: torch.device, compile_: Callable
                     ) -> Cases:
    """Validation's MLP (no gradient) over one val_seq_len sequence: the ReLU^2 GEMM's bf16 forward mode."""
    x = T.norm(torch.randn(rows, cfg.model_dim, device=device, generator=torch.Generator(device).manual_seed(0)))
    x = x.to(dtype)
    w_fc, w_proj = mlp_weights(cfg, 1, device)[0]
    torch_path = compile_(lambda: F.relu(F.linear(x, w_fc)).square() @ w_proj)
    return (x, w_fc), {"torch": torch.no_grad()(torch_path),
                       "kernel": torch.no_grad()(lambda: torch.ops.speedrun.mlp_relu2(x, w_fc, w_proj))}


def head_cases(cfg: T.Config, rows: int, dtype: torch.dtype, device: torch.device, compile_: Callable, fp8: bool
               ) -> Cases:
    g = torch.Generator(device=device).manual_seed(0)
    x = T.norm(torch.randn(rows, cfg.model_dim, device=device, generator=g)).to(dtype).requires_grad_()
    w = (0.05 * torch.randn(cfg.vocab_size, cfg.model_dim, device=device, generator=g)).requires_grad_()
    targets = torch.randint(0, cfg.vocab_size, (rows,), device=device, generator=g)
    mtp, scales = torch.tensor(MTP, device=device), T.fp8_scales(cfg, 1.0) if fp8 else []
    caps = (cfg.logit_cap, cfg.logit_shift, cfg.logit_temp)
    # upstream's prefix term (spec 2.7) on both paths: random prefix targets, a quarter of them none (-1)
    prefix = torch.where(torch.rand(rows, device=device, generator=g) < 0.25, -1, targets.roll(1))
    prefix = (prefix, torch.full((1,), 0.25, device=device))

    def torch_loss() -> torch.Tensor:  # the model's training loss on the logits path (GPT.logits, GPT.forward)
        z = torch.ops.speedrun.fp8_mm(x, w, *scales) if fp8 else x @ w.type_as(x).T
        return T.SoftcappedMTPLoss.apply(z, targets, mtp, *prefix, *caps).sum()

    torch_path = compile_(torch_loss)
    return (x, w), {"torch": lambda: torch_path().backward(),
                    "kernel": lambda: torch.ops.speedrun.softcap_ce(x, w, targets, mtp, *prefix, *caps,
                                                                      scales)[0].backward()}


def eval_cases(cfg: T.Config, rows: int, dtype: torch.dtype, device: torch.device, compile_: Callable) -> Cases:
    """Validation's loss (no gradient, bf16 head, mean next-token loss) over one val_seq_len sequence."""
    g = torch.Generator(device=device).manual_seed(0)
    x = T.norm(torch.randn(rows, cfg.model_dim, device=device, generator=g)).to(dtype)
    w = 0.05 * torch.randn(cfg.vocab_size, cfg.model_dim, device=device, generator=g)
    targets = torch.randint(0, cfg.vocab_size, (rows,), device=device, generator=g)
    one, caps = torch.ones(1, device=device), (cfg.logit_cap, cfg.logit_shift, cfg.logit_temp)
    no_prefix = (torch.full_like(targets, -1), torch.zeros(1, device=device))  # validation reads neither

    def torch_loss() -> torch.Tensor:  # GPT.forward in eval on the logits path: the softcap in the head's dtype
        z = x @ w.type_as(x).T
        return F.cross_entropy(T.softcap(z, cfg).to(z.dtype).float(), targets)

    torch_path = compile_(torch_loss)
    return (x, w), {"torch": lambda: torch_path(),
                    "kernel": lambda: torch.ops.speedrun.softcap_ce(x, w, targets, one, *no_prefix, *caps, [],
                                                                      False)[0] / rows}


def fp8_mlp_state(bank: torch.Tensor) -> list[torch.Tensor]:
    """quantize_mlp_weights_'s state for a bank: w8_fc, up_scales, w8_proj_t, used_scales, next_scales."""
    layers, _, hidden, dim = bank.shape
    f32 = dict(dtype=torch.float32, device=bank.device)
    return [torch.empty(layers, hidden, dim, dtype=torch.float8_e4m3fn, device=bank.device), torch.empty(layers, **f32),
            torch.empty(layers, dim, hidden, dtype=torch.float8_e4m3fn, device=bank.device), torch.empty(layers, **f32),
            torch.empty(layers, **f32)]


def fp8_mlp_cases(cfg: T.Config, rows: int, dtype: torch.dtype, device: torch.device, compile_: Callable) -> Cases:
    """#89's FP8 MLP (gpt_kernels.mlp_fp8: e4m3 up- and down-projections, the backward in bf16), forward and
    backward: the ReLU^2 GEMM (kernel=True) against the op's torch path. The weights are quantized once, outside the
    timing (quantize_mlp_weights_ runs once per optimizer step, not per micro-step); post's delayed scale is the
    amax of a first call, with #89's headroom."""
    g = torch.Generator(device=device).manual_seed(0)
    x = T.norm(torch.randn(rows, cfg.model_dim, device=device, generator=g)).to(dtype).requires_grad_()
    bank = mlp_weights(cfg, 1, device)
    w_fc, w_proj = (bank[0, i].clone().requires_grad_() for i in range(2))
    grad = torch.randn(rows, cfg.model_dim, device=device, generator=g).to(dtype)
    state = fp8_mlp_state(bank)
    K.quantize_mlp_weights_(bank, *state, bootstrap=True)
    fp8_args = (state[0][0], state[1][0], state[2][0], state[3][0])
    with torch.no_grad():
        amax = torch.ops.speedrun.mlp_fp8(x, w_fc, w_proj, *fp8_args, torch.ones((), device=device), False)[1].max()
    act_scale = amax * (cfg.fp8_down_act_headroom / 448)
    paths = {path: compile_(lambda kernel=kernel: torch.ops.speedrun.mlp_fp8(x, w_fc, w_proj, *fp8_args, act_scale,
                                                                             kernel)[0])
             for path, kernel in (("torch", False), ("kernel", True))}
    return (x, w_fc), {path: lambda fn=fn: fn().backward(grad) for path, fn in paths.items()}


def fp8_quantize_cases(cfg: T.Config, layers: int, device: torch.device) -> Cases:
    """quantize_mlp_weights_ after an optimizer step (the delayed down-weight scale), every layer of the bank: the
    down-projection's part by its Triton kernels against torch (the up-projection's is torch in both, as #89's)."""
    bank = mlp_weights(cfg, layers, device)
    state = fp8_mlp_state(bank)
    K.quantize_mlp_weights_(bank, *state, bootstrap=True, kernel=False)
    return (bank, state[0]), {path: lambda kernel=kernel: K.quantize_mlp_weights_(bank, *state, False, kernel=kernel)
                              for path, kernel in (("torch", False), ("kernel", True))}


def polar_express_cases(cfg: T.Config, small: bool, device: torch.device, compiled: bool) -> Cases:
    """One optimizer step's Polar Express (momentum_polar_express) over the three banks' blocks of one rank; --small:
    wide and tall blocks the interpreter runs in seconds."""
    dim, hidden = cfg.model_dim, cfg.mlp_ratio * cfg.model_dim
    shapes = [(2, 16, 48), (2, 96, 48)] if small else [(8, 256, dim), (3, dim, dim), (3, hidden, dim)]
    g = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(shape, device=device, generator=g) for shape in shapes]
    bufs, momentum = [torch.zeros_like(x) for x in grads], T.scalar(0.95)
    paths = {}
    for path, kernels in (("torch", False), ("kernel", True)):
        orthogonalize = T.update_steps(compiled, kernels).orthogonalize
        paths[path] = lambda fn=orthogonalize: [fn(x, buf, momentum) for x, buf in zip(grads, bufs)]
    return (grads[0], bufs[0]), paths


def dc_cases(cfg: T.Config, rows: int, dtype: torch.dtype, device: torch.device, compile_: Callable) -> Cases:
    """Layer 10's DC attention (speedrun::dc_attention, window 112) over one micro-step's tokens in documents of 768
    (cu_seqlens padded to the stage's 128 slots), forward and backward, against its torch path."""
    g = torch.Generator(device=device).manual_seed(0)
    shape = (1, rows, cfg.num_heads, cfg.head_dim)
    q, k, v = (T.norm(torch.randn(shape, device=device, generator=g)).to(dtype).requires_grad_() for _ in range(3))
    base = torch.randn(shape[1:], device=device, generator=g).to(dtype).requires_grad_()
    w1 = torch.ones(shape[:3], device=device, dtype=dtype, requires_grad=True)
    w2 = (0.3 * torch.randn(shape[:3], device=device, generator=g)).to(dtype).requires_grad_()
    starts = torch.arange(0, rows, 768, device=device)
    cu = F.pad(starts, (0, max(128, starts.numel() + 1) - starts.numel()), value=rows).to(torch.int32)
    grad = torch.randn(shape[1:], device=device, generator=g).to(dtype)
    args = (base, q, k, v, w1, w2, cu, 0.12)
    torch_path = compile_(lambda: T.dc_attention(*args))
    return (q, k), {"torch": lambda: torch_path().backward(grad),
                    "kernel": lambda: torch.ops.speedrun.dc_attention(*args)[0].backward(grad)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the figures as JSON here too")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--small", action="store_true", help="interpreter-sized shapes (a CPU check of the script)")
    opts = parser.parse_args()
    cuda = torch.cuda.is_available() and not opts.small
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda and not (opts.small and os.environ.get("TRITON_INTERPRET") == "1"):
        sys.exit("error: the benchmark needs a CUDA GPU; on a CPU, TRITON_INTERPRET=1 with --small checks the script")
    if not cuda:  # the interpreter computing as sm90 does (its bf16 dots, its casts, a persistent kernel's loop)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import interpreter_sm90
        interpreter_sm90.install()
    dims = ["--model_dim=64", "--head_dim=32", "--vocab_size=512"] if opts.small else []
    cfg = T.parse_config([*dims])
    rows = 64 if opts.small else cfg.train_seq_len
    dtype = torch.bfloat16  # the kernels' (Triton's interpreter computes bf16 as sm90 does: tests/interpreter_sm90.py)
    fp8 = cuda and torch.cuda.get_device_capability() >= (8, 9)
    compile_ = (lambda fn: torch.compile(fn, fullgraph=True, dynamic=False)) if cuda else (lambda fn: fn)
    where = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter: times say nothing)"
    print(f"kernel_bench: {where}, torch {torch.__version__}, {rows} rows, {dtype}, fp8 head {fp8}")
    rows_out = []
    val_rows = rows if opts.small else cfg.val_seq_len
    kernels = [("relu2_mlp", relu2_cases(cfg, rows, dtype, device, compile_)),
               ("relu2_mlp_eval", relu2_eval_cases(cfg, val_rows, dtype, device, compile_))]
    if fp8 or opts.small:  # the CPU runs the FP8 ops too, as the trainer's CPU rehearsal does
        kernels += [("fp8_mlp", fp8_mlp_cases(cfg, rows, dtype, device, compile_)),
                    ("fp8_mlp_quantize", fp8_quantize_cases(cfg, 2 if opts.small else cfg.num_layers + 1, device))]
    kernels += [("softcap_ce", head_cases(cfg, rows, dtype, device, compile_, fp8)),
                ("softcap_ce_eval", eval_cases(cfg, val_rows, dtype, device, compile_)),
                ("polar_express", polar_express_cases(cfg, opts.small, device, compiled=cuda)),
                ("dc_attention", dc_cases(cfg, rows, dtype, device, compile_))]
    for kernel, cases in kernels:
        for path, fn in cases[1].items():
            figures = timed(fn, opts.repeats, device)
            rows_out.append({"kernel": kernel, "path": path, **figures})
            peak = figures["peak_mib_above_inputs"]
            print(f"{kernel:<15} {path:<7} {figures['ms']:9.2f} ms  peak above inputs "
                  f"{'-' if peak is None else f'{peak:,.0f} MiB'}")
    if opts.out:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps({"device": where, "torch": torch.__version__, "rows": rows, "fp8": fp8,
                                        "dtype": str(dtype), "results": rows_out}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
