"""The Triton kernels compiled for the H100 (sm90) offline by Triton's own compiler and ptxas, no GPU needed:
every launch the recipe makes compiles, within sm90's shared memory and without spills (tools/sm90_kernels.py);
the cross-entropy's e5m2 codes are the GPU's own rounding (cvt.rn.satfinite) of values its bit-level rounding put
on e5m2's grid, which the compiler keeps (no fast-math folding of (a + 128) - 128); the FP8 MLP's e4m3 codes come
from an IEEE division (div.rn: Triton's / is approximate) and the saturating nearest-even cast."""

import json
import os
import re
import subprocess
import sys

import pytest

import train_gpt as T
from conftest import REPO

pytest.importorskip("triton")
TOOL = REPO / "tools" / "sm90_kernels.py"


@pytest.mark.slow
def test_every_recipe_launch_compiles_for_sm90_within_shared_memory_and_without_spills(tmp_path):
    run = subprocess.run([sys.executable, str(TOOL), "--json", str(tmp_path / "sm90.json")], capture_output=True,
                         text=True, timeout=600)
    print(run.stdout)  # the table: shared memory and registers of each kernel
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    rows = json.loads((tmp_path / "sm90.json").read_text())
    assert {r["kernel"].split()[0] for r in rows} == {"linear_relu_square", "quantize_mlp_down", "amax_scales",
                                                      "softcap_ce", "xxt", "xtx", "ba_plus_caa", "transpose_copy",
                                                      "dc_attention"}
    gemm = {r["kernel"] for r in rows if r["kernel"].startswith("linear_relu_square")}  # #89's three modes
    assert gemm == {f"linear_relu_square {mode} M={m}" for mode, ms in (
        ("fp8 forward", (16384, 32768, 49152)), ("backward", (16384, 32768, 49152)),
        ("bf16 forward", (16384, 32768, 49152, 262144))) for m in ms}, gemm
    ce = {r["kernel"] for r in rows if r["kernel"].startswith("softcap_ce")}  # #89's three modes, 2 or 4 weights
    assert ce == {f"softcap_ce bf16 K={k} {mode}" for k in (2, 4) for mode in ("loss+grad e5m2", "loss+grad bf16",
                                                                               "loss")}, ce
    # Polar Express on each bank's blocks (b A + c A^2 of qk's 256 x 256 and of the 768 x 768 vo and mlp Grams), the
    # FP8 head backward's transposes of x's e4m3 and the gradient's e5m2 codes
    assert {r["kernel"] for r in rows if r["kernel"].split()[0] in ("xxt", "xtx", "ba_plus_caa", "transpose_copy")} == {
        "xxt bf16 256x768 (qk)", "xxt bf16 768x768 (vo)", "xtx bf16 3072x768 (mlp)", "ba_plus_caa bf16 256x256 (qk)",
        "ba_plus_caa bf16 768x768 (vo, mlp)", "transpose_copy e4m3 49152x768", "transpose_copy e5m2 49152x50304"}
    assert {r["kernel"] for r in rows if r["kernel"].startswith("dc_attention")} == {
        f"dc_attention {k} bf16 H=6 D=128 window=112" for k in ("forward", "backward queries", "backward keys")}
    assert len(rows) == 10 + 2 + 6 + 5 + 2 + 3
    for r in rows:
        assert r["ok"] and 0 < r["registers"] <= 255 and r["shared_bytes"] <= 227 * 1024, r


def test_the_sm90_check_compiles_the_specialization_triton_launches():
    # Triton's JIT types each TMA descriptor by its dtype and block shape, makes the constexprs (and an unused
    # None) constants, and hints 16-divisible sizes and aligned pointers; a compile without them is another kernel.
    sys.path.insert(0, str(TOOL.parent))
    import sm90_kernels as S
    launches = {name: case for name, *case in S.cases(T.Config())}
    for name, fp8 in (("linear_relu_square fp8 forward M=49152", True), ("linear_relu_square backward M=49152", False)):
        kernel, args, keywords = launches[name]
        src, options = S.source(kernel, args, keywords)
        names = list(src.signature)
        constants = {names[i]: v for (i,), v in src.constants.items()}
        hinted = {names[i] for (i,), a in src.attrs.items() if ["tt.divisibility", 16] in a}
        a = "fp8e4nv" if fp8 else "bf16"
        assert src.signature["a_desc"] == f"tensordesc<{a}[128, {128 if fp8 else 64}]>", src.signature
        assert src.signature["b_desc"] == f"tensordesc<{a}[256, {128 if fp8 else 64}]>", src.signature
        assert src.signature["c_desc"] == "tensordesc<bf16[128, 128]>", src.signature
        assert {"NUM_SMS": 132, "FORWARD": fp8, "FP8": fp8}.items() <= constants.items(), constants
        pointers = {"amax_ptr", "dequant_ptr", "act_scale_ptr"}
        if fp8:  # the scales' pointers unhinted (do_not_specialize_on_alignment): one compile for every layer
            assert src.signature["post8_desc"] == "tensordesc<fp8e4nv[128, 128]>", src.signature
            assert "amax_ptr" in hinted and not {"dequant_ptr", "act_scale_ptr"} & hinted, hinted
            assert constants["aux_desc"] is None, constants  # the forward stores post alone (#87), reads no aux
        else:  # the backward reads post (aux) in c's tiles
            assert src.signature["aux_desc"] == "tensordesc<bf16[128, 128]>", src.signature
            assert all(constants[p] is None for p in (*pointers, "post8_desc")), constants
        assert {"M", "N", "K"} <= hinted, hinted
        assert options == {"num_warps": keywords["num_warps"], "num_stages": keywords["num_stages"]}


