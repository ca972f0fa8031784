"""`auto` on each GPU generation, without a GPU: torch.cuda's device queries faked (capability, name, memory), the
resolution reads gpt_kernels.RUNS_ON (the compile matrix's facts, tools/sm90_kernels.py): FP8 from sm89 on, each
Triton kernel where it compiles cleanly, FA3 on sm90 only; an explicit flag the GPU cannot run is one `error:` line
before any work; the CPU's resolution is untouched."""


import pytest
import torch

import gpt_kernels as K
import train_gpt as T
from conftest import GPUS, fake_gpu, main_in_process, tiny_args

FLAGS = ("fp8_head", "fp8_mlp", "relu2_kernel", "fused_head", "dc_kernel", "polar_express", "attention")


def relu2_expected(capability: tuple[int, int], fp8_mlp: bool) -> bool:
    """--relu2_kernel under auto, from gpt_kernels.RUNS_ON (the compile matrix's facts, not restated here): its bf16
    modes' row, and its FP8 forward's too where the FP8 MLP is on."""
    return capability in K.RUNS_ON["relu2_kernel"] and (not fp8_mlp or capability in K.RUNS_ON["relu2_kernel+fp8_mlp"])


# What auto takes on each: (fp8_head, fp8_mlp, relu2_kernel, fused_head, dc_kernel, Polar Express kernels, attention);
# relu2_kernel as RUNS_ON says (today: on at each GPU's own tiles, off on the B200 with the FP8 MLP, whose FP8
# forward does not compile there or spills)
EXPECTED = {
    (8, 0): (False, False, relu2_expected((8, 0), False), True, True, True, "flex"),  # A100: no FP8
    (8, 6): (False, False, relu2_expected((8, 6), False), True, True, True, "flex"),  # RTX 3090, A6000: no FP8
    (8, 9): (True, True, relu2_expected((8, 9), True), True, True, True, "flex"),  # L40S / 4090
    (9, 0): (True, True, True, True, True, True, "fa3"),  # H100 / H200: as before
    (10, 0): (True, True, relu2_expected((10, 0), True), True, True, True, "flex"),  # B200
    (12, 0): (True, True, relu2_expected((12, 0), True), True, True, True, "flex"),  # RTX 5090
    (12, 1): (False, False, False, False, False, False, "flex"),  # not in the matrix: the torch paths
}


def resolved(*args: str) -> T.Config:
    cfg = T.parse_config(list(args))
    T.resolve_for_device(cfg, cuda=True)
    return cfg


def taken(cfg: T.Config) -> tuple:
    return (*(getattr(cfg, f) for f in FLAGS[:5]), T.polar_express_kernels(torch.device("cuda")), cfg.attention)


@pytest.mark.parametrize("capability", EXPECTED, ids=[f"sm{a}{b}" for a, b in EXPECTED])
def test_auto_takes_each_path_where_the_gpu_runs_it(monkeypatch, capability):
    fake_gpu(monkeypatch, capability)
    cfg = resolved()
    assert taken(cfg) == EXPECTED[capability]
    line = T.gpu_report(cfg)  # one line: the GPU, and each path with why where it is off
    name, gib = GPUS[capability]
    assert "\n" not in line and line.startswith(f"gpu: {name} (sm{capability[0]}{capability[1]}, {gib} GiB): "), line
    for flag, on in zip(FLAGS, EXPECTED[capability]):
        assert (f"{flag} {'on' if on else 'off'}" if flag != "attention" else f"attention {on}") in line, line
    if capability == (8, 0):
        assert "fp8_mlp off (sm80 has no FP8 tensor cores" in line, line
    if capability == (10, 0) and not EXPECTED[capability][2]:
        assert "relu2_kernel off (its Triton kernels (linear_relu_square fp8) do not compile for sm100" in line, line
    if capability == (12, 1):
        assert "sm121 is not in the compile matrix" in line, line


