"""tools/gpu_check.py: its table reads pytest's junit XML (outcomes, reasons, recorded figures) and its stages
survive a failing or hanging step. The whole check on the CPU is `python tools/gpu_check.py` (about two
minutes); here its parts run on small inputs."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import wait_until

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import gpu_check  # noqa: E402

SAMPLE_TESTS = '''
import pytest

def test_measures(record_property):
    record_property("ms", 1.5)

def test_breaks():
    assert 1 == 2, "one is not two"

@pytest.mark.skipif(True, reason="needs a CUDA GPU")
def test_gpu_only():
    pass
'''


def test_rows_carry_outcome_reason_and_figures_from_junit_xml(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    xml = tmp_path / "out.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
                    f"--junitxml={xml}", str(tmp_path / "test_sample.py")], cwd=tmp_path, capture_output=True)
    rows = {r["check"].split("::")[1]: r for r in gpu_check.test_rows(xml)}
    assert rows["test_measures"]["result"] == "PASS" and rows["test_measures"]["figures"] == {"ms": "1.5"}
    assert rows["test_breaks"]["result"] == "FAIL" and "one is not two" in rows["test_breaks"]["note"]
    assert rows["test_gpu_only"]["result"] == "SKIP" and "needs a CUDA GPU" in rows["test_gpu_only"]["note"]
    table = gpu_check.table(list(rows.values()))
    assert table.count("\n") == 4 and "| PASS |" in table and "ms=1.5" in table


def test_a_stage_past_its_limit_is_killed_and_reported(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text(textwrap.dedent("""
        import time
        print("started", flush=True)
        time.sleep(60)
    """))
    code, seconds = gpu_check.run_logged([sys.executable, str(script)], tmp_path / "slow.log", limit_s=2)
    assert code is None and seconds < 30
    log = (tmp_path / "slow.log").read_text()
    assert "started" in log and "killed after 2 s" in log
    code, _ = gpu_check.run_logged([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "fail.log", 30)
    assert code == 3


def test_a_killed_test_stage_keeps_each_finished_tests_outcome_from_its_log(tmp_path):
    # The XML is written at the end only: a stage killed at its limit reads the verbose log instead.
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS + textwrap.dedent('''
        def test_hangs():
            import time
            time.sleep(60)
    '''))
    rows = gpu_check.run_tests([str(tmp_path / "test_sample.py")], tmp_path, limit_s=8)
    results = {r["check"].split("::")[-1]: (r["result"], r["note"]) for r in rows}
    assert results["test_measures"] == ("PASS", "") and results["test_breaks"][0] == "FAIL"
    assert results["test_gpu_only"][0] == "SKIP"
    assert results["test_hangs"] == ("FAIL", "running when the stage was killed")
    assert results["tests"] == ("FAIL", "killed after 8 s; see tests.log")


def test_stages_run_kernels_first_then_the_model_then_the_bench_at_its_last_stage_inside_ten_minutes(
        monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(gpu_check, "run_tests", lambda tests, out, limit, stage: calls.append((stage, tests)) or [])
    monkeypatch.setattr(gpu_check, "bench_run", lambda out, cuda: calls.append(("bench", None)) or ({}, None))
    gpu_check.stages(tmp_path, cuda=True)
    gpu_check.benches(tmp_path, cuda=True)
    assert [c[0] for c in calls] == ["kernels", "model", "bench"]
    kernels, model = calls[0][1], calls[1][1]
    cuda_kernel_tests = [t for t in kernels if t.startswith("tests/test_cuda.py::")]
    assert {t.split("::")[1] for t in cuda_kernel_tests} >= {
        "test_relu2_mlp_kernel_in_bf16_at_the_recipes_shape_follows_the_torch_mlp", "test_fp8_ops_pass_opcheck_on_cuda",
        "test_fp8_mlp_kernels_at_the_recipes_shape_follow_the_torch_path_and_the_quantizers_is_bit_exact"}
    # Each CUDA test runs once: the kernel ones in the first stage, deselected from the model stage's file.
    assert "tests/test_cuda.py" in model and {f"--deselect={t}" for t in cuda_kernel_tests} <= set(model)
    for test in [t for t in kernels + model if "::" in t and not t.startswith("--")]:  # no renamed test lost
        path, name = test.split("::")
        assert f"def {name}(" in (REPO / path).read_text(), test
    assert sum(gpu_check.LIMITS_S.values()) <= 600 - 60  # start-up and the memory estimate inside ten minutes


def test_the_bench_runs_the_recipe_at_its_last_and_largest_shape():
    import train_gpt as T
    cfg = T.parse_config([*gpu_check.last_stage_args(), "--bench"])
    T.validate_config(cfg, 1)
    recipe = T.Config()
    first, last = T.schedule_table(cfg)[0], T.schedule_table(recipe)[recipe.num_steps - recipe.extension_steps - 1]
    shape = lambda s: (s.seq_len, s.long_window, s.short_window, s.max_doc_len, s.lr_mult)  # noqa: E731
    assert shape(first) == (49152, 11, 5, 2048, 1.73)
    assert shape(last)[:4] == shape(first)[:4]  # the last stage's (its lr has cooled down by then)


# A stage that hangs, with a helper process in its group (as inductor's compile workers are): it writes both ids.
HANGING_STAGE = """
import os, pathlib, subprocess, time