@pytest.mark.parametrize("target, launch", [("sm80", "linear_relu_square bf16 forward M=16384"),
                                            ("sm86", "linear_relu_square backward M=16384"),
                                            ("sm89", "linear_relu_square fp8 forward M=16384"),
                                            *(("sm120", f"linear_relu_square {mode} M=16384")
                                              for mode in ("fp8 forward", "bf16 forward", "backward"))])
def test_the_relu2_gemm_compiles_without_spills_at_its_targets_own_tiles(target, launch):
    # sm80, sm86 and sm89 spill at sm90's 128 x 256 tiles (255 registers); sm120 would overflow its 99 KB at sm89's
    # (next test). The tool compiles each target's launches at its gpt_kernels.mlp_config (128 x 128, 8 warps there),
    # as the launcher runs them on that GPU. One compile each.
    sys.path.insert(0, str(TOOL.parent))
    import sm90_kernels as S
    config = S.K.mlp_config(S.K.TARGETS[target])
    assert (config.block_m, config.block_n, config.num_warps) == (128, 128, 8), config
    name, kernel, args, keywords = next(c for c in S.cases(T.Config(), target=target) if c[0] == launch)
    mode = launch.split(" M=")[0].removeprefix("linear_relu_square ")
    assert (keywords["BLOCK_M"], keywords["BLOCK_N"], keywords["num_warps"]) == (128, 128, 8), keywords
    assert (keywords["BLOCK_K"], keywords["num_stages"]) == config.modes[mode], keywords
    row = S.check(name, kernel, args, keywords, target=target)
    assert row["ok"] and row["spill_bytes"] == row["reload_bytes"] == row["local_bytes"] == 0, row
    assert row["registers"] <= 255 and row["shared_bytes"] <= S.TARGETS[target][1], row
    # sm120's TMA loads each get an out-of-line call from ptxas (8 bytes of stack for it, nothing spilled)
    assert row["stack_bytes"] == (8 if target == "sm120" else 0), row


@pytest.mark.parametrize("bf16_forward, problem", [((64, 4), "shared memory 114712 B > 101376 B"),
                                                   ((64, 3), "spills: 76 B stored, 76 B reloaded")])
def test_sm120s_bf16_forward_fits_where_sm89s_and_fewer_stages_do_not(monkeypatch, bf16_forward, problem):
    # The bf16 forward on sm120 (TMA): sm89's K blocks of 64 at 4 stages need 112 KB of its 99 KB; at 3 stages they
    # fit (80 KB) but ptxas spills. Its own, K blocks of 32 at 5 stages, passes (the test above). One compile each.
    sys.path.insert(0, str(TOOL.parent))
    import sm90_kernels as S
    sm120 = S.K.MLP_CONFIGS[S.K.TARGETS["sm120"]]
    monkeypatch.setitem(S.K.MLP_CONFIGS, S.K.TARGETS["sm120"],
                        sm120._replace(modes={**sm120.modes, "bf16 forward": bf16_forward}))
    name, kernel, args, keywords = next(c for c in S.cases(T.Config(), target="sm120")
                                        if c[0] == "linear_relu_square bf16 forward M=16384")
    row = S.check(name, kernel, args, keywords, target="sm120")
    assert not row["ok"] and row["problem"] == problem, row


@pytest.mark.parametrize("tile, status", [((128, 256), "does not compile"), ((128, 128), "does not compile"),
                                          ((64, 128), "spill")])
