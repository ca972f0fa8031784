"""Triton 3.6's interpreter made to compute what sm90 computes, for the kernel checks (tests/kernel_checks.py).

Two of its shortcuts would make an interpreted kernel disagree with the same kernel on an H100:
- tl.dot of bf16 operands multiplies their uint16 storage, the bits, not the values (fp8 operands it converts);
- float down-casts (fp32 -> bf16, fp16, e4m3, e5m2) cut the mantissa (truncation, and a round-half-up that can
  overflow into the exponent), where sm90's cvt.rn rounds to nearest even, and to e4m3/e5m2 with satfinite
  (tests/test_sm90_kernels.py checks that the compiled kernels use those instructions).
A third is numpy's: a loop bound that is a runtime value (a persistent kernel's program id, a tile count from a
size argument) reaches range() as a one-element array, which numpy 2.4 no longer converts to an int.
install() replaces the first two with torch's conversions, which round to nearest even: a bf16 or fp8 dot takes the
exact fp32 values of its operands (their products are exact in fp32) and accumulates in fp32, in numpy's order, not
the tensor cores'; every float-to-float cast rounds as the GPU's does; and it reads a loop bound's one element.
Import it before any kernel runs.
"""

from __future__ import annotations

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter

# The interpreter's storage of each float type (numpy has no bf16 or fp8: their bits, as unsigned ints) and torch's
# type of the same format.
TORCH_DTYPES = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
                tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2, tl.float64: torch.float64}
STORAGE = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16,
           torch.float8_e4m3fn: np.uint8, torch.float8_e5m2: np.uint8, torch.float64: np.float64}
VIEWS = {np.uint16: torch.int16, np.uint8: torch.uint8}  # torch views the bits of a numpy uint16 as int16


def to_torch(data: np.ndarray, dtype: tl.dtype) -> torch.Tensor:
    """The values the interpreter's storage of `dtype` holds, as a torch tensor of that dtype."""
    t = torch.from_numpy(np.ascontiguousarray(data))
    wanted = TORCH_DTYPES[dtype]
    return t.view(VIEWS[data.dtype.type]).view(wanted) if data.dtype.type in VIEWS else t.to(wanted)


def to_storage(t: torch.Tensor) -> np.ndarray:
    storage = STORAGE[t.dtype]
    return (t.view(VIEWS[storage]) if storage in VIEWS else t).numpy().view(storage)


def convert(data: np.ndarray, src: tl.dtype, dst: tl.dtype) -> np.ndarray:
    """src -> dst as sm90's cvt.rn rounds: to nearest even; into fp8 saturating at its largest finite (NaN stays).
    bf16 <-> fp32 and fp16 -> fp32 in numpy, on the bits, as torch rounds them (a NaN stays a NaN): a wide block's
    loads and their `other` fill, whose torch round trips were most of an interpreted cross-entropy's time."""
    if dst == tl.float32 and src == tl.bfloat16:
        return (data.astype(np.uint32) << 16).view(np.float32)
    if dst == tl.float32 and src == tl.float16:
        return data.astype(np.float32)
    if dst == tl.bfloat16 and src == tl.float32:
        bits = data.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return np.where(np.isnan(data), np.uint16(0x7FC0), rounded)
    values = to_torch(data, src).to(torch.float32 if src != tl.float64 else torch.float64)
    wanted = TORCH_DTYPES[dst]
    if wanted in (torch.float8_e4m3fn, torch.float8_e5m2):
        limit = torch.finfo(wanted).max
        values = torch.where(values.isnan(), values, values.clamp(-limit, limit))
    return to_storage(values.to(wanted))


def _is_float(dtype: tl.dtype) -> bool:
    return dtype in TORCH_DTYPES


def install() -> None:
    """Patch the interpreter's builder (this process, once)."""
    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_sm90_semantics", False):
        return
    cast_impl, fp_to_fp, dot = builder.cast_impl, builder.create_fp_to_fp, builder.create_dot

    def cast(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if _is_float(s) and _is_float(d):
            return interpreter.TensorHandle(convert(src.data, s, d), d)
        return cast_impl(self, src, dst_type)

    def cast_fp(self, src, dst_type, rounding_mode):
        s, d = src.dtype.scalar, dst_type.scalar
        if _is_float(s) and _is_float(d) and rounding_mode in (None, interpreter._ir.ROUNDING_MODE.RTNE):
            return interpreter.TensorHandle(convert(src.data, s, d), d)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    def widened(x):
        s = x.dtype.scalar
        if s in (tl.bfloat16, tl.float8e4nv, tl.float8e5):
            return interpreter.TensorHandle(convert(x.data, s, tl.float32), tl.float32)
        return x

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    patch_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):  # after the interpreter's own patches, restored with them
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch_lang_tensor
    for name in ("create_fp_ext", "create_fp_trunc"):
        setattr(builder, name, cast)
    builder.cast_impl = cast
    builder.create_fp_to_fp = cast_fp
    builder.create_dot = create_dot
    builder._sm90_semantics = True
