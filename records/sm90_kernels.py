"""Compile the trainer's Triton kernels for the H100 (sm90) without a GPU, and report what each needs.

    python records/sm90_kernels.py [--json FILE]

Triton's own compiler runs (its ptxas included) for every dtype and configuration a run of the recipe launches:
the fused ReLU^2 GEMM (--relu2_kernel) at model_dim 768, and the softcapped multi-token cross-entropy
(--fused_head) over the 50,304-column vocabulary with 1 to 3 loss weights (padded to 2 or 4), with and without
its gradient pass. For each: shared memory, registers per thread and spilled bytes (from cuobjdump, which ships
with Triton). A compile error, shared memory above sm90's 227 KB per block, or any spill fails it (exit 1).
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
    from triton.compiler import ASTSource
except ImportError:
    sys.exit("error: sm90_kernels.py runs Triton's compiler: pip install triton==3.6.0")

import train_gpt as T  # noqa: E402

H100 = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm90
DEFAULTS = {"num_warps": 4, "num_stages": 3}  # what a launch without options gets


def cases(cfg: T.Config) -> list[tuple[str, object, dict, dict]]:
    """(name, kernel, signature, constexprs) of every launch the recipe makes."""
    relu2 = T.relu2_launcher().kernel
    relu2_sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "constexpr",
                 "sxm": "i32", "sxk": "i32", "swk": "i32", "swn": "i32", "som": "i32", "son": "i32",
                 "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
    out = [(f"relu2_mm bf16 K={cfg.model_dim}", relu2, relu2_sig,
            {"K": cfg.model_dim, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32})]
    ce = T.softcap_ce_launcher().kernel
    ce_sig = {"z_ptr": "*bf16", "stride": "i32", "targets_ptr": "*i64", "weights_ptr": "*fp32", "loss_ptr": "*fp32",
              "row0": "i32", "T": "i32", "cap": "fp32", "shift": "fp32", "temp": "fp32", "V": "constexpr",
              "K": "constexpr", "BLOCK_V": "constexpr", "GRAD": "constexpr"}
    for k in (2, 4):  # 1 or 2 weights pad to 2, 3 to 4 (softcap_ce)
        for grad in (True, False):
            out.append((f"softcap_ce bf16 K={k} {'loss+grad' if grad else 'loss'}", ce, ce_sig,
                        {"V": cfg.vocab_size, "K": k, "BLOCK_V": 1024, "GRAD": grad}))
    return out


def resources(cubin: bytes) -> dict[str, int]:
    """Registers, stack and local (spill) bytes of the kernel in a cubin, as cuobjdump reports them."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                              check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", text))
    return {"registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"]), "spill_bytes": int(fields["LOCAL"])}


def check(name: str, kernel, signature: dict, constexprs: dict) -> dict:
    row: dict = {"kernel": name, **DEFAULTS}
    try:
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=H100,
                                  options=DEFAULTS)
    except Exception as e:  # a compile error is this check's finding, reported in its row
        return {**row, "ok": False, "problem": f"does not compile for sm90: {type(e).__name__}: {e}"}
    row |= {"shared_bytes": compiled.metadata.shared, **resources(compiled.asm["cubin"])}
    problems = ([f"shared memory {row['shared_bytes']} B > {SMEM_LIMIT} B"] if row["shared_bytes"] > SMEM_LIMIT
                else []) + ([f"spills: {row['spill_bytes']} B local, {row['stack_bytes']} B stack"]
                                          if row["spill_bytes"] or row["stack_bytes"] else [])
    return {**row, "ok": not problems, "problem": "; ".join(problems)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = [check(*case) for case in cases(T.Config())]
    for r in rows:
        figures = (f"shared {r['shared_bytes'] / 1024:6.1f} KB  registers {r['registers']:3d}  "
                   f"spills {r['spill_bytes'] + r['stack_bytes']} B" if "shared_bytes" in r else "")
        print(f"{'PASS' if r['ok'] else 'FAIL'}  {r['kernel']:34s} {figures}  {r['problem']}".rstrip())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
