"""The GPU path where the CPU rehearsal (test_compiled.py) cannot reach: FlexAttention's CUDA kernels, the FP8
head through cuBLAS, the copy stream, CUDA events. Skipped without a GPU. tools/gpu_check.py runs these first
on a new GPU machine, then a benchmark; each test records its figures with record_property (the junit XML and
the check's table show them)."""

import math
import os
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
from torch.nn.attention.flex_attention import flex_attention
from torch.utils._python_dispatch import _disable_current_modes

import gpt_kernels as K
import train_gpt as T
from conftest import SAMPLE_TRAIN, rel, tiny_args
from test_model import assert_fp8_head_saturates

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")
fp8 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                         reason="needs a CUDA GPU with FP8 matmuls (compute capability 8.9 or newer: Ada, Hopper)")
# The runs below share these shapes, so the compiled graphs are built once (inductor's cache) for all of them.
RUN = dict(device="cuda", global_batch_seqs=2, model_dim=64, head_dim=32, val_tokens=1024, val_seq_len=1024)
SLEEP_CYCLES = 2_000_000  # torch.cuda._sleep: about a millisecond of one stream held busy


def test_cuda_environment(record_property):
    import triton

    major, minor = torch.cuda.get_device_capability()
    for key, value in [("device", torch.cuda.get_device_name()), ("capability", f"{major}.{minor}"),
                       ("torch", torch.__version__), ("cuda", torch.version.cuda), ("triton", triton.__version__),
                       ("memory_gib", round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))]:
        record_property(key, value)
    assert torch.cuda.is_bf16_supported()


