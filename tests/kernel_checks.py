"""Triton kernels against the torch path they replace, run by tests/test_kernels.py in a process of their own
under Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is first imported, which importing
torch.compile'd code does): values and gradients at sizes that do not divide the blocks (masked tails),
negative pre-activations (the ReLU's zero side), saturated softcaps, #89's cross-entropy numerics (the bf16
sigmoid, the tail quirk, the e5m2 codes, against tests/reference89_optim.py too), Polar Express's symmetric GEMMs
and the tiled transpose, and the ops' registration. The interpreter computes as sm90 does (tests/interpreter_sm90.py:
bf16 dots on values, casts rounded to nearest even), so the GEMMs run in bf16 here too. Not collected on its own
(no test_ prefix)."""
import functools
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
import interpreter_sm90  # noqa: E402

interpreter_sm90.install()  # before any kernel runs

import gpt_kernels as K  # noqa: E402
import reference89_optim as R  # noqa: E402
import train_gpt as T  # noqa: E402

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_kernels.py (it sets TRITON_INTERPRET=1)"


def operands(dtype: torch.dtype, m: int = 100, k: int = 72, n: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(m, k, generator=g).to(dtype), (0.1 * torch.randn(k, n, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 4e-3)])
def test_relu2_kernel_equals_relu_squared_of_the_product_with_masked_tails(dtype, tol):
    # bf16: the fp32 result rounded once, half an ulp (2^-8 relative at most; 2.0e-3 of the largest measured)
    x, w = operands(dtype)  # 100 x 72 @ 72 x 200: no dimension a multiple of the 64/128/32 blocks
    got = torch.ops.speedrun.relu2_mm(x, w)
    pre = x.float() @ w.float()
    want = torch.relu(pre).square()
    assert got.dtype == dtype and got.shape == want.shape
    assert (pre < 0).float().mean() > 0.3 and not got[pre < -1e-3].any()  # the zero side is exactly zero
    assert (got.float() - want).abs().max() <= tol * want.abs().max()


@pytest.mark.parametrize("config", K.RELU2_CONFIGS, ids=lambda c: "x".join(map(str, c[:3])) + f"w{c[3]}s{c[4]}")
def test_every_autotuning_tile_of_the_relu2_kernel_computes_the_same_product(config):
    x, w = operands(torch.float32)  # masked tails in every tile: 100 x 72 @ 72 x 200
    out = torch.empty(100, 200)
    K.relu2_launcher()(x, w, out, config)
    torch.testing.assert_close(out, torch.relu(x @ w).square(), rtol=1e-5, atol=1e-6)


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
    # GPT.mlp outside training's FP8 (validation; a run without the FP8 MLP): --relu2_kernel against the torch path
    args = ["--preset=tiny", "--model_dim=64", "--head_dim=32", "--fp8_mlp=false"]
    models = [T.GPT(T.parse_config([*args, f"--relu2_kernel={flag}"]), use_flex=False, fp8_head=False).eval()
              for flag in ("false", "true")]
    g = torch.Generator().manual_seed(0)
    w_fc, w_proj = (0.1 * torch.randn(256, 64, generator=g) for _ in range(2))
    x = torch.randn(1, 50, 64, generator=g)
    plain, fused = (model.mlp(x, 0, w_fc, w_proj, []) for model in models)
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("flag", ["relu2_kernel", "fused_head"])
def test_a_kernel_flag_is_refused_without_a_gpu_or_the_interpreter(monkeypatch, flag):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(T.UsageError, match=f"--{flag} runs a Triton kernel"):
        T.resolve_for_device(T.parse_config(["--preset=tiny", f"--{flag}=true"]), cuda=False)


def softcap89(logits: torch.Tensor, cap: float, shift: float, temp: float, training: bool = True) -> torch.Tensor:
    """#89's softcap u of the logits, float64 (spec 4.10, 7.3): in training u = cap * bf16(s) with s the sigmoid of
    (z / temp + shift / temp) in fp32; in validation u = cap * s rounded to the logits' dtype (#89's bf16)."""
    inv = 1 / torch.tensor(temp, dtype=torch.float32)  # the kernel's: z / temp as z times 1 / temp, all fp32
    s = torch.sigmoid(logits.float() * inv + shift * inv)
    return cap * s.bfloat16().double() if training else (cap * s).to(logits.dtype).double()


