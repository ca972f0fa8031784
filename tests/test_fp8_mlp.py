"""Record #89's FP8 MLP (gpt_kernels.mlp_fp8) and its weight quantizer (gpt_kernels.quantize_mlp_weights_) against
the spec's formulas (record89_spec.md 4.8, 7.2) written out here in plain torch, and against the independent
reference89_optim.py (with record #89's snapshot). Exact where the math is exact (selection weights make every dot
product one term, so each rounding the spec names is visible on its own); elsewhere within the fp32 accumulation a
CPU GEMM adds (the bf16 roundings can then flip, by one bf16 step, where a value lies that close to a rounding
boundary).
CPU only: torch._scaled_mm runs there, no Triton."""
import pytest
import torch

import gpt_kernels as K
import reference89_optim as R

E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
M, D, HIDDEN = 48, 64, 256  # rows (tokens), model_dim, 4 x model_dim


def scalar(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def activations(seed: int = 0, rows: int = M) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D, generator=g)
    return (x / x.square().mean(-1, keepdim=True).sqrt()).to(BF16)  # norm(x): the MLP's input


def bank(seed: int = 1, layers: int = 3, std: float = 0.02) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (std * torch.randn(layers, 2, HIDDEN, D, generator=g)).to(BF16)


def quantized(weights: torch.Tensor, bootstrap: bool = True) -> dict[str, torch.Tensor]:
    layers = weights.size(0)
    state = dict(w8_fc=torch.zeros(layers, HIDDEN, D, dtype=E4M3), up_scales=torch.zeros(layers),
                 w8_proj_t=torch.zeros(layers, D, HIDDEN, dtype=E4M3), used_scales=torch.zeros(layers),
                 next_scales=torch.zeros(layers))
    K.quantize_mlp_weights_(weights, *state.values(), bootstrap=bootstrap)
    return state


def codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def bf16_scale(amax: torch.Tensor) -> torch.Tensor:
    """The spec's current scale: bf16(bf16(max|W|) clamped >= 1e-12 / 448), as fp32."""
    return (amax.to(BF16).clamp(min=1e-12) / 448).float()


# ---- the quantizer (4.8.1) ------------------------------------------------------------------------------------

def test_the_quantizer_rounds_up_weights_to_bf16_before_e4m3_and_down_weights_once_from_fp32():
    weights = bank()
    weights[1, 0, 3, 5] = 0.5  # layer 1's W_fc amax, a scale of bf16(0.5 / 448) whose quotients double-round
    q = quantized(weights)
    for layer in range(3):
        w_fc, w_proj = weights[layer, 0], weights[layer, 1]
        s_up = bf16_scale(w_fc.abs().max())
        assert q["up_scales"][layer] == s_up
        want = (w_fc / s_up.to(BF16)).to(E4M3)  # bf16 quotient, then e4m3 (spec open question 7)
        assert torch.equal(codes(q["w8_fc"][layer]), codes(want))
        s_down = bf16_scale(w_proj.abs().max())
        assert q["used_scales"][layer] == s_down  # bootstrap: the current amax, no headroom
        want = (w_proj.double() / s_down.double()).float().clamp(-448, 448).to(E4M3)  # one rounding, from fp32
        assert torch.equal(codes(q["w8_proj_t"][layer]), codes(want.T))
        assert q["next_scales"][layer] == w_proj.abs().max().float() * scalar(1.12 / 448)
    # the double rounding is visible: a single rounding of the fp32 quotient gives other codes somewhere
    single = (weights[:, 0].float() / q["up_scales"][:, None, None]).to(E4M3)
    assert (codes(single) != codes(q["w8_fc"])).sum() > 0


def test_the_quantizer_matches_the_independent_reference():
    weights = bank(seed=5)
    q = quantized(weights)
    nxt = q["next_scales"].clone()
    weights[:, 1] *= 1.05  # a second, delayed call
    K.quantize_mlp_weights_(weights, *q.values(), bootstrap=False)
    first = bank(seed=5)
    for layer in range(3):
        w8, s_up = R.mlp_up_quant89(weights[layer, 0])
        assert torch.equal(codes(q["w8_fc"][layer]), codes(w8)) and q["up_scales"][layer] == s_up
        _, _, next0 = R.mlp_down_quant89(first[layer, 1], None, bootstrap=True)
        assert nxt[layer] == next0
        w8, used, next1 = R.mlp_down_quant89(weights[layer, 1], next0, bootstrap=False)
        assert torch.equal(codes(q["w8_proj_t"][layer]), codes(w8.T))
        assert q["used_scales"][layer] == used == next0 and q["next_scales"][layer] == next1