def test_hangs():
    helper = subprocess.Popen(["sleep", "600"])
    pathlib.Path(os.environ["STAGE_PIDS"]).write_text(f"{os.getpid()} {helper.pid}\\n")
    time.sleep(600)
"""
# gpu_check.py's own main, its stages replaced by that one, with SIGINT as a terminal's foreground job has it: a
# launcher without job control (a background `cmd &` in a script, so this suite's too) hands it on ignored.
CHECK_WITH_A_HANGING_STAGE = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, sys.argv[1])
import gpu_check
_, stage, out = sys.argv[1:]
gpu_check.stages = lambda folder, cuda: gpu_check.run_tests([stage], folder, 600, "kernels")
sys.argv = ["gpu_check.py", "--out", out, "--skip_bench"]
sys.exit(gpu_check.main())
"""


def running(pid: int) -> bool:
    """Whether pid is a live process (not one that has exited and awaits its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("signum, code, line", [(signal.SIGINT, 130, "interrupted"),
                                                (signal.SIGTERM, 143, "terminated")])
def test_a_stopped_check_ends_its_stages_process_group(tmp_path, signum, code, line):
    # The stage runs in a session of its own (so that its limit can kill its whole group): a Ctrl-C in the terminal
    # does not reach it, and a SIGTERM is gpu_check's alone. Either one used to leave pytest running, orphaned.
    (tmp_path / "test_stage.py").write_text(HANGING_STAGE)
    pids = tmp_path / "stage.pids"
    proc = subprocess.Popen([sys.executable, "-c", CHECK_WITH_A_HANGING_STAGE, str(REPO / "tools"),
                             str(tmp_path / "test_stage.py"), str(tmp_path / "out")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "STAGE_PIDS": str(pids)},
                            start_new_session=True)
    wait_until(lambda: pids.exists() and pids.read_text().endswith("\n"), proc)
    stage = [int(pid) for pid in pids.read_text().split()]
    try:
        os.killpg(proc.pid, signum)  # the terminal's Ctrl-C goes to its process group; a scheduler's SIGTERM too
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == code and err.splitlines()[-1] == line and "Traceback" not in err, err
        assert not any(running(pid) for pid in stage)
    finally:  # what a stopped check left behind (or a check that did not stop), ended here
        for pid in filter(running, [*stage, proc.pid]):
            os.kill(pid, signal.SIGKILL)
        proc.wait()
