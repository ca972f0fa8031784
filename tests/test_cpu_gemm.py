"""CPU bf16 matmuls: where the CPU has no native bf16 GEMM (oneDNN's), a run's bf16 GEMMs run as fp32 GEMMs of the
same bf16 values rounded to bf16 (--cpu_bf16_gemm=fp32, auto's choice there), in eager and in compiled code."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import gpt_kernels
import train_gpt as T
from conftest import MATMULS, REPO, SMALL, tiny_args

# oneDNN capped at AVX2 has no bf16 GEMM: torch then runs bf16 matmuls in its reference loop, as on an
# AVX2-only CPU. aten's kernels and MKL take their AVX2 code too.
AVX2_ONLY = dict(ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2")


class MatmulInputs(TorchDispatchMode):
    """Records the input dtypes of every matmul op that reaches it (entered below Fp32Gemms: what it passes on).
    It ignores compile internals as Fp32Gemms does, so that torch.compile compiles under it."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in MATMULS:
            self.seen.append((str(func), tuple(a.dtype for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))

    def bf16(self) -> list[tuple[str, tuple]]:
        return [(op, dtypes) for op, dtypes in self.seen if torch.bfloat16 in dtypes]


def test_fp32_path_leaves_no_bf16_matmul_in_a_run_and_trains_as_the_native_path(tmp_path):
    args = tiny_args(tmp_path, num_steps=3, val_every=3, **SMALL)
    runs = {}
    for path in ("native", "fp32"):
        with MatmulInputs() as ops:
            result = T.run([*args, f"--cpu_bf16_gemm={path}", f"--run_id={path}"])
        runs[path] = ops, [loss for _, loss in result.val_losses]
    native, fp32 = runs["native"][0], runs["fp32"][0]
    # The native path feeds bf16 to the matmuls (forward, backward, Newton-Schulz): what the fp32 path must route.
    assert len(native.bf16()) > 50, native.seen[:5]
    assert fp32.seen and not fp32.bf16(), fp32.bf16()[:5]
    assert len(fp32.seen) == len(native.seen)  # the same GEMMs, only wider inputs
    # A bf16 GEMM with fp32 accumulation either way: the losses agree to bf16 rounding, not to the bit.
    assert runs["fp32"][1] == pytest.approx(runs["native"][1], rel=2e-3)
    log = (tmp_path / "logs" / "fp32.txt").read_text()
    assert "bf16 GEMM path: fp32 (" in log and '"cpu_bf16_gemm": "fp32"' in log


def test_fp32_gemms_round_an_fp32_product_of_the_bf16_values_once():
    a, b, c = (torch.randn(*shape).bfloat16() for shape in ((3, 40, 24), (3, 24, 16), (3, 40, 16)))
    exact = lambda t: t.double()  # noqa: E731
    with gpt_kernels.Fp32Gemms():
        got = {"mm": a[0] @ b[0], "addmm": torch.addmm(c[0], a[0], b[0], beta=0.5, alpha=2.0), "bmm": a @ b,
               "baddbmm": torch.baddbmm(c, a, b, beta=0.5, alpha=2.0), "out": torch.mm(a[1], b[1], out=c[2].clone())}
    want = {"mm": exact(a[0]) @ exact(b[0]), "addmm": 0.5 * exact(c[0]) + 2.0 * exact(a[0]) @ exact(b[0]),
            "bmm": exact(a) @ exact(b), "baddbmm": 0.5 * exact(c) + 2.0 * exact(a) @ exact(b),
            "out": exact(a[1]) @ exact(b[1])}
    for name, value in got.items():
        assert value.dtype == torch.bfloat16, name
        # fp32 accumulation of exact bf16 products, one rounding to bf16: the float64 product rounded, or a neighbour
        assert torch.allclose(value.double(), want[name].bfloat16().double(), rtol=2**-7, atol=1e-6), name


@pytest.mark.filterwarnings("ignore:TF32 acceleration")  # torch's note on setting oneDNN's flags
def test_auto_takes_fp32_where_the_cpu_has_no_native_bf16_gemm():
    cfg = T.parse_config(["--preset=tiny"])
    with torch.backends.mkldnn.flags(enabled=False):  # without oneDNN torch has no bf16 GEMM but the reference loop
        assert not gpt_kernels.native_bf16_gemm()
        T.resolve_for_device(cfg, cuda=False)
    assert cfg.cpu_bf16_gemm == "fp32"
    forced = T.parse_config(["--preset=tiny", "--cpu_bf16_gemm=native"])
    T.resolve_for_device(forced, cuda=False)
    assert forced.cpu_bf16_gemm == "native"
    with pytest.raises(T.UsageError, match="--cpu_bf16_gemm must be auto, native, fp32"):
        T.validate_config(T.parse_config(["--cpu_bf16_gemm=bf16"]), 1)
    with pytest.raises(T.UsageError, match="CPU run"):
        T.resolve_for_device(T.parse_config(["--cpu_bf16_gemm=fp32"]), cuda=True)


def test_the_log_says_record_path_only_where_the_run_computes_the_records_arithmetic(monkeypatch):
    def path(isa: str, gemm: str, env: dict[str, str], compiled: bool = False) -> str:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: isa)
        for name in T.RECORD_PATH_ENV:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return T.cpu_path(gemm, compiled)

    record = T.RECORD_PATH_ENV
    assert path("AVX2", "fp32", record) == "record"  # run.sh's default on every x86-64 CPU with AVX2
    assert path("AVX2", "fp32", {}) == "native"  # OpenBLAS's own choice of kernels and threads: this CPU's
    assert path("AVX2", "fp32", dict(record, OPENBLAS_NUM_THREADS="2")) == "native"  # another sum than one thread's
    assert path("AVX2", "fp32", dict(record, OPENBLAS_CORETYPE="SkylakeX")) == "native"
    assert path("AVX2", "fp32", record, compiled=True) == "native"  # inductor's own kernels
    assert path("AVX2", "native", record) == "native"
    assert path("AVX512", "fp32", {k: v for k, v in record.items() if k != "ATEN_CPU_CAPABILITY"}) == "native"
    path("AVX2", "fp32", record)
    assert f"\nCPU path: {T.CPU_PATHS['record']}" in T.environment_report(torch.device("cpu"), "fp32")


