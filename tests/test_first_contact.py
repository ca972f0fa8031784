"""A newcomer's first run, in a scratch copy of the repository with nothing beside it: ./run.sh on a CPU, the
tiny preset's fixed seed reproducing the bundled record on the record path (every x86-64 CPU with AVX2), then
tools/compare.py diff against that record; CPU_PATH=native for the CPU's own kernels; and what the README
promises of it (the install line, the final line) agreeing with CI and the record."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, SMALL, fresh_copy, tiny_args, wait_until

RECORD = Path("records/2026-11-28_tiny_cpu_head/tiny_cpu_w1.txt")
README = (REPO / "README.md").read_text()


def readme_final_line() -> str:
    """The quick start's expected last step line, up to its val loss: `step:40/40 val_loss:X`."""
    return re.search(r"^(step:40/40 val_loss:\d+\.\d+) ", README, re.M).group(1)


def test_the_readme_installs_what_ci_installs_and_quotes_the_records_final_loss():
    ci = re.search(r"^python -m pip install --quiet (.+)$", (REPO / ".ci" / "run").read_text(), re.M).group(1)
    assert re.search(r"^pip install (.+?)\s+# CPU", README, re.M).group(1) == ci  # the same packages, the same pins
    assert "torch==2.13.0" in ci.split() and "triton==3.6.0" in ci.split()
    final = json.loads((REPO / RECORD.with_suffix(".json")).read_text())["final_val_loss"]
    assert readme_final_line() == f"step:40/40 val_loss:{final:.4f}"
    rows = (REPO / "records" / "README.md").read_text().splitlines()
    row = next(line for line in rows if "(2026-11-28_tiny_cpu_head/)" in line)
    assert f"| {final:.4f} |" in row  # records/README.md quotes the same run


def test_the_readmes_first_install_command_is_pytorchs_cpu_build_then_cis_line():
    # pip's default torch for Linux is the CUDA build: gigabytes a CPU machine never uses. The first pip command a
    # reader copies takes the CPU index's torch at CI's pin (the build the bundled record ran); CI's line follows,
    # and its torch==2.13.0 is met by the 2.13.0+cpu already there.
    install = README.split("\n## Install\n")[1].split("\n## ")[0]
    ci = re.search(r"^python -m pip install --quiet (.+)$", (REPO / ".ci" / "run").read_text(), re.M).group(1)
    pips = [line.split("#")[0].split() for line in install.splitlines() if line.startswith("pip install ")]
    torch_pin = next(p for p in ci.split() if p.startswith("torch=="))
    assert pips[0] == ["pip", "install", torch_pin, "--index-url", "https://download.pytorch.org/whl/cpu"], pips
    assert pips[1] == ["pip", "install", *ci.split()], pips
    version = torch_pin.split("==")[1]
    assert f"Running PyTorch {version}+cpu compiled for CUDA None" in (REPO / RECORD).read_text()


def logged_losses(jsonl: Path) -> dict[tuple[int, str], float]:
    """Every train and val loss a run logged, by (step, name)."""
    entries = [json.loads(line) for line in jsonl.read_text().splitlines()]
    return {(e["step"], name): e[name] for e in entries for name in ("train_loss", "val_loss") if name in e}


def cpu_kind(log: str) -> tuple[str, ...]:
    """What a CPU run's bits depend on, from its log header: torch's version, its threads, the vector ISA of its
    kernels and the bf16 GEMM path (README: "Quick start")."""
    patterns = (r"^Running PyTorch (\S+)", r"^CPU run: .*?(\d+) torch threads, vector ISA (\w+)",
                r"^bf16 GEMM path: (\w+)")
    return tuple(g for p in patterns for m in [re.search(p, log, re.MULTILINE)] if m for g in m.groups())


# On another kind of CPU the losses drift apart by rounding (README: "Quick start"): #70's AVX2 run against its
# AVX-512 one (records/snapshots/2026-11-26_record70/tiny_cpu_avx2.txt, tiny_cpu_w1.txt) stays well within these
# bounds (compare.py diff's verdict gives the largest).
DRIFT = {"train_loss": 0.2, "val_loss": 0.05}


