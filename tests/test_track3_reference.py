"""The track-3 reference's own facts, against values derived by hand from upstream's scripts (result #36's
train_gpt_simple.py, result #2's logged code): schedules, validation steps, the data generator, Newton-Schulz and
Muon's update, parameter names and count, the forward at init and the norms' precision, and a few real training
steps."""
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import track3_reference as R
from conftest import REPO

TINY = dict(vocab_size=512, num_layers=2, model_dim=128, head_dim=64)
TINY_SEQ_LEN = 64
# 12 blocks of q, k, v, proj (768 x 768 + 768 each), fc (3072 x 768 + 3072), proj (768 x 3072 + 768), 2 x 768 gains;
# embed 50304 x 768; head 768 x 50304 + 50304; 2 x 768 gains.
BLOCK_PARAMS = 4 * (768 * 768 + 768) + (3072 * 768 + 3072) + (768 * 3072 + 768) + 2 * 768
DEFAULT_PARAMS = 50304 * 768 + 12 * BLOCK_PARAMS + (768 * 50304 + 50304) + 2 * 768
BLOCK_NAMES = ["attn.q.weight", "attn.q.bias", "attn.k.weight", "attn.k.bias", "attn.v.weight", "attn.v.bias",
               "attn.proj.weight", "attn.proj.bias", "mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight",
               "mlp.proj.bias", "norm1.gains", "norm2.gains"]