def test_record_math_computes_what_torch_does_without_mkl():
    # Each op the record path takes from MKL, by its own formulation: within an ulp or two of torch's (MKL's) result,
    # the same dtype and shape, in place and out= as torch's; every float GEMM as numpy's product; bf16 in, bf16 out.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 8
    ops = {"exp": x, "log": x.abs() + 1e-30, "tanh": x, "sin": x, "cos": x, "sqrt": x.abs()}
    for name, t in ops.items():
        with gpt_kernels.RecordMath():
            got, inplace, out = getattr(torch, name)(t), getattr(t.clone(), f"{name}_")(), torch.empty_like(t)
            getattr(torch, name)(t, out=out)
        want = getattr(torch, name)(t)
        assert got.dtype == want.dtype and torch.equal(got, inplace) and torch.equal(got, out), name
        assert torch.allclose(got, want, rtol=3e-7, atol=1e-30), (name, (got - want).abs().max())
    rows = torch.randn(8, 300, generator=g) * 5
    rows[0] = -torch.inf
    with gpt_kernels.RecordMath():
        lse = torch.logsumexp(rows, -1)
        with pytest.raises(NotImplementedError, match="give it a formulation"):
            torch.erf(x)  # MKL computes it: refused, not silently per CPU model
        assert torch.equal(torch.exp(x.bfloat16()), torch.exp(x.bfloat16()))  # bf16: torch's own kernel, untouched
    assert lse[0] == -torch.inf and torch.allclose(lse, torch.logsumexp(rows, -1), rtol=1e-6)
    a, b, c = (torch.randn(3, 33, 17, generator=g), torch.randn(3, 17, 9, generator=g), torch.randn(3, 33, 9,
                                                                                                   generator=g))
    with gpt_kernels.RecordMath():
        got = {"mm": a[0] @ b[0], "bmm": torch.bmm(a, b), "addmm": torch.addmm(c[0], a[0], b[0], beta=0.5, alpha=2),
               "baddbmm": torch.baddbmm(c, a, b), "mv": a[0] @ b[0, :, 0], "dot": torch.dot(a[0, 0], a[0, 1]),
               "bf16": a[0].bfloat16() @ b[0].bfloat16()}
    product = torch.from_numpy(a.numpy() @ b.numpy())
    assert torch.equal(got["mm"], product[0]) and torch.equal(got["bmm"], product)
    assert torch.equal(got["addmm"], c[0] * 0.5 + product[0] * 2) and torch.equal(got["baddbmm"], c + product)
    assert torch.allclose(got["mv"], a[0] @ b[0, :, 0], atol=1e-5) and torch.allclose(got["dot"], a[0, 0] @ a[0, 1])
    assert got["bf16"].dtype == torch.bfloat16 and torch.equal(
        got["bf16"], torch.from_numpy(a[0].bfloat16().float().numpy() @ b[0].bfloat16().float().numpy()).bfloat16())


