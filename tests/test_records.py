"""Tests for tools/compare.py on fixture logs written here, in this project's and upstream's format."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from scipy import stats

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import compare  # noqa: E402

SEP = "=" * 100
H100 = "NVIDIA H100 80GB HBM3"
SOURCE = '"""Toy trainer."""\nimport torch\n\n\ndef lr(step):\n    return 0.05\n\n\ndef main():\n    print("train")\n'
SOURCE_B = SOURCE.replace("return 0.05", "return 0.06")
CONFIG = {"num_steps": 20, "muon_lr": 0.05, "val_every": 10, "seed": 1, "run_id": "a"}


# -----------------------------------------------------------------------------
# Fixture logs
# make_log writes a realistic log: code snapshot, separator, header (ours: GPUs/config lines;
# upstream: nvidia-smi table), separator, then val and train step lines with exact times.


def step_lines(val: dict[int, float], num_steps: int, step_ms: float, upstream: bool) -> list[str]:
    lines = []
    for s in range(num_steps + 1):
        if s in val:
            ms = s * step_ms
            lines.append(f"step:{s}/{num_steps} val_loss:{val[s]:.4f} train_time:{ms:.0f}ms "
                         f"step_avg:{ms / max(s, 1):.2f}ms")
        if s < num_steps:
            ms = (s + 1) * step_ms
            extra = "train_loss:5.0000 " if upstream else ""
            tail = "" if upstream else f" tok/s:{1_000_000 + s + 1} mfu:41.2% eta:0m{num_steps - s}s"
            lines.append(f"step:{s + 1}/{num_steps} {extra}train_time:{ms:.0f}ms step_avg:{ms / (s + 1):.2f}ms{tail}")
    return lines


def smi_table(n: int) -> list[str]:
    rows = ["nvidia-smi:", "+-----------------------------------------------------------------------------+",
            "| NVIDIA-SMI 550.54.15    Driver Version: 550.54.15    CUDA Version: 12.4     |",
            "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |"]
    for i in range(n):
        rows.append(f"|   {i}  {H100}          On  |   00000000:{i:02d}:00.0 Off |                    0 |")
        rows.append("| N/A   35C    P0            118W /  700W |       3MiB /  81559MiB |      0%      Default |")
    rows.append("|    0   N/A  N/A     12345      C   /usr/bin/python3                          0MiB |")
    return rows


def make_log(path: Path, val: dict[int, float], *, num_steps: int = 20, step_ms: float = 100.0,
             source: str | None = SOURCE, config: dict | None = None, upstream: bool = False,
             gpus: int = 8) -> Path:
    """A run log at path; val maps step -> val loss; train_time at step s is s * step_ms."""
    if upstream:
        header = ["Running pytorch 2.5.0 compiled for CUDA 12.4", *smi_table(gpus)]
    else:
        cfg = dict(CONFIG if config is None else config, num_steps=num_steps, run_id=path.stem)
        header = ["Running Python 3.11.7 on Linux-6.1", "Running PyTorch 2.13.0+cu126 compiled for CUDA 12.6",
                  "Running Triton version 3.4.0", f"GPUs: {', '.join([H100] * gpus)}", *smi_table(gpus),
                  f"config: {json.dumps(cfg)}"]
    body = [SEP, *header, SEP]
    if not upstream:
        body += [f"run {path.stem} seed 1, log logs/{path.stem}.txt",
                 f"model: 20,037,698 parameters, fp8 head True, compile True, world size {gpus}, grad accumulation 1",
                 "warmup: 10 steps in 30.0s (untimed; state restored)"]
    body += step_lines(val, num_steps, step_ms, upstream)
    body.append("peak memory allocated: 33860 MiB reserved: 49040 MiB")
    text = "\n".join(body) + "\n"
    if source is not None:
        text = source + "\n" + text
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def curve(final: float, num_steps: int = 20) -> dict[int, float]:
    return {0: 10.8258, num_steps // 2: 4.0, num_steps: final}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "tools" / "compare.py"), *args], capture_output=True,
                          text=True, timeout=60)


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = compare.main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


# -----------------------------------------------------------------------------
# Parsing: both formats, the summary JSON, record folders.


def test_parse_project_log(tmp_path: Path) -> None:
    run = compare.load_run(make_log(tmp_path / "r1.txt", curve(3.27)))
    assert run.name == "r1"
    assert run.final_val_loss == pytest.approx(3.27)
    assert run.train_time_ms == 2000 and run.step_avg_ms == pytest.approx(100.0)
    assert run.last_step == 20 and not run.incomplete
    assert run.tokens_per_s == 1_000_020
    assert run.gpu_names == [H100] * 8 and run.world_size == 8
    assert run.config is not None and run.config["muon_lr"] == 0.05
    assert run.code == SOURCE
    assert [(p.step, p.time_ms) for p in run.val_points] == [(0, 0), (10, 1000), (20, 2000)]
    assert run.torch_version == "2.13.0+cu126" and run.cuda_version == "12.6"
    assert compare.describe_hardware(run) == f"8x {H100}"


def test_parse_upstream_log(tmp_path: Path) -> None:
    run = compare.load_run(make_log(tmp_path / "up.txt", curve(3.2791), step_ms=90, upstream=True))
    assert run.config is None and run.code == SOURCE
    assert run.gpu_names == [H100] * 8 and run.world_size is None
    assert run.final_val_loss == pytest.approx(3.2791) and run.train_time_ms == 1800
    assert run.tokens_per_s is None


def test_summary_json_is_preferred_and_nulls_ignored(tmp_path: Path) -> None:
    log = make_log(tmp_path / "r1.txt", curve(3.27))
    summary = {"run_id": "r1", "final_val_loss": 3.2654, "train_time_ms": 1990.5, "steps": 20, "step_avg_ms": None,
               "tokens_per_s": 2.5e6, "world_size": 4, "gpu_names": None, "config": None,
               "val_losses": [[0, 10.8, 0.0], [20, 3.2654, 1990.5]]}
    log.with_suffix(".json").write_text(json.dumps(summary))
    run = compare.load_run(log)
    assert run.has_summary
    assert run.final_val_loss == 3.2654 and run.train_time_ms == 1990.5 and run.tokens_per_s == 2.5e6
    assert run.step_avg_ms == pytest.approx(100.0)  # null in the summary: the log's value stays
    assert run.gpu_names == [H100] * 8 and run.config is not None and run.world_size == 4
    assert [p.step for p in run.val_points] == [0, 20]
    assert compare.describe_hardware(run) == f"8x {H100}, world size 4"


def test_malformed_summary_falls_back_to_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = make_log(tmp_path / "r1.txt", curve(3.27))
    log.with_suffix(".json").write_text("{not json")
    run = compare.load_run(log)
    assert run.final_val_loss == pytest.approx(3.27) and not run.has_summary
    assert "unreadable summary" in capsys.readouterr().err


def test_record_folder_with_two_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "records" / "2026-01-01_test"
    make_log(folder / "a.txt", curve(3.2712))
    make_log(folder / "b.txt", curve(3.2755))
    (folder / "README.md").write_text("# a record\n")
    (folder / "notes.txt").write_text("just notes, no steps\n")
    assert [r.name for r in compare.load_runs([str(folder)])] == ["a", "b"]
    rc, out, _ = run_main(capsys, "show", str(folder))
    assert rc == 0 and "3.2712" in out and "3.2755" in out and "notes" not in out


def test_same_stem_in_two_folders_gets_folder_prefix(tmp_path: Path) -> None:
    make_log(tmp_path / "x" / "run.txt", curve(3.27))
    make_log(tmp_path / "y" / "run.txt", curve(3.28))
    runs = compare.load_runs([str(tmp_path / "x"), str(tmp_path / "y"), str(tmp_path / "x" / "run.txt")])
    assert [r.name for r in runs] == ["x/run", "y/run"]  # the repeated log is counted once


# -----------------------------------------------------------------------------
# show


def test_show_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = make_log(tmp_path / "ours.txt", curve(3.2712))
    b = make_log(tmp_path / "upstream.txt", curve(3.2795), step_ms=90, upstream=True)
    rc, out, err = run_main(capsys, "show", str(a), str(b))
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["run", "val", "loss"]
    ours = next(line for line in lines if line.startswith("ours"))
    assert ours.split()[:6] == ["ours", "3.2712", "2.00", "20", "100.00", "1,000,020"]
    assert ours.endswith("  8x H100 80GB HBM3")  # "NVIDIA " left out: the column stays narrow
    upstream = next(line for line in lines if line.startswith("upstream"))
    assert upstream.split()[:6] == ["upstream", "3.2795", "1.80", "20", "90.00", "-"]


def test_show_log_without_val_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = make_log(tmp_path / "noval.txt", {})
    rc, out, err = run_main(capsys, "show", str(log))
    assert rc == 0
    row = next(line for line in out.splitlines() if line.startswith("noval"))
    assert row.split()[1:3] == ["-", "2.00"]
    assert "noval: no validation line" in err and len(err.strip().splitlines()) == 1


# -----------------------------------------------------------------------------
# diff


def test_diff_two_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = make_log(tmp_path / "a.txt", {0: 10.8258, 10: 4.0, 20: 3.2800})
    b = make_log(tmp_path / "b.txt", {0: 10.8258, 10: 3.9900, 20: 3.2750}, step_ms=90, source=SOURCE_B,
                 config=dict(CONFIG, muon_lr=0.06))
    rc, out, _ = run_main(capsys, "diff", str(a), str(b), "--code")
    assert rc == 0
    assert "muon_lr: 0.05 -> 0.06" in out and "run_id" not in out and "num_steps" not in out  # a run's name: no
    assert "-    return 0.05" in out and "+    return 0.06" in out and "@@" in out
    assert '"""Toy trainer."""' not in out  # unchanged code far from the hunk is left out
    rows = {line.split("  ")[0]: line.split() for line in out.splitlines()
            if line.startswith(("train time", "step_avg", "final val loss"))}
    assert rows["train time (s)"][-3:] == ["2.00", "1.80", "0.9000x"]
    assert rows["step_avg (ms)"][-3:] == ["100.00", "90.00", "0.9000x"]
    assert rows["final val loss"][-3:] == ["3.2800", "3.2750", "-0.0050"]
    val_rows = [line.split() for line in out.split("== val loss at matching steps")[1].splitlines()[3:6]]
    assert val_rows == [["0", "10.8258", "10.8258", "+0.0000"], ["10", "4.0000", "3.9900", "-0.0100"],
                        ["20", "3.2800", "3.2750", "-0.0050"]]


def test_diff_answers_first_and_shows_the_code_hunks_only_when_asked(tmp_path, capsys):
    # What a user wants first fits a screen: losses at common steps, the final loss and times, then the changed
    # config fields (fields one code version lacks on one line), then the code change's size.
    a = make_log(tmp_path / "a.txt", curve(3.28), config={k: v for k, v in CONFIG.items() if k != "muon_lr"})
    b = make_log(tmp_path / "b.txt", curve(3.27), source=SOURCE_B, step_ms=90)
    rc, out, _ = run_main(capsys, "diff", str(a), str(b))
    order = [out.index(s) for s in ("== val loss at matching steps", "final val loss", "train time (s)",
                                    "== config (A -> B)", "== code (A -> B)")]
    assert rc == 0 and order == sorted(order) and "@@" not in out
    assert "only in B's config (1): muon_lr" in out
    assert "\ntrain_gpt.py: 1 line(s) removed, 1 added\n(--code shows the hunks)" in out
    assert len(out.splitlines()) < 40


def source_block(files: dict[str, str]) -> str:
    """A code snapshot as this project's logs write it: each file after its `# source: NAME (N bytes)` line."""
    return "".join(f"# source: {name} ({len(text.encode())} bytes)\n{text}" + ("" if text.endswith("\n") else "\n")
                   for name, text in files.items())


