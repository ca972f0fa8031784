"""train_optim.py (the optimization track) against tests/track3_reference.py, an independent eager reference of
upstream's train_gpt_simple.py (result #36) and of result #2's Adam: each test pins one part, from identical weights
(copied by parameter name) and identical batches."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import track3_reference as R
import train_optim as O
from conftest import cpu_gemms, free_port
from tokenize_text import write_shard

# Small shapes: a 2 x 64 model (two heads of 32) over a 512-token vocabulary, steps of 8 sequences of 32 tokens in
# micro-batches of 2 (4 per step at world size 1, 2 per rank at 2).
VOCAB, LAYERS, DIM, HEAD_DIM, SEQ, SEQS, MBS = 512, 2, 64, 32, 32, 8, 2


def models(seed: int = 0) -> tuple[R.RefGPT, O.GPT]:
    """The reference and the trainer's model with the same weights: the baseline's init, then every parameter moved
    off it (the zero-initialized outputs too) so that every gradient is non-trivial."""
    torch.manual_seed(seed)
    ref = R.RefGPT(VOCAB, LAYERS, DIM, HEAD_DIM)
    R.init_baseline_(ref)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p, dtype=torch.float32).to(p.dtype), alpha=0.02)
    mine = O.GPT(VOCAB, LAYERS, DIM, HEAD_DIM)
    mine.load_state_dict(ref.state_dict())
    return ref, mine


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random (inputs int32, targets int64) steps of SEQS x SEQ tokens, shifted by one as the loaders give them."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, VOCAB, (SEQS * SEQ + 1,), generator=g, dtype=torch.int32) for _ in range(steps)]
    return [O.split_batch(t, SEQ) for t in tokens]


def assert_same_parameters(ref: torch.nn.Module, mine: torch.nn.Module) -> None:
    theirs = dict(ref.named_parameters())
    for name, p in mine.named_parameters():
        assert torch.equal(p, theirs[name]), name


def test_forward_loss_and_every_gradient_equal_the_references():
    ref, mine = models()
    inputs, targets = batches(1)[0]
    expected, got = ref(inputs, targets), mine(inputs, targets)
    expected.backward()
    got.backward()
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    theirs = dict(ref.named_parameters())
    assert [n for n, _ in mine.named_parameters()] == list(theirs)  # upstream's names, in upstream's order
    assert mine.embed.weight.dtype == torch.bfloat16 and mine.proj.weight.dtype == torch.float32
    for name, p in mine.named_parameters():
        assert p.grad.abs().sum() > 0 and torch.equal(p.grad, theirs[name].grad), name


def test_both_inits_draw_the_references_weights():
    """Each trial seeds torch, then its recipe draws the init: result #36's loop, or torch's default init as the
    model's construction draws it (result #2's, which inits at construction)."""
    for recipe, init in (("baseline", O.init_baseline_), ("adam", O.init_torch_default_)):
        torch.manual_seed(7)
        ref = R.RefGPT(VOCAB, LAYERS, DIM, HEAD_DIM, recipe=recipe)
        if recipe == "baseline":
            torch.manual_seed(7)
            R.init_baseline_(ref)
        else:
            R.init_adam_(ref)
        mine = O.GPT(VOCAB, LAYERS, DIM, HEAD_DIM)
        torch.manual_seed(7)
        init(mine)
        assert_same_parameters(ref, mine)


def test_two_muon_steps_equal_the_references():
    ref, mine = models()
    theirs = R.RefMuon([p for p in ref.blocks.parameters() if p.ndim >= 2], lr=0.025, weight_decay=0.05)
    ours = O.Muon([p for p in mine.blocks.parameters() if p.ndim >= 2], lr=0.025, weight_decay=0.05)
    assert [p.shape for p in ours.param_groups[0]["params"]] == [p.shape for p in theirs.param_groups[0]["params"]]
    g = torch.Generator().manual_seed(3)
    for _ in range(2):  # the second step reads the momentum the first left
        for p, q in zip(ref.blocks.parameters(), mine.blocks.parameters()):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        theirs.step()
        ours.step()
        assert_same_parameters(ref, mine)


@pytest.mark.parametrize("recipe", ["muon", "adam"])
def test_one_adamw_step_of_each_group_equals_the_references(recipe):
    ref, mine = models()
    theirs = (R.baseline_optimizers if recipe == "muon" else R.adam_optimizers)(ref)
    ours = O.build_recipe(recipe, mine).optimizers
    mine.load_state_dict(ref.state_dict())  # the recipe initialized it
    names = {p: n for n, p in mine.named_parameters()} | {p: n for n, p in ref.named_parameters()}
    adamw = [(t, o) for t, o in zip(theirs, ours) if isinstance(t, torch.optim.AdamW)]
    assert len(adamw) == (1 if recipe == "muon" else 2)
    for t, o in adamw:
        for tg, og in zip(t.param_groups, o.param_groups, strict=True):
            assert [names[p] for p in tg["params"]] == [names[p] for p in og["params"]]
            assert {k: v for k, v in og.items() if k != "params"} == {k: v for k, v in tg.items() if k != "params"
                                                                      and k != "warmup_steps"}
    g = torch.Generator().manual_seed(4)
    for p, q in zip(ref.parameters(), mine.parameters()):
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        q.grad = p.grad.clone()
    for t, o in adamw:
        t.step()
        o.step()
    assert_same_parameters(ref, mine)


@pytest.mark.parametrize("recipe", ["muon", "adam"])
def test_the_lr_of_every_group_at_every_step_equals_the_references(recipe):
    ref, mine = models()
    theirs = (R.baseline_optimizers if recipe == "muon" else R.adam_optimizers)(ref)
    ours = O.build_recipe(recipe, mine)
    steps = ours.train_steps
    assert steps == (R.BASELINE_STEPS if recipe == "muon" else R.ADAM_STEPS)
    for step in range(steps):
        R.set_hparams(theirs, step, steps, "baseline" if recipe == "muon" else "adam")
        ours.set_hparams(step, steps)
        expected = [g["lr"] for opt in theirs for g in opt.param_groups]
        assert [g["lr"] for opt in ours.optimizers for g in opt.param_groups] == expected, step


@pytest.mark.parametrize("steps", [3250, 5625, 24, 100, 7])
def test_validation_steps_are_the_baselines(steps):
    """The current file's cadence for both recipes: result #2's older file validated every 125 steps throughout."""
    ours = [s for s in range(steps + 1) if O.validates_at(s, steps, 125, 25)]
    assert ours == R.validation_steps(steps, "baseline")


def write_shards(folder: Path, sizes: list[int], seed: int = 0, vocab: int = VOCAB) -> list[Path]:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"t_train_{i:06d}.bin" for i in range(len(sizes))]
    for path, size in zip(paths, sizes):
        write_shard(path, rng.integers(0, vocab, size))
    return paths


def test_the_token_stream_of_each_rank_is_upstreams(tmp_path):
    """Shard 0 ends exactly at a fourth batch's last target, which upstream's ">=" skips; so does shard 1 after one
    batch; shard 3 holds two batches and a token more. Every step's tokens of every rank, from every start."""
    batch = SEQS * SEQ
    files = write_shards(tmp_path, [4 * batch + 1, 2 * batch + 1, 5 * batch + 7, 2 * batch + 2])
    supplied = sum(O.steps_in_shard(O.shard_token_count(f), batch) for f in files)
    for world_size in (1, 2):
        for rank in range(world_size):
            expected = R.data_batches(files, batch, SEQ, rank, world_size)
            expected = [next(expected) for _ in range(supplied)]
            for start in range(supplied):
                source = O.TokenBatches(files, batch, rank, world_size, VOCAB, supplied, start)
                buffer = np.empty(source.shape, dtype=np.int32)
                for step in range(start, supplied):
                    assert source.fill(buffer) == source.shape
                    inputs, targets = O.split_batch(torch.from_numpy(buffer), SEQ)
                    assert torch.equal(inputs, expected[step][0]) and torch.equal(targets, expected[step][1])
                    assert inputs.dtype == torch.int32 and targets.dtype == torch.int64
                assert source.fill(buffer) is None
    assert supplied == 3 + 1 + 5 + 2


