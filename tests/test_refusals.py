"""What can be known at start-up is refused there: one `error:` line, exit code 2, and no file or folder written
(no log set aside, no folder created, nothing outside --log_dir), nor anything built that grows with the step count.
Then the command line's own manners: argparse's two option forms, one value per flag, the ranges --help states, the
signal handler's lifetime, and a signal during the warmup, the final validation or a failed run's cleanup."""

import dataclasses
import signal
import subprocess
import sys

import pytest
import torch

import train_gpt as T
from conftest import REPO, SMALL, fail_in_step_2, main_in_process, tiny_args


@pytest.mark.parametrize("args, message", [
    (["--model_dim=1048576", "--head_dim=524288"], "the model needs at least"),  # parameters beyond any memory
    (["--vocab_size=100000000000"], "GB for its parameters, their gradients and tables"),
    (["--bigram_rows=10000000000"], "bigram_embed.weight: 5,120.0 GB"),
    # the prefix-token loss's vocabulary: missing, or not a BPE rank file
    (["--vocab_file=nowhere/gpt2.tiktoken"], "--vocab_file=nowhere/gpt2.tiktoken: cannot read GPT-2's BPE tokens"),
    (["--vocab_file=README.md"], "--vocab_file=README.md: cannot read GPT-2's BPE tokens"),
    (["--vocab_file=data/sample/README.md"], "--vocab_file=data/sample/README.md: cannot read GPT-2's BPE tokens"),
    (["--vocab_size=1e11"], "--vocab_size expects int, got '1e11'"),
    # the biggest tensor named with the flags that size it (here the paired heads' RoPE table: not --vocab_size)
    (["--train_seq_len=1000000000000"], "(rotary_paired.cos: 256,000.0 GB), more than the cpu's "),
    (["--train_seq_len=1000000000000"], "check the sizes that make rotary_paired.cos (--train_seq_len=1000000000000, "
                                        "--val_seq_len=1024)"),
    (["--muon_lr=1e30"], "--muon_lr must be in (0, 10], got 1e+30"),
    (["--embed_wd_mul=1e300"], "--embed_wd_mul must be in [0, 1000], got 1e+300"),
    (["--logit_shift=nan"], "--logit_shift must be in [-1000, 1000], got nan"),
    (["--logit_shift=inf"], "--logit_shift must be in [-1000, 1000], got inf"),
    (["--logit_temp=-inf"], "--logit_temp must be in (0, 1000], got -inf"),
    (["--adam_eps=0"], "--adam_eps must be in (0, 1], got 0.0"),
    (["--run_id=../escape"], "--run_id='../escape' names the run's files inside --log_dir: no '/'"),
    (["--run_id=a/b"], "--run_id='a/b' names the run's files"),
    (["--run_id=.."], "--run_id='..' names the run's files"),
    (["--run_id=" + "r" * 201], "at most 200 characters"),
    (["--run_id=a\nb"], "--run_id='a\\nb' names the run's files inside --log_dir: no '/' or '\\', no whitespace or "
                        "control characters"),
    (["--run_id=a b"], "no whitespace or control characters"),
    (["--run_id=a\x1b[2Jb"], "no whitespace or control characters"),
    (["--log_dir="], "--log_dir is empty: give the folder for the run's logs (e.g. --log_dir=logs; --log_dir=. for "),
    (["--seed=99999999999999999999999"], "--seed must be in [-1, 4294967295], got 99999999999999999999999"),
    (["--num_steps=10000000"], "--num_steps must be in [1, 100000], got 10000000"),  # refused before any table
    (["--warmup_steps=1000000000"], "--warmup_steps must be in [0, 10000], got 1000000000"),  # before its plan
    (["--train_epochs=1000000000000"], "--train_epochs must be in [1, 10000]"),  # before a list of 10^12 shards
    (["--num_steps=100000"], "the run needs 100000 steps of 8 sequences"),  # counted step by step to the corpus's end
    (["--train_files="], "--train_files is empty: give a glob of token shards, e.g. --train_files='data/sample/"),
    (["--val_files= "], "--val_files is empty"),
    (["--num_steps=3", "--num_steps", "4"], "--num_steps is given twice ('3' and '4'): give it once"),
    (["--preset=tiny", "--preset", "tiny"], "--preset is given twice ('tiny' and 'tiny'): give it once"),
    (["--log_every"], "--log_every needs a value: --log_every=VALUE"),
    (["--seed", "--log_every=2"], "--seed needs a value: --seed=VALUE"),
    (["--save_final", "maybe"], "unexpected argument 'maybe'"),
    # A long window of 0 blocks (tiny_args' one stage); a short one of 0 stays allowed (the tiny preset's).
    (["--stage_windows=0/0,0/0"], "--stage_windows=0/0,0/0: row 1 holds 0/0: a long window must be at least 1 block"),
    (["--final_val_windows=0/0"], "--final_val_windows=0/0: a long window must be at least 1 block"),
    # A window beyond 2**20 blocks (far past any sequence) would overflow the int32 tables of the step's windows.
    *((["--stage_windows=1/2," + w], f"--stage_windows=1/2,{w}: row 2 holds {w}: an entry is SHORT/LONG blocks, each "
                                     f"in [0, 1048576]") for w in ("1/3000000000", "9300000000000000000/"
                                                                   "9300000000000000000", "1/100000000000000000000")),
    (["--final_val_windows=1/1048577"], "--final_val_windows=1/1048577: an entry is SHORT/LONG blocks, each in "
                                        "[0, 1048576]"),
    # A table of one row (no stage, the extension alone), and a column of another length: each named as given.
    ([f"--stage_{c}={v}" for c, v in zip(T.STAGE_COLUMNS, (128, 2048, "1/2", 1, 1, 1, 0, 0))],
     "the stage table needs a stage and the extension (its last row), got 1 row: --stage_seq_len=128 "
     "--stage_doc_len=2048 --stage_windows=1/2 --stage_lr_mul=1 "),
    (["--stage_windows=1/2"], "the stage table's columns must each list an entry per row (the stages, then the "
                              "extension): --stage_seq_len=128,128 lists 2, "),
    (["--stage_windows=1/2"], ", --stage_windows=1/2 lists 1, "),
    # --micro_split: a piece of every stage's sequence is whole blocks (the masks' tiles)
    (["--micro_split=0"], "--micro_split must be > 0, got 0"),
    (["--micro_split=3"], "--stage_seq_len=128,128: row 1 holds 128: at most --train_seq_len=128 (the longest), in "
                          "--micro_split=3 pieces of a multiple of --block_size=128"),
])
def test_a_refusal_is_one_line_exit_2_and_writes_nothing(tmp_path, monkeypatch, capsys, args, message):
    work = tmp_path / "work"  # the run's folder: --log_dir is work/logs; ../escape would land in work/
    work.mkdir()
    monkeypatch.chdir(work)

    def every_step(cfg):  # a table of every step: minutes for --num_steps=10000000, before any refusal said why
        raise AssertionError(f"schedule_table({cfg.num_steps} steps) was built before the refusal")

    monkeypatch.setattr(T, "schedule_table", every_step)
    given = {a[2:].split("=")[0] for a in args}  # these replace tiny_args' own
    base = [a for a in tiny_args(work, run_id="r") if a[2:].split("=")[0] not in given]
    code, out, err = main_in_process(base + args, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert out == "" and list(tmp_path.rglob("*")) == [work], list(tmp_path.rglob("*"))


def test_the_prefix_token_loss_takes_gpt2s_whole_vocabulary_or_refuses(tmp_path, monkeypatch, capsys):
    # A partial vocabulary leaves the prefix table partial (all -1 from an empty one): the loss would do nothing.
    ranks = (REPO / T.Config.vocab_file).read_text().splitlines(keepends=True)
    for name, lines in (("empty", []), ("first_1000", ranks[:1000]), ("all_but_the_last", ranks[:-1])):
        (tmp_path / name).write_text("".join(lines))
    for path, count in (("/dev/null", 0), (tmp_path / "empty", 0), (tmp_path / "first_1000", 1000),
                        (tmp_path / "all_but_the_last", 50255)):
        code, out, err = main_in_process(tiny_args(tmp_path, vocab_file=path), monkeypatch, capsys)
        assert code == 2 and err.strip() == (
            f"error: --vocab_file={path}: {count:,} BPE ranks, where the prefix-token loss needs GPT-2's 50,256 (ids "
            f"0..50255, within --vocab_size=50304): `git checkout data/tokenizer`, or point it at tiktoken's r50k_base "
            f"file"), err
    assert len(T.read_vocabulary(T.Config())) == 50256 and not (tmp_path / "logs").exists()


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(T.Config) if f.type in ("float", float)])
def test_every_float_field_has_a_finite_range(name):
    for value in (float("nan"), float("inf")):
        with pytest.raises(T.UsageError, match=f"--{name} must be "):
            T.validate_config(dataclasses.replace(T.Config(), **{name: value}), 1)


