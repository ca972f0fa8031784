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