def softcap_ce_reference(logits, targets, weights, cap, shift, temp, training: bool = True, quirk: bool = True):
    """(per-row losses, dloss/dlogits) in float64 from #89's u: loss_t = sum_k w_k (lse_t - u[t, y_(t+k)]) over t + k
    < T; the gradient (S_w softmax(u) - sum_k w_k onehot(y_(t+k))) (cap / temp) s (1 - s), S_w the sum of all K
    weights for every row (#89's tail quirk; quirk=False: the valid k's alone, the loss's true derivative)."""
    u = softcap89(logits, cap, shift, temp, training)
    n, lse = targets.numel(), torch.logsumexp(u, dim=-1)
    losses, picked, s_w = torch.zeros(n, dtype=torch.float64), torch.zeros_like(u), torch.zeros(n, dtype=torch.float64)
    for k, wk in enumerate(weights):
        rows = torch.arange(n - k)
        losses[rows] += wk * (lse[rows] - u[rows, targets[k:]])
        picked[rows, targets[k:]] += wk
        s_w[rows] += wk
    if quirk:
        s_w[:] = sum(weights)
    s = u / cap
    return losses, (s_w[:, None] * torch.softmax(u, dim=-1) - picked) * (cap / temp) * s * (1 - s)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def ce_operands(m: int, d: int = 24, vocab: int = 300, spread: float = 1.0):
    g = torch.Generator().manual_seed(2)
    x = T.norm(torch.randn(m, d, generator=g))
    w = spread * torch.randn(vocab, d, generator=g) / d**0.5
    return x, w, torch.randint(0, vocab, (m,), generator=g)


def near_a_rounding_boundary(v: torch.Tensor, dtype: torch.dtype, eps: float) -> torch.Tensor:
    """Where v (float64) lies within a relative eps of a tie between two neighbouring values of dtype."""
    lo, hi = (v * (1 - eps)).float().to(dtype), (v * (1 + eps)).float().to(dtype)
    return lo.view(torch.uint8 if dtype.itemsize == 1 else torch.int16) != hi.view(
        torch.uint8 if dtype.itemsize == 1 else torch.int16)