def trajectory(steps: int) -> tuple[list[float], R.RefGPT]:
    """The reference's train losses and model after `steps` steps of the baseline at world size 1."""
    ref, _ = models()
    optimizers = R.baseline_optimizers(ref)
    return [R.train_step(ref, optimizers, i, t, s, 10, MBS) for s, (i, t) in enumerate(batches(steps))], ref


class LossSum:
    """The per-micro-batch losses train_step hands its metrics, summed."""

    def __init__(self):
        self.total = torch.zeros(())

    def add(self, loss: torch.Tensor) -> None:
        self.total += loss


def our_trajectory(steps: int, rank: int = 0, world_size: int = 1) -> tuple[list[float], O.GPT]:
    """The trainer's summed train losses (over all ranks) and model after `steps` steps on this rank's slices."""
    ref, mine = models()
    recipe = O.build_recipe("muon", mine)
    mine.load_state_dict(ref.state_dict())
    losses = []
    for s, (inputs, targets) in enumerate(batches(steps)):
        rows = SEQS // world_size
        total = LossSum()
        O.train_step(mine, recipe, inputs[rank * rows:(rank + 1) * rows], targets[rank * rows:(rank + 1) * rows], s,
                     10, MBS, total)
        if world_size > 1:
            dist.all_reduce(total.total)
        losses.append(float(total.total))
    return losses, mine