def test_the_fp8_forward_on_sm100_fails_at_every_tile_tried(monkeypatch, tile, status):
    # Why RUNS_ON leaves sm100 out of the FP8 MLP's GEMM: Triton 3.6.0's TMEM layout pass fails at #89's tiles and at
    # 128 x 128; 64 x 128 compiles but spills (8 B). One compile each.
    sys.path.insert(0, str(TOOL.parent))
    import sm90_kernels as S
    sm100 = S.K.TARGETS["sm100"]
    monkeypatch.setitem(S.K.MLP_CONFIGS, sm100, S.K.MLP_CONFIGS[sm100]._replace(block_m=tile[0], block_n=tile[1]))
    name, kernel, args, keywords = next(c for c in S.cases(T.Config(), target="sm100")
                                        if c[0] == "linear_relu_square fp8 forward M=16384")
    row = S.check(name, kernel, args, keywords, target="sm100")
    assert row["status"] == status, row
    assert ("PassManager::run failed" in row["problem"]) if status == "does not compile" else (
        row["spill_bytes"] == 8 and row["shared_bytes"] <= S.TARGETS["sm100"][1]), row


@pytest.mark.slow
def test_the_sm90_check_fails_a_launch_beyond_shared_memory():
    # The FP8 forward with one pipeline stage more than #89's 3: 240 KB, over sm90's 227 KB.
    code = ("import sys, json; sys.path.insert(0, sys.argv[1]); import sm90_kernels as S, train_gpt as T; "
            "name, kernel, args, kw = S.cases(T.Config())[0]; "
            "print(json.dumps(S.check(name, kernel, args, dict(kw, num_stages=4))))")
    run = subprocess.run([sys.executable, "-c", code, str(REPO / "tools")], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    row = json.loads(run.stdout.strip().splitlines()[-1])
    assert not row["ok"] and "shared memory" in row["problem"], row


def compiled_ptx(name_prefix: str) -> str:
    sys.path.insert(0, str(TOOL.parent))
    import triton

    import sm90_kernels as S
    _, kernel, args, keywords = next(c for c in S.cases(T.Config()) if c[0].startswith(name_prefix))
    src, options = S.source(kernel, args, keywords)
    return triton.compile(src, target=S.H100, options=options).asm["ptx"]


@pytest.mark.slow
def test_the_cross_entropys_e5m2_rounding_survives_the_compiler():
    ptx = compiled_ptx("softcap_ce bf16 K=2 loss+grad e5m2")
    assert "cvt.rn.satfinite.e5m2x2.f32" in ptx  # nearest-even, saturating: exact on values already on the grid
    assert re.search(r"add\.f32.*0f43000000", ptx)  # + 128 and - 128 both there: the subnormals' rounding
    assert re.search(r"(sub\.f32.*0f43000000|add\.f32.*0fC3000000)", ptx)


@pytest.mark.slow
def test_the_relu2_backwards_root_is_ieee_as_the_torch_paths():
    # dpre = 2 h sqrt(post): sqrt.rn (tl.sqrt_rn), the correctly rounded root torch's fallback takes, so the kernel's
    # dpre is _mlp_grads' bit for bit on the GPU as under the interpreter; tl.sqrt would be sqrt.approx.
    ptx = compiled_ptx("linear_relu_square backward")
    assert "sqrt.rn.f32" in ptx and "sqrt.approx" not in ptx


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["linear_relu_square fp8 forward", "quantize_mlp_down"])
def test_the_fp8_mlps_e4m3_codes_are_the_torch_paths_roundings_on_sm90(launch):
    # post / s_act and W_proj / s_next: one IEEE division (the torch path's), then the nearest-even saturating cast;
    # the GEMM on the tensor cores (wgmma) fed by TMA, its bf16 roundings nearest-even.
    ptx = compiled_ptx(launch)
    assert "div.rn.f32" in ptx and not re.search(r"div\.(full|approx)", ptx)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    if launch.startswith("linear_relu_square"):
        assert "wgmma" in ptx and "cp.async.bulk.tensor" in ptx and "cvt.rn.bf16.f32" in ptx


def test_the_bf16_gemms_round_their_outputs_to_nearest_even_as_the_interpreter_shim_does():
    # tests/interpreter_sm90.py makes the interpreter's casts round to nearest even: that is what the GPU runs only if
    # the compiled kernels' fp32 -> bf16 casts are cvt.rn (not the truncating cvt.rz), as here, and their dots are the
    # tensor cores' (wgmma), which the shim's fp32 dot of exact products stands in for.
    sys.path.insert(0, str(TOOL.parent))
    import triton

    import sm90_kernels as S
    cases = S.cases(T.Config())  # the MLP GEMM's bf16 mode at the first stage's rows, each Polar Express launch
    for name, kernel, args, keywords in [c for c in cases if c[0] == "linear_relu_square bf16 forward M=16384"
                                         or c[0].split()[0] in ("xxt", "xtx", "ba_plus_caa")]:
        src, options = S.source(kernel, args, keywords)
        ptx = triton.compile(src, target=S.H100, options=options).asm["ptx"]
        casts = set(re.findall(r"cvt\.[a-z0-9.]+", ptx))
        assert any(c.startswith("cvt.rn.bf16") for c in casts) and not any(".rz" in c for c in casts), (name, casts)
        assert "wgmma" in ptx, name


