"""Triton kernels against the torch path they replace, run by tests/test_kernels.py in a process of their own
under Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is first imported, which importing
torch.compile'd code does): values and gradients at sizes that do not divide the blocks (masked tails),
negative pre-activations (the ReLU's zero side), and the op's registration (opcheck). Triton 3.6's
interpreter misreads bf16 loads with numpy 2.4, so it runs fp32 and fp16 here; bf16 (the trainer's dtype) is
for the GPU check. Not collected on its own (no test_ prefix)."""
import os

import pytest
import torch

import train_gpt as T

pytest.importorskip("triton")


assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_kernels.py (it sets TRITON_INTERPRET=1)"


def operands(dtype: torch.dtype, m: int = 100, k: int = 72, n: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(m, k, generator=g).to(dtype), (0.1 * torch.randn(k, n, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_relu2_kernel_equals_relu_squared_of_the_product_with_masked_tails(dtype, tol):
    x, w = operands(dtype)  # 100 x 72 @ 72 x 200: no dimension a multiple of the 64/128/32 blocks
    got = torch.ops.speedrun.relu2_mm(x, w)
    pre = x.float() @ w.float()
    want = torch.relu(pre).square()
    assert got.dtype == dtype and got.shape == want.shape
    assert (pre < 0).float().mean() > 0.3 and not got[pre < -1e-3].any()  # the zero side is exactly zero
    assert (got.float() - want).abs().max() <= tol * want.abs().max()


def test_relu2_kernel_gradients_equal_the_torch_path():
    x, w = operands(torch.float32)
    g = torch.randn(100, 200, generator=torch.Generator().manual_seed(1))
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    (torch.ops.speedrun.relu2_mm(xs, ws) * g).sum().backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (torch.relu(xr @ wr).square() * g).sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ws.grad, wr.grad, rtol=1e-4, atol=1e-5)


def test_relu2_op_passes_opcheck():
    x, w = operands(torch.float32, m=48, k=32, n=64)
    torch.library.opcheck(torch.ops.speedrun.relu2_mm.default, (x.requires_grad_(), w.requires_grad_()),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_mlp_with_the_kernel_equals_the_torch_mlp():
    cfg = T.parse_config(["--preset=tiny", "--model_dim=64", "--head_dim=32"])
    torch.manual_seed(0)
    plain = T.MLP(cfg)
    fused = T.MLP(T.parse_config(["--preset=tiny", "--model_dim=64", "--head_dim=32", "--relu2_kernel=true"]))
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(1, 50, 64)
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-4, atol=1e-6)


def test_the_kernel_flag_is_refused_without_a_gpu_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(T.UsageError, match="--relu2_kernel runs a Triton kernel"):
        T.resolve_for_device(T.parse_config(["--preset=tiny", "--relu2_kernel=true"]), cuda=False)