def test_diff_compares_every_source_file_a_log_holds(tmp_path, capsys):
    # This project's logs hold every file the run executed: the code section is per file; a file one log lacks (an
    # older log's gpt_kernels.py) shows as only in the other; a file without a final newline keeps its bytes.
    kernels = "def kernel():\n    return 1"  # no final newline
    a = make_log(tmp_path / "a.txt", curve(3.28), source=source_block({"train_gpt.py": SOURCE, "k.py": kernels}))
    b = make_log(tmp_path / "b.txt", curve(3.28), source=source_block({"train_gpt.py": SOURCE_B,
                                                                       "k.py": kernels + "  # same"}))
    old = make_log(tmp_path / "old.txt", curve(3.28))
    assert compare.load_run(a).sources == {"train_gpt.py": SOURCE, "k.py": kernels}
    rc, out, _ = run_main(capsys, "diff", str(a), str(b))
    assert rc == 0 and "\ntrain_gpt.py: 1 line(s) removed, 1 added\nk.py: 1 line(s) removed, 1 added\n" in out
    rc, out, _ = run_main(capsys, "diff", str(old), str(a))
    assert rc == 0 and "k.py: only in B" in out and "train_gpt.py:" not in out.split("== code")[1]
    rc, out, _ = run_main(capsys, "code", str(a), str(tmp_path / "code"))
    assert rc == 0 and (tmp_path / "code" / "k.py").read_bytes() == kernels.encode()
    rc, _, err = run_main(capsys, "code", str(old), str(tmp_path / "none"))
    assert rc == 2 and "holds no source blocks" in err and not (tmp_path / "none").exists()