@pytest.mark.slow
def test_the_record_path_calls_no_mkl_function(tmp_path):
    # MKL's GEMMs and vector math follow the CPU model: on the record path none runs (MKL_VERBOSE prints each BLAS
    # call it makes; its vector math, which it does not print, is RecordMath's to refuse: the test above).
    proc = subprocess.run([sys.executable, str(REPO / "train_gpt.py"), *tiny_args(tmp_path, num_steps=2, **SMALL),
                           "--run_id=mkl", "--cpu_bf16_gemm=fp32"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **T.RECORD_PATH_ENV, "MKL_VERBOSE": "1", "ONEDNN_VERBOSE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "\nCPU path: record (" in (tmp_path / "logs" / "mkl.txt").read_text()
    calls = [line for line in proc.stdout.splitlines() if line.startswith(("MKL_VERBOSE", "onednn_verbose"))]
    assert len(calls) <= 1 and all(" oneMKL " in line for line in calls), calls[:5]  # the version line at most


@pytest.mark.slow
def test_an_avx2_only_cpu_runs_the_fp32_path_and_says_so(tmp_path):
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import train_gpt as T; "
            "T.run(sys.argv[2:])")
    proc = subprocess.run([sys.executable, "-c", code, str(REPO), *tiny_args(tmp_path, num_steps=2, **SMALL),
                           "--run_id=avx2"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **AVX2_ONLY, **T.RECORD_PATH_ENV})
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = (tmp_path / "logs" / "avx2.txt").read_text()
    assert "vector ISA AVX2, native bf16 GEMM no" in log
    assert "bf16 GEMM path: fp32 (" in log and "\nCPU path: record (" in log  # the bundled records' arithmetic
    config = json.loads(next(line for line in log.splitlines() if line.startswith("config: "))[len("config: "):])
    assert config["cpu_bf16_gemm"] == "fp32"


@pytest.mark.slow
def test_compiled_code_under_fp32_gemms_compiles_and_calls_fp32_gemms():
    torch._dynamo.reset()
    w1, w2 = torch.randn(64, 32).bfloat16().requires_grad_(), torch.randn(16, 64).bfloat16().requires_grad_()

    def mlp(x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.relu(F.linear(x, w1)).square(), w2).float().square().sum()

    x = torch.randn(2, 48, 32).bfloat16()
    compiled = torch.compile(mlp, fullgraph=True, dynamic=False)  # fullgraph: fails if dynamo skips the frame
    with MatmulInputs() as below, gpt_kernels.Fp32Gemms(), MatmulInputs() as above:
        loss = compiled(x)
        loss.backward()
    got = loss.detach(), w1.grad.clone(), w2.grad.clone()
    # The compiled code calls its GEMMs as extern kernels with out= buffers, in bf16; they reach aten in fp32.
    assert above.bf16() and all(op.endswith(".out") for op, _ in above.seen), above.seen
    assert len(below.seen) == len(above.seen) and not below.bf16(), below.bf16()[:5]
    w1.grad = w2.grad = None
    with gpt_kernels.Fp32Gemms():
        loss = mlp(x)
        loss.backward()
    for a, b in zip(got, (loss.detach(), w1.grad, w2.grad)):
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=1e-2)
