"""The docs are true as written: every command in README.md's and docs/DETAILS.md's code blocks is either run here
from a fresh copy of the repository (the ones that take under a minute) or skipped for a reason listed below; every
repository path the docs name exists; every name of the code they write inline (a function, class, constant,
method, Config field or flag) is the code's; the lists the docs copy from the code (the resume refusals, the sm90
check's rows) are the code's."""

import ast
import dataclasses
import fnmatch
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, fresh_copy

DOCS = ("README.md", "docs/DETAILS.md")
# Every README and doc a reader follows paths from (the paths test).
ALL_DOCS = (*DOCS, "records/README.md", "tools/README.md", *(str(p.relative_to(REPO)) for p in sorted(
    (REPO / "records").glob("**/README.md"))))

# Each command of the docs' shell blocks, as written (its comment cut): run here (None), or why not.
PIP = "installs packages from the network (CI's first step runs the CPU line: .ci/run)"
SUITE = "runs the test suite this test is part of"
GPU = "needs a CUDA GPU"
PLACEHOLDER = "names placeholders (A.txt, RUN..., <run_id>) a reader fills in"
SLURM = "a SLURM job script's lines (sbatch runs them on a cluster; tests/test_resume_auto.py runs their kind of loop)"
COMMANDS = {
    "python -m venv .venv && . .venv/bin/activate": "makes a virtual environment (CI's image has its own)",
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu": PIP,
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
    "trap 'scontrol requeue $SLURM_JOB_ID' USR1": SLURM,
    "./run.sh --resume=auto --run_id=speedrun-$SLURM_JOB_ID &": SLURM,
    "wait": SLURM,
    "python tools/comm_bytes.py --train_files='data/sample/sample_train_*.bin'":
        "over a minute on 2 cores (the optimizer stepped at 1, 2, 4 and 8 ranks); tests/test_comm_bytes.py checks it",
    "./run.sh train_optim.py": "minutes on a CPU (tests/test_track3_record.py runs it and compares it with its record)",
    "./run.sh train_optim.py --trials=4": GPU,
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


# The docs that name the code inline, and the code they name: the project's own Python files.
NAME_DOCS = ("README.md", "docs/DETAILS.md", "tools/README.md")
CODE_FILES = ("train_gpt.py", "gpt_kernels.py", "train_optim.py", "sample.py", "tools/*.py", "data/*.py")
FILE_ENDINGS = {"py", "sh", "json", "jsonl", "md", "txt", "bin", "pt", "gz", "png", "so"}  # `model.pt` is a file
# Another code base (a record's, upstream's) named: a table column headed by it lists its names, and so does its
# possessive in prose ("upstream's `sparse_comms_start`", "#89's `XXT`"), not this project's.
OTHER_CODE = r"#\d+|upstream"


def inline_code(markdown: str) -> list[tuple[int, str]]:
    """(line, text) of each `span` of a markdown text outside its code blocks and other code bases' names; a span may
    wrap across lines."""
    kept, fenced, other_columns = [], False, set()
    for line in markdown.splitlines():
        fence = line.lstrip().startswith("```")
        fenced ^= fence
        if fenced or fence:
            line = ""
        elif line.startswith("|"):
            cells = line.strip().strip("|").split("|")
            if not other_columns:  # the header row: which columns list other code's names
                other_columns = {i for i, cell in enumerate(cells) if re.fullmatch(OTHER_CODE, cell.strip(), re.I)}
                other_columns.add(-1)  # the table has begun, whatever its columns
            line = "|".join(cell for i, cell in enumerate(cells) if i not in other_columns)
        else:
            other_columns = set()
        kept.append(line)
    text = "\n".join(kept)
    return [(text.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
            for m in re.finditer(r"`([^`]+)`", text)
            if not re.search(rf"(?:{OTHER_CODE})'s\s+$", text[max(m.start() - 20, 0):m.start()], re.I)]


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of a module's docstring nodes: prose, which may be as stale as the docs."""
    bodies = [n.body for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))]
    return {id(body[0].value) for body in bodies if body and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)}