def test_a_resumed_runs_repeated_steps_read_as_their_later_lines(tmp_path):
    # --resume=auto logs again the steps after the checkpoint it carried on from (the same values in practice): the
    # later line of a step wins, in the log and in the .jsonl, where a line a kill cut short is skipped.
    log = make_log(tmp_path / "r.txt", curve(3.28))
    text = log.read_text()
    log.write_text(text + "step:10/20 val_loss:3.9000 train_time:1000ms step_avg:100.00ms\n"
                   "step:20/20 val_loss:3.2700 train_time:2000ms step_avg:100.00ms\n")
    log.with_suffix(".jsonl").write_text('{"step": 1, "train_loss": 5.0}\n{"step": 2, "train_lo\n'
                                         '{"step": 1, "train_loss": 4.5}\n{"step": 2, "train_loss": 4.25}\n')
    run = compare.load_run(log)
    assert [(p.step, p.loss) for p in run.val_points] == [(0, 10.8258), (10, 3.9), (20, 3.27)]
    assert run.final_val_loss == 3.27 and [(p.step, p.loss) for p in run.train_points] == [(1, 4.5), (2, 4.25)]


def test_diff_against_upstream_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = make_log(tmp_path / "ours.txt", curve(3.2800))
    b = make_log(tmp_path / "theirs.txt", curve(3.2790), source=SOURCE_B, upstream=True)
    rc, out, _ = run_main(capsys, "diff", str(a), str(b), "--code")
    assert rc == 0
    assert "no config recorded for theirs" in out
    assert "+    return 0.06" in out


