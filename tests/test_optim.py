import math

import pytest
import torch

import train_gpt as T


def test_muon_step_equals_plain_reference():
    torch.manual_seed(0)
    p, buf = torch.randn(2, 16, 24), torch.randn(2, 16, 24)
    grads = [torch.randn(2, 16, 24) for _ in range(3)]
    ref_p, ref_buf = p.clone(), buf.clone()
    lr, mom = 0.05, 0.9
    for g in grads:
        T.muon_update_(p, g.clone(), {"momentum": buf}, lr, mom)
        ref_buf = mom * ref_buf + (1 - mom) * g
        nesterov = (1 - mom) * g + mom * ref_buf
        ref_p = ref_p - lr * T.newton_schulz(nesterov).float()  # rows < cols: scale factor 1
    torch.testing.assert_close(buf, ref_buf)
    torch.testing.assert_close(p, ref_p, atol=1e-5, rtol=1e-5)


def test_muon_scales_tall_matrices():
    p, buf = torch.zeros(32, 8), torch.zeros(32, 8)
    g = torch.randn(32, 8)
    T.muon_update_(p, g.clone(), {"momentum": buf}, lr=1.0, momentum=0.0)
    torch.testing.assert_close(p, -2.0 * T.newton_schulz(g).float())  # sqrt(32 / 8) = 2


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