def test_the_quantizer_at_init_gives_zero_codes_and_the_smallest_scale():
    weights = bank()
    weights[:, 1] = 0  # #89's W_proj at init
    q = quantized(weights)
    assert not codes(q["w8_proj_t"]).any()
    assert torch.equal(q["used_scales"], bf16_scale(torch.zeros(3)))
    assert abs(q["used_scales"][0].item() - 2.234e-15) < 1e-18
    assert torch.equal(q["next_scales"], torch.full((3,), 1e-12) * scalar(1.12 / 448))


def test_the_quantizer_bootstraps_then_delays_and_saturates_a_weight_grown_past_its_headroom():
    weights = bank()
    amax0 = weights[:, 1].flatten(1).abs().amax(1).float()
    q = quantized(weights)  # call 1, bootstrap: used = the current scale
    assert torch.equal(q["used_scales"], bf16_scale(amax0))
    weights[:, 1] *= 1.1  # call 2, delayed: quantized with 1.12 x the previous amax / 448, so 10% growth fits
    K.quantize_mlp_weights_(weights, *q.values(), bootstrap=False)
    assert torch.equal(q["used_scales"], amax0 * scalar(1.12 / 448))
    assert (weights[:, 1].float() / q["used_scales"][:, None, None]).abs().max() < 448  # nothing clipped
    amax1 = weights[:, 1].flatten(1).abs().amax(1).float()
    grown = weights[:, 1].abs() == amax1[:, None, None]
    weights[:, 1] = torch.where(grown, weights[:, 1] * 1.2, weights[:, 1])  # call 3: the largest weights +20%
    K.quantize_mlp_weights_(weights, *q.values(), bootstrap=False)
    assert torch.equal(q["used_scales"], amax1 * scalar(1.12 / 448))
    quotients = weights[:, 1].float()[grown] / q["used_scales"][:, None, None].expand_as(grown)[grown]
    top = q["w8_proj_t"].transpose(1, 2)[grown].float()
    assert (quotients.abs() > 479).all() and top.numel() >= 3  # 1.2 / 1.12 x 448: past e4m3's largest
    assert torch.equal(top, 448 * quotients.sign())  # clamped to +-448 (not NaN, nor rounded to 480's neighbour)
    assert torch.equal(q["next_scales"], weights[:, 1].flatten(1).abs().amax(1).float() * scalar(1.12 / 448))


# ---- the forward (4.8.2-4.8.3) --------------------------------------------------------------------------------

def selection_weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes with one non-zero per dot product: hidden unit h reads input column h % D times a code c_h; output
    column j reads hidden unit j with code 1. Every accumulation is then exact, whatever the GEMM's order."""
    g = torch.Generator().manual_seed(3)
    signs = torch.where(torch.rand(HIDDEN, generator=g) < 0.5, -1.0, 1.0)
    c = signs * torch.tensor([1.0, 1.125, 1.5, 1.875, 0.75, 2.0, 3.5, 0.3125])[torch.arange(HIDDEN) % 8]
    w8_fc = torch.zeros(HIDDEN, D)
    w8_fc[torch.arange(HIDDEN), torch.arange(HIDDEN) % D] = c
    w8_proj_t = torch.zeros(D, HIDDEN)
    w8_proj_t[torch.arange(D), torch.arange(D)] = 1.0
    return w8_fc.to(E4M3), w8_proj_t.to(E4M3), c


def run(*args):
    """(out, post_amax, post): mlp_fp8's outputs on the torch path and the activation its backward keeps (post alone:
    upstream's #87 never keeps pre)."""
    out, amax, post = torch.ops.speedrun.mlp_fp8_forward(*args, False)
    public = torch.ops.speedrun.mlp_fp8(*args, False)
    assert len(public) == 2 and torch.equal(public[0], out) and torch.equal(public[1], amax)
    return out, amax, post


def test_every_rounding_of_the_forward_is_the_specs_on_single_term_products():
    x = activations()
    w8_fc, w8_proj_t, c = selection_weights()
    s_up, s_act = scalar(0.3), scalar(2.0 ** -6)  # s_act a power of two: out / s_act shows post8 exactly
    weights = bank(layers=1)[0]
    out, amax, post = run(x, weights[0], weights[1], w8_fc, s_up, w8_proj_t, scalar(1.0), s_act)
    a = x.abs().max().float()
    x8 = (x.float() * (448 / a)).to(E4M3)  # current scale, fp32 product, one rounding
    dq = s_up * a / 448  # fp32: s_up times the amax, then over 448
    want_pre = (x8.float()[:, torch.arange(HIDDEN) % D] * c * dq).to(BF16)  # the one product, times dq, to bf16
    want_post = want_pre.float().relu().square().to(BF16)  # post from the spec's pre: every rounding shows in it
    assert torch.equal(post, want_post) and amax == want_post.float().max() and amax.dtype == torch.float32
    post8 = (want_post.float() * (1 / s_act)).clamp(max=448).to(E4M3)
    assert torch.equal(out, (post8.float()[:, :D] * s_act).to(BF16))
    assert (post8.float() == 448).any() and (post8.float() == 0).any()  # saturated at 448, and the ReLU's zeros
    assert (post8.float()[(post8.float() > 0) & (post8.float() < 2 ** -6)]).numel() > 0  # subnormal codes too