def test_stats_groups_runs_of_different_recipes_and_tests_each_against_its_own_target(tmp_path, capsys):
    eager = [make_log(tmp_path / f"e{i}.txt", curve(loss), config=dict(CONFIG, compile=False, seed=i))
             for i, loss in enumerate([6.97, 6.98])]  # seeds differ: one recipe
    fused = [make_log(tmp_path / "r.txt", curve(6.90), config=dict(CONFIG, compile=True))]
    rc, out, err = run_main(capsys, "stats", *map(str, eager + fused))
    assert rc == 0 and "2 different recipes: statistics per recipe, never pooled" in err
    groups = [line for line in out.splitlines() if line.startswith("runs [")]
    assert groups == ["runs [compile=false] (n=2): e0, e1", "runs [compile=true] (n=1): r"]
    assert out.count("H1 mean val loss < 3.28") == 2  # runs without val_files: FineWeb's target (upstream's)
    tiny = [make_log(tmp_path / f"t{i}.txt", curve(6.9 + i / 100), config=dict(
        CONFIG, val_files="data/sample/sample_val_*.bin", seed=i)) for i in range(2)]
    rc, out, _ = run_main(capsys, "stats", *map(str, tiny))
    assert rc == 0 and "no target: these are not FineWeb validation runs" in out and "t-test" not in out
    rc, out, _ = run_main(capsys, "stats", *map(str, tiny), "--target", "7.0")
    assert "one-sided t-test, H1 mean val loss < 7: t = " in out


def test_a_malformed_final_val_line_gives_no_final_loss_rather_than_an_earlier_one(tmp_path, capsys):
    log = make_log(tmp_path / "bad.txt", curve(3.28))
    log.write_text(log.read_text().replace("step:20/20 val_loss:3.2800", "step:20/20 val_loss:abc"))
    rc, out, err = run_main(capsys, "show", str(log))
    row = next(line.split() for line in out.splitlines() if line.startswith("bad"))
    assert rc == 0 and row[1] == "-" and "4.0000" not in out
    assert "step 20: val_loss:abc is not a number" in err and "no val loss at its last step 20" in err


def test_diff_identical_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = make_log(tmp_path / "a.txt", curve(3.28))
    rc, out, _ = run_main(capsys, "diff", str(a), str(a))
    assert rc == 0 and "(no differences)" in out and "(identical)" in out
    assert out.splitlines()[0] == ("verdict: reproduced: all 3 logged losses equal (0 train, 3 val; 3 to the 4 "
                                   "decimals a log line prints)")  # no .jsonl, no summary: the lines alone


def write_losses(log: Path, train: dict[int, float], val: dict[int, float]) -> None:
    """The .jsonl and .json the trainer writes beside a log: full-precision train and val losses."""
    records = [{"step": s, "train_loss": loss} for s, loss in train.items()]
    log.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    log.with_suffix(".json").write_text(json.dumps({"val_losses": [[s, loss, 0.0] for s, loss in val.items()]}))