def test_one_dc_attention_compile_serves_every_stage_and_validation():
    # T and the cu_seqlens entries are runtime arguments: the four launches (three stages, validation) specialize
    # alike (sizes divisible by 16, no constant), so the row compiled at validation's shape is each stage's kernel.
    sys.path.insert(0, str(TOOL.parent))
    import sm90_kernels as S
    compiled = [[S.source(kernel, args, keywords) for _, kernel, args, keywords in S.dc_cases(T.Config(), *launch)]
                for launch in S.DC_LAUNCHES]
    for sources in compiled[:-1]:
        for (src, options), (last, last_options) in zip(sources, compiled[-1]):
            assert (src.signature, src.constants, src.attrs, options) == (last.signature, last.constants, last.attrs,
                                                                          last_options)


def test_the_compile_matrix_refuses_a_table_that_claims_a_failing_launch():
    # tools/sm90_kernels.py --targets=all measures sm80, sm89 and sm100 in its own run (minutes); here its check of
    # gpt_kernels.RUNS_ON (what train_gpt's auto reads) on made-up rows: a failing launch on a claimed target is an
    # error, every launch of a path passing on an unclaimed one a note.
    sys.path.insert(0, str(TOOL.parent))
    import sm90_kernels as S
    assert set(S.TARGETS) == set(S.K.TARGETS) and S.TARGETS["sm90"] == (S.H100, 227 * 1024)
    assert {t: limit // 1024 for t, (_, limit) in S.TARGETS.items()} == {"sm80": 163, "sm86": 99, "sm89": 99,
                                                                         "sm90": 227, "sm100": 227, "sm120": 99}
    rows = [{"kernel": "linear_relu_square bf16 forward M=16384", "target": t, "ok": t == "sm90",
             "status": "pass" if t == "sm90" else "spill"} for t in ("sm89", "sm90")]
    rows += [{"kernel": "xxt bf16 256x768 (qk)", "target": "sm89", "ok": False, "status": "shared memory"}]
    table, wrong = S.matrix(rows, ["sm89", "sm90"])
    assert table[2:] == ["| linear_relu_square bf16 | spill (1 of 1) | pass (1) |",
                         "| xxt | shared memory (1 of 1) | - |"], table
    assert "gpt_kernels.RUNS_ON['polar_express'] has sm89, where xxt bf16 256x768 (qk) fails" in wrong, wrong
    # the ReLU^2 GEMM's bf16 modes are claimed on sm89 (at its own tiles): a failing launch there is an error too
    assert S.K.TARGETS["sm89"] in S.K.RUNS_ON["relu2_kernel"]
    assert "gpt_kernels.RUNS_ON['relu2_kernel'] has sm89, where linear_relu_square bf16 forward M=16384 fails" in wrong
    # a launch failing where the table does not claim its path (the FP8 forward on sm100) is no error
    rows = [{"kernel": "linear_relu_square fp8 forward M=16384", "target": "sm100", "ok": False,
             "status": "does not compile"}]
    assert S.K.TARGETS["sm100"] not in S.K.RUNS_ON["relu2_kernel+fp8_mlp"]
    assert not any(not w.startswith("note") for w in S.matrix(rows, ["sm100"])[1])
    # a run of one kernel (--kernels) says nothing of the paths whose launches it did not compile (no "lacks" note)
    rows = [{"kernel": "softcap_ce bf16 K=2 loss", "target": "sm100", "ok": True, "status": "pass"}]
    assert S.matrix(rows, ["sm100"])[1] == []


@pytest.mark.slow
def test_each_target_compiles_apart_so_none_leaks_into_the_next(tmp_path):
    # Compiled after sm90 in one process, sm80's e5m2 cross-entropy came out with a cvt to .e5m2x2, which ptxas
    # refuses below sm89 ("requires .target sm_89 or higher"): a failure on a cold cache, as here, that sm80 alone
    # does not have. Each target compiles in a process of its own: both pass, as each does alone.
    launch = "softcap_ce bf16 K=2 loss+grad e5m2"
    run = subprocess.run([sys.executable, str(TOOL), "--targets=sm90,sm80", f"--kernels={launch}", "--json",
                          str(tmp_path / "rows.json")], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")})
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["target"], r["kernel"], r["status"]) for r in rows] == [("sm90", launch, "pass"),
                                                                        ("sm80", launch, "pass")], run.stdout