def test_the_forward_with_quantized_weights_follows_the_spec_within_fp32_accumulation():
    x, weights = activations(), bank()[1]
    q = quantized(bank())
    s_act = scalar(0.37)
    args = (q["w8_fc"][1], q["up_scales"][1], q["w8_proj_t"][1], q["used_scales"][1], s_act)
    out, amax, post = run(x, weights[0], weights[1], *args)
    a = x.abs().max().double()
    x8 = (x.float() * (448 / a.float())).to(E4M3)
    dq = (q["up_scales"][1] * a.float() / 448).double()
    exact_post = (dq * (x8.double() @ q["w8_fc"][1].double().T)).relu().square()
    # pre within one bf16 step (2^-7 relative) of the exact product, so its square within two, and post's rounding
    # half a step more; and post is the nearest pre's square, rounded, almost always
    assert ((post.double() - exact_post).abs() <= 2.5 * torch.finfo(BF16).eps * exact_post).all()
    nearest = (dq * (x8.double() @ q["w8_fc"][1].double().T)).to(BF16).float().relu().square().to(BF16)
    assert (post == nearest).float().mean() > 0.99
    post8 = (post.float() * (1 / s_act)).clamp(max=448).to(E4M3)
    exact_out = s_act.double() * q["used_scales"][1].double() * (post8.double() @ q["w8_proj_t"][1].double().T)
    err = (out.double() - exact_out).abs()
    assert (err <= torch.finfo(BF16).eps * exact_out.abs() + 1e-6 * exact_out.abs().max()).all()
    # and FP8 as a whole: within e4m3's error of the bf16 MLP, and visibly not bf16
    bf16 = torch.relu(x @ weights[0].T).square() @ weights[1]
    rel = ((out.float() - bf16.float()).norm() / bf16.float().norm()).item()
    assert 0.005 < rel < 0.1, rel


def test_the_forward_matches_the_independent_reference():
    x, weights = activations(seed=4), bank(seed=4)
    q = quantized(weights)
    for layer, s_act in ((0, 1.0), (2, 1e-4)):  # step 0's scale 1, and a delayed one that saturates
        args = (q["w8_fc"][layer], q["up_scales"][layer], q["w8_proj_t"][layer], q["used_scales"][layer])
        out, amax, post = run(x, weights[layer, 0], weights[layer, 1], *args, scalar(s_act))
        assert (post.float() / s_act > 448).any() == (s_act < 1)
        r_pre, r_post, r_out, r_amax = R.mlp_fp8_forward89(x, args[0], args[1], args[2].T, args[3], s_act)
        step = torch.finfo(BF16).eps * r_out.double().abs()
        assert ((out.double() - r_out.double()).abs() <= step + 1e-6 * r_out.double().abs().max()).all()
        # pre is the reference's nearly everywhere, else a bf16 step off: post the same or within 2.5 steps
        assert (post == r_post).float().mean() > 0.99 and amax == post.float().max()
        assert ((post.double() - r_post.double()).abs() <= 2.5 * torch.finfo(BF16).eps * r_post.double()).all()
        assert abs(amax.item() - r_amax) <= torch.finfo(BF16).eps * r_amax


# ---- the backward (4.8.4) -------------------------------------------------------------------------------------

