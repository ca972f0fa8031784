"""Triton kernels against the torch path they replace, run by tests/test_kernels.py in a process of their own
under Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is first imported, which importing
torch.compile'd code does): values and gradients at sizes that do not divide the blocks (masked tails),
negative pre-activations (the ReLU's zero side), saturated softcaps, and the ops' registration (opcheck).
Triton 3.6's interpreter misreads the relu2 GEMM's bf16 operands with numpy 2.4 (the cross-entropy kernel's
bf16 reads right), so that kernel runs fp32 and fp16 here and bf16 in the GPU check. Not collected on its own
(no test_ prefix)."""
import functools
import json
import os
import sys

import pytest
import torch

import gpt_kernels as K
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
    cfg = T.parse_config(["--preset=tiny", "--model_dim=64", "--head_dim=32"])
    torch.manual_seed(0)
    plain = T.MLP(cfg)
    fused = T.MLP(T.parse_config(["--preset=tiny", "--model_dim=64", "--head_dim=32", "--relu2_kernel=true"]))
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(1, 50, 64)
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("flag", ["relu2_kernel", "fused_head"])
def test_a_kernel_flag_is_refused_without_a_gpu_or_the_interpreter(monkeypatch, flag):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(T.UsageError, match=f"--{flag} runs a Triton kernel"):
        T.resolve_for_device(T.parse_config(["--preset=tiny", f"--{flag}=true"]), cuda=False)


def softcap_ce_reference(x, w, targets, weights, cap, shift, temp):
    """The spec's loss (recipe_v2 §2.27) in float64, plainly: sum_k w_k sum_t (lse_t - u[t, y_(t+k)])."""
    u = cap * torch.sigmoid((x.double() @ w.double().T + shift) / temp)
    lse, n = torch.logsumexp(u, dim=-1), targets.numel()
    return sum(wk * (lse[: n - k] - u[torch.arange(n - k), targets[k:]]).sum() for k, wk in enumerate(weights))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def ce_operands(m: int, d: int = 24, vocab: int = 300, spread: float = 1.0):
    g = torch.Generator().manual_seed(2)
    x = T.norm(torch.randn(m, d, generator=g))
    w = spread * torch.randn(vocab, d, generator=g) / d**0.5
    return x, w, torch.randint(0, vocab, (m,), generator=g)


@pytest.mark.parametrize("weights, cap, shift, spread", [
    ([1.0], 30.0, 0.0, 1.0),  # #28's softcap
    ([1.0, 0.5, 0.25], 23.0, 5.0, 1.0),  # v2: the asymmetric rescale and three next tokens
    ([1.0, 0.5], 23.0, 5.0, 400.0),  # |z| in the hundreds: the sigmoid saturates at 0 and at cap
])
def test_softcap_ce_kernel_equals_the_spec_loss_and_its_gradients_across_chunks(monkeypatch, weights, cap, shift,
                                                                                spread):
    # 100 rows in chunks of 32 (the last of 4), a vocabulary of 300 in blocks of 1024 / 128: every tail masked.
    monkeypatch.setattr(K, "HEAD_CHUNK_ROWS", 32)
    x, w, targets = ce_operands(100, spread=spread)
    mtp = torch.tensor(weights)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss, _, _ = torch.ops.speedrun.softcap_ce(xs, ws, targets, mtp, cap, shift, 7.5, [])
    (3.0 * loss).backward()  # a loss scale reaches the gradients as it would through autograd
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    want = softcap_ce_reference(xr, wr, targets, weights, cap, shift, 7.5)
    (3.0 * want).backward()
    assert torch.isfinite(loss) and torch.isfinite(xs.grad).all()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(xs.grad.double(), xr.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ws.grad.double(), wr.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_softcap_ce_kernel_in_half_precision_follows_the_reference(dtype):
    # The logits and their gradient in x's dtype, as on the GPU (whose bf16 this kernel's 1-D loads read right
    # under the interpreter).
    x, w, targets = ce_operands(64)
    loss, gx, gw = torch.ops.speedrun.softcap_ce(x.to(dtype), w, targets, torch.tensor([1.0, 0.5]), 23.0, 5.0, 7.5, [])
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    want = softcap_ce_reference(xr, wr, targets, [1.0, 0.5], 23.0, 5.0, 7.5)
    want.backward()
    assert gx.dtype == dtype and gw.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want.detach(), rtol=2e-3, atol=0)
    assert rel(gx, xr.grad) < 2e-2 and rel(gw, wr.grad) < 2e-2


