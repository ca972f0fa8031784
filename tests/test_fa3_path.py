"""FA3's code path (#89's attention kernel on Hopper) driven on the CPU by tests/fa3_standin.py, a stand-in written from
FA3's documented semantics alone: the model's varlen calls (cu_seqlens from the packed documents, #89's layout and
sizes, doubled on the paired layers, the windows in tokens, YaRN's scale as the softmax scale) compute what the
Flex path computes, and the buffers are sized from the run's data, so that no batch overflows them."""

import numpy as np
import pytest
import torch

import fa3_standin
import train_gpt as T
from tokenize_text import write_shard
from conftest import SMALL, stage_flags, tiny_args



def tiny(tmp_path, *args: str) -> T.Config:
    """The tiny preset (three stages, the extension) on the FA3 path, logging under tmp_path."""
    return T.parse_config(["--preset=tiny", "--attention=fa3", f"--log_dir={tmp_path}", *args])


def tiny_run_data(cfg: T.Config) -> tuple[list[T.StepSchedule], T.DocumentCounts, list]:
    """The schedule, load_data's document counts and the training files of a tiny-preset run."""
    files, _, documents = T.load_data(cfg, torch.device("cpu"))
    return T.schedule_table(cfg), documents, files


def first_sequence(cfg: T.Config, files: list, schedules: list[T.StepSchedule], step: int) -> torch.Tensor:
    """Global sequence 0 of training step `step` (seq_len + 1 tokens), as the loader serves it."""
    stream = T.TrainTokenStream(files, cfg.train_seq_len, cfg.global_batch_seqs, cfg.vocab_size,
                                T.step_shape(schedules))
    for _ in range(step):
        stream.next_step()
    pieces = stream.next_step()[0]
    return torch.from_numpy(np.concatenate([stream.tokens[a:b] for a, b in pieces]).astype(np.int64))


def twins(cfg: T.Config, fp32: bool) -> tuple[T.GPT, T.GPT]:
    """The dense-mask model (the Flex path's CPU kernel) and an FA3-path model with the same weights, every
    parameter moved off its init; fp32: float copies of both (else the dtypes a run trains in, bf16 activations)."""
    torch.manual_seed(0)
    flex = T.GPT(cfg, use_flex=False, fp8_head=False)
    with torch.no_grad():
        for p in flex.parameters():
            p.add_(0.02 * torch.randn_like(p))
    fa3 = T.GPT(cfg, use_flex=False, fp8_head=False, fa3=fa3_standin.flash_attn_varlen_func)
    fa3.load_state_dict(flex.state_dict())
    return (flex.float(), fa3.float()) if fp32 else (flex, fa3)


def test_cu_seqlens_are_89s_layout_padded_with_the_length():
    tokens = torch.tensor([T.BOS_ID, 5, 6, T.BOS_ID, 7, T.BOS_ID, T.BOS_ID, 8])
    assert T.cu_seqlens(tokens, 8).tolist() == [0, 3, 5, 6, 8, 8, 8, 8]
    assert T.cu_seqlens(tokens, 5).tolist() == [0, 3, 5, 6, 8]  # exactly full: the last entry still closes it
    mid_document = torch.tensor([9, 9, T.BOS_ID, 4])  # validation is not document-aligned: a first part from 0
    assert T.cu_seqlens(mid_document, 4).tolist() == [0, 2, 4, 4]
    assert T.cu_seqlens(tokens, 8).dtype == torch.int32


def test_cu_seqlens_slots_are_89s_where_the_data_fits_and_grow_where_it_does_not():
    assert [T.varlen_slots(n, 40) for n in (16384, 32768, 49152)] == [64, 96, 128]  # #89's TRAIN_MAX_NUM_DOCS
    assert [T.varlen_slots(n, docs) for n, docs in ((16384, 63), (32768, 95), (49152, 127))] == [64, 96, 128]
    assert [T.varlen_slots(n, docs) for n, docs in ((16384, 64), (32768, 100), (49152, 5461))] == [80, 112, 5472]
    assert T.varlen_slots(262_144, 500) == 896  # #89's rule elsewhere: tokens // 300, rounded up to 128
    assert T.varlen_slots(256, 3) == 16  # where #89's rule gives 0 (short sequences): the data's need