@pytest.mark.slow
def test_the_quick_start_reproduces_the_bundled_record_and_compares_with_it(tmp_path):
    if not (REPO / ".git").exists():
        pytest.skip("needs the git checkout (the copy takes its tracked files)")
    repo = fresh_copy(tmp_path / "speedrun")
    assert not (repo.parent / "shared").exists()
    run = subprocess.run([str(repo / "run.sh"), "--run_id=first"], cwd=repo, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    ours, record = logged_losses(repo / "logs" / "first.jsonl"), logged_losses(repo / RECORD.with_suffix(".jsonl"))
    assert ours.keys() == record.keys() and len(ours) == 43  # 40 train losses, 3 validations
    log = (repo / "logs" / "first.txt").read_text()
    kind, record_kind = cpu_kind(log), cpu_kind((repo / RECORD).read_text())
    assert len(record_kind) == 4 and record_kind[2:] == ("AVX2", "fp32"), record_kind  # made on the record path
    if torch.cpu._is_avx2_supported():  # run.sh's default there: the record's kernels and GEMMs, whatever the CPU
        assert "\nCPU path: record (" in log and kind[2:] == record_kind[2:], kind
    if kind == record_kind:  # and the same torch and threads: every logged loss to the bit
        assert ours == record
    else:
        for key, loss in ours.items():
            assert abs(loss - record[key]) <= DRIFT[key[1]], (key, loss, record[key], kind, record_kind)
    diff = subprocess.run([sys.executable, "tools/compare.py", "diff", str(RECORD), "logs/first.txt"], cwd=repo,
                          capture_output=True, text=True, timeout=120)
    assert diff.returncode == 0, diff.stderr
    verdict = diff.stdout.splitlines()[0]
    if kind == record_kind:  # the README's exact line, and the verdict it shows
        assert f"\n{readme_final_line()} " in run.stdout
        assert verdict == "verdict: reproduced: all 43 logged losses equal (40 train, 3 val)"
    else:
        assert verdict.startswith("verdict: not reproduced: first difference at step ")


# What else differs between two x86-64 CPUs with AVX2 that could reach the record path's bits: numpy picks its kernels
# by the CPU's features (its AVX-512 ones where the CPU has them), and OpenBLAS reads the L2 cache's size.
ANOTHER_CPU = {"NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR", "OPENBLAS_L2_SIZE": "32768"}


def first_steps_of_run_sh(log_dir: Path, run_id: str, env: dict[str, str], steps: int = 6) -> dict:
    """./run.sh stopped with Ctrl-C once step `steps` is logged (it stops at a step boundary soon after): its losses."""
    proc = subprocess.Popen([str(REPO / "run.sh"), f"--log_dir={log_dir}", f"--run_id={run_id}"], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**env, "CUDA_VISIBLE_DEVICES": ""})
    for line in proc.stdout:  # run.sh execs the trainer (one process): the signal reaches it
        if line.startswith(f"step:{steps}/"):
            proc.send_signal(signal.SIGINT)
            break
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 130, err[-3000:]
    losses = logged_losses(log_dir / f"{run_id}.jsonl")
    assert {step for step, name in losses if name == "train_loss"} >= set(range(1, steps + 1))
    return losses


@pytest.mark.slow
def test_the_record_path_keeps_its_bits_with_numpys_avx512_kernels_off_and_another_l2_cache(tmp_path):
    if not torch.cpu._is_avx2_supported():
        pytest.skip("the record path needs an x86-64 CPU with AVX2")
    ours = first_steps_of_run_sh(tmp_path, "another", {**os.environ, **ANOTHER_CPU})
    assert "\nCPU path: record (" in (tmp_path / "another.txt").read_text()
    kind, record_kind = cpu_kind((tmp_path / "another.txt").read_text()), cpu_kind((REPO / RECORD).read_text())
    # The record's own bits where this is its kind of CPU (torch, threads); elsewhere this CPU's unmasked run's.
    reference = (logged_losses(REPO / RECORD.with_suffix(".jsonl")) if kind == record_kind else
                 first_steps_of_run_sh(tmp_path, "plain", dict(os.environ)))
    shared = ours.keys() & reference.keys()  # every step to 6 at least: each run stops soon after it
    assert {key: ours[key] for key in shared} == {key: reference[key] for key in shared}