def test_every_measured_target_is_a_row_of_the_table_and_sm90_runs_everything():
    assert set(K.RUNS_ON) == set(K.PATH_KERNELS)
    assert all(K.TARGETS["sm90"] in targets for targets in K.RUNS_ON.values())  # nothing changes on the H100
    assert all(set(targets) <= set(K.TARGETS.values()) for targets in K.RUNS_ON.values())
    assert not any(c < K.FP8_MIN for path, targets in K.RUNS_ON.items() if "fp8" in path for c in targets)


def test_without_fp8_the_b200_takes_the_relu2_kernels_bf16_modes(monkeypatch):
    fake_gpu(monkeypatch, (10, 0))
    monkeypatch.setenv("DISABLE_FP8", "1")
    cfg = resolved()
    assert (cfg.fp8_mlp, cfg.relu2_kernel) == (False, True)
    assert "fp8_mlp off (DISABLE_FP8)" in T.gpu_report(cfg)
    fake_gpu(monkeypatch, (10, 0))
    assert resolved("--fp8_mlp=false").relu2_kernel is True


@pytest.mark.parametrize("capability, args, message", [
    ((8, 0), ["--fp8_mlp=true"], "--fp8_mlp=true: sm80 has no FP8 tensor cores"),
    ((8, 0), ["--fp8_head=true"], "--fp8_head=true: sm80 has no FP8 tensor cores"),
    ((8, 6), ["--fp8_mlp=true"], "--fp8_mlp=true: sm86 has no FP8 tensor cores"),
    ((8, 6), ["--fp8_head=true"], "--fp8_head=true: sm86 has no FP8 tensor cores"),
    ((10, 0), ["--relu2_kernel=true"], "(linear_relu_square fp8) do not compile for sm100 within its shared memory "
                                       "and without spills (tools/sm90_kernels.py) (its FP8 mode, with --fp8_mlp); use "
                                       "--relu2_kernel=false (or auto)"),
])
def test_an_explicit_flag_the_gpu_cannot_run_is_refused(monkeypatch, capability, args, message):
    fake_gpu(monkeypatch, capability)
    with pytest.raises(T.UsageError) as refused:
        resolved(*args)
    assert message in str(refused.value) and str(refused.value).startswith(f"{args[0]}: "), refused.value


@pytest.mark.parametrize("capability", [c for c in GPUS if c in K.TARGETS.values()],
                         ids=[f"sm{a}{b}" for a, b in GPUS if (a, b) in K.TARGETS.values()])
@pytest.mark.parametrize("fp8_mlp", [False, True])
def test_an_explicit_relu2_kernel_runs_exactly_where_runs_on_has_it(monkeypatch, capability, fp8_mlp):
    # the A100 and the L40S / 4090 run the ReLU^2 GEMM at their own tiles (gpt_kernels.MLP_CONFIGS); where RUNS_ON
    # lacks the capability (the B200's FP8 forward) the flag is refused
    fake_gpu(monkeypatch, capability)
    fp8 = fp8_mlp and capability >= K.FP8_MIN
    args = ("--relu2_kernel=true", f"--fp8_mlp={str(fp8).lower()}")
    if relu2_expected(capability, fp8):
        assert resolved(*args).relu2_kernel is True
    else:
        with pytest.raises(T.UsageError, match="--relu2_kernel=true: its Triton kernels"):
            resolved(*args)


