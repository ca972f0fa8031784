"""Compile the trainer's Triton kernels for the H100 (sm90), or for each GPU generation, without a GPU: the compile
matrix of what runs where.

    python tools/sm90_kernels.py [--targets sm80,sm89,... | --targets all] [--kernels PREFIX] [--json FILE]

Triton's own compiler runs (its ptxas included) for every dtype and configuration a run of the recipe launches: the
MLP's persistent ReLU^2 GEMM (#89's linear_relu_square: --relu2_kernel; on each target at the tiles its launcher takes
there, gpt_kernels.mlp_config: 128 x 256 on sm90 and sm100, 128 x 128 elsewhere; the persistent width is an H100's 132
SMs everywhere) in its three modes at model_dim 768 and hidden 3072 over each stage's rows per micro-step (16,384,
32,768, 49,152): the FP8 forward and the backward in training, the bf16 forward in validation (262,144 rows) and in
training without FP8; the FP8 MLP's down-weight quantizer over the 12 x 3072 x 768 bank and its scale reduction; the
softcapped multi-token cross-entropy (--fused_head, #89's numerics and upstream's prefix term) over the 50,304-column
vocabulary with 1 to 3 loss weights (padded to 2 or 4): with its gradient as e5m2 codes (the FP8 head) or in bf16 in
place, and the loss alone (validation); Polar Express's symmetric GEMMs on the Muon blocks (qk 256 x 768, vo 768 x
768, mlp 3072 x 768; a rank's count of blocks, 8/3/3 on 8 GPUs or 64/24/24 on one, is the grid's, not the compiled
kernel's) and the FP8 head backward's transposes, each with the specialization Triton's JIT gives the real launch (TMA
descriptors: their dtype and block shape). For each: shared memory, registers per thread and the stack frame
(cuobjdump, which ships with Triton), and the bytes spilled and reloaded (ptxas -v on the same PTX: a stack frame need
not hold spills). A compile error, shared memory above the target's per-block limit (TARGETS: 163 KB on sm80, 99 KB on
sm86, sm89 and sm120, 227 KB on sm90 and sm100), or any spill fails it. With several targets it ends with the matrix
kernel x target (pass, spill, shared memory, does not compile) and checks it against gpt_kernels.RUNS_ON, the table
train_gpt's `auto` reads: exit 1 where a path is said to run on a target where one of its launches fails (the default,
sm90 alone: where any fails). Each target compiles in a process of its own: one target's compiles can leave Triton
state that changes the next's. --kernels keeps the launches whose name starts with PREFIX (one kernel on every target:
--targets=all --kernels=softcap_ce).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, not the interpreter
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    sys.exit("error: sm90_kernels.py runs Triton's compiler: pip install triton==3.6.0")

import torch  # noqa: E402

import gpt_kernels as K  # noqa: E402
import train_gpt as T  # noqa: E402

H100 = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm90
# Each target: Triton's GPUTarget and the shared memory one block may use (CUDA's opt-in maximum per block): the A100
# (sm80), the RTX 3090 and A6000 (sm86), the L40S and RTX 4090 (sm89), the H100 and H200 (sm90), the B200 (sm100), the
# RTX 5090 (sm120). gpt_kernels.TARGETS names the same capabilities.
TARGETS = {"sm80": (GPUTarget("cuda", 80, 32), 163 * 1024), "sm86": (GPUTarget("cuda", 86, 32), 99 * 1024),
           "sm89": (GPUTarget("cuda", 89, 32), 99 * 1024), "sm90": (H100, SMEM_LIMIT),
           "sm100": (GPUTarget("cuda", 100, 32), 227 * 1024), "sm120": (GPUTarget("cuda", 120, 32), 99 * 1024)}
DEFAULTS = {"num_warps": 4, "num_stages": 3}  # what a launch without options gets
H100_SMS = 132  # the persistent GEMM's width: one program per SM (an H100 SXM's 132)
STAGE_ROWS = (16_384, 32_768, 49_152)  # the recipe's rows per micro-step, by stage (train_seq_len's stages)


def descriptor(dtype: torch.dtype, rows: int, cols: int, block: list[int]) -> TensorDescriptor:
    """A row-major (rows, cols) tensor's TMA descriptor as the launcher makes it, on a small host tensor (only its
    dtype and alignment reach the compiler, with the block shape)."""
    return TensorDescriptor(torch.empty(8, dtype=dtype), [rows, cols], [cols, 1], block)


def mlp_gemm_cases(dim: int, hidden: int, val_rows: int, target: str = "sm90") -> list[tuple[str, object, tuple, dict]]:
    """linear_relu_square's launches on target, in its configuration (gpt_kernels.mlp_config: sm90's tiles of 128 x
    256, their halves 128 x 128): a (rows, K) @ b (N, K)^T into (rows, N) halves of a tile."""
    kernel, cases, config = K.linear_relu_square_launcher().kernel, [], K.mlp_config(K.TARGETS[target])
    bf16, e4m3, f32 = torch.bfloat16, torch.float8_e4m3fn, torch.empty(8)
    runs = [("fp8 forward", rows) for rows in STAGE_ROWS] + [("backward", rows) for rows in STAGE_ROWS] + [
        ("bf16 forward", rows) for rows in (*STAGE_ROWS, val_rows)]
    for mode, rows in runs:
        block_k, stages = config.modes[mode]
        fp8 = mode == "fp8 forward"
        a_dtype = e4m3 if fp8 else bf16  # x8 and W8_fc; x and W_fc; g and W_proj
        half = [config.block_m, config.block_n // 2]
        args = (descriptor(a_dtype, rows, dim, [config.block_m, block_k]),
                descriptor(a_dtype, hidden, dim, [config.block_n, block_k]), descriptor(bf16, rows, hidden, half),
                None if mode != "backward" else descriptor(bf16, rows, hidden, half),  # aux: post, backward only
                descriptor(e4m3, rows, hidden, half) if fp8 else None,
                *((f32, f32, f32) if fp8 else (None, None, None)), rows, hidden, dim)
        cases.append((f"linear_relu_square {mode} M={rows}", kernel, args,
                      {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": block_k, "NUM_SMS": H100_SMS,
                       "FORWARD": mode != "backward", "FP8": fp8, "num_warps": config.num_warps,
                       "num_stages": stages}))
    return cases


def cases(cfg: T.Config, rows: int = 49_152, target: str = "sm90") -> list[tuple[str, object, tuple, dict]]:
    """(name, kernel, arguments, keywords) of every launch a run of the recipe makes on target, arguments as the
    launchers pass them at one micro-step's rows: small host tensors of the launch's dtypes stand in for the device
    buffers (only their dtype and 16-byte alignment reach the compiler), integers are the real sizes and strides."""
    bf16 = torch.empty(8, dtype=torch.bfloat16)
    dim, hidden, vocab = cfg.model_dim, cfg.mlp_ratio * cfg.model_dim, cfg.vocab_size
    out = mlp_gemm_cases(dim, hidden, cfg.val_seq_len, target)
    # the down-weight quantizer over the whole bank (its layers one W_proj apart in the (L, 2, hidden, d) bank), then
    # the reduction of its 48 x 12 tile maxima per layer to the next scales
    layers, tiles = cfg.num_layers + 1, -(-hidden // K.QUANT_BLOCK) * -(-dim // K.QUANT_BLOCK)
    out.append((f"quantize_mlp_down bf16->e4m3 {layers}x{hidden}x{dim}", K.quantize_mlp_down_launcher().kernel,
                (bf16, torch.empty(8, dtype=torch.float8_e4m3fn), torch.empty(8), torch.empty(8), torch.empty(8),
                 2 * hidden * dim, dim), {"HIDDEN": hidden, "DIM": dim, "BLOCK": K.QUANT_BLOCK, "num_warps": 4,
                                          "num_stages": 1}))
    out.append((f"amax_scales {layers}x{tiles} headroom {cfg.fp8_down_w_headroom}", K.amax_scales_launcher().kernel,
                (torch.empty(8), torch.empty(8), tiles), {"COUNT": tiles, "HEADROOM": cfg.fp8_down_w_headroom,
                                                          "BLOCK": triton.next_power_of_2(tiles), "num_warps": 4,
                                                          "num_stages": 1}))
    ce = K.softcap_ce_launcher().kernel  # one HEAD_CHUNK_ROWS chunk of logits, its first row at row0
    targets, losses, e5m2 = torch.empty(8, dtype=torch.int64), torch.empty(8), torch.empty(8, dtype=torch.float8_e5m2)
    # training with the FP8 head (e5m2 codes, grad_s #89's), with the bf16 head (in place), validation (loss alone);
    # the prefix targets (int64, one per row) and weight (fp32, one) after the MTP weights
    modes = (("loss+grad e5m2", e5m2, 0.75 / 448, True), ("loss+grad bf16", bf16, 1.0, True),
             ("loss", bf16, 1.0, False))
    for k in (2, 4):  # 1 or 2 weights pad to 2, 3 to 4 (softcap_ce)
        for mode, grad, grad_s, with_grad in modes:
            out.append((f"softcap_ce bf16 K={k} {mode}", ce,
                        (bf16, vocab, grad, vocab, targets, torch.empty(k), targets, torch.empty(1), losses,
                         K.HEAD_CHUNK_ROWS, rows, 23.0, 5.0, 7.5, grad_s),
                        {"V": vocab, "K": k, "BLOCK_V": 1024, "GRAD": with_grad, **DEFAULTS}))
    gram, (block, block_k, warps, stages) = K.gram_launcher().kernel, K.GRAM_CONFIG
    tiles = {"BLOCK": block, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages}
    a, b, c = T.POLAR_EXPRESS[0]
    # (name, n, k, a's batch, row and column strides as the kernel reads them, alpha, beta): C = alpha G G^T + beta A
    qk, vo, mlp = (256, dim), (dim, dim), (hidden, dim)  # one block of each bank: rows x cols
    for name, n, k, strides, alpha, beta in (
            (f"xxt bf16 {qk[0]}x{qk[1]} (qk)", qk[0], qk[1], (qk[0] * qk[1], qk[1], 1), 1.0, None),
            (f"xxt bf16 {vo[0]}x{vo[1]} (vo)", vo[0], vo[1], (vo[0] * vo[1], vo[1], 1), 1.0, None),
            (f"xtx bf16 {mlp[0]}x{mlp[1]} (mlp)", mlp[1], mlp[0], (mlp[0] * mlp[1], 1, mlp[1]), 1.0, None),
            (f"ba_plus_caa bf16 {qk[0]}x{qk[0]} (qk)", qk[0], qk[0], (qk[0] ** 2, qk[0], 1), c, b),
            (f"ba_plus_caa bf16 {dim}x{dim} (vo, mlp)", dim, dim, (dim**2, dim, 1), c, b)):
        out.append((name, gram, (bf16, bf16, n, k, *strides, n * n, n, 1, alpha, 0.0 if beta is None else beta),
                    {"ADD": beta is not None, **tiles}))
    transpose, (bm, bn, warps, stages) = K.transpose_launcher().kernel, K.TRANSPOSE_CONFIG
    e4m3 = torch.empty(8, dtype=torch.float8_e4m3fn)  # the head's backward: x's e4m3 codes and the gradient's e5m2
    for name, codes, cols in (("e4m3", e4m3, dim), ("e5m2", e5m2, vocab)):
        out.append((f"transpose_copy {name} {rows}x{cols}", transpose, (codes, codes, rows, cols, cols, 1, rows, 1),
                    {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}))
    return out + dc_cases(cfg, *DC_LAUNCHES[-1])


# DC attention on layer 10 (gpt_kernels.dc_attention_launcher): T and the cu_seqlens entries' count are runtime
# arguments (T a multiple of 16 at every stage: one specialization), so validation's launch stands for all four.
DC_LAUNCHES = ((16_384, 64), (32_768, 96), (49_152, 128), (262_144, 896))  # (T, cu_seqlens entries): stages, val


def dc_cases(cfg: T.Config, T_: int, entries: int) -> list[tuple[str, object, tuple, dict]]:
    """speedrun::dc_attention's three kernels in bf16 at (T_, entries): the forward and the backward's query-major
    and key-major kernels, arguments as the launcher passes them."""
    forward, backward = K.dc_attention_launcher()
    queries, keys = backward.kernels
    bf16, f32, i32 = torch.empty(8, dtype=torch.bfloat16), torch.empty(8), torch.empty(8, dtype=torch.int32)
    window, n_docs = 112, entries - 1
    runtime = (T_, n_docs, max(1, n_docs.bit_length()), 0.12)
    shared = {"H": cfg.num_heads, "D": cfg.head_dim, "WINDOW": window, "PRECISION": "tf32",
              "num_warps": K.DC_NUM_WARPS, "num_stages": 1}
    slots = K.dc_slots(window, K.DC_BLOCK_M)
    name = f"bf16 H={cfg.num_heads} D={cfg.head_dim} window={window}"
    return [(f"dc_attention forward {name}", forward.kernel, (bf16,) * 6 + (i32, bf16, f32) + runtime,
             {**shared, "BLOCK_M": K.DC_BLOCK_M, "SLOTS": slots}),
            (f"dc_attention backward queries {name}", queries,
             (bf16,) * 6 + (i32, f32, bf16, bf16, bf16, bf16, f32) + runtime,
             {**shared, "BLOCK_M": K.DC_BLOCK_M, "SLOTS": slots}),
            (f"dc_attention backward keys {name}", keys, (bf16, bf16, bf16, bf16, f32, bf16, bf16, T_, 0.12),
             {**shared, "BLOCK_N": K.DC_BLOCK_N, "SLOTS": K.dc_slots(window, K.DC_BLOCK_N)})]


def source(kernel, args: tuple, keywords: dict, target: GPUTarget = H100) -> tuple[ASTSource, dict]:
    """What Triton's JIT compiles for this launch, and its options: the JIT's own binder decides, as at run time,
    which integers become constants (those equal to 1: unit strides) or carry a divisible-by-16 hint, and which
    pointers are aligned. Without them the loads are neither vectorized nor pipelined (a different kernel)."""
    backend = make_backend(target)
    bound, specialization, options = create_function_from_signature(kernel.signature, kernel.params, backend)(
        *args, **keywords)
    options, signature, constexprs, attrs = kernel._pack_args(backend, keywords, bound, specialization, options)
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs), {
        "num_warps": options.num_warps, "num_stages": options.num_stages}


def resources(cubin: bytes) -> dict[str, int]:
    """Registers, stack frame and local memory bytes of the kernel in a cubin, as cuobjdump reports them."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                              check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", text))
    return {"registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"]), "local_bytes": int(fields["LOCAL"])}