def test_diff_says_first_whether_the_run_reproduced_every_logged_loss(tmp_path, capsys):
    train, val = {s: 10 - s / 7 for s in range(1, 21)}, {0: 10.8258, 10: 4.0, 20: 3.28}
    record, same, drift, short = (make_log(tmp_path / f"{n}.txt", curve(3.28)) for n in ("record", "same", "drift",
                                                                                         "short"))
    write_losses(record, train, val)
    write_losses(same, train, val)
    rc, out, _ = run_main(capsys, "diff", str(record), str(same))
    assert rc == 0 and out.splitlines()[0] == "verdict: reproduced: all 23 logged losses equal (20 train, 3 val)"
    # One ulp at step 4 and 0.25 at step 12: the first is where it starts, the second the largest.
    write_losses(drift, {**train, 4: math.nextafter(train[4], 0), 12: train[12] + 0.25}, val)
    rc, out, _ = run_main(capsys, "diff", str(record), str(drift))
    assert rc == 0 and out.splitlines()[0] == (
        f"verdict: not reproduced: first difference at step 4 (train loss {train[4]!r} vs "
        f"{math.nextafter(train[4], 0)!r}), largest 0.25 (train loss, step 12)")
    write_losses(short, {s: v for s, v in train.items() if s <= 10}, {s: v for s, v in val.items() if s <= 10})
    rc, out, _ = run_main(capsys, "diff", str(record), str(short))
    assert out.splitlines()[0] == ("verdict: equal on the steps both cover, steps 0-10: all 12 logged losses equal "
                                   "(10 train, 2 val); 11 logged loss(es) only in record (steps 11-20)")


def test_diff_compares_an_unfinished_or_resumed_run_on_the_steps_both_cover_at_the_precision_both_have(tmp_path,
                                                                                                     capsys):
    train, val = {s: 10 - s / 7 for s in range(1, 21)}, {0: 10.827478408813477, 10: 4.000012, 20: 3.28}
    record = make_log(tmp_path / "record.txt", val)
    write_losses(record, train, val)
    # A log cut at step 10 (a run still going, killed, or copied in part) without its .jsonl: its val lines print
    # 10.8275 and 4.0000, equal to the record's losses as far as a log line tells.
    cut = tmp_path / "cut.txt"
    text = make_log(cut, val).read_text()
    cut.write_text(text[: text.index("step:11/20")])
    rc, out, _ = run_main(capsys, "diff", str(record), str(cut))
    assert rc == 0 and out.splitlines()[0] == (
        "verdict: equal on the steps both cover, steps 0-10: all 2 logged losses equal (0 train, 2 val; 2 to the 4 "
        "decimals a log line prints); 21 logged loss(es) only in record (steps 1-20)")
    # The same run with its .jsonl (a kill may cut its last line short): the exact losses, compared bit for bit.
    records = [{"step": 0, "val_loss": val[0]}, *({"step": s, "train_loss": train[s]} for s in range(1, 11)),
               {"step": 10, "val_loss": val[10]}]
    cut.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 11, "trai')
    rc, out, err = run_main(capsys, "diff", str(record), str(cut))
    assert out.splitlines()[0] == ("verdict: equal on the steps both cover, steps 0-10: all 12 logged losses equal "
                                   "(10 train, 2 val); 11 logged loss(es) only in record (steps 11-20)") and not err
    records[-1]["val_loss"] = math.nextafter(val[10], 0)  # one ulp off: no longer equal
    cut.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rc, out, _ = run_main(capsys, "diff", str(record), str(cut))
    assert out.splitlines()[0].startswith("verdict: not reproduced: first difference at step 10 (val loss 4.000012 vs")
    # A run resumed from step 10's checkpoint logs from there on: equal on steps 10-20, which it says.
    resumed = make_log(tmp_path / "resumed.txt", val)
    write_losses(resumed, {s: v for s, v in train.items() if s > 10}, {s: v for s, v in val.items() if s >= 10})
    rc, out, _ = run_main(capsys, "diff", str(record), str(resumed))
    assert out.splitlines()[0] == ("verdict: equal on the steps both cover, steps 10-20: all 12 logged losses equal "
                                   "(10 train, 2 val); 11 logged loss(es) only in record (steps 0-10)")