def test_help_states_each_numeric_fields_range_and_what_a_zero_window_means(monkeypatch, capsys):
    code, out, _ = main_in_process(["--help"], monkeypatch, capsys)
    help_of = {}  # --field=default -> its description, continued on the lines below it
    for line in out.splitlines():
        if line.startswith("  --"):
            name, _, text = line[4:].partition("=")
            help_of[name] = text.split(maxsplit=1)[1] if " " in text.strip() else ""
        elif line.startswith(" " * 44) and help_of:
            help_of[name] += " " + line.strip()
    assert code == 0 and help_of["seed"].endswith("must be in [-1, 4294967295]")
    assert help_of["num_steps"].endswith("must be in [1, 100000]") and help_of["muon_lr"].endswith("must be in (0, 10]")
    for name, rule in T.FIELD_RULES.items():
        assert help_of[name].endswith(f"must be {rule}"), (name, help_of[name])
    # A window of 0 blocks (the tiny preset's first short window) is a token attending to itself alone.
    assert "(0: itself)" in help_of["stage_windows"] and T.PRESETS["tiny"]["stages"][0].windows[0] == 0
    # The stage table as a table, a row per stage and the extension last, then a flag per column, its default the
    # column: what --stage_<column>=A,B,... replaces.
    rows = [line.split() for line in out.splitlines()]
    top = rows.index(["seq_len", "doc_len", "windows", "lr_mul", "mtp_start", "mtp_end", "prefix_start", "prefix_end"])
    assert rows[top + 1] == ["stage", "1", "16384", "896", "1/3", "1", "1/0.5/0.25", "1/0.5/0", "0.25", "0.25"]
    assert rows[top + 4] == ["extension", "49152", "2048", "6/13", "1.73", "1", "1", "0", "0"]
    assert "  --stage_windows=1/3,3/7,5/11,6/13 " in out and "  --stage_mtp_end=1/0.5/0,1/0,1,1 " in out
    tokens = torch.tensor([T.BOS_ID, 5, 6, 7, T.BOS_ID, 8, 9, 10] * 32)
    assert torch.equal(T.dense_mask(tokens, 128, torch.tensor(0)), torch.eye(256, dtype=torch.bool))