def test_fa3_follows_flex_attention_at_the_recipes_shapes(record_property):
    # #89's kernel (FA3's varlen call, from the kernels package) against FlexAttention with the same mask rule, at the
    # last stage's shape: 49,152 tokens of documents cut at 2,048, windows 5/11 blocks, YaRN's gain of the stage, and
    # the paired layers' 98,304 positions. Forward and the gradients of q, k, v; FA3 first on a new machine.
    fa3, why = T.load_fa3()
    if fa3 is None:
        pytest.skip(why)
    cfg = T.parse_config(["--attention=fa3"])
    s = T.schedule(T.stage_starts(cfg)[2], cfg)
    g = torch.Generator(device=CUDA).manual_seed(0)
    tokens = torch.randint(0, 50000, (s.seq_len,), device=CUDA, generator=g)
    starts = torch.cumsum(torch.randint(1, s.max_doc_len + 1, (s.seq_len // 100,), device=CUDA, generator=g), 0)
    tokens[0], tokens[starts[starts < s.seq_len]] = T.BOS_ID, T.BOS_ID
    documents = int((tokens == T.BOS_ID).sum())
    knobs = T.StepKnobs(cfg, [s], CUDA, T.DocumentCounts({(s.seq_len, s.max_doc_len): documents}, documents))
    models = {"flex": T.GPT(cfg, use_flex=True, fp8_head=False, compile_flex=True).to(CUDA),
              "fa3": T.GPT(cfg, use_flex=False, fp8_head=False, fa3=fa3).to(CUDA)}
    for model in models.values():
        model.apply_yarn(s.yarn_windows)
    plan = knobs.plan(0, training=True)
    every_token = T.cu_seqlens(tokens, tokens.numel() + 1)
    attend = {"flex": models["flex"].attention_kernels(tokens, knobs.windows[0], every_token),
              "fa3": models["fa3"].attention_kernels(tokens, plan, T.cu_seqlens(tokens, plan.slots))}
    for kind, positions, heads in (("long", s.seq_len, 6), ("short", s.seq_len, 6), ("paired", 2 * s.seq_len, 3)):
        q, k, v = (T.norm(torch.randn(1, positions, heads, 128, device=CUDA, generator=g)).bfloat16() for _ in "qkv")
        grad = torch.randn(1, positions, heads, 128, device=CUDA, generator=g).bfloat16()
        results = {}
        for path in ("flex", "fa3"):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = attend[path][kind](*inputs)
            out.backward(grad)
            results[path] = [out, *(t.grad for t in inputs)]
        errors = [rel(a, b) for a, b in zip(results["fa3"], results["flex"])]
        record_property(f"{kind}_rel_error_out_dq_dk_dv", [round(e, 5) for e in errors])
        assert max(errors) < 2e-2, (kind, errors)  # bf16 kernels' own rounding: ~4e-3 expected


@fp8
def test_fp8_ops_pass_opcheck_on_cuda():
    torch.manual_seed(0)
    x = T.norm(torch.randn(256, 768, device=CUDA)).bfloat16()
    w = 0.02 * torch.randn(1024, 768, device=CUDA)
    g = torch.randn(256, 1024, device=CUDA).bfloat16()
    scales = (math.sqrt(768) / K.FP8_MAX_E4M3, T.Config.fp8_w_scale, T.Config.fp8_grad_scale)
    torch.library.opcheck(torch.ops.speedrun.fp8_mm.default, (x, w, *scales))
    torch.library.opcheck(torch.ops.speedrun.fp8_mm_backward.default, (g, x, w, *scales))


@fp8
def test_fp8_head_saturates_on_cuda():
    assert_fp8_head_saturates(CUDA)


@fp8
def test_fp8_head_matches_bf16_matmul_at_the_recipe_shape_eager_and_compiled(record_property):
    cfg = T.Config()
    tokens, dim, vocab = cfg.train_seq_len, cfg.model_dim, cfg.vocab_size
    torch.manual_seed(0)
    x = T.norm(torch.randn(tokens, dim, device=CUDA)).bfloat16().requires_grad_()
    w = (0.02 * torch.randn(vocab, dim, device=CUDA)).requires_grad_()
    g = (1e-3 * torch.randn(tokens, vocab, device=CUDA)).bfloat16()
    scales = (math.sqrt(dim) / K.FP8_MAX_E4M3, T.Config.fp8_w_scale, T.Config.fp8_grad_scale)
    out = torch.ops.speedrun.fp8_mm(x, w, *scales)
    out.backward(g)
    with torch.no_grad():
        errors = {"out": rel(out, x.float() @ w.T)}
        errors["grad_x"] = rel(x.grad, g.float() @ w)
        errors["grad_w"] = rel(w.grad, g.float().T @ x.float())
    grads = x.grad, w.grad
    x.grad = w.grad = None
    # Compiled, the op's fake kernel stands in for it while tracing: its strides must be the real ones.
    compiled = torch.compile(lambda x, w: torch.ops.speedrun.fp8_mm(x, w, *scales), fullgraph=True)
    out_c = compiled(x, w)
    out_c.backward(g)
    for name, value in errors.items():
        record_property(f"rel_err_{name}", round(value, 4))
    # e4m3 operands: ~3.7% on the product; an e5m2 gradient: ~6% (the CPU emulation gives the same figures).
    assert errors["out"] < 0.05 and errors["grad_x"] < 0.08 and errors["grad_w"] < 0.08, errors
    assert torch.equal(out_c, out) and torch.equal(x.grad, grads[0]) and torch.equal(w.grad, grads[1])


def test_compiled_flex_attention_matches_dense_forward_and_backward_at_block_128(record_property):
    torch.manual_seed(0)
    n, heads, dim, block = 8192, 6, 128, 128
    tokens = torch.randint(0, 50000, (n,), device=CUDA, dtype=torch.int32)
    tokens[torch.randint(0, n, (24,), device=CUDA)] = T.BOS_ID
    tokens[[0, 127, 128, 129, 1000, 1001]] = T.BOS_ID  # documents on, across and inside block edges
    flex = torch.compile(flex_attention, dynamic=False)
    worst = {}
    for window in (0, 1, 2, 7, 14):  # 0: short layers while the long window is one block
        q, k, v = (torch.randn(1, heads, n, dim, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        size = torch.tensor(window, dtype=torch.int32, device=CUDA)
        out = flex(q, k, v, block_mask=T.block_mask(tokens, block, size), scale=0.12)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*ref_in, attn_mask=T.dense_mask(tokens, block, size), scale=0.12)
        ref_grads = torch.autograd.grad(ref.square().sum(), ref_in)
        worst[window] = max(rel(out, ref), *(rel(a, b) for a, b in zip(grads, ref_grads)))
        record_property(f"rel_err_window_{window}", round(worst[window], 4))
    assert max(worst.values()) < 3e-2, worst  # bf16 kernels against an fp32 reference


def test_flex_compiled_alone_keeps_an_uncompiled_model_from_materializing_scores(record_property):
    # --compile=false on CUDA: eager flex_attention would build the (heads, T, T) score matrix, 8 GiB here.
    cfg = T.parse_config(["--preset=tiny", "--vocab_size=1024", "--train_seq_len=32768", "--val_seq_len=32768",
                          "--model_dim=128", "--num_heads=2", "--head_dim=64"])
    model = T.GPT(cfg, use_flex=True, fp8_head=False, compile_flex=True).to(CUDA)
    tokens = torch.randint(0, 1000, (cfg.train_seq_len + 1,), device=CUDA)
    tokens[::4096] = T.BOS_ID
    torch.cuda.reset_peak_memory_stats()
    model(tokens[:-1], tokens[1:].long(), torch.tensor([2, 1], device=CUDA)).backward()
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    record_property("peak_gib", round(peak_gib, 2))
    assert peak_gib < 2.0


def test_compiled_gpt_keeps_one_graph_across_windows_and_matches_flex_compiled_alone(record_property):
    cfg = T.parse_config(["--preset=tiny", "--train_seq_len=4096", "--val_seq_len=4096"])
    torch.manual_seed(0)
    raw = T.GPT(cfg, use_flex=True, fp8_head=True).to(CUDA)
    with torch.no_grad():
        for p in raw.parameters():
            p.add_(0.02 * torch.randn_like(p))
    eager = T.GPT(cfg, use_flex=True, fp8_head=True, compile_flex=True).to(CUDA)
    eager.load_state_dict(raw.state_dict())
    torch._dynamo.reset()
    model = torch.compile(raw, dynamic=False, fullgraph=True)
    tokens = torch.randint(0, 50000, (cfg.train_seq_len + 1,), device=CUDA)
    tokens[[0, 700, 1400, 2100, 2800]] = T.BOS_ID
    windows = torch.tensor([[1, 0], [2, 1], [3, 1], [4, 2], [6, 3]], dtype=torch.int32, device=CUDA)  # (long, short)
    worst_loss, worst_grad = 0.0, 0.0
    for i in range(len(windows)):
        for m in (model, eager):
            m.zero_grad()
            loss = m(tokens[:-1], tokens[1:].long(), windows[i])
            loss.backward()
            if m is model:
                compiled_loss = loss.item()
        worst_loss = max(worst_loss, abs(compiled_loss - loss.item()) / abs(loss.item()))
        for (name, a), b in zip(raw.named_parameters(), eager.parameters()):
            if name not in ("scalars", "x0_lambdas"):
                worst_grad = max(worst_grad, rel(a.grad, b.grad))
    train_graphs = len(_debug_get_cache_entry_list(T.GPT.forward.__code__))
    raw.eval()
    eager.eval()
    with torch.no_grad():
        eval_c, eval_e = (m(tokens[:-1], tokens[1:].long(), windows[-1]).item() for m in (model, eager))
    graphs = len(_debug_get_cache_entry_list(T.GPT.forward.__code__))
    for key, value in [("train_graphs", train_graphs), ("graphs_with_eval", graphs),
                       ("loss_rel_diff", worst_loss), ("grad_rel_diff", worst_grad)]:
        record_property(key, value)
    assert train_graphs == 1 and graphs == 2
    assert worst_loss < 1e-3 and abs(eval_c - eval_e) < 1e-3 * abs(eval_e)
    assert worst_grad < 0.05  # fused rounding and the e5m2 head gradient (~1-2% on the CPU)


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("slow", ["compute", "copy"])
def test_prefetch_loader_hands_out_exactly_the_synchronous_batches(depth, slow):
    # A slow compute stream with the batches dropped at once: device memory must not be reused by a later copy
    # before compute has read it (record_stream). A slow copy stream: compute must wait for each copy (the
    # event), and a pinned host buffer must not be refilled before its copy has left it.
    files = T.find_shards(SAMPLE_TRAIN)

    def source() -> T.TrainBatches:
        stream = T.TrainTokenStream(files, 4096, 8, 50304, lambda step: (4096, 2048), preload=depth > 0)
        return T.TrainBatches(stream, 0, 1, steps=12)

    with T.PrefetchLoader(source(), 0, torch.device("cpu")) as host:
        expected = torch.stack([b.clone() for b in host]).to(CUDA)
    mismatches = torch.zeros((), dtype=torch.int64, device=CUDA)
    count = 0
    with T.PrefetchLoader(source(), depth, CUDA) as loader:
        stream = loader.copy_stream if slow == "copy" else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)
        for i, batch in enumerate(loader):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SLEEP_CYCLES)  # held busy before the read, and before the next copy
            mismatches += (batch != expected[i]).sum()
            count += 1
    assert count == len(expected)
    assert mismatches.item() == 0


def test_the_bigram_rows_ids_go_up_from_pinned_memory():
    # #89's send_idxes_buffer: the touched rows' ids are staged in pinned host memory, whose upload does not block.
    cfg = T.parse_config(["--preset=tiny", *(f"--{k}={v}" for k, v in RUN.items())])
    opt = T.ShardedMuonAdam(T.GPT(cfg, use_flex=True, fp8_head=False).to(CUDA), cfg, 0, 2, compile_ns=False)
    assert opt.row_bucket is not None and opt.row_bucket.send_buffer.is_pinned()


def test_tiny_preset_trains_on_cuda_and_checkpoints_report_the_gpu_stall(tmp_path, record_property):
    result = T.run(tiny_args(tmp_path, run_id="tiny", num_steps=6, val_every=3, save_every=3, warmup_steps=2,
                             **RUN))
    losses = [loss for _, loss in result.val_losses]
    assert losses[-1] < losses[0] - 0.3  # 10.83 -> 10.14 on the CPU
    log = (tmp_path / "logs" / "tiny.txt").read_text()
    assert "fp8 head True, fp8 mlp True, compile True" in log
    # The run asks for expandable segments unless the environment chose (test_train checks that rule).
    assert f"PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']}" in log
    stalls = [line for line in log.splitlines() if line.startswith("checkpoint:")]
    assert len(stalls) == 2 and all(", GPU stall " in line for line in stalls), stalls
    record_property("checkpoint_lines", " | ".join(stalls))


def test_the_staged_recipe_on_cuda_compiles_each_sequence_length_in_the_warmup_and_resumes_exactly(
        tmp_path, monkeypatch, record_property):
    # The recipe's stages on the GPU path: Polar Express compiled, three sequence lengths (three graphs, all
    # compiled before the clock), clipped documents, YaRN rewriting RoPE in place, Adam every other step, the
    # untie, the five-layer model (smear, gates, one skip, MUDD, XSA, key offset, paired heads) under FlexAttention
    # and the FP8 head and MLP with their delayed scales, resumed from a checkpoint.
    from test_compiled import model_graphs
    from test_recipe import SMALL_STAGES, SMALL_MODEL
    graphs = []
    warmup = T.warmup
    monkeypatch.setattr(T, "warmup", lambda *a, **k: (warmup(*a, **k), graphs.append(model_graphs())))
    torch._dynamo.reset()
    v2 = {**RUN, **SMALL_STAGES, **SMALL_MODEL, "num_steps": 8, "val_every": 4, "warmup_steps": 1}
    full = T.run(tiny_args(tmp_path, run_id="v2", save_every=4, **v2))
    record_property("graphs_after_warmup_and_at_the_end", f"{graphs} {model_graphs()}")
    assert graphs == [3] and model_graphs() == 4  # + the eval graph: nothing compiled while the clock ran
    resumed = T.run(tiny_args(tmp_path, run_id="v2_resumed", resume=tmp_path / "logs" / "v2" / "ckpt_4", **v2))
    assert resumed.val_losses == full.val_losses[1:]
    assert full.val_losses[-1][1] < full.val_losses[0][1] - 0.3


def test_worker_threads_select_the_runs_device(tmp_path, monkeypatch):
    # On one GPU the device is cuda:0 anyway; what this checks is that the threads select it before CUDA calls.
    seen = []
    set_device = torch.cuda.set_device
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: (seen.append(threading.current_thread().name.split("_")[0]), set_device(d)))
    T.run(tiny_args(tmp_path, num_steps=2, val_every=0, save_every=2, warmup_steps=0, **RUN))
    assert {"prefetch", "ckpt-writer"} <= set(seen)


def test_relu2_mlp_kernel_in_bf16_at_the_recipes_shape_follows_the_torch_mlp(record_property):
    # The bf16 MLP through the ReLU^2 GEMM (--relu2_kernel outside FP8 training) on the GPU, one micro-step's
    # 49,152 x 768 -> 3,072 -> 768, forward and backward, against the bf16 torch MLP.
    g = torch.Generator(device="cuda").manual_seed(0)
    x = T.norm(torch.randn(49152, 768, device="cuda", generator=g)).bfloat16().requires_grad_()
    w_fc, w_proj = ((torch.rand(3072, 768, device="cuda", generator=g) - 0.5).mul(0.0625).bfloat16().requires_grad_()
                    for _ in range(2))
    grad = torch.randn(49152, 768, device="cuda", generator=g).bfloat16()
    results = []
    for mlp in (torch.ops.speedrun.mlp_relu2, lambda x, w_fc, w_proj: F.relu(F.linear(x, w_fc)).square() @ w_proj):
        out = mlp(x, w_fc, w_proj)
        out.backward(grad)
        results.append([out.detach(), *(t.grad for t in (x, w_fc, w_proj))])
        x.grad = w_fc.grad = w_proj.grad = None
    for name, got, want in zip(("out", "grad_x", "grad_w_fc", "grad_w_proj"), *results):
        record_property(f"{name}_rel_err", f"{rel(got, want):.2e}")
        assert rel(got, want) < 0.01, name


@fp8
def test_fp8_mlp_kernels_at_the_recipes_shape_follow_the_torch_path_and_the_quantizers_is_bit_exact(record_property):
    # The FP8 MLP's kernels against its torch path on the same GPU, at the recipe's shapes: the down-weight
    # quantizer over the 12-layer bank (bootstrap, then a delayed scale past which some weights grew: saturation),
    # bit for bit; the op at one micro-step's 49,152 rows through the ReLU^2 GEMM against cuBLAS's e4m3 GEMM (both
    # fast-accumulated: their order alone differs), forward and backward; its partial maxima one per SM.
    g = torch.Generator(device="cuda").manual_seed(0)
    bank = ((torch.rand(12, 2, 3072, 768, device="cuda", generator=g) - 0.5) * 0.06).bfloat16()
    f32 = dict(dtype=torch.float32, device="cuda")
    states = {kernel: [torch.empty(12, 3072, 768, dtype=torch.float8_e4m3fn, device="cuda"), torch.empty(12, **f32),
                       torch.empty(12, 768, 3072, dtype=torch.float8_e4m3fn, device="cuda"), torch.empty(12, **f32),
                       torch.empty(12, **f32)] for kernel in (False, True)}
    for bootstrap in (True, False):
        for kernel, state in states.items():
            K.quantize_mlp_weights_(bank, *state, bootstrap, 1.12, kernel=kernel)
        for a, b in zip(states[True], states[False]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype.itemsize == 1 else torch.equal(a, b)
        bank[:, 1] *= torch.where(torch.rand(bank[:, 1].shape, device="cuda", generator=g) < 1e-4, 1.3, 1.0).bfloat16()
    x = T.norm(torch.randn(49152, 768, device="cuda", generator=g)).bfloat16()
    grad = torch.randn(49152, 768, device="cuda", generator=g).bfloat16()
    w8_fc, up, w8_proj_t, used, _ = states[True]
    results = {}
    for kernel in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, bank[0, 0], bank[0, 1])]
        out, maxima, post = torch.ops.speedrun.mlp_fp8_forward(*leaves, w8_fc[0], up[0], w8_proj_t[0], used[0],
                                                               torch.tensor(0.01, device="cuda"), kernel)
        out.backward(grad)
        results[kernel] = [out.detach(), maxima, post, *(t.grad for t in leaves)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert results[True][1].shape == (sms,) and results[False][1].shape == (1,)
    assert results[True][1].max().item() == pytest.approx(results[False][1].item(), rel=2**-7)
    for name, got, want in zip(("out", "maxima", "post", "grad_x", "grad_w_fc", "grad_w_proj"),
                               results[True], results[False]):
        if name != "maxima":
            record_property(f"{name}_rel_err", f"{rel(got, want):.2e}")
            assert rel(got, want) < (0.005 if name == "post" else 0.02), name


def polar_express_float64(G: torch.Tensor) -> torch.Tensor:
    """Polar Express in float64 (wide: X <- a X + (b A + c A^2) X, A = X X^T; tall on its transpose)."""
    X = G.double().mT if G.size(-2) > G.size(-1) else G.double()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    for a, b, c in T.POLAR_EXPRESS:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if G.size(-2) > G.size(-1) else X


def test_polar_express_kernels_at_the_recipes_shapes_follow_the_torch_path(record_property):
    # One rank's Muon blocks at 8 GPUs (qk 8 x 256 x 768, vo 3 x 768 x 768, mlp 3 x 3072 x 768: tall, past the
    # 1024-row split), Polar Express with its momentum on gpt_kernels' symmetric GEMMs against torch's (cuBLAS), eager
    # (compiled, it runs in every compiled CUDA run: test_the_staged_recipe_on_cuda_...). bf16 roundings in other
    # orders spread over five iterations: the paths differ by about what each differs from float64 (CPU, interpreter,
    # 96 x 200: 5e-3 between the paths, 1.6e-2 to float64; tests/test_recipe.py's bound to float64: 3.5e-2).
    g = torch.Generator(device="cuda").manual_seed(0)
    momentum = T.scalar(0.95)
    for name, shape in (("qk", (8, 256, 768)), ("vo", (3, 768, 768)), ("mlp", (3, 3072, 768))):
        grad = torch.randn(shape, device="cuda", generator=g)
        outputs = {}
        for path, kernels in (("torch", False), ("kernel", True)):
            buf = torch.zeros_like(grad)
            outputs[path] = T.momentum_polar_express(grad, buf, momentum, kernels)
            assert torch.equal(buf, grad * (1 - momentum.item())), path  # the momentum, from zero: (1 - mu) grad
        exact = polar_express_float64(grad)  # the Nesterov update from a zero buffer is (1 - mu^2) grad: same factor
        for path, out in outputs.items():
            error = rel(out, exact)
            record_property(f"polar_express_{name}_{path}_rel_err_to_float64", round(error, 5))
            assert out.dtype == torch.bfloat16 and error < 0.035, (name, path, error)
        between = rel(outputs["kernel"], outputs["torch"])
        record_property(f"polar_express_{name}_kernel_vs_torch_rel", round(between, 5))
        assert between < 0.03, (name, between)


def test_transpose_copy_at_the_fp8_heads_shapes_is_an_exact_copy():
    # The FP8 head backward's transposes at a micro-step's 49,152 rows: x's e4m3 codes (x 768) and the gradient's e5m2
    # codes (x 50,304: 2.5e9 elements, past int32's offsets), every bit as torch's copy.
    g = torch.Generator(device="cuda").manual_seed(0)
    for cols, dtype in ((768, torch.float8_e4m3fn), (50304, torch.float8_e5m2)):
        codes = torch.randint(0, 256, (49152, cols), dtype=torch.uint8, device="cuda", generator=g)
        got = torch.ops.speedrun.transpose_copy(codes.view(dtype)).view(torch.uint8)
        assert torch.equal(got, codes.T.contiguous()), cols
        del got, codes


@fp8
def test_fp8_mlp_at_the_recipes_shape_follows_its_cpu_path_and_the_quantizer_matches(record_property):
    # #89's FP8 MLP (up: current scales, down: delayed weight and activation scales) at one micro-step's 8,192 rows of
    # the recipe's 768 x 3072 layer, on cuBLAS's _scaled_mm, against the same op on the CPU's torch path (the tests'
    # reference there: tests/test_fp8_mlp.py): outputs within a bf16 step or two, the same bf16 backward.
    g = torch.Generator().manual_seed(0)
    bank = ((torch.rand(1, 2, 3072, 768, generator=g) - 0.5) * 0.06).bfloat16()
    x = T.norm(torch.randn(8192, 768, generator=g)).bfloat16()
    grad = torch.randn(8192, 768, generator=g).bfloat16()
    results = {}
    for device in ("cpu", "cuda"):
        w8_fc = torch.empty(1, 3072, 768, dtype=torch.float8_e4m3fn, device=device)
        w8_proj_t = torch.empty(1, 768, 3072, dtype=torch.float8_e4m3fn, device=device)
        up, used, nxt = (torch.ones(1, device=device) for _ in range(3))
        b = bank.to(device)
        K.quantize_mlp_weights_(b, w8_fc, up, w8_proj_t, used, nxt, True, 1.12)
        xs = x.to(device).requires_grad_()
        w_fc, w_proj = b[0, 0].clone().requires_grad_(), b[0, 1].clone().requires_grad_()
        out, amax = torch.ops.speedrun.mlp_fp8(xs, w_fc, w_proj, w8_fc[0], up[0], w8_proj_t[0], used[0],
                                               torch.tensor(0.01, device=device), False)
        (out * grad.to(device)).sum().backward()
        results[device] = [t.detach().cpu() for t in (w8_fc, w8_proj_t, up, used, out, amax, xs.grad, w_fc.grad,
                                                      w_proj.grad)]
    cpu, cuda = results["cpu"], results["cuda"]
    for a, b in zip(cpu[:4], cuda[:4]):  # the quantizer: the same codes and scales (up to the odd division tie)
        assert (a.float() != b.float()).float().mean() < 1e-4
    record_property("mlp_fp8_out_rel_err", rel(cuda[4], cpu[4]))
    assert rel(cuda[4], cpu[4]) < 0.01 and cuda[5].item() == pytest.approx(cpu[5].item(), rel=2**-7)
    assert all(rel(b, a) < 0.02 for a, b in zip(cpu[6:], cuda[6:]))


@fp8
def test_fused_head_at_the_recipes_shape_follows_the_fp8_head_and_cuts_the_logits_memory(record_property):
    # --fused_head against the FP8 head + compiled softcapped MTP cross-entropy at one micro-step's shapes (the
    # rescale, three next tokens), and validation's loss over one val sequence, from tools/kernel_bench.py: the
    # gradients and the loss, and peak memory above the inputs, which must fall by at least the bf16 logits the
    # fused head never holds whole (times: the benchmark's).
    sys.path.insert(0, str(T.HERE / "tools"))
    import kernel_bench as bench
    cfg = T.parse_config([])
    compile_ = lambda fn: torch.compile(fn, fullgraph=True, dynamic=False)  # noqa: E731
    (x, w), cases = bench.head_cases(cfg, cfg.train_seq_len, torch.bfloat16, CUDA, compile_, fp8=True)
    results = {}
    for path in ("torch", "kernel"):  # timed() calls each 3 times: both gradients are 3x one call's
        x.grad = w.grad = None
        results[path] = bench.timed(cases[path], 1, CUDA)["peak_mib_above_inputs"], x.grad.clone(), w.grad.clone()
        record_property(f"train_{path}_peak_mib_above_inputs", round(results[path][0]))
    (mem_t, gx_t, gw_t), (mem_k, gx_k, gw_k) = results["torch"], results["kernel"]
    record_property("grad_rel_err", f"{rel(gx_k, gx_t):.4f} {rel(gw_k, gw_t):.4f}")
    assert rel(gx_k, gx_t) < 0.05 and rel(gw_k, gw_t) < 0.05
    assert mem_t - mem_k >= cfg.train_seq_len * cfg.vocab_size * 2 / 2**20, (mem_t, mem_k)
    _, cases = bench.eval_cases(cfg, cfg.val_seq_len, torch.bfloat16, CUDA, compile_)
    with torch.no_grad():
        losses = {path: fn().item() for path, fn in cases.items()}
        peaks = {path: bench.timed(fn, 1, CUDA)["peak_mib_above_inputs"] for path, fn in cases.items()}
    record_property("eval_peak_mib_above_inputs", peaks)
    assert abs(losses["kernel"] - losses["torch"]) < 1e-4 * losses["torch"], losses
    assert peaks["torch"] - peaks["kernel"] >= cfg.val_seq_len * cfg.vocab_size * 2 / 2**20, peaks


def test_a_compiled_run_with_both_triton_kernels_learns(tmp_path):
    # --relu2_kernel and --fused_head inside the compiled model (one graph with the custom ops), with the MTP loss:
    # the FP8 MLP through the ReLU^2 GEMM in training, the bf16 one in validation.
    result = T.run(tiny_args(tmp_path, run_id="kernels", relu2_kernel=True, fused_head=True,
                             stage_mtp_start="1/0.5,1/0.5", logit_cap=23, logit_shift=5, num_steps=8, val_every=4,
                             warmup_steps=1, **RUN))
    assert result.val_losses[-1][1] < result.val_losses[0][1] - 0.3


def test_the_recipe_runs_every_matmul_and_flex_attention_in_bf16_on_cuda(record_property):
    # The CPU suite proves this on fake tensors (tests/test_gpu_path.py); here the CUDA kernels dispatch for real:
    # the recipe's model with FlexAttention (compiled alone) at 8,192 tokens, one forward and backward, FP8 head on.
    from test_gpu_path import InputDtypes

    cfg = T.parse_config([])
    cfg.fp8_head = True
    model = T.GPT(cfg, use_flex=True, fp8_head=True, compile_flex=True).cuda()
    s = T.schedule_table(cfg)[-2]
    tokens = torch.randint(0, cfg.vocab_size, (8193,), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    tokens[::1000] = T.BOS_ID
    windows = torch.tensor([s.long_window, s.short_window], dtype=torch.int32, device="cuda")
    ops = InputDtypes()

    def recorded(flex):  # q, k, v recorded here; the compiled kernel runs outside the mode (flex is a HOP)
        def call(q, k, v, **kw):
            ops.seen.append(("flex_attention", (q.dtype, k.dtype, v.dtype)))
            with _disable_current_modes():
                return flex(q, k, v, **kw)
        return call

    model.flex = recorded(model.flex)
    with ops:
        model(tokens[:-1], tokens[1:].long(), windows, torch.tensor(s.mtp_weights, device="cuda")).backward()
    assert any(name == "flex_attention" for name, _ in ops.seen)
    record_property("ops_seen", len(ops.seen))
    assert len(ops.seen) > 50 and not ops.not_bf16(), sorted(set(ops.not_bf16()))
