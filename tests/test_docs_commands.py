"""The docs are true as written: every command in README.md's and docs/DETAILS.md's code blocks is either run here
from a fresh copy of the repository (the ones that take under a minute) or skipped for a reason listed below; every
repository path the docs name exists; the lists the docs copy from the code (the resume refusals, the sm90 check's
rows) are the code's."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

DOCS = ("README.md", "docs/DETAILS.md")
# Every README and doc a reader follows paths from (the paths test).
ALL_DOCS = (*DOCS, "records/README.md", "tools/README.md", *(str(p.relative_to(REPO)) for p in sorted(
    (REPO / "records").glob("**/README.md"))))

# Each command of the docs' shell blocks, as written (its comment cut): run here (None), or why not.
PIP = "installs packages from the network (CI's first step runs the CPU line: .ci/run)"
SUITE = "runs the test suite this test is part of"
GPU = "needs a CUDA GPU"
PLACEHOLDER = "names placeholders (A.txt, RUN..., <run_id>) a reader fills in"
COMMANDS = {
    "python -m venv .venv && . .venv/bin/activate": "makes a virtual environment (CI's image has its own)",
    "pip install torch==2.13.0 triton==3.6.0 -r requirements.txt": PIP,
    "pip install torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130": PIP,
    "pip install triton==3.6.0 -r requirements.txt": PIP,
    "pip install kernels": PIP,
    "./run.sh": "minutes on a CPU (tests/test_first_contact.py runs the quick start and checks its verdict)",
    "python tools/compare.py diff records/2026-11-28_tiny_cpu_head/tiny_cpu_w1.txt logs/<run_id>.txt": PLACEHOLDER,
    "python data/cached_fineweb10B.py 8": "downloads FineWeb shards from the network",
    "python tools/gpu_check.py": GPU,
    "OMP_WAIT_POLICY=PASSIVE pytest -n 2 --dist loadfile": SUITE,
    'pytest -m "not slow"': SUITE,
    "SPEEDRUN_SLOW_COMPILES=1 pytest tests/test_compiled_fa3.py": "five minutes of cold compiles (opt-in by design)",
    "python tools/compare.py show records/2026-11-28_tiny_cpu_head/": None,
    "python tools/compare.py diff A.txt B.txt": PLACEHOLDER,
    "python tools/compare.py stats RUN... [--baseline RUN...]": PLACEHOLDER,
    "python tools/compare.py plot RUN... -o compare.png": PLACEHOLDER,
    "python tools/trace_report.py logs/<run_id>/": PLACEHOLDER,
    "python tools/memory_estimate.py": None,
    "python tools/comm_bytes.py --train_files='data/proxy/proxy_train_*.bin'":
        "needs the proxy corpus in the git-ignored data/proxy/ (without it the tool refuses the glob, as it should)",
    "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python train_optim.py --preset=tiny":
        "minutes on a CPU (tests/test_track3_record.py runs it and compares it with its record)",
    "torchrun --standalone --nproc_per_node=8 train_optim.py --trials=4": GPU,
}


def shell_commands(doc: str) -> list[str]:
    """The commands of a markdown file's bash code blocks, one per line, comments cut."""
    text = (REPO / doc).read_text()
    out = []
    for body in re.findall(r"^ *```(?:bash|sh)\n(.*?)^ *```", text, re.S | re.M):
        for line in body.splitlines():
            command = re.sub(r"\s+#\s.*$", "", line).strip()
            if command and not command.startswith("#"):
                out.append(command)
    return out


def test_every_command_in_the_docs_is_run_here_or_skipped_for_a_listed_reason():
    found = [c for doc in DOCS for c in shell_commands(doc)]
    assert set(found) == set(COMMANDS), ("commands the list lacks", set(found) - set(COMMANDS),
                                         "listed commands no doc has", set(COMMANDS) - set(found))


def fresh_copy(dest: Path) -> Path:
    """The repository's files as a clone would have them (tracked, and new files git does not ignore)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout")
@pytest.mark.parametrize("command", [c for c, why in COMMANDS.items() if why is None])
def test_a_quick_command_of_the_docs_runs_as_written_from_a_fresh_copy(command, tmp_path):
    repo = fresh_copy(tmp_path / "repo")
    argv = command.split()
    assert argv[0] == "python"
    run = subprocess.run([sys.executable, *argv[1:]], cwd=repo, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() and "error" not in run.stderr.lower(), (run.stdout[-2000:], run.stderr[-2000:])


# Paths the docs name that a clone does not hold, by design: outputs, git-ignored data, upstream's and examples.
NOT_IN_A_CLONE = ("logs/", "data/proxy/", "data/fineweb10B/", "records/track_1_short/", "records/2026-01-01_example/",
                  "records/082725_FA3/", "records/<date>", "tests/reference70.py", "tests/reference89.py")


def named_paths(doc: str) -> set[str]:
    text = (REPO / doc).read_text()
    found = re.findall(r"(?<![\w/.~<-])((?:tools|records|tests|docs|data)/[\w.*/-]*[\w*/])", text)
    return {p for p in found if not p.startswith(NOT_IN_A_CLONE)}


@pytest.mark.parametrize("doc", ALL_DOCS)
def test_every_repository_path_a_doc_names_exists(doc):
    base = (REPO / doc).parent
    missing = [p for p in sorted(named_paths(doc))
               if not any(root.glob(p.rstrip("/")) for root in (REPO, base)) and not (REPO / p).exists()]
    assert not missing, missing


def test_details_lists_the_fields_a_resume_must_match():
    import train_gpt as T
    text = (REPO / "docs" / "DETAILS.md").read_text()
    listed = re.search(r"a different model\s+shape or token stream \((.*?)`CKPT_MATCH_FIELDS`", text, re.S).group(1)
    assert re.findall(r"`(\w+)`", listed) == list(T.CKPT_MATCH_FIELDS)


def test_the_sm90_sample_output_shows_every_launch_the_check_compiles():
    pytest.importorskip("triton")
    sys.path.insert(0, str(REPO / "tools"))
    import sm90_kernels
    import train_gpt as T
    text = (REPO / "docs" / "DETAILS.md").read_text()
    shown = re.findall(r"^PASS  sm90  (.+?)\s+shared", text, re.M)
    assert shown == [name for name, *_ in sm90_kernels.cases(T.Config())]


def test_the_readme_states_the_python_the_file_needs():
    # train_gpt.py calls BaseException.add_note (3.11); the README's floor and the file's start-up check say so.
    assert "Python 3.11+" in (REPO / "README.md").read_text()
    assert sys.version_info >= (3, 11)


def test_the_quick_starts_time_is_its_records():
    # The README's training time for the quick start is the bundled record's own, not a figure from another file.
    record = REPO / "records" / "2026-11-28_tiny_cpu_head" / "tiny_cpu_w1.json"
    if not record.exists():
        pytest.skip(f"{record.relative_to(REPO)} is not made yet")
    import json
    seconds = json.loads(record.read_text())["train_time_ms"] / 1000
    stated = re.search(r"\((\d+) s of training on the record path, on the 2-core AMD EPYC",
                       (REPO / "README.md").read_text())
    assert stated and int(stated.group(1)) == round(seconds), (stated, seconds)
