"""Profiling and benchmark: --profile/--bench on tiny CPU runs (their trace analysis: test_trace_report.py),
the load-balance count against the dense mask. No speed thresholds anywhere."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt as T
from conftest import REPO, main_in_process, tiny_args

sys.path.insert(0, str(REPO / "tools"))
import load_balance as LB  # noqa: E402
import trace_report as TR  # noqa: E402


def test_recipe_matmul_weights():
    with torch.device("meta"):
        model = T.GPT(T.Config(), use_flex=True, fp8_head=True)
    # The recipe's N: 10 attention layers (4 x 768^2), 5 VE gates (6 x 12), 11 MLPs (2 x 768 x 3072), the smear's
    # gate (12), MUDD's two MLPs (64 x 768 + 14 x 64 each), the gate network's two (64 x 768 + 41 x 64 each) and the
    # LM head (50304 x 768).
    assert T.matmul_weights(model) == (10 * 4 * 768**2 + 5 * 72 + 11 * 2 * 768 * 3072 + 12
                                       + 2 * (64 * 768 + 14 * 64) + 2 * (64 * 768 + 41 * 64) + 50304 * 768)
    assert T.matmul_weights(model) == 114_334_964


# -----------------------------------------------------------------------------
# --profile and --bench on tiny CPU runs


def small(tmp_path, **kw):
    return tiny_args(tmp_path, **{"global_batch_seqs": 2, "val_every": 0, "val_tokens": 1024, **kw})


def trace_steps(path: Path) -> list[int]:
    return sorted(TR.cpu_step_spans(TR.load_trace(path)))


def test_profile_writes_one_trace_per_run_and_the_report_reads_it(tmp_path, capsys):
    T.run(small(tmp_path, num_steps=3, profile="1:3", run_id="prof"))
    folder = tmp_path / "logs" / "prof"
    assert sorted(p.name for p in folder.iterdir()) == ["trace_rank0.json.gz"]
    assert trace_steps(folder / "trace_rank0.json.gz") == [1, 2]
    assert f"profile: steps 1..2 traced to {folder}" in capsys.readouterr().out
    assert TR.main([str(folder)]) == 0
    assert capsys.readouterr().out.startswith("rank 0: steps=2, trace_ms_per_step_median=")
    assert TR.main([str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_bench_prints_figures_and_writes_json(tmp_path, capsys):
    result = T.run(small(tmp_path, num_steps=6, bench=True, bench_steps=1, run_id="bench"))
    out = capsys.readouterr().out
    for label in ["bench: ms/step", "bench: tokens/s", "bench: MFU", "bench: peak memory", "bench: GPU idle",
                  "bench: H2D overlapped", "bench: comm overlapped"]:
        assert label in out
    assert "val_loss" not in out  # a benchmark does not validate
    assert "step:5/6" in out and "step:6/6" not in out  # settle 2 + timed 1 + profiler warmup 1 + traced 1
    report = json.loads((tmp_path / "logs" / "bench_bench.json").read_text())
    assert report == json.loads(json.dumps(result.bench))
    assert report["timed_steps"] == [2, 2] and report["traced_steps"] == [4, 4]
    assert report["ms_per_step_median"] > 0 and report["tokens_per_s"] > 0 and report["tokens_per_step"] == 256
    assert report["mfu_pct"] is None and report["gpu_idle_frac"] is None and report["peak_memory_allocated_mib"] is None
    assert report["per_rank"][0]["steps"] == 1
    assert trace_steps(tmp_path / "logs" / "bench" / "trace_rank0.json.gz") == [4]


def test_bench_needs_data_for_its_own_steps_only(tmp_path):
    # The benchmark runs the first steps of a long schedule (the recipe's 1695 steps on a small corpus).
    args = small(tmp_path, num_steps=100_000, bench=True, bench_steps=1, run_id="long")
    with pytest.raises(T.UsageError, match="the run needs 100000 steps"):
        T.run([a for a in args if not a.startswith("--bench")])
    assert T.run(args).bench["traced_steps"] == [4, 4]


@pytest.mark.parametrize("flags, message", [
    (["--profile=5"], "--profile expects START:END"),
    (["--profile=9:3"], "needs 0 <= START < END"),
    (["--profile=a:b"], "--profile expects START:END"),
    (["--profile=2:7"], "END is beyond --num_steps=6"),
    (["--bench", "--profile=1:2"], "leave out --profile"),
    (["--bench", "--bench_steps=3"], "runs 9 steps but --num_steps is 6"),
    (["--bench", "--bench_steps=0"], "--bench_steps must be > 0"),
])
def test_bad_profile_and_bench_values(tmp_path, flags, message):
    with pytest.raises(T.UsageError, match=message.replace("+", r"\+")) as err:
        T.validate_config(T.parse_config(tiny_args(tmp_path) + flags), 1)
    assert "\n" not in str(err.value)


def test_bad_profile_value_is_one_line_on_the_command_line(tmp_path, monkeypatch, capsys):
    code, _, err = main_in_process([*tiny_args(tmp_path), "--profile=9:3"], monkeypatch, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --profile=9:3"), err


# -----------------------------------------------------------------------------
# Load balance


def synthetic_sequence(rng, length: int, n_bos: int, aligned: bool) -> np.ndarray:
    seq = rng.integers(0, 50000, length)
    seq[rng.choice(length, n_bos, replace=False)] = T.BOS_ID
    if aligned:
        seq[0] = T.BOS_ID
    return seq


def test_load_balance_count_equals_dense_mask_count():
    rng = np.random.default_rng(0)
    cases = [synthetic_sequence(rng, 512, n, aligned=n % 2 == 0) for n in (0, 1, 3, 9, 30)]
    long_doc = np.full(512, 7)
    long_doc[[0, 96, 100]] = T.BOS_ID  # documents ending inside and on block boundaries
    cases.append(long_doc)
    for seq in cases:
        for window in (0, 1, 2, 3, 5, 16):
            for paired in (False, True):
                assert LB.attention_pairs(seq, 32, window, paired) == LB.brute_force_pairs(seq, 32, window, paired)


def test_load_balance_script_runs_on_the_sample(tmp_path, capsys):
    out = LB.main(["--train_files", str(REPO / "data" / "sample" / "sample_train_*.bin"), "--steps", "3",
                   "--world_size", "4", "--window_blocks", "4"])
    text = capsys.readouterr().out
    assert len(out["rows"]) == 3 and all(r["attn"] >= 1.0 for r in out["rows"])
    assert "implied slowdown" in text and "max/mean: mean" in text
    assert out["step_slowdown"] <= out["attn_slowdown"]