def test_a_trajectory_at_world_size_1_is_the_references_bit_for_bit():
    expected, ref = trajectory(4)
    losses, mine = our_trajectory(4)
    assert losses == expected
    assert_same_parameters(ref, mine)


def _trajectory_rank(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    try:
        with cpu_gemms():  # the GEMM path the session's reference runs
            losses, mine = our_trajectory(4, rank, world_size)
        if rank == 0:
            torch.save({"losses": losses, "state": mine.state_dict()}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_trajectory_at_world_size_2_is_the_references_up_to_summation_order(tmp_path):
    """Two gloo ranks, each two micro-batches of its half of every step, gradients all-reduced, Muon's matrices
    split between them: the reference's world-size-1 trajectory but for the order of the gradient sums (rank 0's
    half plus rank 1's, against four micro-batches in a row; the bf16 embedding gradient rounds once more). Measured
    over 4 steps (2-core AMD EPYC, torch 2.13): the train losses of steps 1-2 equal, of steps 3-4 2.3e-6 relative
    apart at most; each parameter's distance from the reference's, relative to how far the reference moved it,
    7.0e-3 at most (an attention matrix: Muon's bf16 Newton-Schulz turns a rounding into a bf16 step of the update),
    4.8e-4 for the embedding (0.5% of its entries differ, three in four of those by one bf16 ulp)."""
    out = tmp_path / "rank0.pt"
    mp.spawn(_trajectory_rank, args=(2, free_port(), str(out)), nprocs=2, join=True)
    got = torch.load(out)
    expected, ref = trajectory(4)
    relative = [abs(a - b) / b for a, b in zip(got["losses"], expected)]
    assert max(relative) < 1e-5, relative
    start, theirs = models()[0].state_dict(), ref.state_dict()
    for name, p in ref.named_parameters():
        moved = (theirs[name].float() - start[name].float()).norm()
        assert (got["state"][name].float() - theirs[name].float()).norm() < 2e-2 * moved, name


# -----------------------------------------------------------------------------
# The command line: trials, checkpoints, refusals (small shards of a 512-token vocabulary, a few steps each)

def small_args(tmp_path: Path, **overrides: object) -> list[str]:
    """A few seconds' run on the CPU: the small model on shards written under tmp_path, logging there."""
    data = tmp_path / "data"
    if not data.exists():
        write_shards(data, [40_000, 30_000])
        write_shard(data / "t_val_000000.bin", np.random.default_rng(1).integers(0, VOCAB, 2_000))
    fields = dict(vocab_size=VOCAB, num_layers=LAYERS, model_dim=DIM, head_dim=HEAD_DIM, seq_len=SEQ,
                  batch_seqs=SEQS, mbs=MBS, val_tokens=4 * MBS * SEQ, val_every=2, val_every_end=1, train_steps=6,
                  seed=5, train_files=data / "t_train_*.bin", val_files=data / "t_val_*.bin", device="cpu",
                  log_dir=tmp_path / "logs", run_id="a")
    fields.update(overrides)
    return [f"--{k}={v}" for k, v in fields.items()]


def records(log_dir: Path, run_id: str) -> list[dict]:
    return [json.loads(line) for line in (log_dir / f"{run_id}.jsonl").read_text().splitlines()]


def test_a_run_logs_the_losses_of_the_references_loop_on_the_same_shards(tmp_path):
    """The whole run at world size 1 (seeded init, the prefetched token stream, the val tokens, the schedule over
    train_steps, upstream's cadence) against the reference's loop: the val losses bit for bit; the train losses as
    the reference sums a step's micro-batch losses in fp32, the run in fp64 on the device (measured over these 6
    steps: 7.6e-8 relative apart at most, one fp32 ulp of the reference's sum; step 1 equal)."""
    O.run(small_args(tmp_path, val_every=125, val_every_end=25))
    logged = records(tmp_path / "logs", "a")
    data = tmp_path / "data"
    torch.manual_seed(5)
    ref = R.RefGPT(VOCAB, LAYERS, DIM, HEAD_DIM)
    torch.manual_seed(5)
    R.init_baseline_(ref)
    optimizers = R.baseline_optimizers(ref)
    stream = R.data_batches(sorted(data.glob("t_train_*.bin")), SEQS * SEQ, SEQ, 0, 1)
    val = R.val_batch(sorted(data.glob("t_val_*.bin")), 4 * MBS * SEQ, SEQ, 0, 1)
    val_losses, train_losses = {}, {}
    for step in range(7):
        if step in R.validation_steps(6):
            val_losses[step] = R.val_loss(ref, *val, MBS)
        if step < 6:
            train_losses[step + 1] = R.train_step(ref, optimizers, *next(stream), step, 6, MBS) / (SEQS * SEQ)
    assert {r["step"]: r["val_loss"] for r in logged if "val_loss" in r} == val_losses
    ours = {r["step"]: r["train_loss"] for r in logged if "train_loss" in r}
    assert ours.keys() == train_losses.keys()
    assert all(abs(ours[s] - train_losses[s]) <= 3e-7 * train_losses[s] for s in ours), (ours, train_losses)


def test_trials_run_each_seed_as_its_own_run_would_one_after_another_in_one_log(tmp_path):
    trials = O.run(small_args(tmp_path, trials=2, run_id="both"))
    alone = [O.run(small_args(tmp_path, seed=seed, run_id=f"seed{seed}"))[0] for seed in (5, 6)]
    assert [t.seed for t in trials] == [5, 6] and [t.val_losses for t in alone] != [[]] * 2
    for trial, single in zip(trials, alone):
        assert [v[:2] for v in trial.val_losses] == [v[:2] for v in single.val_losses]
    log = (tmp_path / "logs" / "both.txt").read_text()
    lines = [line for line in log.split(O.SEPARATOR)[-1].splitlines() if line.startswith("step:")]
    assert [line.split()[0] for line in lines] == ["step:0/6", "step:2/6", "step:4/6", "step:6/6"] * 2
    assert all(len(line.split()[1].split(".")[1]) == 5 for line in lines)  # val_loss:V with upstream's 5 decimals
    losses = [(r["trial"], r["step"], r["val_loss"]) for r in records(tmp_path / "logs", "both") if "val_loss" in r]
    assert losses == [(t, s, v) for t, trial in enumerate(trials) for s, v, _ in trial.val_losses]
    summary = json.loads((tmp_path / "logs" / "both.json").read_text())
    assert [t["final_val_loss"] for t in summary["trials"]] == [t.val_losses[-1][1] for t in trials]


def test_the_log_holds_every_source_file_the_run_executed(tmp_path):
    O.run(small_args(tmp_path, train_steps=1))
    log = (tmp_path / "logs" / "a.txt").read_text()
    for name in ("train_optim.py", "train_gpt.py", "gpt_kernels.py"):
        source = (Path(O.__file__).parent / name).read_text()
        assert f"# source: {name} ({len(source.encode())} bytes)\n{source}" in log, name


def test_a_resumed_run_logs_the_same_losses_bit_for_bit(tmp_path):
    logs = tmp_path / "logs"
    O.run(small_args(tmp_path, save_every=3, trials=2, run_id="whole"))
    folder = logs / "whole" / "trial2_ckpt_3"
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["trial"] == 1 and meta["step"] == 3 and set(meta["files"]) == {"model.pt", "rank0.pt"}
    O.run(small_args(tmp_path, trials=2, resume=folder, run_id="resumed", seed=-1))
    whole = [r for r in records(logs, "whole") if r["trial"] == 1 and r["step"] > 3]
    resumed = records(logs, "resumed")
    assert [(r["trial"], r["step"], r.get("train_loss"), r.get("val_loss")) for r in resumed] == [
        (r["trial"], r["step"], r.get("train_loss"), r.get("val_loss")) for r in whole]
    assert len(resumed) == 3 + 2  # the train losses of steps 4, 5 and 6, the validations at 4 and 6


def main_in_process(argv: list[str], monkeypatch, capsys, world_size: int = 1) -> tuple[int, str, str]:
    """train_optim.main() as the command line runs it, in this process: (exit code, stdout, stderr)."""
    monkeypatch.setattr("sys.argv", ["train_optim.py", *map(str, argv)])
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    try:
        O.main()
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory) -> Path:
    """A complete checkpoint of a small run at step 2, written by one rank."""
    folder = tmp_path_factory.mktemp("saved")
    O.run(small_args(folder, save_every=2, train_steps=3, run_id="saved"))
    return folder / "logs" / "saved" / "ckpt_2"


@pytest.mark.parametrize("case", ["unknown_flag", "optimizer", "world_size", "no_shards", "too_few_tokens", "run_id",
                                  "checkpoint_corrupt", "checkpoint_world_size", "checkpoint_shape"])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, monkeypatch, capsys, saved_checkpoint,
                                                           case):
    args = small_args(tmp_path)
    if case.startswith("checkpoint"):
        folder = shutil.copytree(saved_checkpoint, tmp_path / "ckpt_2")
        args = small_args(tmp_path, resume=folder)
        if case == "checkpoint_corrupt":
            with open(folder / "rank0.pt", "r+b") as f:
                f.seek(100)
                f.write(b"\x00" * 8)
    extra, expected = {
        "unknown_flag": (["--optimiser=adam"], "unknown option --optimiser; did you mean --optimizer?"),
        "optimizer": (["--optimizer=adamw"], "unknown --optimizer='adamw'; choose from: muon, adam (did you mean "),
        "world_size": ([], "--batch_seqs=8 over 3 rank(s) must give each a multiple of --mbs=2 sequences"),
        "no_shards": (["--train_files=/nowhere/x_*.bin"], "no files match '/nowhere/x_*.bin'"),
        "too_few_tokens": (["--train_steps=1000"], "the run needs 1000 steps of 256 tokens but 2 file(s) supply 273"),
        "run_id": (["--run_id=a/b"], "--run_id='a/b' names the run's files inside --log_dir"),
        "checkpoint_corrupt": ([], "rank0.pt does not match its checksum in meta.json"),
        "checkpoint_world_size": ([], "was saved by 1 rank(s): resume it with as many (this launch has 2)"),
        "checkpoint_shape": (["--model_dim=128"], "needs --model_dim=64 (this run: 128)"),
    }[case]
    world_size = {"world_size": 3, "checkpoint_world_size": 2}.get(case, 1)
    args = [a for a in args if not any(a.startswith(e.split("=")[0] + "=") for e in extra)] + extra
    code, out, err = main_in_process(args, monkeypatch, capsys, world_size)
    assert code == 2 and out == "", (out, err)
    assert err.count("\n") == 1 and err.startswith("error: ") and expected in err, err
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())