def test_softcap_ce_with_fp8_scales_follows_the_fp8_head_path():
    # --fused_head with the FP8 head: the same e4m3 operands and e5m2 gradient as fp8_mm followed by the
    # softcapped cross-entropy in torch (its gradient scale then carries the loss scale; here 1/8).
    cfg = T.parse_config([])
    x, w, targets = ce_operands(96, d=32)
    x = x.bfloat16()
    loss, gx, gw = torch.ops.speedrun.softcap_ce(x, w, targets, torch.tensor([1.0, 0.5]), 23.0, 5.0, 7.5,
                                                 T.fp8_scales(cfg, 1.0))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    z = torch.ops.speedrun.fp8_mm(xr, wr, *T.fp8_scales(cfg, 1 / 8))
    u = 23.0 * torch.sigmoid((z.float() + 5.0) / 7.5)
    lse = torch.logsumexp(u, dim=-1)
    want = sum(m * (lse[: 96 - k] - u[torch.arange(96 - k), targets[k:]]).sum() for k, m in enumerate([1.0, 0.5]))
    (want / 8).backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=0)
    assert rel(gx, 8 * xr.grad) < 3e-2 and rel(gw, 8 * wr.grad) < 3e-2  # e5m2 roundings (~5% from the exact)
    exact = softcap_ce_reference(x, w, targets, [1.0, 0.5], 23.0, 5.0, 7.5)
    assert abs(loss.double() - exact) / exact > 1e-5  # the operands were quantized (not the bf16 path)


def test_softcap_ce_without_gradients_gives_the_same_loss():
    x, w, targets = ce_operands(70)
    args = (targets, torch.tensor([1.0, 0.5]), 23.0, 5.0, 7.5, [])
    with_grad = torch.ops.speedrun.softcap_ce(x, w, *args)
    loss, gx, gw = torch.ops.speedrun.softcap_ce(x, w, *args, False)
    assert torch.equal(loss, with_grad[0]) and gx.numel() == gw.numel() == 0


def test_softcap_ce_op_passes_opcheck():
    x, w, targets = ce_operands(40, vocab=200)
    torch.library.opcheck(torch.ops.speedrun.softcap_ce.default,
                          (x.requires_grad_(), w.requires_grad_(), targets, torch.tensor([1.0, 0.5]), 23.0, 5.0, 7.5,
                           []), test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_softcap_ce_compiled_in_one_graph_equals_eager():
    # Inside torch.compile(fullgraph=True) the op traces through its fake kernel and its autograd rule.
    x, w, targets = ce_operands(40, vocab=200)
    mtp = torch.tensor([1.0, 0.5])

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return 2 * torch.ops.speedrun.softcap_ce(x, w, targets, mtp, 23.0, 5.0, 7.5, [])[0]

    results = []
    for run in (fn, torch.compile(fn, fullgraph=True, dynamic=False)):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = run(xs, ws)
        loss.backward()
        results.append((loss, xs.grad, ws.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_the_model_with_the_fused_head_equals_the_torch_path_loss_and_every_gradient():
    # The recipe's loss (the rescale, three next tokens) through the whole model, fp32: --fused_head against the
    # logits path, in training (the loss and every gradient) and in validation (the mean loss).
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
    kernels = ("relu2_mm", "softcap_ce", "softcap_ce_eval", "fp8_mlp")
    assert [(r["kernel"], r["path"]) for r in results] == [(k, p) for k in kernels for p in ("torch", "kernel")]
    assert all(r["ms"] > 0 for r in results)


def test_the_benchmarks_fp8_mlp_computes_the_bf16_mlps_gradients_in_fp8():
    # Its two paths must do the same work: the FP8 one within FP8's error of the bf16 MLP (e4m3 operands, e5m2
    # gradients: ~4% and ~6% per GEMM, ~9% through both and the square), and really in FP8 (bf16's is ~0.4%).
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
        assert 0.02 < rel(got, want) < 0.15, rel(got, want)