def test_the_document_count_is_each_sequences_bos_tokens_among_its_inputs(tmp_path):
    cfg = tiny(tmp_path)
    schedules, documents, files = tiny_run_data(cfg)
    shape = T.step_shape(schedules)
    stream = T.TrainTokenStream(files, cfg.train_seq_len, cfg.global_batch_seqs, cfg.vocab_size, shape)
    most: dict[tuple[int, int], int] = {}
    for step in range(cfg.num_steps):
        for pieces in stream.next_step():
            row = np.concatenate([stream.tokens[a:b] for a, b in pieces])
            most[shape(step)] = max(most.get(shape(step), 0), int((row[:-1] == T.BOS_ID).sum()))
    assert documents.train == most and len(most) == 3  # the warmup's batches (the first steps) hold no more here
    val = T.ValTokens(T.find_shards(cfg.val_files), cfg.val_tokens, cfg.vocab_size).tokens
    chunks = [val[c * cfg.val_seq_len: (c + 1) * cfg.val_seq_len] for c in range(cfg.val_tokens // cfg.val_seq_len)]
    assert documents.val == max(int((c == T.BOS_ID).sum()) + int(c[0] != T.BOS_ID) for c in chunks)


def test_a_corpus_of_tiny_documents_gets_buffers_beyond_89s(tmp_path):
    # Documents of three tokens: 5,461 in a 16,384-token sequence, where #89's 64 slots would crash its loader.
    docs = np.tile(np.array([T.BOS_ID, 11, 12], dtype=np.uint16), 12_000)
    write_shard(tmp_path / "tiny_train_000.bin", docs)
    write_shard(tmp_path / "tiny_val_000.bin", docs)
    one_stage = stage_flags(*[(16384, 2048, "1/3", 1, 1, 1, 0.25, 0)] * 2)
    cfg = T.parse_config(["--attention=fa3", f"--train_files={tmp_path}/tiny_train_*.bin",
                          f"--val_files={tmp_path}/tiny_val_*.bin", "--global_batch_seqs=1", "--num_steps=2",
                          "--extension_steps=0", "--warmup_steps=1",
                          *(f"--{k}={v}" for k, v in one_stage.items()),
                          "--val_seq_len=16384", "--val_tokens=16384", "--untie_stage=1", "--train_seq_len=16384"])
    _, documents, _ = tiny_run_data(cfg)
    assert documents.train == {(16384, 2048): 5462} and documents.val == 5462  # a partial one at the end
    plan = T.StepKnobs(cfg, T.schedule_table(cfg), torch.device("cpu"), documents).plan(0, training=True)
    assert plan.slots == 5472 and plan.max_seqlen == 2048


def test_the_fa3_path_equals_the_flex_path_in_every_stage_loss_and_every_gradient(tmp_path):
    # fp32 copies of the model: the two paths differ only by where YaRN's gain goes (FA3's softmax scale, Flex's q)
    # and by the kernels' summation order, so everything agrees to fp32 rounding. Every training plan of the tiny
    # preset (the stages' windows and lengths, the extension's YaRN scale), the paired layer over 2T positions.
    cfg = tiny(tmp_path)
    schedules, documents, files = tiny_run_data(cfg)
    flex, fa3 = twins(cfg, fp32=True)
    knobs = {"flex": T.StepKnobs(cfg, schedules, torch.device("cpu")),
             "fa3": T.StepKnobs(cfg, schedules, torch.device("cpu"), documents)}
    starts = sorted(set(T.warmup_plan(cfg, schedules)))
    assert starts == [0, *T.stage_starts(cfg)[1:4]]  # three stages and the extension: a graph each
    for step in starts:
        tokens = first_sequence(cfg, files, schedules, step)
        results = {}
        for name, model in (("flex", flex), ("fa3", fa3)):
            model.apply_yarn(schedules[step].yarn_windows)
            model.zero_grad()
            loss = model(tokens[:-1], tokens[1:], *knobs[name].train(step))
            loss.backward()
            results[name] = loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()
                                          if p.grad is not None}
        (loss_flex, grads_flex), (loss_fa3, grads_fa3) = results["flex"], results["fa3"]
        assert loss_fa3 == pytest.approx(loss_flex, rel=1e-5), step
        assert grads_fa3.keys() == grads_flex.keys()
        for name, g in grads_flex.items():  # fp32 rounding: under 1e-6 of each gradient's norm measured; the gates'
            # shared scale, one sum over every gate of every token: 1.5e-5
            tol = 1e-4 if name == "_mudd_gate_scale" else 1e-5
            assert (grads_fa3[name] - g).norm() <= tol * g.norm(), f"{name} at step {step}"
        assert grads_flex["qk_bank"].abs().sum() > 0
    with torch.no_grad():  # the final validation: its own long window (6 blocks) at the extension's scale
        val = torch.from_numpy(T.ValTokens(T.find_shards(cfg.val_files), cfg.val_tokens, cfg.vocab_size)
                               .tokens[: cfg.val_seq_len + 1].astype(np.int64))
        final = [m.eval()(val[:-1], val[1:], knobs[name].val(cfg.num_steps)).item()
                 for name, m in (("flex", flex), ("fa3", fa3))]
    assert final[1] == pytest.approx(final[0], rel=1e-6)


def test_the_fa3_path_in_bf16_follows_the_flex_path_to_bf16_rounding(tmp_path):
    # The dtypes a run trains in (bf16 activations): Flex rounds q x YaRN's gain to bf16 before its kernel, FA3 scales
    # inside; the two kernels round their bf16 outputs apart. At the first stage and at the extension's scale (gain
    # 1.30) the losses agree within 1e-4 relative (1.4e-5 and 0 measured).
    cfg = tiny(tmp_path)
    schedules, documents, files = tiny_run_data(cfg)
    flex, fa3 = twins(cfg, fp32=False)
    for step in (0, T.stage_starts(cfg)[3]):
        tokens = first_sequence(cfg, files, schedules, step)
        losses = []
        for model, knobs in ((flex, T.StepKnobs(cfg, schedules, torch.device("cpu"))),
                             (fa3, T.StepKnobs(cfg, schedules, torch.device("cpu"), documents))):
            model.apply_yarn(schedules[step].yarn_windows)
            with torch.no_grad():
                losses.append(model(tokens[:-1], tokens[1:], *knobs.train(step)).item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-4), step


def test_a_run_on_the_fa3_path_names_it_and_sizes_its_buffers_from_the_data(tmp_path, monkeypatch):
    monkeypatch.setattr(T, "load_fa3", lambda: (fa3_standin.flash_attn_varlen_func, ""))
    fa3 = T.run(tiny_args(tmp_path, run_id="fa3", attention="fa3", num_steps=4, val_every=2, **SMALL))
    flex = T.run(tiny_args(tmp_path, run_id="flex", attention="flex", num_steps=4, val_every=2, **SMALL))
    log = (tmp_path / "logs" / "fa3.txt").read_text()
    assert "\nattention: fa3 (kernels-community/flash-attn3 version 1, varlen); cu_seqlens slots" in log
    assert "\nattention: flex (on the CPU" in (tmp_path / "logs" / "flex.txt").read_text()
    # bf16 training: the two paths' kernels sum in other orders (in fp32 the loss and every gradient agree to 1e-5 at
    # each stage's start: the test above); four bf16 steps apart by rounding, which DC attention's bf16 weights
    # amplify: 2.6e-2 measured
    for (step_a, a), (step_b, b) in zip(fa3.val_losses, flex.val_losses):
        assert step_a == step_b and a == pytest.approx(b, abs=5e-2)


def test_fa3_is_refused_where_it_cannot_load_and_auto_falls_back_to_flex():
    cfg = T.parse_config(["--preset=tiny", "--attention=fa3"])
    with pytest.raises(T.UsageError, match=r"--attention=fa3: FA3 runs on Hopper GPUs \(sm90\) only; use "):
        T.resolve_for_device(cfg, cuda=False)
    auto = T.parse_config(["--preset=tiny"])
    assert T.resolve_for_device(auto, cuda=False).startswith("flex (on the CPU") and auto.attention == "flex"
    with pytest.raises(T.UsageError, match="--attention must be auto, fa3, flex, got 'flash'"):
        T.validate_config(T.parse_config(["--attention=flash"]), 1)


def test_a_split_runs_plan_holds_every_pieces_documents_and_cuts_documents_at_the_piece(tmp_path):
    # --micro_split=2 on the tiny preset (blocks of 64: every stage's length halves into whole blocks): each piece
    # the loader serves is a micro-step of micro_len tokens whose cu_seqlens (a continued document starts at 0) fit
    # the training plan's slots, and FA3's longest document is at most the piece.
    cfg = tiny(tmp_path, "--block_size=64", "--micro_split=2")
    schedules, documents, files = tiny_run_data(cfg)
    knobs = T.StepKnobs(cfg, schedules, torch.device("cpu"), documents)
    stream = T.TrainTokenStream(files, cfg.train_seq_len, cfg.global_batch_seqs, cfg.vocab_size,
                                T.step_shape(schedules))
    batches = T.TrainBatches(stream, 0, 1, cfg.num_steps, split=2)
    buffer = np.zeros(int(np.prod(batches.shape)), dtype=np.int32)
    for step in range(cfg.num_steps):
        rows, cols = batches.fill(buffer)
        plan, s = knobs.plan(step, True), schedules[step]
        assert (rows, cols) == (2 * cfg.global_batch_seqs, s.seq_len // 2 + 1) and s.micro_len == s.seq_len // 2
        assert plan.max_seqlen == min(s.max_doc_len, s.micro_len)
        for row in torch.from_numpy(buffer[: rows * cols].reshape(rows, cols)).long():
            cu = T.cu_seqlens(row[:-1], plan.slots)
            assert cu[-1] == s.micro_len  # padded with the length: the last document closed within the slots
            assert int(((row[:-1] == T.BOS_ID).sum() + (row[0] != T.BOS_ID))) < plan.slots