def spills(ptx: str, gpu: GPUTarget, fp_fusion: bool) -> dict[str, int]:
    """The bytes ptxas spills (stores) and reloads, and its registers, from the PTX assembled again as Triton assembles
    it (its ptxas for the target, its flags, -v). The cubin's stack frame alone does not tell a spill: on sm120 every
    TMA load gets an out-of-line call whose frame is 8 bytes, with nothing spilled."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.ptx"
        path.write_text(ptx)
        log = subprocess.run([get_ptxas(gpu.arch).path, "-lineinfo", *([] if fp_fusion else ["--fmad=false"]), "-v",
                              f"--gpu-name={sm_arch_from_capability(gpu.arch)}", str(path), "-o", f"{path}.o"],
                             capture_output=True, text=True, check=True).stderr
    stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups()
    return {"spill_bytes": int(stores), "reload_bytes": int(loads),
            "ptxas_registers": int(re.search(r"Used (\d+) registers", log).group(1))}


def problems(row: dict, limit: int) -> list[str]:
    """Why a compiled launch cannot run cleanly: shared memory above the target's per-block limit, bytes spilled or
    reloaded, local memory; and a reassembly that is not the cubin's (its registers differ)."""
    return ([f"shared memory {row['shared_bytes']} B > {limit} B"] if row["shared_bytes"] > limit else []) + (
        [f"spills: {row['spill_bytes']} B stored, {row['reload_bytes']} B reloaded"]
        if row["spill_bytes"] or row["reload_bytes"] else []) + (
        [f"local memory: {row['local_bytes']} B"] if row["local_bytes"] else []) + (
        [f"ptxas -v used {row['ptxas_registers']} registers, the cubin {row['registers']}"]
        if row["ptxas_registers"] != row["registers"] else [])