@pytest.fixture(autouse=True)
def _one_thread(_cpu_threads):
    """Tiny bf16 matmuls (Newton-Schulz above all) run far faster on one thread of the shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_model(recipe: str = "baseline", seed: int = 0) -> R.RefGPT:
    torch.manual_seed(seed)
    model = R.RefGPT(**TINY, recipe=recipe)
    (R.init_baseline_ if recipe == "baseline" else R.init_adam_)(model)
    return model


def lrs(optimizers: list[torch.optim.Optimizer]) -> list[float]:
    return [group["lr"] for opt in optimizers for group in opt.param_groups]


def write_shard(path: Path, tokens: np.ndarray) -> Path:
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240520, 1, len(tokens))
    path.write_bytes(header.tobytes() + tokens.astype(np.uint16).tobytes())
    return path


# ---------------------------------------------------------------------------------------------------- schedule


def test_baseline_schedule_is_stable_then_linear_to_zero():
    optimizers = R.baseline_optimizers(tiny_model())
    initial = [0.7, 0.004, 0.015, 0.025]  # AdamW embed / head / vectors, Muon
    assert lrs(optimizers) == initial
    expected_eta = {0: 1.0, 974: 1.0, 975: 1.0, 976: (2274 / 3250) / 0.7, 1625: (1625 / 3250) / 0.7,
                    3249: (1 / 3250) / 0.7}
    for step, eta in expected_eta.items():
        R.set_hparams(optimizers, step, R.BASELINE_STEPS)
        assert lrs(optimizers) == pytest.approx([lr * eta for lr in initial], rel=1e-12), step
    with pytest.raises(AssertionError):
        R.set_hparams(optimizers, R.BASELINE_STEPS, R.BASELINE_STEPS)


def test_adam_schedule_warms_every_group_then_cools_down():
    optimizers = R.adam_optimizers(tiny_model("adam"))
    initial = [0.3, 1 / 320, 0.01, 0.0015]  # aux embed / head / vectors, block AdamW
    expected_factor = {0: 1 / 250, 124: 125 / 250, 249: 1.0, 1687: 1.0,  # 1687 / 5625 < 0.3 <= 1688 / 5625
                       1688: (3937 / 5625) / 0.7, 5624: (1 / 5625) / 0.7}
    for step, factor in expected_factor.items():
        R.set_hparams(optimizers, step, R.ADAM_STEPS, recipe="adam")
        assert lrs(optimizers) == pytest.approx([lr * factor for lr in initial], rel=1e-12), step


def test_validation_steps():
    baseline = R.validation_steps(3250)
    assert baseline[:3] == [0, 125, 250]
    assert baseline[23:26] == [2875, 2925, 2950]  # 2925 / 3250 is exactly 0.9: every 25 from there
    assert baseline[-1] == 3250 and len(baseline) == 24 + 14
    long_baseline = R.validation_steps(5625)
    assert long_baseline[40:43] == [5000, 5075, 5100]  # 0.9 * 5625 = 5062.5
    assert long_baseline[-1] == 5625 and len(long_baseline) == 41 + 23
    assert R.validation_steps(5625, recipe="adam") == list(range(0, 5626, 125))  # result #2: every 125 throughout


def test_optimizer_groups():
    model = tiny_model()
    adamw, muon = R.baseline_optimizers(model)
    embed, head, vectors = adamw.param_groups
    assert embed["params"] == [model.embed.weight] and head["params"] == [model.proj.weight]
    assert vectors["params"] == [p for p in model.parameters() if p.ndim == 1]
    assert adamw.defaults["betas"] == (0.8, 0.95) and adamw.defaults["eps"] == 1e-10
    assert adamw.defaults["weight_decay"] == 0.001 and adamw.defaults["fused"]
    assert (muon.defaults["lr"], muon.defaults["weight_decay"], muon.defaults["mu"]) == (0.025, 0.05, 0.95)
    matrices = list(muon.param_groups[0]["params"])
    blocks = model.blocks
    dim = TINY["model_dim"]
    assert [tuple(p.shape) for p in matrices] == [(4 * dim, dim)] * 2 + [(dim, 4 * dim)] * 2 + [(dim, dim)] * 8
    # Stable sort: equal shapes keep model order.
    assert matrices[:2] == [blocks[0].mlp.fc.weight, blocks[1].mlp.fc.weight]
    assert matrices[4:8] == [blocks[0].attn.q.weight, blocks[0].attn.k.weight, blocks[0].attn.v.weight,
                             blocks[0].attn.proj.weight]
    aux, block_adamw = R.adam_optimizers(tiny_model("adam"))
    assert aux.defaults["weight_decay"] == 0 and aux.defaults["betas"] == (0.8, 0.95)
    assert block_adamw.defaults["betas"] == (0.9, 0.95) and block_adamw.defaults["weight_decay"] == 0.10
    assert len(block_adamw.param_groups[0]["params"]) == 12


# -------------------------------------------------------------------------------------------------------- data


def test_data_batches_slice_per_rank_and_switch_shards(tmp_path):
    first = np.arange(0, 100)
    second = np.arange(1000, 1100)
    files = [write_shard(tmp_path / "s_000001.bin", second), write_shard(tmp_path / "s_000000.bin", first)]
    for rank in range(2):
        batches = R.data_batches(files, batch_tokens=32, seq_len=8, rank=rank, world_size=2)
        # Three batches from the first shard (the fourth would need tokens 96..128), then the second's start.
        starts = [(first, 0), (first, 32), (first, 64), (second, 0), (second, 32), (second, 64)]
        for shard, pos in starts:
            inputs, targets = next(batches)
            start = pos + 16 * rank
            assert inputs.dtype == torch.int32 and targets.dtype == torch.int64
            assert inputs.tolist() == shard[start:start + 16].reshape(2, 8).tolist()
            assert targets.tolist() == shard[start + 1:start + 17].reshape(2, 8).tolist()
        with pytest.raises(RuntimeError):  # out of shards: StopIteration inside a generator
            next(batches)


@pytest.mark.parametrize("length, batches_from_first", [(97, 2), (98, 3)])
def test_data_batches_switch_when_exactly_a_batch_plus_one_is_left(tmp_path, length, batches_from_first):
    """pos + batch + 1 >= len: with 97 tokens, tokens 64..96 would make the third batch, yet the shard is left."""
    files = [write_shard(tmp_path / "s_000000.bin", np.arange(length)),
             write_shard(tmp_path / "s_000001.bin", np.arange(1000, 1100))]
    batches = R.data_batches(files, batch_tokens=32, seq_len=8, rank=1, world_size=2)
    firsts = [int(next(batches)[0][0, 0]) for _ in range(batches_from_first + 1)]
    assert firsts == [16 + 32 * k for k in range(batches_from_first)] + [1016]


def test_val_batch_is_the_first_batch(tmp_path):
    files = [write_shard(tmp_path / "v_000000.bin", np.arange(500, 700))]
    inputs, targets = R.val_batch(files, val_tokens=64, seq_len=8, rank=1, world_size=2)
    assert inputs.flatten().tolist() == list(range(532, 564)) and targets.flatten().tolist() == list(range(533, 565))


def test_full_scale_validation_batch_per_rank(tmp_path):
    """val_tokens = 20 x 524288: 10240 sequences of 1024 at world size 1 (160 micro-batches of 64), 1280 a rank at
    world size 8, rank r's from token r x 1310720."""
    tokens = np.arange(R.VAL_TOKENS + 2) % 50000
    files = [write_shard(tmp_path / "v_000000.bin", tokens)]
    inputs, targets = R.val_batch(files, R.VAL_TOKENS, R.SEQ_LEN, rank=0, world_size=1)
    assert inputs.shape == targets.shape == (10240, 1024) and len(inputs) // R.MBS == 160
    inputs, targets = R.val_batch(files, R.VAL_TOKENS, R.SEQ_LEN, rank=7, world_size=8)
    assert inputs.shape == (1280, 1024) and len(inputs) % R.MBS == 0
    start = 7 * 1310720
    assert inputs[0, :3].tolist() == (tokens[start:start + 3]).tolist()
    assert targets[-1, -1].item() == tokens[start + 1310720]
    train = next(R.data_batches(files, R.BATCH_TOKENS, R.SEQ_LEN, rank=0, world_size=1))[0]
    assert train.shape == (512, 1024) and len(train) // R.MBS == 8


