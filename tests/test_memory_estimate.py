"""tools/memory_estimate.py: GPU memory per rank at the real shapes from traces on fake tensors. The recipe fits an
80 GB H100 on 1 GPU and on 8; the estimate of record #28's snapshot lands near the memory record #28 logged on
8xH100, and the tool's model of record #89's own storage near the memory #89 logged; the liveness walk counts what
inductor materializes, not fused intermediates. --micro_split lowers a training micro-step's activations only; the
per-card table (--cards) resolves each card's kernel paths as the trainer does and names the smallest split that
fits."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from conftest import REPO, fake_gpu

sys.path.insert(0, str(REPO / "tools"))
import memory_estimate as M  # noqa: E402

RECORD28_ALLOCATED_MIB = (33_860, 34_761)  # record #28's logged peak allocated per GPU, 8xH100
RECORD89_ALLOCATED_MIB = 30_220  # record #89's, its README's log (its 13 logs: 30,220-30,935 MiB; 8xH100)
# #85 v3's (MuddGatedAndDC/this_pr_v3, 10 logs, 8xH100): the nearest logged code to upstream f411b3d (spec §1.3)
V3_ALLOCATED_MIB = (31_765, 32_160)


def test_liveness_counts_gemm_outputs_and_what_they_read_not_fused_pointwise_chains():
    def f(x, w):
        h = torch.relu(x @ w) * 2  # the GEMM's output exists; relu and *2 fuse into the reduction
        return (h + 1).sum(), h.T @ x  # h is read by a GEMM: it exists too

    x, w = torch.ones(64, 32), torch.ones(32, 16)
    graph = make_fx(f, tracing_mode="fake")(x, w).graph
    peak, at = M.liveness_peak(graph, M.leading_inputs(graph, 2))
    # x @ w and h (64 x 16 fp32 each) at once; relu's output and h + 1 never exist; then h, the sum and h.T @ x
    assert (peak, at.name) == (2 * 64 * 16 * 4, "mul"), (peak, at)


def test_record89s_static_tensors_are_the_ones_its_source_allocates():
    """Counted here from #89's own shapes (its train_gpt.py; spec 4.1, 5): the tool states them (RECORD89_PARAMS),
    whatever model train_gpt.py holds."""
    V, d, bigram = 50304, 768, 754_560 * 192
    tables = [V * d, d * V, 5 * V * d, bigram]  # embed, lm_head, value embeddings, bigram: bf16, sharded Adam
    gates = 10 * 6 * 12 + 5 * 6 * 12 + 12 + 12  # attention and VE gate banks, smear and skip gates: bf16, Adam
    mudd = 2 * 64 * 768 + 2 * 14 * 64 + 2 * 14  # w1, w2, b2: bf16, Adam
    fp32 = 24 + 11 * 2 + 11 * 2 + 11 + 11 + 11 * 6  # scalars, resid and post lambdas, x0, bigram, XSA: fp32, Adam
    qk, vo, mlp = (64, 256, 768), (24, 768, 768), (24, 3072, 768)  # padded: 60 -> 64, 20 -> 24, 22 -> 24 matrices
    matrices = sum(n * r * c for n, r, c in (qk, vo, mlp))
    bf16 = sum(tables) + gates + mudd
    cfg = M.recipe_config([])
    got, signs = M.record89_static(cfg, 8)
    expected = {
        "parameters": 2 * (bf16 + matrices) + 4 * fp32,
        "gradients": 2 * bf16 + 4 * fp32,  # the Adam ones, kept over even steps
        "muon_gradients": 2 * matrices,
        # m and v fp32: an eighth of the tables, all of the rest; Muon: 8 of 64, 3 of 24, 3 of 24 matrices per rank,
        # an fp32 momentum + a uint16 mantissa each, and an fp32 second moment per column (qk) or row (vo, mlp)
        "optimizer": sum(tables) + 8 * (gates + mudd + fp32) + 6 * (8 * 256 * 768 + 3 * 768 * 768 + 3 * 3072 * 768)
        + 4 * (8 * 768 + 3 * 768 + 3 * 3072),
        # bf16 cos and sin, 2 x 262,144 rows: normal and paired; e4m3 W_fc and W_proj^T of 12 layers; the sign table
        "tables": 2 * 2 * (2 * 262_144) * (128 + 256) + 24 * 3072 * 768 + 2 * 8192 * 192,
    }
    assert signs == 2 * 8192 * 192
    assert got == expected, {k: got[k] - expected[k] for k in expected}


def test_upstreams_static_tensors_are_its_parameter_table_with_89s_storage():
    """Counted here from upstream f411b3d's shapes (upstream_head_spec.md §2.2): #89's five gate/lambda tensors gone,
    the MUDD gate network added, the bigram table 377,280 x 768, the sign table 8192 x 768, the prefix table."""
    V, d, bigram = 50304, 768, 377_280 * 768
    tables = [V * d, d * V, 5 * V * d, bigram]
    gates = 5 * 6 * 12 + 12  # VE gate bank, smear gate: bf16
    mudd = 2 * (2 * 64 * 768) + 2 * 14 * 64 + 2 * 14 + 2 * 41 * 64 + 2 * 41  # mudd_w1/w2/b2, mudd_gate_w1/w2/b2: bf16
    fp32 = 24 + 11 * 2 + 11 * 2 + 1  # scalars, resid and post lambdas, the 0-d _mudd_gate_scale
    qk, vo, mlp = (64, 256, 768), (24, 768, 768), (24, 3072, 768)
    matrices = sum(n * r * c for n, r, c in (qk, vo, mlp))
    bf16 = sum(tables) + gates + mudd
    got, signs = M.upstream_static(M.recipe_config([]), 8)
    expected = {
        "parameters": 2 * (bf16 + matrices) + 4 * fp32,
        "gradients": 2 * bf16 + 4 * fp32,
        "muon_gradients": 2 * matrices,
        "optimizer": sum(tables) + 8 * (gates + mudd + fp32) + 6 * (8 * 256 * 768 + 3 * 768 * 768 + 3 * 3072 * 768)
        + 4 * (8 * 768 + 3 * 768 + 3 * 3072),
        "tables": 2 * 2 * (2 * 262_144) * (128 + 256) + 24 * 3072 * 768 + 2 * 8192 * 768 + 8 * 50304,
    }
    assert signs == 2 * 8192 * 768
    assert got == expected, {k: got[k] - expected[k] for k in expected}


@pytest.fixture(scope="module")
def repo_output(tmp_path_factory) -> list[dict]:
    """One run of the tool with its card table (--cards): the presets' rows and the cards'."""
    return estimate_rows(tmp_path_factory.mktemp("memory"), cards=True)


@pytest.fixture(scope="module")
def repo_rows(repo_output) -> list[dict]:
    return [r for r in repo_output if "card" not in r]


@pytest.fixture(scope="module")
def card_table(repo_output) -> list[dict]:
    return [r for r in repo_output if "card" in r]


def estimate_rows(tmp_path, trainer: str | None = None, cards: bool = False) -> list[dict]:
    env = {**os.environ, **({"SPEEDRUN_TRAINER": trainer} if trainer else {})}
    run = subprocess.run([sys.executable, str(REPO / "tools" / "memory_estimate.py"), "--json",
                          str(tmp_path / "memory.json"), *(["--cards"] if cards else [])],
                         capture_output=True, text=True, timeout=900, env=env)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    rows = json.loads((tmp_path / "memory.json").read_text())
    assert any("card" in r for r in rows) == cards
    for r in rows:
        if "card" in r:
            continue
        assert r["total"] <= M.LIMIT_BYTES and r["saved"] > 2**30, r
        assert r["static"] == r["parameters"] + r["gradients"] + r["optimizer"] + r["tables"]
        assert r["total"] == r["static"] + r["peak_snapshot"] + r["peak_activations"]
    return rows


def test_the_recipe_fits_an_80_gb_gpu_and_its_kernels_cut_the_peak(repo_rows):
    presets = {*M.PRESETS, M.RECORD89, M.UPSTREAM}
    assert {(r["preset"], r["gpus"]) for r in repo_rows} == {(p, g) for p in presets for g in (1, 8)}
    by = {(r["preset"], r["gpus"]): r for r in repo_rows}
    assert by["recipe", 1]["optimizer"] > 4 * by["recipe", 8]["optimizer"]  # sharded over 8 ranks
    # The fused head never holds the (T, vocab) logits: the recipe with its kernels peaks well below its torch path.
    assert by["recipe", 8]["train_peak"] < 0.6 * by["recipe torch path", 8]["train_peak"]
    # The warmup trains (never validates) holding clones of the parameters, the optimizer state and the persistent
    # buffers (the FP8 MLP's codes and scales, the sign table): on top of the train peak, where the recipe peaks.
    persistent = 2 * 11 * 3072 * 768 + 4 * 11 * 4 + 2 * 8192 * 768  # e4m3 W_fc, W_proj^T; 4 scale vectors; signs
    for gpus in (1, 8):
        r = by["recipe", gpus]
        assert r["warmup_snapshot"] == r["parameters"] + r["optimizer"] + persistent and r["peak_phase"] == "train", r
        assert r["peak_snapshot"] == r["warmup_snapshot"]


def test_the_estimate_of_record89s_own_memory_is_near_the_peak_record89_logged(repo_rows):
    by = {(r["preset"], r["gpus"]): r for r in repo_rows}
    r89, ours = by[M.RECORD89, 8], by["recipe", 8]
    logged = RECORD89_ALLOCATED_MIB * 2**20
    # One tensor, known exactly, is most of it: a tighter band than #28's liveness upper bound needs.
    assert 0.97 * logged <= r89["total"] <= 1.03 * logged, r89["total"] / logged
    # The peak is a validation batch in the warmup: the val logits (262,144 x 50304 bf16) with the warmup's deep
    # copies and the Adam gradients of its even steps. Without the copies the estimate falls out of the band.
    logits = 262_144 * 50_304 * 2
    assert r89["peak_phase"] == "validation" and logits < r89["peak_activations"] < logits + 2**30, r89
    assert r89["total"] - r89["peak_snapshot"] < 0.97 * logged
    # #89's training (bf16 logits and their e5m2 gradient) stays below its validation; ours holds no logits at all.
    assert r89["train_peak"] < r89["validation_peak"] and ours["total"] < 0.75 * r89["total"]
    # Term by term (the tool's second table) upstream's storage of the same parameters and the recipe's differ by under
    # 1 GiB outside the activations at the peak: the gap is upstream's validation logits against the recipe's training.
    up = by[M.UPSTREAM, 8]
    assert abs((up["total"] - ours["total"]) - (up["peak_activations"] - ours["peak_activations"])) < 2**30


def test_the_estimate_of_upstreams_own_memory_is_near_the_peak_85_v3_logged(repo_rows):
    # #85 v3 is the nearest logged code (spec §1.3); its peak, like #89's, is a warmup validation batch's logits.
    by = {(r["preset"], r["gpus"]): r for r in repo_rows}
    up, r89 = by[M.UPSTREAM, 8], by[M.RECORD89, 8]
    low, high = (m * 2**20 for m in V3_ALLOCATED_MIB)
    assert 0.97 * low <= up["total"] <= 1.03 * high, up["total"] / low
    assert up["peak_phase"] == "validation" and up["peak_activations"] == r89["peak_activations"]
    # The 768-wide bigram table (bf16 parameter and gradient, sharded fp32 moments, the warmup's copies) is most of
    # what upstream holds above #89: 377,280 x 768 - 754,560 x 192 = 144,875,520 more values.
    more = 144_875_520 * (2 + 2 + 8 / 8 + 2 + 8 / 8)
    assert 0.9 * more < up["total"] - r89["total"] < 1.1 * more + 2**27, (up["total"] - r89["total"]) / more


def test_the_estimate_of_record28s_snapshot_is_near_the_peak_record28_logged(tmp_path):
    rows = estimate_rows(tmp_path, str(REPO / "records" / "snapshots" / "2026-11-25_record28" / "train_gpt.py"))
    by = {r["gpus"]: r for r in rows}
    assert {r["preset"] for r in rows} == {"2026-11-25_record28"}
    logged = RECORD28_ALLOCATED_MIB[0] * 2**20
    assert 0.85 * logged <= by[8]["total"] <= 1.1 * logged, by[8]["total"] / logged


def small_split_config(micro_split: int):
    """The tiny preset's model at one training length (512: splits of 2 and 4 cut it into whole blocks), traced as
    the GPU resolves it, without the fused head: the (T, vocab) logits and their gradient scale with the micro-step."""
    return M.recipe_config(["--preset=tiny", "--stage_seq_len=512,512,512,512", "--fused_head=false",
                            f"--micro_split={micro_split}"])


def test_the_micro_split_lowers_a_training_micro_steps_activations_only():
    traces = {1: M.traced(small_split_config(1)), **{s: M.activation_bytes(small_split_config(s)) for s in (2, 4)}}
    statics = {(s, w): M.static_bytes(small_split_config(s), w) for s in (1, 2, 4) for w in (1, 8)}
    assert [traces[s]["micro_len"] for s in (1, 2, 4)] == [512, 256, 128]
    # Each piece holds half of the one before it: saved activations and the training peak fall by about half.
    assert traces[4]["saved"] < traces[2]["saved"] < traces[1]["saved"]
    assert traces[4]["train_peak"] < traces[2]["train_peak"] < traces[1]["train_peak"]
    assert 2 * traces[2]["saved"] < 1.25 * traces[1]["saved"] and 2 * traces[4]["saved"] < 1.25 * traces[2]["saved"]
    # Validation (never split), the static tensors and the warmup's snapshot of them: the same at every split.
    assert len({traces[s]["validation_peak"] for s in traces}) == 1
    for w in (1, 8):
        assert statics[1, w] == statics[2, w] == statics[4, w]
    # The tool's cache traces a split's training alone and takes validation from the unsplit trace (traced above):
    # the same figures as the split's whole trace.
    cached = M.traced(small_split_config(2))
    assert {k: cached[k] for k in traces[2]} == traces[2]


def test_the_split_halves_the_recipes_micro_step_at_the_real_shapes(card_table):
    """The cards that needed a split: their traces at the real shapes, each split's saved activations and training
    peak below the one before it, static and validation unchanged."""
    walked = [r["tried"] for r in card_table if len(r["tried"]) > 1]
    assert walked, "no card needed a split: nothing to compare"
    for tried in walked:
        for smaller, larger in zip(tried, tried[1:]):
            assert larger["micro_split"] == 2 * smaller["micro_split"]
            assert larger["saved"] < 0.75 * smaller["saved"] and larger["train_peak"] < smaller["train_peak"]
            assert (larger["static"], larger["validation_peak"]) == (smaller["static"], smaller["validation_peak"])


@pytest.mark.parametrize("card", M.CARDS, ids=[c[0] for c in M.CARDS])
def test_each_cards_kernel_paths_are_the_trainers_resolution_at_its_capability(monkeypatch, card):
    name, gb, capability = card
    real = M.T.gpu_capability
    got = M.card_config(capability, 1, 8)
    assert M.T.gpu_capability is real  # the fake capability is the tool's for the call only
    with monkeypatch.context() as patched:
        fake_gpu(patched, capability)
        expected = M.T.parse_config([])
        M.T.resolve_for_device(expected, cuda=True)
    assert {f: getattr(got, f) for f in M.PATH_FLAGS} == {f: getattr(expected, f) for f in M.PATH_FLAGS}
    if capability < M.T.gpt_kernels.FP8_MIN:  # the A100s: no FP8 (the head and the MLP in bf16)
        assert not (got.fp8_mlp or got.fp8_head) and got.fused_head, name
    for flag, fp8 in (("relu2_kernel", "fp8_mlp"), ("fused_head", "fp8_head")):  # each kernel where RUNS_ON has it
        runs_on = M.T.gpt_kernels.RUNS_ON
        runs = capability in runs_on[flag] and (not getattr(got, fp8) or capability in runs_on[f"{flag}+{fp8}"])
        assert getattr(got, flag) == runs, (name, flag)
    if capability == (9, 0):  # the H100 and H200 run the recipe preset's path (the tool's presets trace it)
        assert all(getattr(got, f) for f in M.PATH_FLAGS)
        assert all(getattr(got, f) == getattr(M.recipe_config([]), f) for f in M.PATH_FLAGS)


def test_the_card_table_names_the_smallest_split_that_fits(card_table, repo_rows):
    assert [(r["card"], r["gpus"]) for r in card_table] == [(c[0], g) for c in M.CARDS for g in (1, 8)]
    presets = {(r["preset"], r["gpus"]): r for r in repo_rows}
    for r in card_table:
        capability = next(c[2] for c in M.CARDS if c[0] == r["card"])
        assert r["limit"] == r["gb"] * 10**9 - M.RESERVE_BYTES < r["gb"] * 10**9
        assert {f: r[f] for f in M.PATH_FLAGS} == {f: getattr(M.card_config(capability, 1, 1), f) for f in M.PATH_FLAGS}
        tried = r["tried"]
        assert [t["micro_split"] for t in tried] == list(M.SPLITS[:len(tried)])
        assert all(t["fits"] == (t["total"] <= r["limit"]) for t in tried)
        assert r["total_unsplit"] == tried[0]["total"] and r["fits_unsplit"] == tried[0]["fits"]
        # Every split before the last tried does not fit; the last one is the answer, or the split runs out or
        # cannot help (a validation peak).
        assert not any(t["fits"] for t in tried[:-1]), r
        if r["micro_split"] is not None:
            assert r["micro_split"] == tried[-1]["micro_split"] and r["total"] == tried[-1]["total"] <= r["limit"]
        else:
            assert not tried[-1]["fits"] and (tried[-1]["peak_phase"] == "validation"
                                              or len(tried) == len(M.SPLITS)), r
        if capability == (9, 0):  # unsplit, the H100's and H200's path is the recipe preset's: the same total
            assert r["total_unsplit"] == presets["recipe", r["gpus"]]["total"]
    # More memory never needs a larger split, on the same path and rank count.
    for a in card_table:
        for b in card_table:
            if a["gpus"] == b["gpus"] and a["path"] == b["path"] and a["gb"] < b["gb"] and a["micro_split"]:
                assert b["micro_split"] is not None and b["micro_split"] <= a["micro_split"], (a, b)


@pytest.mark.parametrize("target, message", [
    ("notes.txt/memory.json", "{tmp}/notes.txt is a file, not a folder"),
    (".", "a folder, not a file"),
    ("/proc/memory.json", "cannot write a file in /proc ("),  # procfs takes no new file, not even root's
])
def test_a_json_path_it_cannot_write_is_one_line_before_any_tracing(tmp_path, target, message):
    # The tracing takes minutes: a bad --json used to fail after them, with a traceback.
    (tmp_path / "notes.txt").write_text("kept\n")
    run = subprocess.run([sys.executable, str(REPO / "tools" / "memory_estimate.py"), "--json", target],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stdout == "", run.stderr  # no table: it stopped before the estimate
    assert run.stderr.startswith(f"error: --json={target}: {message.format(tmp=tmp_path)}") and \
        run.stderr.count("\n") == 1, run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_json_path_it_can_write_is_left_as_it_was(tmp_path):
    existing, new = tmp_path / "rows.json", tmp_path / "new" / "rows.json"
    existing.write_text("kept\n")
    assert M.unwritable(existing) is None and M.unwritable(new) is None
    assert existing.read_text() == "kept\n" and sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]