@pytest.mark.parametrize("weights, cap, shift, spread", [
    ([1.0], 30.0, 0.0, 1.0),  # #28's softcap
    ([1.0, 0.5, 0.25], 23.0, 5.0, 1.0),  # #89's: the rescale and three next tokens
    ([1.0, 0.5], 23.0, 5.0, 400.0),  # |z| in the hundreds: the sigmoid saturates at 0 and at cap
])
def test_softcap_ce_kernel_equals_89s_loss_and_gradients_across_chunks(monkeypatch, weights, cap, shift, spread):
    # 100 rows in chunks of 32 (the last of 4), a vocabulary of 300 in blocks of 1024 / 128: every tail masked. The
    # logits fp32 (the bf16 head with fp32 activations): the gradient's own rounding is fp32's.
    monkeypatch.setattr(K, "HEAD_CHUNK_ROWS", 32)
    x, w, targets = ce_operands(100, spread=spread)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss, _, _ = torch.ops.speedrun.softcap_ce(xs, ws, targets, torch.tensor(weights), cap, shift, 7.5, [])
    (3.0 * loss).backward()  # a loss scale reaches the gradients as it would through autograd
    losses, d_logits = softcap_ce_reference(x @ w.T, targets, weights, cap, shift, 7.5)
    assert torch.isfinite(loss) and torch.isfinite(xs.grad).all()
    torch.testing.assert_close(loss.double(), losses.sum(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(xs.grad.double(), 3 * d_logits @ w.double(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ws.grad.double(), 3 * d_logits.T @ x.double(), rtol=1e-4, atol=1e-5)
    # the sigmoid rounded to bf16: the loss is not the unrounded softcap's
    u = cap * torch.sigmoid((x.double() @ w.double().T + shift) / 7.5)
    lse = torch.logsumexp(u, -1)
    exact = sum(wk * (lse[: 100 - k] - u[torch.arange(100 - k), targets[k:]]).sum() for k, wk in enumerate(weights))
    assert spread > 1 or abs(loss.double() - exact) > 1e-6 * exact


def test_softcap_ce_kernels_gradient_on_the_last_rows_is_89s_not_the_losss_derivative():
    # #89's tail quirk: on the last K - 1 rows the softmax keeps the weight of all K next tokens, the targets past
    # the end are left out; every other row's gradient is the loss's derivative.
    x, w, targets = ce_operands(40)
    weights = [1.0, 0.5, 0.25]
    z = x @ w.T
    losses = torch.empty(40)
    K.softcap_ce_launcher()(z, targets, torch.tensor(weights + [0.0]), losses, 0, 23.0, 5.0, 7.5, z)  # z: dloss/dz
    ref_losses, quirk = softcap_ce_reference(x @ w.T, targets, weights, 23.0, 5.0, 7.5)
    _, true = softcap_ce_reference(x @ w.T, targets, weights, 23.0, 5.0, 7.5, quirk=False)
    torch.testing.assert_close(losses.double(), ref_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(z.double(), quirk, rtol=1e-4, atol=1e-7)
    assert torch.equal(quirk[:38], true[:38])
    for row, missing in ((38, 0.25), (39, 0.75)):  # the weight whose target is past the end
        extra = quirk[row] - true[row]  # missing x softmax x (cap / temp) s (1 - s): the softmax pushed down alone
        torch.testing.assert_close(z[row].double() - true[row], extra, rtol=1e-4, atol=1e-7)
        s = softcap89(x[row] @ w.T, 23.0, 5.0, 7.5) / 23
        want = missing * torch.softmax(23 * s, -1) * (23 / 7.5) * s * (1 - s)
        torch.testing.assert_close(extra, want, rtol=1e-9, atol=1e-12)
        assert rel(z[row], true[row]) > 0.01


def test_softcap_ce_kernels_e5m2_codes_are_89s_but_at_named_ties():
    # The FP8 head's path: bf16 logits in, e5m2 codes of dloss/dz / grad_s out (nearest-even, saturating), against
    # the independent reference's codes. They may differ only where the float64 value lies within 1e-5 of a tie
    # between two codes, or the sigmoid within 1e-6 of a tie between two bf16 values (the interpreter's fp32 exp
    # is not the float64 one); never by more than one code.
    rows, vocab = 64, 1000
    g = torch.Generator().manual_seed(4)
    logits = (8 * torch.randn(rows, vocab, generator=g)).bfloat16()
    logits[3, :10] = torch.tensor([-1e4, 1e4, -60, 60, 0, -5, 2e3, -2e3, 30, 100]).bfloat16()  # saturated sigmoids
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[10:13] = targets[9]  # the same token next, next but one: the target terms add up
    grad_s = 0.75 / 448
    for weights in ([1.0, 0.5, 0.25], [1.0]):
        codes = torch.empty(rows, vocab, dtype=torch.float8_e5m2)
        losses = torch.empty(rows)
        padded = torch.tensor(weights + [0.0])  # 4 or 2: a power of two
        K.softcap_ce_launcher()(logits, targets, padded, losses, 0, 23.0, 5.0, 7.5, codes, grad_s)
        want_losses, want_codes, _ = R.softcap_ce89(logits, targets, weights, grad_s)
        _, d_logits = softcap_ce_reference(logits, targets, weights, 23.0, 5.0, 7.5)
        exact_s = torch.sigmoid(logits.double() / 7.5 + 5 / 7.5)
        torch.testing.assert_close(losses.double(), want_losses, rtol=2e-6, atol=1e-5)
        got, want = codes.view(torch.uint8), want_codes.view(torch.uint8)
        differ = got != want
        named = (near_a_rounding_boundary(d_logits / grad_s, torch.float8_e5m2, 1e-5)
                 | near_a_rounding_boundary(exact_s, torch.bfloat16, 1e-6))
        assert not (differ & ~named).any(), (differ & ~named).nonzero()[:5]
        assert ((got.int() - want.int()).abs() <= 1).all() and differ.float().mean() < 1e-3
        assert (codes.float() != 0).float().mean() > 0.5  # the codes carry the gradient (not flushed to zero)


def test_softcap_ce_saturates_its_e5m2_codes_at_57344():
    # A gradient scale far too small: |dloss/dz| / grad_s past e5m2's largest saturates (cvt.rn.satfinite), no inf.
    logits = torch.zeros(4, 64).bfloat16()
    targets = torch.tensor([1, 2, 3, 4])
    codes, losses = torch.empty(4, 64, dtype=torch.float8_e5m2), torch.empty(4)
    K.softcap_ce_launcher()(logits, targets, torch.tensor([1.0, 0.0]), losses, 0, 23.0, 0.0, 7.5, codes, 1e-9)
    values = codes.float()
    assert torch.isfinite(values).all() and (values[torch.arange(4), targets] == -57344).all()
    assert ((values == 57344).sum(1) == 63).all()


def test_softcap_ce_with_fp8_scales_runs_89s_head_forward_and_backward():
    # The whole op against the independent reference of #89's head: e4m3 operands, the bf16 logits, the kernel's
    # e5m2 codes, and the two backward GEMMs on those codes (fast accumulation off). The loss scale (1/8) reaches the
    # gradients through autograd; grad_s carries none (fp8_scales(cfg, 1.0)).
    cfg = T.parse_config([])
    x, w, targets = ce_operands(96, d=32)
    x, w = x.bfloat16(), (w / 8).bfloat16()
    scales = T.fp8_scales(cfg, 1.0)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss, gx, gw = torch.ops.speedrun.softcap_ce(xs, ws, targets, torch.tensor([1.0, 0.5]), 23.0, 5.0, 7.5, scales)
    (loss / 8).backward()
    logits, _, _ = R.lm_head_fp8_89(x, w, *scales[:2])
    losses, codes, _ = R.softcap_ce89(logits, targets, [1.0, 0.5], scales[2])
    want_x, want_w = R.lm_head_fp8_backward89(x, w, codes, *scales)
    assert gx.dtype == torch.bfloat16 and gw.dtype == torch.float32 and ws.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss.double(), losses.sum(), rtol=1e-5, atol=0)
    assert rel(gx, want_x) < 1e-2 and rel(gw, want_w) < 1e-3, (rel(gx, want_x), rel(gw, want_w))
    assert rel(xs.grad, want_x / 8) < 1e-2 and rel(ws.grad, want_w / 8) < 1e-2
    bf16 = torch.ops.speedrun.softcap_ce(x, w, targets, torch.tensor([1.0, 0.5]), 23.0, 5.0, 7.5, [])[0]
    assert abs(loss - bf16) > 1e-5 * bf16  # the operands were quantized (not the bf16 head)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_softcap_ce_kernel_in_half_precision_follows_the_reference(dtype):
    # The logits and their gradient in x's dtype, as on the GPU (whose bf16 this kernel's 1-D loads read right
    # under the interpreter).
    x, w, targets = ce_operands(64)
    loss, gx, gw = torch.ops.speedrun.softcap_ce(x.to(dtype), w, targets, torch.tensor([1.0, 0.5]), 23.0, 5.0, 7.5, [])
    losses, d_logits = softcap_ce_reference(x @ w.T, targets, [1.0, 0.5], 23.0, 5.0, 7.5)
    assert gx.dtype == dtype and gw.dtype == torch.float32
    torch.testing.assert_close(loss.double(), losses.sum(), rtol=2e-3, atol=0)
    assert rel(gx, d_logits @ w.double()) < 2e-2 and rel(gw, d_logits.T @ x.double()) < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_softcap_ce_without_gradients_is_89s_validation_loss(dtype):
    # Validation: u = cap s in the logits' dtype (#89's compiled softcap: bf16), plain cross-entropy; no gradient.
    x, w, targets = ce_operands(70)
    x, w = x.to(dtype), w.to(dtype)
    loss, gx, gw = torch.ops.speedrun.softcap_ce(x, w, targets, torch.ones(1), 23.0, 5.0, 7.5, [], False)
    u = softcap89(x @ w.T, 23.0, 5.0, 7.5, training=False)
    torch.testing.assert_close(loss.double(), F.cross_entropy(u, targets, reduction="sum"), rtol=1e-6, atol=0)
    training = torch.ops.speedrun.softcap_ce(x, w, targets, torch.ones(1), 23.0, 5.0, 7.5, [])[0]
    assert loss != training and gx.numel() == gw.numel() == 0  # the two roundings differ


@pytest.mark.parametrize("fp8", [False, True])
def test_softcap_ce_op_passes_opcheck(fp8):
    x, w, targets = ce_operands(40, vocab=200)
    scales = T.fp8_scales(T.parse_config([]), 1.0) if fp8 else []
    for with_grad in (True, False):
        torch.library.opcheck(torch.ops.speedrun.softcap_ce.default,
                              (x.requires_grad_(with_grad), w.requires_grad_(with_grad), targets,
                               torch.tensor([1.0, 0.5]), 23.0, 5.0, 7.5, scales, with_grad),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("fp8", [False, True])
def test_softcap_ce_compiled_in_one_graph_equals_eager(fp8):
    # Inside torch.compile(fullgraph=True) the op traces through its fake kernel and its autograd rule.
    x, w, targets = ce_operands(40, vocab=200)
    mtp = torch.tensor([1.0, 0.5])
    scales = T.fp8_scales(T.parse_config([]), 1.0) if fp8 else []

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return 2 * torch.ops.speedrun.softcap_ce(x, w, targets, mtp, 23.0, 5.0, 7.5, scales)[0]

    results = []
    for run in (fn, torch.compile(fn, fullgraph=True, dynamic=False)):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = run(xs, ws)
        loss.backward()
        results.append((loss, xs.grad, ws.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_the_model_with_the_fused_head_equals_the_torch_path_loss_and_every_gradient():
    # #89's loss (the rescale, three next tokens, the bf16 sigmoid, the tail quirk) through the whole model, fp32:
    # --fused_head against the logits path, in training (the loss and every gradient) and in validation.
    args = ["--preset=tiny", "--model_dim=64", "--head_dim=32", "--vocab_size=320", "--logit_cap=23",
            "--logit_shift=5"]
    torch.manual_seed(0)
    plain = T.GPT(T.parse_config(args), use_flex=False, fp8_head=False).float()
    fused = T.GPT(T.parse_config([*args, "--fused_head=true"]), use_flex=False, fp8_head=False).float()
    fused.load_state_dict(plain.state_dict())
    for model in (plain, fused):  # untied, so that the embedding takes a gradient of its own
        model.tie_embedding(False)
    g = torch.Generator().manual_seed(3)
    tokens, windows, mtp = torch.randint(0, 320, (257,), generator=g), torch.tensor([2, 1]), torch.tensor([1, .5, .25])
    losses = [model(tokens[:-1], tokens[1:], windows, mtp) for model in (plain, fused)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    for (name, a), b in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert plain.embed.weight.grad.abs().sum() > 0
    with torch.no_grad():  # validation: the mean next-token loss, no gradient made
        evals = [model.eval()(tokens[:-1], tokens[1:], windows) for model in (plain, fused)]
    torch.testing.assert_close(evals[1], evals[0], rtol=1e-6, atol=0)
    assert evals[0] < losses[0] / 256  # the training loss sums three next tokens' terms, validation one's mean


def test_a_run_with_the_fused_head_follows_the_torch_path(tmp_path, monkeypatch):
    # The training loop's use on the CPU (bf16 activations, the loss scale reaching the gradients through
    # backward, MTP weights from the schedule): two steps with --fused_head against the logits path. The vocabulary
    # in one block of 65536, as the interpreter's cost is per block. The tolerance: Adam's first steps move by about
    # lr x sign(g) even where g is rounding noise, so bf16 roundings in the rare tokens' gradients reach the loss.
    from conftest import SMALL, tiny_args
    launch = K.softcap_ce_launcher()
    monkeypatch.setattr(K, "softcap_ce_launcher", lambda: functools.partial(launch, block_v=65536))
    runs = [T.run(tiny_args(tmp_path, run_id=f"head_{fused}", fused_head=fused, mtp_stages="1/0.5", logit_cap=23,
                            logit_shift=5, num_steps=2, val_every=2, **{**SMALL, "val_tokens": 128, "val_seq_len": 128})
                  ).val_losses for fused in (False, True)]
    (_, start), (_, plain) = runs[0]
    assert [s for s, _ in runs[1]] == [0, 2] and abs(runs[1][0][1] - start) < 1e-5  # validation: the kernel too
    assert abs(runs[1][1][1] - plain) < 1e-2 < start - plain, runs


def test_the_kernel_benchmark_runs_and_reports_both_paths_of_each_kernel(tmp_path, monkeypatch):
    sys.path.insert(0, str(T.HERE / "records"))
    import kernel_bench as bench
    out = tmp_path / "kernels.json"
    monkeypatch.setattr("sys.argv", ["kernel_bench.py", "--small", "--repeats=1", f"--out={out}"])
    assert bench.main() == 0
    results = json.loads(out.read_text())["results"]
    kernels = ("relu2_mm", "softcap_ce", "softcap_ce_eval", "fp8_mlp", "polar_express")
    assert [(r["kernel"], r["path"]) for r in results] == [(k, p) for k in kernels for p in ("torch", "kernel")]
    assert all(r["ms"] > 0 for r in results)


def test_the_benchmarks_fp8_mlp_is_89s_fp8_mlp_against_the_bf16_one():
    # Its two paths must do the same work: the FP8 one within FP8's error of the bf16 MLP (e4m3 forward; its bf16
    # backward then differs through pre and post alone), and really in FP8 (bf16's own is ~0.4%).
    sys.path.insert(0, str(T.HERE / "records"))
    import kernel_bench as bench
    cfg = T.parse_config(["--model_dim=64", "--head_dim=32"])
    (x, w), cases = bench.fp8_mlp_cases(cfg, 96, torch.bfloat16, torch.device("cpu"), lambda fn: fn)
    grads = {}
    for path, fn in cases.items():
        x.grad = w.grad = None
        fn()
        grads[path] = x.grad.clone(), w.grad.clone()
    for got, want in zip(grads["kernel"], grads["torch"]):
        assert 0.01 < rel(got, want) < 0.15, rel(got, want)


# -- Polar Express's symmetric GEMMs and the tiled transpose ----------------------------------------------------

def bf16_operand(*shape: int, seed: int = 5) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def gram_of_torch(op: str, a: torch.Tensor) -> torch.Tensor:
    """polar_express's torch path for op, on fp32 copies, rounded once (as train_gpt's CPU path computes it)."""
    x = a.float()
    if op == "xtx":
        return (x.mT @ x).bfloat16()
    if op == "xxt":
        return (x @ x.mT).bfloat16()
    return (-2.8 * x + 0.5 * x @ x).bfloat16() if x.dim() == 2 else torch.baddbmm(x, x, x, beta=-2.8, alpha=0.5
                                                                                    ).bfloat16()


def symmetric(a: torch.Tensor) -> torch.Tensor:
    """A Gram matrix as Polar Express's A, symmetric to the bit (the kernel computes c A A^T, the torch path c A^2)."""
    x = a.float()
    gram = x @ x.mT / a.size(-1)
    return ((gram + gram.mT) / 2).bfloat16()


@pytest.mark.parametrize("op, a", [
    ("xxt", bf16_operand(2, 70, 100)),  # wide, batched
    ("xxt", bf16_operand(70, 70)),  # square, one matrix
    ("xtx", bf16_operand(2, 100, 70)),  # tall, batched: its columns' Gram matrix, read in place
    ("xtx", bf16_operand(100, 70)),
    ("ba_plus_caa", symmetric(bf16_operand(2, 70, 40))),
    ("ba_plus_caa", symmetric(bf16_operand(70, 40))),
], ids=["xxt-wide-batched", "xxt-square", "xtx-tall-batched", "xtx-tall", "ba_plus_caa-batched", "ba_plus_caa"])
def test_symmetric_gemm_kernels_equal_the_torch_products_within_a_rounding(monkeypatch, op, a):
    # 32 x 32 tiles in reductions of 16: a 3 x 3 grid of tiles (the 6 on and below the diagonal computed, the 3 above
    # mirrored) with masked tails, 3 to 7 partial sums per element. Measured: equal bits (these sums of exact bf16
    # products are exact in fp32, whatever their order). The bound, one bf16 ulp on under 1% of the elements, leaves
    # room for the epilogue's b A + c acc, which torch's GEMM may fuse into a multiply-add.
    monkeypatch.setattr(K, "GRAM_CONFIG", (32, 16, 4, 1))
    got = torch.ops.speedrun.ba_plus_caa(a, -2.8, 0.5) if op == "ba_plus_caa" else getattr(torch.ops.speedrun, op)(a)
    want = gram_of_torch(op, a)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert ulps.max() <= 1 and (ulps > 0).float().mean() < 0.01, (ulps > 0).sum()
    tile = torch.arange(got.size(-1)) // 32
    off_diagonal = tile[:, None] != tile[None, :]
    assert torch.equal(got[..., off_diagonal], got.mT[..., off_diagonal])  # the mirrored tiles: exact transposes


@pytest.mark.parametrize("shape", [(2, 24, 56), (40, 40), (56, 24), (1040, 16)],
                         ids=["wide-batched", "square", "tall", "tall-split"])
def test_polar_express_with_the_kernels_equals_its_torch_path(monkeypatch, shape):
    # The whole orthogonalization, kernels against torch's GEMMs: wide, square and tall blocks, batched or not, and a
    # block past the 1024-row split (its xtx reduces 1040 rows: in chunks of 128 here, for the interpreter's sake).
    # Measured: equal bits at these sizes. At 96 x 200 (sums of 64-product chunks that fp32 rounds, in another order
    # than torch's GEMM) rounding ties flip and five iterations spread them: 5.4e-3 relative measured, bound 1e-2.
    if shape[0] > T.SPLIT_ROWS:
        monkeypatch.setattr(K, "GRAM_CONFIG", (16, 128, 4, 1))
    G = torch.randn(shape, generator=torch.Generator().manual_seed(6))
    got, want = T.polar_express(G, kernels=True), T.polar_express(G)
    assert got.dtype == torch.bfloat16 and got.shape == G.shape
    assert rel(got, want) < 1e-2, rel(got, want)
    s = torch.linalg.svdvals(got.float())
    assert s.min() > 0.5 and s.max() < 1.3  # orthogonalized (#89's coefficients leave the spectrum in ~[0.7, 1.2])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float32])
def test_transpose_copy_copies_every_bit_of_any_dtype(dtype):
    # 100 x 300 in 64 x 128 tiles: tails on both sides; every bit pattern (NaNs, infinities, negative zeros) moves as
    # it is. A transposed view as the source too: strides as given.
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]
    raw = torch.randint(-2**7 if bits != torch.uint8 else 0, 2**7, (100, 300), dtype=torch.int32,
                        generator=torch.Generator().manual_seed(7))
    x = (raw.to(torch.uint8) if bits == torch.uint8 else raw.to(bits) * 257).view(dtype)
    for src in (x, x.T):
        got = torch.ops.speedrun.transpose_copy(src)
        assert got.is_contiguous() and torch.equal(got.view(bits), src.T.contiguous().view(bits))


def test_polar_express_and_transpose_ops_pass_opcheck():
    a = bf16_operand(2, 48, 32)
    for op, args in ((torch.ops.speedrun.xxt, (a,)), (torch.ops.speedrun.xtx, (a,)),
                     (torch.ops.speedrun.ba_plus_caa, (symmetric(a), -2.8, 0.5)),
                     (torch.ops.speedrun.transpose_copy, (a[0],))):
        torch.library.opcheck(op.default, args, test_utils=("test_schema", "test_faketensor"))