def test_show_keeps_the_hardware_column_narrow(tmp_path, capsys):
    def cpu_log(name: str, cpu: str) -> Path:
        log = make_log(tmp_path / f"{name}.txt", curve(3.28), gpus=0)
        log.write_text(log.read_text().replace("world size 0", "world size 2").replace("config:", (
            f"CPU run: {cpu}, 2 cores, 2 torch threads, vector ISA AVX512, native bf16 GEMM yes\nbf16 GEMM path: "
            "native (oneDNN bf16 GEMM; the reference loop where the CPU has no bf16 instructions)\nconfig:")))
        return log

    logs = [cpu_log("epyc", "AMD EPYC"), cpu_log("long", "AMD EPYC 9R14 96-Core Processor"),
            make_log(tmp_path / "gpu.txt", curve(3.28))]
    rc, out, _ = run_main(capsys, "show", *map(str, logs))
    rows = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert rc == 0 and rows["gpu"].endswith("  8x H100 80GB HBM3")
    assert rows["epyc"].endswith("  AMD EPYC AVX512, native GEMM, W=2")
    assert rows["long"].endswith("  AMD EPYC 9R14 96-Core Processor AVX51...")  # cut at 40 characters
    assert max(map(len, out.splitlines())) <= 120


# -----------------------------------------------------------------------------
# stats: numbers must match scipy computed here on the same values.

LOSSES = [3.2750, 3.2790, 3.2810, 3.2720, 3.2770]
STEP_MS = [100.0, 101.5, 99.0, 100.5, 98.5]
BASE_LOSSES = [3.2805, 3.2790, 3.2830]
BASE_STEP_MS = [104.0, 105.5, 103.0]


def make_group(folder: Path, losses: list[float], step_ms: list[float], num_steps: int = 20,
               upstream: bool = False) -> list[str]:
    return [str(make_log(folder / f"run{i}.txt", curve(loss, num_steps), num_steps=num_steps, step_ms=ms,
                         upstream=upstream)) for i, (loss, ms) in enumerate(zip(losses, step_ms))]


def test_stats_target_ttest_matches_scipy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_main(capsys, "stats", *make_group(tmp_path, LOSSES, STEP_MS), "--target", "3.28")
    assert rc == 0 and err == ""
    expected = stats.ttest_1samp(LOSSES, 3.28, alternative="less")
    match = re.search(r"one-sided t-test, H1 mean val loss < 3\.28: t = (\S+), p = (\S+)", out)
    assert match is not None
    assert float(match.group(1)) == pytest.approx(expected.statistic, abs=1e-4)
    assert float(match.group(2)) == pytest.approx(expected.pvalue, rel=1e-5)
    mean, std = compare.mean_std(LOSSES)
    assert f"{mean:.4f} ± {std:.4f}" in out and "n=5" in out
    assert std == pytest.approx(stats.tstd(LOSSES))
    times_s = [20 * ms / 1000 for ms in STEP_MS]
    assert f"{sum(times_s) / 5:.3f} ± {stats.tstd(times_s):.3f} s" in out
    t, p = compare.target_test(LOSSES, 3.28)  # type: ignore[misc]
    assert p == pytest.approx(expected.pvalue, rel=1e-12)


def test_stats_welch_against_baseline_matches_scipy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = make_group(tmp_path / "new", LOSSES, STEP_MS)
    base = make_group(tmp_path / "old", BASE_LOSSES, BASE_STEP_MS)
    rc, out, _ = run_main(capsys, "stats", *runs, "--baseline", *base)
    assert rc == 0 and "baseline (n=3)" in out
    times = [20 * ms / 1000 for ms in STEP_MS]
    base_times = [20 * ms / 1000 for ms in BASE_STEP_MS]
    for metric, x, y in (("train time", times, base_times), ("val loss", LOSSES, BASE_LOSSES)):
        match = re.search(rf"Welch t-test \(two-sided\), {metric}, runs vs baseline: t = (\S+), p = (\S+)", out)
        assert match is not None, metric
        expected = stats.ttest_ind(x, y, equal_var=False)
        assert float(match.group(2)) == pytest.approx(expected.pvalue, rel=1e-5)