# ------------------------------------------------------------------------------------------------------ Muon


def test_newton_schulz_orthogonalizes_both_orientations():
    torch.manual_seed(0)
    for shape in [(64, 32), (32, 64)]:
        out = R.newton_schulz(torch.randn(shape))
        assert out.dtype == torch.bfloat16 and out.shape == shape
        singular = torch.linalg.svdvals(out.float())
        assert (singular - 1).abs().max() < 0.1, singular


def test_muon_update_mutates_as_upstream_and_scales_tall_matrices():
    torch.manual_seed(0)
    grad, momentum = torch.randn(8, 2), torch.randn(8, 2)
    expected_momentum = 0.95 * momentum + 0.05 * grad
    expected_nesterov = 0.05 * grad + 0.95 * expected_momentum
    update = R.muon_update(grad, momentum)
    torch.testing.assert_close(momentum, expected_momentum)
    torch.testing.assert_close(grad, expected_nesterov)  # the gradient itself becomes the Nesterov blend
    assert torch.equal(update, R.newton_schulz(grad) * 2)  # sqrt(8 / 2)


def test_muon_step_decays_then_adds_the_update():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 4))
    grad = torch.randn(4, 4)
    before = p.detach().clone()
    p.grad = grad.clone()
    muon = R.RefMuon([p], lr=0.1, weight_decay=2.0)
    muon.step()
    update = R.newton_schulz(grad * 0.05 * 0.95 + grad * 0.05)  # first step: momentum 0.05 g, Nesterov 0.0975 g
    torch.testing.assert_close(p.detach(), before * (1 - 0.1 * 2.0) - 0.1 * update.float(), rtol=0, atol=2e-3)


# ----------------------------------------------------------------------------------------------------- model


def test_parameter_names_dtypes_and_count():
    with torch.device("meta"):
        model = R.RefGPT()
    names = [name for name, _ in model.named_parameters()]
    expected = (["embed.weight"] + [f"blocks.{i}.{name}" for i in range(12) for name in BLOCK_NAMES]
                + ["proj.weight", "proj.bias", "norm1.gains", "norm2.gains"])
    assert names == expected and len(names) == 173
    assert sum(p.numel() for p in model.parameters()) == DEFAULT_PARAMS == 162_354_816
    assert {name for name, p in model.named_parameters() if p.dtype != torch.float32} == {"embed.weight"}
    assert model.embed.weight.dtype == torch.bfloat16


def test_init_baseline_laws():
    model = tiny_model()
    for name, p in model.named_parameters():
        if "proj" in name or name.endswith("bias"):
            assert not p.any(), name
        elif name.endswith("gains"):
            assert torch.equal(p, torch.ones_like(p)), name
    fc = model.blocks[0].mlp.fc.weight
    assert fc.std().item() == pytest.approx((0.33 / TINY["model_dim"]) ** 0.5, rel=0.05)
    assert model.embed.weight.float().std().item() == pytest.approx(1.0, rel=0.05)