def check(name: str, kernel, args: tuple, keywords: dict, target: str = "sm90") -> dict:
    """One launch compiled for target: its row, with status pass, spill, shared memory or does not compile."""
    gpu, limit = TARGETS[target]
    src, options = source(kernel, args, keywords, gpu)
    row: dict = {"kernel": name, "target": target, **options}
    try:
        compiled = triton.compile(src, target=gpu, options=options)
    except Exception as e:  # a compile error is this check's finding, reported in its row
        text = str(e).strip()
        ptxas = re.search(r"^ptxas.*?; error\s*:\s*(.+)$", text, re.M)  # its words, not the repro command after them
        why = ptxas.group(1) if ptxas else text.splitlines()[-1] if text else ""
        return {**row, "ok": False, "status": "does not compile",
                "problem": f"does not compile for {target}: {type(e).__name__}: {why}"[:300]}
    row |= {"shared_bytes": compiled.metadata.shared, **resources(compiled.asm["cubin"]),
            **spills(compiled.asm["ptx"], gpu, compiled.metadata.enable_fp_fusion)}
    found = problems(row, limit)
    status = "shared memory" if row["shared_bytes"] > limit else "spill" if found else "pass"
    return {**row, "ok": not found, "status": status, "problem": "; ".join(found)}


def matrix(rows: list[dict], targets: list[str]) -> tuple[list[str], list[str]]:
    """The table kernel x target (each cell the worst of the kernel's launches: FAIL's count and why), and where it
    contradicts gpt_kernels.RUNS_ON: a path said to run on a target where one of its launches fails."""
    groups: dict[str, dict[str, list[dict]]] = {}
    for r in rows:
        groups.setdefault(K.launch_group(r["kernel"]), {}).setdefault(r["target"], []).append(r)
    lines = [f"| kernel | {' | '.join(targets)} |", "|---" * (len(targets) + 1) + "|"]
    for group, by_target in groups.items():
        cells = []
        for t in targets:
            runs = by_target.get(t, [])
            bad = [r for r in runs if not r["ok"]]
            worst = sorted({r["status"] for r in bad})
            cells.append("-" if not runs else f"pass ({len(runs)})" if not bad
                         else f"{' / '.join(worst)} ({len(bad)} of {len(runs)})")
        lines.append(f"| {group} | {' | '.join(cells)} |")
    wrong = []
    for path, groups_of_path in K.PATH_KERNELS.items():
        for t in targets:
            runs = [r for r in rows if r["target"] == t and K.launch_group(r["kernel"]) in groups_of_path]
            if not runs:  # not compiled in this run (--kernels): nothing to say
                continue
            said, failing = K.TARGETS[t] in K.RUNS_ON[path], [r["kernel"] for r in runs if not r["ok"]]
            if said and failing:
                wrong.append(f"gpt_kernels.RUNS_ON[{path!r}] has {t}, where {failing[0]} fails")
            elif not said and not failing and ("fp8" not in path or K.TARGETS[t] >= K.FP8_MIN):
                wrong.append(f"note: gpt_kernels.RUNS_ON[{path!r}] lacks {t}, where all its launches pass")
    return lines, wrong