def test_run_sh_refuses_a_cpu_path_it_does_not_know_in_one_line(tmp_path):
    run = subprocess.run([str(REPO / "run.sh"), f"--log_dir={tmp_path}"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CPU_PATH": "avx512", "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 2 and run.stdout == "" and not any(tmp_path.iterdir()), run.stderr
    assert run.stderr.splitlines() == ["error: CPU_PATH=avx512: use CPU_PATH=record (the default: the bundled records' "
                                       "arithmetic) or CPU_PATH=native (this CPU's own kernels)"]


def stand_in_torch(folder: Path, body: str) -> dict[str, str]:
    """The environment of a machine whose `import torch` runs body instead (what run.sh's probe sees of it)."""
    (folder / "torch").mkdir(parents=True)
    (folder / "torch" / "__init__.py").write_text(body)
    return {**os.environ, "PYTHONPATH": str(folder)}


TWO_GPUS = """
class cuda:
    device_count = staticmethod(lambda: 2)
class cpu:
    _is_avx2_supported = staticmethod(lambda: True)
"""
CPUS = len(os.sched_getaffinity(0))  # the CPUs this process may use


@pytest.mark.parametrize("nproc, gpus, flags, message", [
    *((n, False, [], f"NPROC={n}: give the number of processes, a whole number from 1 (e.g. NPROC=2), or leave it "
      "unset for one per GPU (one on a CPU)") for n in ("abc", "0", "-1", "2.5", "02", " 2")),
    (str(CPUS + 1), False, [], f"NPROC={CPUS + 1} but {CPUS} CPU(s) are available: give NPROC={CPUS} or fewer (one "
     "process per CPU)"),
    ("9" * 30, False, [], f"NPROC={'9' * 30} but {CPUS} CPU(s) are available"),  # past bash's integers
    ("3", True, [], "NPROC=3 but 2 GPU(s) are available: give NPROC=2 or fewer (one process per GPU)"),
    (str(CPUS + 1), True, ["--device=cpu"], f"NPROC={CPUS + 1} but {CPUS} CPU(s) are available"),
])
def test_run_sh_refuses_an_nproc_it_cannot_run_in_one_line(tmp_path, nproc, gpus, flags, message):
    # --bogus: a flag the trainer refuses at once, so that an NPROC let through starts no training either.
    env = stand_in_torch(tmp_path / "site", TWO_GPUS) if gpus else {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([str(REPO / "run.sh"), f"--log_dir={tmp_path / 'logs'}", *flags, "--bogus=1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**env, "NPROC": nproc})
    assert run.returncode == 2 and run.stdout == "" and not (tmp_path / "logs").exists(), run.stderr
    assert len(run.stderr.splitlines()) == 1 and run.stderr.startswith(f"error: {message}"), run.stderr


def test_ctrl_c_while_run_sh_loads_torch_exits_130_quietly(tmp_path):
    loading = tmp_path / "loading"  # a torch that takes its time to load, and says when it has started
    env = stand_in_torch(tmp_path / "site", f"import pathlib, time\npathlib.Path({str(loading)!r}).touch()\n"
                                            "time.sleep(600)\n")
    proc = subprocess.Popen([str(REPO / "run.sh")], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    wait_until(loading.exists, proc)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    out, err = proc.communicate(timeout=300)
    assert (proc.returncode, out, err) == (130, "", "")


@pytest.mark.slow
def test_run_sh_runs_the_record_path_unless_asked_for_the_native_one(tmp_path):
    avx2, avx512 = torch.cpu._is_avx2_supported(), torch.cpu._is_avx512_supported()
    expected = {"record": "record" if avx2 else "native",  # without AVX2 run.sh runs the CPU's own, and says so
                "native": "record" if avx2 and not avx512 else "native"}  # an AVX2-only CPU's own is the record's
    for path in ("record", "native"):
        run = subprocess.run([str(REPO / "run.sh"), *tiny_args(tmp_path, run_id=path, num_steps=2, **SMALL)],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "CPU_PATH": path, "CUDA_VISIBLE_DEVICES": ""})
        assert run.returncode == 0, run.stderr[-2000:]
        log = (tmp_path / "logs" / f"{path}.txt").read_text()
        assert f"\nCPU path: {expected[path]} (" in log, (path, re.findall(r"^CPU .*$", log, re.M))