def test_loss_at_init_is_log_vocab_and_softcap_formula():
    """The head starts at zero, so every logit is 0 and each token costs ln(V). A head bias of 30 on token 1 gives
    it the capped logit 15 * 30 / sqrt(30^2 + 15^2); the targets (token 0) keep logit 0."""
    model = tiny_model()
    torch.manual_seed(1)
    inputs = torch.randint(0, 512, (2, 16), dtype=torch.int32)
    targets = torch.zeros(2, 16, dtype=torch.int64)
    assert model(inputs, targets).item() == pytest.approx(32 * math.log(512), rel=1e-6)
    with torch.no_grad():
        model.proj.bias[1] = 30.0
    capped = 15 * 30 / math.sqrt(30**2 + 15**2)
    per_token = math.log(math.exp(capped) + 511)
    assert model(inputs, targets).item() == pytest.approx(32 * per_token, rel=1e-5)


@pytest.mark.parametrize("recipe, expected", [("baseline", 11.3125), ("adam", 11.375)])
def test_block_norm_precision(recipe, expected):
    """x = e_0 normalizes to sqrt(128) = 11.3137. Result #36 casts the gains to bf16 first (1.0039 -> 1.0):
    bf16(11.3137) = 11.3125; result #2 multiplies by the fp32 gains before rounding: bf16(11.3578) = 11.375."""
    norm = R.RefGPT(**TINY, recipe=recipe).norm1
    with torch.no_grad():
        norm.gains.fill_(1.0039)
    x = torch.zeros(1, 1, 128, dtype=torch.bfloat16)
    x[0, 0, 0] = 1
    y = norm(x)
    assert y.dtype == torch.bfloat16 and y[0, 0, 0].item() == expected and not y[0, 0, 1:].any()


def test_rotary_turns_the_first_quarter_of_each_half():
    rotary = R.RefGPT(vocab_size=8, num_layers=1, model_dim=8, head_dim=8).blocks[0].attn.rotary
    assert rotary.angular_freq.tolist() == [1.0, 1 / 1024, 0.0, 0.0]
    x = torch.arange(1, 17, dtype=torch.float32).view(1, 2, 1, 8)
    y = rotary(x)
    assert torch.equal(y[0, 0], x[0, 0])  # position 0
    unturned = [2, 3, 6, 7]
    assert torch.equal(y[0, 1, 0, unturned], x[0, 1, 0, unturned])
    a, b = x[0, 1, 0, 0].item(), x[0, 1, 0, 4].item()  # dim 0 pairs with dim 4, at angle 1 * 1 rad
    assert y[0, 1, 0, 0].item() == pytest.approx(a * math.cos(1) + b * math.sin(1), rel=1e-6)
    assert y[0, 1, 0, 4].item() == pytest.approx(-a * math.sin(1) + b * math.cos(1), abs=1e-5)  # cancels


# -------------------------------------------------------------------------------------------------- training


def sample_batches(pattern: str, batch_seqs: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    files = sorted((REPO / "data" / "sample").glob(pattern))
    return R.data_batches(files, batch_seqs * TINY_SEQ_LEN, TINY_SEQ_LEN, rank=0, world_size=1)


@pytest.mark.parametrize("recipe, steps, min_drop", [("baseline", 5, 0.15), ("adam", 3, 2e-4)])
def test_train_steps_lower_the_loss_on_the_sample(recipe, steps, min_drop):
    """Tokens modulo the tiny vocab; at init the loss is ln(512) exactly (zero head)."""
    vocab = TINY["vocab_size"]
    model = tiny_model(recipe)
    optimizers = R.baseline_optimizers(model) if recipe == "baseline" else R.adam_optimizers(model)
    val_inputs, val_targets = next(sample_batches("sample_val_*.bin", 8))
    val_inputs, val_targets = val_inputs % vocab, val_targets % vocab
    start = R.val_loss(model, val_inputs, val_targets, mbs=4)
    assert start == pytest.approx(math.log(vocab), rel=1e-6)
    train = sample_batches("sample_train_*.bin", 4)
    losses = []
    for step in range(steps):
        inputs, targets = next(train)
        losses.append(R.train_step(model, optimizers, inputs % vocab, targets % vocab, step, 8, mbs=2, recipe=recipe))
        assert all(p.grad is None for p in model.parameters())
    assert losses[0] == pytest.approx(inputs.numel() * math.log(vocab), rel=1e-6)
    end = R.val_loss(model, val_inputs, val_targets, mbs=4)
    assert end < start - min_drop and model.training
