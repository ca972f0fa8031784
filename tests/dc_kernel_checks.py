"""DC attention's Triton kernels (gpt_kernels.dc_attention_launcher, speedrun::dc_attention) against its torch path
(train_gpt.dc_attention, itself checked against the dense formula in tests/test_dc_attention.py), run by
tests/test_kernels_dc.py in a process of its own under Triton's interpreter made to compute as sm90 does
(tests/interpreter_sm90.py). The spec's edge cases (a zero-length segment, a document longer than the window, query
and key blocks across document boundaries, trailing padding in cu_seqlens, T not a multiple of the blocks) in fp32,
fp16 and bf16: the output and every gradient within tolerances measured here, the backward's bits the same from run
to run, w2 = 0 giving base bit for bit, and the ops' registration (opcheck). Not collected on its own (no test_
prefix)."""

import importlib
import os

import pytest
import torch

pytest.importorskip("triton")
import interpreter_sm90  # noqa: E402

interpreter_sm90.install()  # before any kernel runs

import train_gpt as DC  # noqa: E402
from conftest import outputs_and_grads  # noqa: E402
from test_dc_attention import inputs  # noqa: E402
importlib.import_module("gpt_kernels")  # registers torch.ops.speedrun's DC attention ops

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_kernels_dc.py (it sets TRITON_INTERPRET=1)"

SCALE, WINDOW = 0.1275175238, 112  # the spec's YaRN scale and the recipe's window
NAMES = ("out", "base", "q", "k", "v", "w1", "w2")
# (T, cu_seqlens): the spec's case (a zero-length segment, a 37-token document, a 163-token one, trailing padding)
# and a T that no block divides, with boundaries inside 16-blocks and a document of one token
CASES = {"spec": (256, [0, 0, 37, 200, 256, 256]), "ragged": (300, [0, 21, 22, 170, 300])}
# Largest |kernel - torch path| over max |torch path| per output, measured at H = 6, D = 64 on the two cases: fp32
# <= 5.8e-7 (summation order only); fp16 <= 7.2e-4 and bf16 <= 5.8e-3 (dq and dk: the kernel rounds dS to the input
# dtype for its dots, where the torch path's autograd keeps it fp32; out, dv <= 5.4e-4: one rounding apart now and
# then). Bounds about 3x the measurements.
TOLERANCE = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def kernel(*tensors: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    return torch.ops.speedrun.dc_attention(*tensors, cu, SCALE, WINDOW)[0]


def torch_path(*tensors: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    return DC.dc_attention(*tensors, cu, SCALE, WINDOW)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_dc_kernels_follow_the_torch_path_forward_and_backward(case, dtype):
    T, cu = CASES[case]
    H, D = 6, 64
    tensors = inputs(T, H, D, dtype)
    grad = torch.randn(T, H, D, generator=torch.Generator().manual_seed(7)).to(dtype)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    got = outputs_and_grads(lambda *x: kernel(*x, cu=cu_t), tensors, grad)
    want = outputs_and_grads(lambda *x: torch_path(*x, cu=cu_t), tensors, grad)
    errors = {name: relative(a, b) for name, a, b in zip(NAMES, got, want)}
    print(case, dtype, {name: f"{e:.1e}" for name, e in errors.items()})
    assert all(a.dtype == dtype and a.shape == b.shape for a, b in zip(got, want))
    assert errors["base"] == 0  # the identity: the output's gradient itself
    assert all(e <= TOLERANCE[dtype] for e in errors.values()), errors
    assert all(g.abs().max() > 0 for g in got[1:])  # every gradient reached


def test_dc_backward_is_deterministic_and_w2_zero_returns_base_bit_for_bit():
    T, cu = CASES["spec"]
    cu_t = torch.tensor(cu, dtype=torch.int32)
    tensors = inputs(T, 6, 128, torch.bfloat16)  # the recipe's heads
    grad = torch.randn(T, 6, 128, generator=torch.Generator().manual_seed(7)).bfloat16()
    first, second = (outputs_and_grads(lambda *x: kernel(*x, cu=cu_t), tensors, grad) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    base, q, k, v, w1, _ = (x.detach() for x in tensors)
    out, lse = torch.ops.speedrun.dc_attention(base, q, k, v, w1, torch.zeros_like(w1), cu_t, SCALE, WINDOW)
    assert torch.equal(out, base) and lse.shape == (T, 6) and lse.dtype == torch.float32


def test_dc_ops_are_registered_for_torch_compile():
    # the schema, the fake kernels' shapes and strides, the autograd rule (a small case: opcheck runs it many times)
    T, cu = 40, torch.tensor([0, 13, 13, 40], dtype=torch.int32)
    tensors = inputs(T, 2, 16, torch.float32)
    torch.library.opcheck(torch.ops.speedrun.dc_attention, (*tensors, cu, SCALE, WINDOW))
    grad = torch.randn(T, 2, 16)
    _, lse = torch.ops.speedrun.dc_attention(*(x.detach() for x in tensors), cu, SCALE, WINDOW)
    torch.library.opcheck(torch.ops.speedrun.dc_attention_backward,
                          (grad, *(x.detach() for x in tensors[1:]), cu, lse, SCALE, WINDOW))


def test_dc_op_refuses_shapes_its_kernels_do_not_take():
    tensors = [x.detach() for x in inputs(32, 2, 24, torch.float32)]  # D = 24: not a power of two
    with pytest.raises(ValueError, match="power of two"):
        torch.ops.speedrun.dc_attention(*tensors, torch.tensor([0, 32], dtype=torch.int32), SCALE, WINDOW)