def test_a_recipe_leaving_a_parameter_out_or_taking_one_twice_is_named():
    def partial(model: O.GPT) -> O.Recipe:
        matrices = [p for p in model.blocks.parameters() if p.ndim >= 2]
        vectors = [p for p in model.parameters() if p.ndim < 2]
        return O.Recipe([O.Muon(matrices), torch.optim.AdamW([model.embed.weight, model.embed.weight, *vectors])], 10)

    with pytest.MonkeyPatch.context() as m:
        m.setitem(O.OPTIMIZERS, "partial", partial)
        with pytest.raises(ValueError, match=r"exactly one optimizer group: embed.weight \(2x\), proj.weight \(0x\)"):
            O.build_recipe("partial", O.GPT(VOCAB, 1, DIM, HEAD_DIM))


def test_a_val_token_outside_the_vocabulary_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    args = small_args(tmp_path)
    write_shard(tmp_path / "data" / "t_val_000000.bin", np.full(2_000, VOCAB))
    code, out, err = main_in_process(args, monkeypatch, capsys)
    assert code == 2 and out == "" and not (tmp_path / "logs").exists()
    assert err.startswith("error: shard ") and f"holds token id {VOCAB} at position 0" in err and err.count("\n") == 1


def _run_rank(rank: int, world_size: int, port: int, args: list[str]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    with cpu_gemms():
        O.run(args)


@pytest.mark.slow
def test_two_ranks_save_a_checkpoint_and_resume_it_bit_for_bit(tmp_path):
    """At world size 2: each rank's Muon momenta in its own rank file, meta.json listing both; the resumed run's
    losses equal the whole run's."""
    logs = tmp_path / "logs"
    mp.spawn(_run_rank, args=(2, free_port(), small_args(tmp_path, save_every=3, run_id="whole")), nprocs=2)
    folder = logs / "whole" / "ckpt_3"
    assert set(json.loads((folder / "meta.json").read_text())["files"]) == {"model.pt", "rank0.pt", "rank1.pt"}
    momenta = [torch.load(folder / f"rank{r}.pt")["optimizers"][1]["state"] for r in range(2)]
    assert len(momenta[0]) == len(momenta[1]) == LAYERS * 6 // 2  # 12 matrices: six updated on each rank
    mp.spawn(_run_rank, args=(2, free_port(), small_args(tmp_path, resume=folder, run_id="resumed", seed=-1)),
             nprocs=2)
    whole = [r for r in records(logs, "whole") if r["step"] > 3]
    assert [{k: v for k, v in r.items() if k != "train_time_ms"} for r in records(logs, "resumed")] == [
        {k: v for k, v in r.items() if k != "train_time_ms"} for r in whole]