def test_stats_with_one_run_says_it_needs_two(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one = make_group(tmp_path, LOSSES[:1], STEP_MS[:1])
    rc, out, _ = run_main(capsys, "stats", *one, "--baseline", *one)
    assert rc == 0
    assert "needs at least 2 runs (have 1)" in out and "needs at least 2 runs in each group" in out


def test_stats_runs_of_different_lengths_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Upstream logs carry no config (their recipe is in the code): one group, whose lengths differ.
    runs = make_group(tmp_path / "a", LOSSES[:2], STEP_MS[:2], upstream=True) + make_group(
        tmp_path / "b", LOSSES[2:3], STEP_MS[2:3], num_steps=18, upstream=True)
    rc, out, err = run_main(capsys, "stats", *runs)
    assert rc == 0 and "p = " in out
    assert err.count("\n") == 1 and "different steps (18, 20)" in err


# -----------------------------------------------------------------------------
# plot


def test_plot_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import matplotlib.image

    a = make_log(tmp_path / "a.txt", curve(3.27))
    b = make_log(tmp_path / "b.txt", curve(3.28), upstream=True, step_ms=90)
    out_png = tmp_path / "plots" / "cmp.png"
    rc, out, _ = run_main(capsys, "plot", str(a), str(b), "-o", str(out_png))
    assert rc == 0 and str(out_png) in out
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out_png.stat().st_size > 10_000
    image = matplotlib.image.imread(out_png)
    assert image.shape[0] > 100 and image.shape[1] > 100


def test_plot_defaults_to_compare_png_and_keeps_identical_runs_apart(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a, b = (make_log(tmp_path / f"{n}.txt", curve(3.27)) for n in "ab")  # the same curve twice
    records = [{"step": s, "train_loss": 10.0 - s / 4, "train_time_ms": 100.0 * s} for s in range(1, 21)]
    (tmp_path / "a.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")
    rc, out, _ = run_main(capsys, "plot", str(a), str(b))
    assert rc == 0 and out.strip() == f"wrote {tmp_path / 'compare.png'}" and (tmp_path / "compare.png").exists()
    runs = [compare.load_run(a), compare.load_run(b)]
    assert [p.loss for p in runs[0].train_points] == [r["train_loss"] for r in records]  # from the .jsonl
    upstream = compare.load_run(make_log(tmp_path / "up.txt", curve(3.28), upstream=True))
    assert [p.loss for p in upstream.train_points] == [5.0] * 20  # no .jsonl: the log's own train lines
    by_step = compare.plot_figure(runs).axes[0]
    val_lines = [line for line in by_step.lines if line.get_marker() not in ("None", None, "")]
    assert len(val_lines) == 2
    assert {(line.get_linestyle(), line.get_marker()) for line in val_lines} == {("-", "o"), ("--", "s")}
    assert sum("(train)" in line.get_label() for line in by_step.lines) == 1  # b has no train losses


def test_stats_warns_when_pooling_different_hardware(tmp_path, capsys):
    runs = [compare.load_run(make_log(tmp_path / f"g{n}.txt", curve(3.28), gpus=n)) for n in (8, 4)]
    compare.stats_report(runs, 3.3)
    assert "the runs ran on different hardware" in capsys.readouterr().err


# -----------------------------------------------------------------------------
# Bad input through the real command line: one `error:` line, exit code 2, no traceback.


def no_code_log(tmp_path: Path) -> Path:
    """A log whose separator has no code above it."""
    path = tmp_path / "nocode.txt"
    path.write_text("\n".join([SEP, *step_lines(curve(3.28), 20, 100.0, upstream=False)]) + "\n")
    return path


@pytest.mark.parametrize("case", ["missing", "not_a_log", "readme", "separator_only", "empty_folder", "diff_no_code",
                                  "plot_no_val"])
def test_cli_bad_input(tmp_path: Path, case: str) -> None:
    good = make_log(tmp_path / "good.txt", curve(3.28))
    notes = tmp_path / "notes.txt"
    notes.write_text("some notes\nno step lines here\n")
    readme = tmp_path / "README.md"  # the README quotes a run's last line
    readme.write_text("# speedrun\n```\nstep:40/40 val_loss:7.4835 train_time:68508ms step_avg:1712.71ms\n```\n")
    (tmp_path / "bare.txt").write_text(f"{SEP}\nno steps\n")
    (tmp_path / "empty").mkdir()
    args, message = {
        "missing": (["show", str(tmp_path / "nope.txt")], "no such file or directory"),
        "not_a_log": (["show", str(notes)], "not a run log: no line of 100 '=' (expected the script source"),
        "readme": (["diff", str(readme), str(good)], "README.md: not a run log: no line of 100 '='"),
        "separator_only": (["stats", str(tmp_path / "bare.txt")], "found a line of 100 '=' but no 'step:S/T"),
        "empty_folder": (["stats", str(tmp_path / "empty")], "no run logs in this folder"),
        "diff_no_code": (["diff", str(good), str(no_code_log(tmp_path))], "no code snapshot (expected the script"),
        "plot_no_val": (["plot", str(make_log(tmp_path / "noval.txt", {})), "-o", str(tmp_path / "x.png")],
                        "nothing to plot"),
    }[case]
    result = run_cli(*args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1].startswith("error: ") and message in result.stderr.splitlines()[-1]
    assert result.stdout == "" and "Traceback" not in result.stderr  # refused before printing anything


def test_cli_help() -> None:
    result = run_cli("--help")
    assert result.returncode == 0 and all(c in result.stdout for c in ("show", "diff", "stats", "plot"))


def test_stats_names_each_warning_once_and_the_files_of_a_folder_it_skips(tmp_path, capsys):
    # Two recipes, each run on 8 and 4 GPUs: one hardware warning, not one per recipe.
    for name, gpus, lr in (("a8", 8, 0.05), ("a4", 4, 0.05), ("b8", 8, 0.06), ("b4", 4, 0.06)):
        make_log(tmp_path / "runs" / f"{name}.txt", curve(3.28), gpus=gpus, config=dict(CONFIG, muon_lr=lr))
    (tmp_path / "runs" / "notes.txt").write_text("what we tried\n")
    rc, out, err = run_main(capsys, "stats", str(tmp_path / "runs"))
    assert rc == 0 and out.count("runs [muon_lr=") == 2
    assert err.count("ran on different hardware") == 1
    assert f"warning: skipped {tmp_path / 'runs' / 'notes.txt'}: not a run log" in err


def test_log_without_code_still_shows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_main(capsys, "show", str(no_code_log(tmp_path)))
    assert rc == 0 and "3.2800" in out


def test_a_diverged_run_shows_nan_and_stays_out_of_the_statistics(tmp_path, capsys):
    # The trainer keeps NaN in its summary (a diverged val loss); the tool used to fall back to the last
    # finite val point and report the run as fine.
    good = [make_log(tmp_path / f"good{i}.txt", curve(3.28 + i / 100)) for i in range(2)]
    bad = make_log(tmp_path / "bad.txt", {0: 10.8258, 10: 4.0, 20: float("nan")})
    (tmp_path / "bad.json").write_text(json.dumps({"final_val_loss": float("nan"), "steps": 20,
                                                   "val_losses": [[0, 10.8258, 0], [20, float("nan"), 2000]]}))
    assert "NaN" in (tmp_path / "bad.json").read_text()
    run = compare.load_run(bad)
    assert math.isnan(run.final_val_loss) and compare.diverged(run)
    table = compare.show_table([*map(compare.load_run, good), run])
    assert "nan (diverged)" in table
    report = compare.stats_report([*map(compare.load_run, [*good, bad])], 3.3)
    assert "(n=3)" in report and "n=2)" in report  # three runs, two losses in the statistics
    assert "bad: diverged (final val loss nan); left out of the runs val loss statistics" in capsys.readouterr().err


def test_runs_of_different_lengths_are_named_once(tmp_path, capsys):
    runs = [compare.load_run(make_log(tmp_path / f"r{n}.txt", curve(3.3, n), num_steps=n, upstream=True))
            for n in (10, 20)]
    compare.stats_report(runs, 3.3)
    assert "warning: the runs end at different steps (10, 20); computing anyway" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["nan", "inf", "-inf"])
def test_stats_refuses_a_target_that_is_not_a_finite_number(tmp_path, target):
    result = run_cli("stats", str(make_log(tmp_path / "a.txt", curve(3.28))), f"--target={target}")
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.splitlines() == [f"error: --target={float(target)}: the val loss target must be a finite "
                                          f"number (e.g. --target=3.28)"]


def test_diff_names_the_cpu_paths_of_two_runs_that_ran_different_ones(tmp_path, capsys):
    def cpu_log(name: str, isa: str, gemm: str, path: str | None) -> Path:
        log = make_log(tmp_path / f"{name}.txt", curve(3.28), gpus=0)
        header = (f"CPU run: AMD EPYC, 2 cores, 2 torch threads, vector ISA {isa}, native bf16 GEMM no\n"
                  f"bf16 GEMM path: {gemm} (...)\n{f'CPU path: {path} (...)' + chr(10) if path else ''}config:")
        log.write_text(log.read_text().replace("config:", header))
        return log

    record = cpu_log("record", "AVX2", "fp32", None)  # a log from before the CPU path line: AVX2 and fp32 GEMMs
    rerun = cpu_log("rerun", "AVX2", "fp32", "record")
    native = cpu_log("native", "AVX512", "native", "native")
    half = cpu_log("half", "AVX2", "fp32", "native")  # aten held to AVX2, MKL not: the line says what ran
    lines = {log.stem: run_main(capsys, "diff", str(record), str(log))[1].splitlines()[0]
             for log in (rerun, native, half)}
    assert lines["rerun"] == ("verdict: reproduced: all 3 logged losses equal (0 train, 3 val; 3 to the 4 decimals "
                              "a log line prints)")
    assert lines["native"].endswith("; record ran the record CPU path, native the native one")
    assert lines["half"].endswith("; record ran the record CPU path, half the native one")