def line(row: dict) -> str:
    """One launch's line of the output: PASS or FAIL, its figures, what is wrong."""
    figures = (f"shared {row['shared_bytes'] / 1024:6.1f} KB  registers {row['registers']:3d}  spills "
               f"{row['spill_bytes']} B" + (f"  stack {row['stack_bytes']} B" if row["stack_bytes"] else "")
               if "shared_bytes" in row else "")
    verdict = "PASS" if row["ok"] else "FAIL"
    return f"{verdict}  {row['target']:5s} {row['kernel']:50s} {figures}  {row['problem']}".rstrip()


def measure(target: str, prefix: str) -> list[dict]:
    """The rows of target's launches whose names start with prefix, compiled in this process, each printed."""
    rows = []
    for case in (c for c in cases(T.Config(), target=target) if c[0].startswith(prefix)):
        rows.append(check(*case, target=target))
        print(line(rows[-1]), flush=True)
    return rows


def measure_apart(target: str, prefix: str) -> list[dict]:
    """measure in a process of its own, its lines passed on. One target's compiles can change the next's in the same
    process: after sm90's, sm80's e5m2 cross-entropy came out with a cvt to .e5m2x2, which ptxas refuses below sm89
    (on a cold cache; a warm one hid it)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows.json"
        child = subprocess.Popen([sys.executable, __file__, f"--targets={target}", f"--kernels={prefix}", "--json",
                                  str(out)], stdout=subprocess.PIPE, text=True)
        for text in child.stdout:
            if text.startswith(("PASS", "FAIL")):
                print(text, end="", flush=True)
        if child.wait() and not out.exists():
            sys.exit(f"error: compiling {target}'s launches stopped (exit {child.returncode})")
        return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="sm90", help=f"comma-separated, of {', '.join(TARGETS)}; or all")
    parser.add_argument("--kernels", default="", help="only the launches whose name starts with this (e.g. softcap_ce)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    targets = list(TARGETS) if args.targets == "all" else args.targets.split(",")
    if set(targets) - set(TARGETS):
        parser.error(f"--targets: unknown {', '.join(sorted(set(targets) - set(TARGETS)))}; choose from "
                     f"{', '.join(TARGETS)}")
    if not any(name.startswith(args.kernels) for name, *_ in cases(T.Config())):
        parser.error(f"--kernels: no launch's name starts with {args.kernels!r}")
    rows = measure(targets[0], args.kernels) if len(targets) == 1 else [
        row for target in targets for row in measure_apart(target, args.kernels)]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    table, wrong = matrix(rows, targets)
    print("\n" + "\n".join(table))
    for line in wrong:
        print(line if line.startswith("note") else f"error: {line}")
    return 1 if any(not line.startswith("note") for line in wrong) else 0


if __name__ == "__main__":
    sys.exit(main())