@dataclasses.dataclass
class CodeNames:
    """What the project's code holds, read from its source (nothing imported but the trainers' Configs)."""
    members: dict[str, set[str]]  # module stem or class name -> its top-level names or members
    names: set[str]  # every identifier the code uses or defines, and the words of its strings (log and JSON keys)
    flags: set[str]  # the Config fields and the --flags the other commands parse
    fields: set[str]
    tests: set[str]  # the tests' function names

    @classmethod
    def read(cls) -> "CodeNames":
        import train_gpt as T
        import train_optim as O
        fields = {f.name for module in (T, O) for f in dataclasses.fields(module.Config)} | set(T.STAGE_FLAGS)
        code = cls({}, set(), fields | {"help"}, fields, set())  # argparse's --help
        for path in sorted(p for pattern in CODE_FILES for p in REPO.glob(pattern)):
            code.add_module(path.stem, ast.parse(path.read_text()))
        code.names |= set(re.findall(r"\w+", (REPO / "run.sh").read_text()))  # its Python part: torchrun's error
        for path in (REPO / "tests").glob("test_*.py"):
            code.tests |= {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
        return code

    def add_module(self, stem: str, tree: ast.Module) -> None:
        self.members.setdefault(stem, set()).update(defined_names(tree.body))
        prose = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                self.members.setdefault(node.name, set()).update(defined_names(node.body), self_attributes(node))
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) not in prose:
                    self.names |= set(re.findall(r"[A-Za-z_]\w*", node.value))
                    self.flags |= set(re.findall(r"^--([a-z]\w*)$", node.value))
            else:
                self.names |= {getattr(node, a) for a in ("id", "attr", "name", "arg") if isinstance(
                    getattr(node, a, None), str)}

    def unknown(self, span: str, gone: set[str]) -> str | None:
        """Why a doc's inline `span` names nothing in the code, or None: it does, or it is no code name of this
        project (a command, a file, a number, a word, another library's name)."""
        text = span.removesuffix("()")
        if flag := re.fullmatch(r"--([a-z][a-z0-9_]*)(=\S*)?", text):
            name = flag.group(1)
            return None if name in self.flags | gone else f"no Config field or command parses --{name}"
        if "*" in text and re.fullmatch(r"[a-z0-9_*]+", text) and "_" in text:  # a family of fields: `fp8_*`
            return None if fnmatch.filter(self.fields, text) else f"no Config field matches {text}"
        if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", text) and text.rsplit(".", 1)[1] not in FILE_ENDINGS:
            return self.unresolved(text.split("."))
        if re.fullmatch(r"[A-Za-z_]\w*", text) and re.search(r"_|[A-Z]", text):  # a code name, not a word
            if text.startswith("test_"):
                return None if text in self.tests else f"no test in tests/ is named {text}"
            return None if text in self.names else f"the code has no name {text}"
        return None

    def unresolved(self, path: list[str]) -> str | None:
        """A dotted path from a module or class of the project: why it does not resolve, or None."""
        head, *rest = path
        if head not in self.members:
            return f"the code has no module or class {head}" if head[0].isupper() else None  # torch.compile: others'
        scope = head
        for part in rest:
            if part not in self.members[scope]:
                return f"{scope} has no {part}"
            if part not in self.members:  # a function or a value: what lies beyond it is not read
                return None
            scope = part
        return None


def defined_names(body: list[ast.stmt]) -> set[str]:
    """The names a module's or class's body binds (in its if and try blocks too): functions, classes, assignments (a
    dataclass's fields)."""
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try)):
            blocks = [node.body, node.orelse, getattr(node, "finalbody", []),
                      *(h.body for h in getattr(node, "handlers", []))]
            names |= set().union(*map(defined_names, blocks))
    return names


def self_attributes(cls: ast.ClassDef) -> set[str]:
    """The attributes a class's methods assign to self (a module's submodules and buffers, say)."""
    return {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}


def gone_flags() -> set[str]:
    """The flags DETAILS lists as gone (`- `--flag`` under "### Gone"): named in the docs, absent from the code."""
    section = (REPO / "docs" / "DETAILS.md").read_text().split("\n### Gone\n")[1].split("\n#")[0]
    return set(re.findall(r"^- `--(\w+)`", section, re.M))


def test_every_code_name_the_docs_write_inline_is_the_codes():
    code, gone = CodeNames.read(), gone_flags()
    unknown = [f"{doc}:{line} `{span}`: {why}" for doc in NAME_DOCS
               for line, span in inline_code((REPO / doc).read_text()) if (why := code.unknown(span, gone))]
    assert not unknown, "\n".join(unknown)


def test_a_flag_the_docs_list_as_gone_is_no_config_field():
    import train_gpt as T
    gone = gone_flags()
    assert gone and not gone & {f.name for f in dataclasses.fields(T.Config)}, gone


def test_the_inline_code_the_rule_reads_leaves_out_code_blocks_and_other_code_bases_names():
    markdown = ("Ours: `a_name` and `a\nwrapped_name`; #89's `XXT` and upstream's\n`sparse_comms_start` are theirs.\n"
                "```bash\npython `in_a_block`\n```\n"
                "| #89 | here |\n|---|---|\n| `theirs_in_a_table` | `ours_in_a_table` |\n\nAfter: `ours_again`\n")
    assert inline_code(markdown) == [(1, "a_name"), (1, "a wrapped_name"), (9, "ours_in_a_table"), (11, "ours_again")]


def test_the_code_names_rule_tells_the_codes_names_from_stale_ones_and_from_words():
    code = CodeNames.read()
    for name in ("TrainTokenStream._take", "GPT.mudd", "gpt_kernels.xxt", "train_gpt.GPT.apply_yarn", "schedule()",
                 "--warmup_steps", "--top_k", "fp8_*", "ShardedMuonAdam", "final_val_loss",
                 "test_every_code_name_the_docs_write_inline_is_the_codes"):
        assert code.unknown(name, set()) is None, name
    for name in ("TrainTokenStream._pack", "GPT.no_such_method", "gpt_kernels.no_such_kernel", "NoSuchClass.method",
                 "--no_such_flag=1", "no_such_field_*", "no_such_function()", "test_no_such_test"):
        assert code.unknown(name, set()), name
    for word in ("./run.sh", "train_gpt.py", "model.pt", "torch.compile", "sqrt.rn", "mlp", "2.13.0+cpu", "error:",
                 "--monitor-interval=5", "python tools/compare.py diff"):
        assert code.unknown(word, set()) is None, word


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
    stated = re.search(r"\): (\d+) s of training on the\s+record path, on a 2-core AMD EPYC",
                       (REPO / "README.md").read_text())
    assert stated and int(stated.group(1)) == round(seconds), (stated, seconds)