def test_the_relu2_gemms_configuration_is_its_gpus(monkeypatch):
    # one table by capability (MLP_CONFIGS), one chooser (mlp_config): the launcher, mlp_programs (the FP8 forward's
    # partial maxima, one per program, and so the fake kernels) and tools/sm90_kernels.py all read it
    assert K.mlp_config(torch.device("cpu")) == K.MLP_CONFIGS[(9, 0)]  # the interpreter checks the H100's tiles
    assert K.MLP_CONFIGS[(9, 0)] == (128, 256, 8, {"fp8 forward": (128, 3), "bf16 forward": (64, 4),
                                                   "backward": (64, 3)})  # #89's: unchanged on sm90
    assert set(K.MLP_CONFIGS) == set(K.TARGETS.values())
    # sm120 loads through TMA (each pipeline stage's tiles in its 99 KB of shared memory), sm89 does not: sm89's bf16
    # forward (K blocks of 64, 4 stages) would need 112 KB there (tests/test_sm90_kernels.py compiles both)
    assert K.MLP_CONFIGS[(12, 0)].modes["bf16 forward"] != K.MLP_CONFIGS[(8, 9)].modes["bf16 forward"]
    # a CUDA device without a visible GPU (the GPU path traced on fake tensors) resolves as the recipe's H100
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert K.mlp_config(torch.device("cuda")) == K.MLP_CONFIGS[(9, 0)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # a capability not measured: the measured configuration of least shared memory for its loads, sm120's where
    # Triton loads through TMA (sm90 on), sm89's before
    unmeasured = {(8, 7): K.MLP_CONFIGS[(8, 9)], (10, 3): K.MLP_CONFIGS[(12, 0)], (12, 1): K.MLP_CONFIGS[(12, 0)]}
    for capability in (*K.TARGETS.values(), *unmeasured):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        config = K.mlp_config(torch.device("cuda"))
        assert config == K.MLP_CONFIGS.get(capability, unmeasured.get(capability)), capability
        tiles = -(-49_152 // config.block_m) * -(-3072 // config.block_n)
        assert K.mlp_programs(49_152, 3072, torch.device("cuda"), width=10**6) == tiles
        assert K.mlp_programs(49_152, 3072, torch.device("cuda"), width=132) == min(132, tiles)


def test_explicit_flags_are_the_users_on_a_gpu_not_measured_and_on_the_cpu(monkeypatch):
    fake_gpu(monkeypatch, (12, 1))  # FP8 hardware, not in the matrix: auto leaves it off, a given true runs
    assert resolved("--fp8_mlp=true", "--fused_head=true").fp8_mlp is True
    fake_gpu(monkeypatch, (8, 0))  # a CPU rehearsal of the GPU path on a machine with an A100: not refused
    cfg = T.parse_config(["--preset=tiny", "--fp8_head=true"])
    T.resolve_for_device(cfg, cuda=False)
    assert (cfg.fp8_head, cfg.fp8_mlp, cfg.relu2_kernel, cfg.fused_head, cfg.dc_kernel) == (True, False, False,
                                                                                            False, False)


def test_an_fp8_flag_on_an_a100_is_one_line_exit_2_and_writes_nothing(tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # setup_runtime's setdefault: restored after
    fake_gpu(monkeypatch, (8, 0))
    args = [a for a in tiny_args(work, run_id="r") if not a.startswith("--device")] + ["--device=cuda",
                                                                                       "--fp8_mlp=true"]
    code, out, err = main_in_process(args, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: --fp8_mlp=true: sm80 has no FP8 tensor cores (torch._scaled_mm: sm89 and "
                               "later); use --fp8_mlp=false (or auto)"), err
    assert out == "" and list(tmp_path.rglob("*")) == [work], list(tmp_path.rglob("*"))


def test_the_docs_tables_of_what_runs_where_are_every_measured_gpus_resolution(monkeypatch):
    # DETAILS' compile matrix and its table of what auto takes have a column per gpt_kernels.TARGETS entry, and each
    # cell of the latter is what resolve_for_device takes on that GPU
    from conftest import REPO
    text = (REPO / "docs" / "DETAILS.md").read_text()
    matrix = text[text.index("| kernel | sm80 (A100) |"):].splitlines()[0]
    assert [c.split()[0] for c in matrix.strip("|").split("|")[1:]] == list(K.TARGETS), matrix
    lines = text[text.index("| path | sm80 |"):].split("\n\n")[0].splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")[1:]] == list(K.TARGETS), lines[0]
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}
    for column, capability in enumerate(K.TARGETS.values()):
        fake_gpu(monkeypatch, capability)
        cfg = resolved()
        on = {path: cells[column].startswith("on") for path, cells in rows.items() if path != "attention"}
        assert on == {"--fp8_head, --fp8_mlp": cfg.fp8_head and cfg.fp8_mlp, "--relu2_kernel": cfg.relu2_kernel,
                      "--fused_head, --dc_kernel, Polar Express's kernels": cfg.fused_head and cfg.dc_kernel
                      and T.polar_express_kernels(torch.device("cuda"))}, capability
        assert rows["attention"][column] == cfg.attention, capability
