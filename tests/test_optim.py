import pytest
import torch

import train_gpt as T


def normuon_reference(O: torch.Tensor, v: torch.Tensor, beta2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """NorMuon (#41) on a wide matrix: v <- beta2 v + (1 - beta2) mean over rows of O^2 (one per column), O / sqrt(v)
    rescaled to O's Frobenius norm."""
    v = beta2 * v + (1 - beta2) * (O**2).mean(dim=-2, keepdim=True)
    scaled = O / v.sqrt()
    return scaled * O.norm(dim=(-2, -1), keepdim=True) / scaled.norm(dim=(-2, -1), keepdim=True), v


def test_muon_step_equals_plain_reference():
    torch.manual_seed(0)
    p, buf = torch.randn(2, 16, 24), torch.randn(2, 16, 24)
    grads = [torch.randn(2, 16, 24) for _ in range(3)]
    ref_p, ref_buf, ref_v = p.clone(), buf.clone(), torch.zeros(2, 1, 24)
    state = {"momentum": buf, "v": torch.zeros(T.normuon_state_shape(p.shape))}
    lr, mom, beta2 = 0.05, 0.9, 0.95
    for g in grads:
        T.muon_update_(p, g.clone(), state, lr, mom, beta2)
        ref_buf = mom * ref_buf + (1 - mom) * g
        nesterov = (1 - mom) * g + mom * ref_buf
        update, ref_v = normuon_reference(T.polar_express(nesterov).float(), ref_v, beta2)
        ref_p = ref_p - lr * update  # rows < cols: scale factor 1
    torch.testing.assert_close(buf, ref_buf)
    torch.testing.assert_close(state["v"], ref_v)
    torch.testing.assert_close(p, ref_p, atol=8e-3 * lr, rtol=0)  # #70 rounds the update to bf16: a bf16 ulp at 2


def test_muon_scales_tall_matrices():
    p, g = torch.zeros(32, 8), torch.randn(32, 8)
    state = {"momentum": torch.zeros(32, 8), "v": torch.zeros(T.normuon_state_shape(p.shape))}
    T.muon_update_(p, g.clone(), state, 1.0, 0.0, 0.95)
    O = T.polar_express(g).float()
    scaled = O / (O**2).mean(dim=-1, keepdim=True).mul(0.05).sqrt()  # per row (tall), after one step of beta2 0.95
    # sqrt(32 / 8) = 2; #70 rounds the update to bf16
    torch.testing.assert_close(p, -2.0 * scaled * O.norm() / scaled.norm(), rtol=1e-2, atol=1e-3)


def test_adam_step_equals_torch_adam():
    torch.manual_seed(0)
    p = torch.randn(40, 8)
    ref = torch.nn.Parameter(p.clone())
    reference = torch.optim.Adam([ref], lr=0.01, betas=(0.8, 0.95), eps=1e-10)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step in range(1, 6):
        g = torch.randn(40, 8)
        T.adam_update_(p, g, m, v, step, 0.01, 0.8, 0.95, 1e-10)
        ref.grad = g.clone()
        reference.step()
    torch.testing.assert_close(p, ref.detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("shape, lr_mul", [((3, 16, 40), 1.0), ((2, 40, 16), torch.tensor([1.0, 2.0]).view(2, 1, 1))],
                         ids=["wide", "tall-per-matrix"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_bf16_bank_with_its_mantissa_updates_as_its_fp32_master_bit_for_bit(shape, lr_mul, compiled):
    # #89's storage (bf16 parameter + the master's low 16 bits) against an fp32 master, from the same value and the
    # same bf16 gradients: every bit of the master, of the momentum and of NorMuon's state, over four steps, the
    # state cloned in between as a checkpoint's (a resume). Negative values, tiny ones and zeros cover the split.
    steps = T.update_steps(compiled=compiled, kernels=False)
    g = torch.Generator().manual_seed(3)
    master = torch.randn(shape, generator=g) * torch.logspace(-6, 0, shape[-1])
    master[0, 0, :3] = torch.tensor([0.0, -0.0, 1e-30])
    p32 = master.clone()
    p16, mantissa = torch.empty(shape, dtype=torch.bfloat16), torch.empty(shape, dtype=torch.int16)
    T.split_master_(p16, mantissa, master)
    assert torch.equal(T.master_of(p16, mantissa).view(torch.int32), master.view(torch.int32))
    ref, state = T.muon_state(p32), {**T.muon_state(p16), "mantissa": mantissa}
    assert "mantissa" not in ref
    for k in range(4):
        grad = torch.randn(shape, generator=g).bfloat16()
        T.muon_update_(p32, grad, ref, 0.02 * (k + 1), 0.9, 0.9, lr_mul, 1.2, steps)
        T.muon_update_(p16, grad, state, 0.02 * (k + 1), 0.9, 0.9, lr_mul, 1.2, steps)
        assert torch.equal(T.master_of(p16, state["mantissa"]).view(torch.int32), p32.view(torch.int32)), k
        assert torch.equal(p16, p32.view(torch.int32).bitwise_and(-65536).view(torch.float32).bfloat16())
        assert all(torch.equal(ref[key], state[key]) for key in ref)
        state = {key: t.clone() for key, t in state.items()}  # a checkpoint's copy, resumed from