def test_the_backward_is_the_bf16_mlps_from_the_saved_activations():
    x, weights = activations(seed=6), bank(seed=6)
    q = quantized(weights)
    w_fc, w_proj = weights[0, 0].clone().requires_grad_(), weights[0, 1].clone().requires_grad_()
    xs = x.clone().requires_grad_()
    out, amax, post = run(xs, w_fc, w_proj, q["w8_fc"][0], q["up_scales"][0], q["w8_proj_t"][0], q["used_scales"][0],
                          scalar(0.5))
    g = torch.randn(M, D, generator=torch.Generator().manual_seed(7)).to(BF16)
    out.backward(g)
    assert xs.grad.dtype == w_fc.grad.dtype == w_proj.grad.dtype == BF16
    # the spec's formulas in float64, rounded to bf16 where upstream rounds (each GEMM's output, dpre's product):
    # relu(pre) as sqrt(post) (#87, spec 2.9)
    h = (g.double() @ w_proj.detach().double().T).to(BF16)
    d_pre = (2 * h.double() * post.double().sqrt()).to(BF16)
    want = ((d_pre.double() @ w_fc.detach().double()), (d_pre.double().T @ x.double()), (post.double().T @ g.double()))
    for got, exact in zip((xs.grad, w_fc.grad, w_proj.grad), want):
        err = (got.double() - exact).abs()
        assert (err <= 2 * torch.finfo(BF16).eps * exact.abs() + 1e-3 * exact.abs().max()).all()
    # #89's backward from its own pre (relu(pre), not sqrt(post)): an eighth of dpre a bf16 step apart, measured
    # 2.9e-3 relative at most (grad_x; grad_w_proj = post^T g equal); bound 1e-2
    r_pre = R.mlp_fp8_forward89(x, q["w8_fc"][0], q["up_scales"][0], q["w8_proj_t"][0].T, q["used_scales"][0], 0.5)[0]
    for got, ref in zip((xs.grad, w_fc.grad, w_proj.grad), R.mlp_backward89(x, w_fc, w_proj, r_pre, post, g)):
        assert ((got.double() - ref.double()).norm() / ref.double().norm()) < 1e-2


def test_no_gradient_reaches_the_codes_the_scales_or_the_extra_outputs():
    x, weights = activations(), bank()
    q = quantized(weights)
    up = q["up_scales"][0].clone().requires_grad_()
    args = (x.requires_grad_(), weights[0, 0], weights[0, 1], q["w8_fc"][0], up, q["w8_proj_t"][0],
            q["used_scales"][0], scalar(1.0), False)
    for outs in (torch.ops.speedrun.mlp_fp8_forward(*args), torch.ops.speedrun.mlp_fp8(*args)):
        assert outs[0].requires_grad and not any(t.requires_grad for t in outs[1:])
    outs[0].float().sum().backward()
    assert up.grad is None and x.grad is not None


# ---- registration and compile ---------------------------------------------------------------------------------

def test_the_mlp_op_passes_opcheck(monkeypatch):
    # SchemaCheckMode compares each input before and after with torch.allclose, which has no fp8 kernel on the CPU;
    # here fp8 tensors are compared by their bytes, everything else as opcheck does.
    allclose = torch.allclose
    monkeypatch.setattr(torch, "allclose", lambda a, b, **kw: (torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                                                               if a.dtype in (E4M3, E5M2) else allclose(a, b, **kw)))
    x, weights = activations(), bank()
    q = quantized(weights)
    args = (x.requires_grad_(), weights[0, 0].clone().requires_grad_(), weights[0, 1].clone().requires_grad_(),
            q["w8_fc"][0], q["up_scales"][0], q["w8_proj_t"][0], q["used_scales"][0], scalar(0.25), False)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")  # the bodies are compiled: no AOT check
    for op in (torch.ops.speedrun.mlp_fp8.default, torch.ops.speedrun.mlp_fp8_forward.default):
        torch.library.opcheck(op, args, test_utils=utils)
    grads = (torch.randn(M, D).to(BF16), x.detach(), *args[1:3], *torch.ops.speedrun.mlp_fp8_forward(*args)[2:])
    torch.library.opcheck(torch.ops.speedrun.mlp_backward.default, (*(t.detach() for t in grads), False),
                          test_utils=utils)


def test_the_mlp_op_compiled_in_one_graph_equals_eager():
    x, weights = activations(), bank()
    q = quantized(weights)
    codes_ = (q["w8_fc"][0], q["up_scales"][0], q["w8_proj_t"][0], q["used_scales"][0], scalar(0.25), False)

    def fn(x, w_fc, w_proj):
        return torch.ops.speedrun.mlp_fp8(x, w_fc, w_proj, *codes_)

    g = torch.randn(M, D, generator=torch.Generator().manual_seed(8)).to(BF16)
    results = []
    for step in (fn, torch.compile(fn, fullgraph=True, dynamic=False)):
        leaves = [t.clone().requires_grad_() for t in (x, weights[0, 0], weights[0, 1])]
        out, amax = step(*leaves)
        out.backward(g)
        results.append((out, amax, *(t.grad for t in leaves)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [(M, D), (M + 16, D)])
def test_the_mlp_ops_bodies_serve_several_row_counts(shape):
    # the compiled bodies are dynamic in the rows (a run's staged lengths share a graph)
    x = activations(rows=shape[0])
    weights = bank()
    q = quantized(weights)
    out, amax, post = run(x, weights[0, 0], weights[0, 1], q["w8_fc"][0], q["up_scales"][0], q["w8_proj_t"][0],
                          q["used_scales"][0], scalar(1.0))
    assert out.shape == shape and post.shape == (shape[0], HIDDEN) and amax.shape == (1,)
