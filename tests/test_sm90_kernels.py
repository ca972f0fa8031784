"""The Triton kernels compiled for the H100 (sm90) offline by Triton's own compiler and ptxas, no GPU needed:
every launch the recipe makes compiles, within sm90's shared memory and without spills (records/sm90_kernels.py);
the cross-entropy's e5m2 codes are the GPU's own rounding (cvt.rn.satfinite) of values its bit-level rounding put
on e5m2's grid, which the compiler keeps (no fast-math folding of (a + 128) - 128)."""

import json
import re
import subprocess
import sys

import pytest

import gpt_kernels as K
import train_gpt as T
from conftest import REPO

pytest.importorskip("triton")
TOOL = REPO / "records" / "sm90_kernels.py"


@pytest.mark.slow
def test_every_recipe_launch_compiles_for_sm90_within_shared_memory_and_without_spills(tmp_path):
    run = subprocess.run([sys.executable, str(TOOL), "--json", str(tmp_path / "sm90.json")], capture_output=True,
                         text=True, timeout=600)
    print(run.stdout)  # the table: shared memory and registers of each kernel
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    rows = json.loads((tmp_path / "sm90.json").read_text())
    assert {r["kernel"].split()[0] for r in rows} == {"relu2_mm", "softcap_ce", "xxt", "xtx", "ba_plus_caa",
                                                      "transpose_copy"}
    assert len(rows) == len(K.RELU2_CONFIGS) + 6 + 5 + 2 and len(K.RELU2_CONFIGS) >= 4  # every tile autotuning may pick
    ce = {r["kernel"] for r in rows if r["kernel"].startswith("softcap_ce")}  # #89's three modes, 2 or 4 weights
    assert ce == {f"softcap_ce bf16 K={k} {mode}" for k in (2, 4) for mode in ("loss+grad e5m2", "loss+grad bf16",
                                                                               "loss")}, ce
    # Polar Express on each bank's blocks (b A + c A^2 of qk's 256 x 256 and of the 768 x 768 vo and mlp Grams), the
    # FP8 head backward's transposes of x's e4m3 and the gradient's e5m2 codes
    assert {r["kernel"] for r in rows if r["kernel"].split()[0] in ("xxt", "xtx", "ba_plus_caa", "transpose_copy")} == {
        "xxt bf16 256x768 (qk)", "xxt bf16 768x768 (vo)", "xtx bf16 3072x768 (mlp)", "ba_plus_caa bf16 256x256 (qk)",
        "ba_plus_caa bf16 768x768 (vo, mlp)", "transpose_copy e4m3 49152x768", "transpose_copy e5m2 49152x50304"}
    for r in rows:
        assert r["ok"] and 0 < r["registers"] <= 255 and r["shared_bytes"] <= 227 * 1024, r


def test_the_sm90_check_compiles_the_specialization_triton_launches():
    # Triton's JIT makes unit strides constants and hints 16-divisible sizes and aligned pointers; a compile
    # without them is a different kernel (for the relu2 GEMM: unvectorized, unpipelined loads, 255 registers).
    sys.path.insert(0, str(TOOL.parent))
    import sm90_kernels as S
    name, kernel, args, keywords = S.cases(T.Config())[0]
    src, options = S.source(kernel, args, keywords)
    names = list(src.signature)
    constants = {names[i]: v for (i,), v in src.constants.items()}
    hinted = {names[i] for (i,), a in src.attrs.items() if ["tt.divisibility", 16] in a}
    assert {"sxk": 1, "swn": 1, "son": 1, "K": 768}.items() <= constants.items(), constants
    assert {"x_ptr", "w_ptr", "out_ptr", "M", "N", "sxm", "swk", "som"} <= hinted, hinted
    assert options == {"num_warps": keywords["num_warps"], "num_stages": keywords["num_stages"]}


@pytest.mark.slow
def test_the_sm90_check_fails_a_tile_beyond_shared_memory():
    # 256 x 256 tiles with K blocks of 256 in bf16, 4 stages: 2 MB of operands in flight, far over sm90's 227 KB.
    code = ("import sys, json; sys.path.insert(0, sys.argv[1]); import sm90_kernels as S, train_gpt as T; "
            "name, kernel, args, kw = S.cases(T.Config())[0]; "
            "print(json.dumps(S.check(name, kernel, args, dict(kw, BLOCK_M=256, BLOCK_N=256, BLOCK_K=256, "
            "num_warps=8, num_stages=4))))")
    run = subprocess.run([sys.executable, "-c", code, str(REPO / "records")], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    row = json.loads(run.stdout.strip().splitlines()[-1])
    assert not row["ok"] and "shared memory" in row["problem"], row


@pytest.mark.slow
def test_the_cross_entropys_e5m2_rounding_survives_the_compiler():
    sys.path.insert(0, str(TOOL.parent))
    import triton

    import sm90_kernels as S
    _, kernel, args, keywords = next(c for c in S.cases(T.Config()) if "e5m2" in c[0])
    src, options = S.source(kernel, args, keywords)
    ptx = triton.compile(src, target=S.H100, options=options).asm["ptx"]
    assert "cvt.rn.satfinite.e5m2x2.f32" in ptx  # nearest-even, saturating: exact on values already on the grid
    assert re.search(r"add\.f32.*0f43000000", ptx)  # + 128 and - 128 both there: the subnormals' rounding
    assert re.search(r"(sub\.f32.*0f43000000|add\.f32.*0fC3000000)", ptx)


@pytest.mark.slow
def test_the_bf16_gemms_round_their_outputs_to_nearest_even_as_the_interpreter_shim_does():
    # tests/interpreter_sm90.py makes the interpreter's casts round to nearest even: that is what the GPU runs only if
    # the compiled kernels' fp32 -> bf16 casts are cvt.rn (not the truncating cvt.rz), as here, and their dots are the
    # tensor cores' (wgmma), which the shim's fp32 dot of exact products stands in for.
    sys.path.insert(0, str(TOOL.parent))
    import triton

    import sm90_kernels as S
    cases = S.cases(T.Config())  # a relu2 tile, then each Polar Express launch
    for name, kernel, args, keywords in cases[:1] + [c for c in cases if c[0].split()[0] in ("xxt", "xtx",
                                                                                             "ba_plus_caa")]:
        src, options = S.source(kernel, args, keywords)
        ptx = triton.compile(src, target=S.H100, options=options).asm["ptx"]
        casts = set(re.findall(r"cvt\.[a-z0-9.]+", ptx))
        assert "cvt.rn.bf16x2.f32" in casts and not any(".rz" in c for c in casts), (name, casts)
        assert "wgmma" in ptx, name