def test_options_read_as_argparse_reads_them():
    spaced = T.parse_config(["--preset", "tiny", "--num_steps", "10", "--seed", "-1", "--save_final", "--compile",
                             "false", "--fp8_head", "--logit_shift", "-2.5"])
    joined = T.parse_config(["--preset=tiny", "--num_steps=10", "--seed=-1", "--save_final=true", "--compile=false",
                             "--fp8_head=true", "--logit_shift=-2.5"])
    assert spaced == joined and spaced.num_steps == 10 and spaced.seed == -1 and spaced.save_final
    assert spaced.compile is False and spaced.fp8_head is True and spaced.logit_shift == -2.5


def test_the_signal_handler_belongs_to_the_run_and_the_previous_one_comes_back(tmp_path, monkeypatch, capsys):
    def mine(signum, frame):  # what the importing process (e.g. pytest) had installed
        pass

    seen = []
    monkeypatch.setattr(T, "run", lambda argv: seen.append((signal.getsignal(signal.SIGINT),
                                                            signal.getsignal(signal.SIGTERM))))
    previous = {s: signal.signal(s, mine) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code, _, _ = main_in_process(tiny_args(tmp_path), monkeypatch, capsys)
        assert code == 0 and seen == [(T.STOP, T.STOP)]
        assert signal.getsignal(signal.SIGINT) is mine and signal.getsignal(signal.SIGTERM) is mine
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


FIELDS = dict(num_steps=8, val_every=0, **SMALL)


def test_a_signal_during_the_warmup_leaves_no_checkpoint_and_exits_130(tmp_path, monkeypatch, capsys):
    warmup, steps = T.warmup, []

    def interrupted_warmup(cfg, rt, log, model, optimizer, loader, plan, step):
        def ctrl_c(*args):  # Ctrl-C while the warmup compiles its first step
            steps.append(1)
            T.STOP(signal.SIGINT, None)
        return warmup(cfg, rt, log, model, optimizer, loader, plan, ctrl_c)

    monkeypatch.setattr(T, "warmup", interrupted_warmup)
    code, out, err = main_in_process(tiny_args(tmp_path, run_id="warm", warmup_steps=1, save_every=1, **FIELDS),
                                     monkeypatch, capsys)
    logs = tmp_path / "logs"
    # Nothing recorded yet: its log is set aside as any such run's, and the run id is free.
    assert code == 130 and steps == [1] and err.strip().splitlines() == [
        "interrupted", f"(its log is kept as {logs / 'warm.failed.txt'}; the run id is free for a rerun)"], err
    assert (logs / "warm.failed.txt").read_text().rstrip().splitlines()[-1] == "interrupted"
    assert not (logs / "warm").exists() and not (logs / "warm.txt").exists()


def test_a_signal_during_the_final_validation_stops_there_and_hands_the_handlers_back(tmp_path, monkeypatch, capsys):
    validate = T.validate

    def sigterm_in_the_last(model, val, cfg, rt, log, windows, step, *args, **kwargs):
        if step == cfg.num_steps:  # a SIGTERM arriving while the last validation runs
            T.STOP(signal.SIGTERM, None)
        return validate(model, val, cfg, rt, log, windows, step, *args, **kwargs)

    monkeypatch.setattr(T, "validate", sigterm_in_the_last)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    code, out, err = main_in_process(tiny_args(tmp_path, run_id="last", **dict(FIELDS, num_steps=2)), monkeypatch,
                                     capsys)
    assert code == 143 and err.strip().splitlines() == ["terminated"], err
    logs = tmp_path / "logs"
    assert "step:2/2 train_loss:" in out and "step:2/2 val_loss:" not in out and not (logs / "last.json").exists()
    # It recorded steps: its log keeps the run id's name, its last line the stop.
    assert (logs / "last.txt").read_text().rstrip().splitlines()[-1] == "terminated"
    # The handler ignored SIGINT and SIGTERM once the signal came; the run hands back what it found, and the next
    # run starts afresh.
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before and not T.STOP.ignored


def test_a_signal_while_a_failed_run_cleans_up_changes_nothing(tmp_path, monkeypatch, capsys):
    close = T.Checkpointer.close

    def sigterm_in_the_cleanup(self, error=False):  # torchrun's SIGTERM to the rank while it waits for its writes
        if error:
            T.STOP(signal.SIGTERM, None)
        close(self, error)

    fail_in_step_2(monkeypatch)
    monkeypatch.setattr(T.Checkpointer, "close", sigterm_in_the_cleanup)
    with pytest.raises(RuntimeError, match="a bug in step 2"):
        main_in_process(tiny_args(tmp_path, run_id="bug", save_every=1, **FIELDS), monkeypatch, capsys)
    logs = tmp_path / "logs"
    assert (logs / "bug.failed.txt").read_text().rstrip().splitlines()[-1] == "failed: RuntimeError: a bug in step 2"
    T.read_checkpoint_meta(logs / "bug" / "ckpt_1")  # the write in flight finished


def test_an_older_python_is_refused_in_one_line():
    # The file calls BaseException.add_note (3.11): on 3.10 it says so at import, before anything else runs.
    code = ("import platform, runpy, sys; sys.version_info = (3, 10, 14, 'final', 0); "
            "platform.python_version = lambda: '3.10.14'; runpy.run_path('train_gpt.py', run_name='old')")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.strip() == "error: train_gpt.py needs Python 3.11 or newer (this is 3.10.14)"


def test_a_gpu_out_of_memory_is_one_line_naming_the_split_that_fits(tmp_path, monkeypatch, capsys):
    # torch's OutOfMemoryError (a page of allocator figures) becomes one line on the rank it happened on, exit 2,
    # pointing at the card table and --micro_split; the run's log is kept aside as for any failed run.
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.38 GiB. GPU 0 has a total capacity of "
                                     "23.55 GiB of which 1.02 GiB is free.")

    monkeypatch.setattr(T, "train", out_of_memory)
    code, out, err = main_in_process(tiny_args(tmp_path, run_id="oom"), monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and lines[0].startswith("error: rank 0 ran out of GPU memory: "), err
    assert "python tools/memory_estimate.py --cards" in lines[0] and "--micro_split=N" in lines[0]
    assert lines[1:] == [f"(its log is kept as {tmp_path / 'logs' / 'oom.failed.txt'}; the run id is free for a "
                         f"rerun)"], err
    assert "Tried to allocate" not in err
