"""sample.py: text from a checkpoint of the tiny model; the logits it samples from are the ones the loss reads."""

import shutil

import pytest
import torch
import torch.nn.functional as F

import sample
import train_gpt as T
from conftest import REPO, SMALL, stage_flags, tiny_args


# Two stages of two steps: the embedding unties after step 2 and YaRN rescales at step 2, before the final checkpoint.
STAGES = stage_flags((128, 2048, "1/2", 1, "1/0.5", "1/0", 0.25, 0.25), (128, 2048, "1/3", 1, 1, 1, 0.25, 0),
                     (128, 2048, "1/3", 1, 1, 1, 0, 0))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sample")
    result = T.run(tiny_args(tmp, run_id="s", num_steps=4, val_every=0, save_final=True, **SMALL, **STAGES))
    return tmp / "logs" / "s" / "ckpt_4", result.model


@pytest.fixture(scope="module")
def checkpoint(trained):
    return trained[0]


def test_the_sampled_model_is_the_trained_one_untied_and_rescaled(trained):
    folder, model = trained
    loaded = sample.load_model(folder, torch.device("cpu"))
    assert not model.embed_tied_now and model.yarn_windows == (2, 3)
    tokens, windows = torch.randint(0, 50000, (256,), generator=torch.Generator().manual_seed(0)), torch.tensor([3, 1])
    with torch.no_grad():
        assert torch.equal(loaded.logits(tokens, windows), model.eval().logits(tokens, windows))


def test_logits_are_what_the_loss_reads():
    cfg = T.parse_config(["--preset=tiny"])
    torch.manual_seed(0)
    model = T.GPT(cfg, use_flex=False, fp8_head=False).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
        tokens = torch.randint(0, 50000, (cfg.train_seq_len + 1,))
        windows = torch.tensor([2, 1])
        logits = model.logits(tokens[:-1], windows)
        assert logits.shape == (cfg.train_seq_len, cfg.vocab_size) and logits.dtype == torch.float32
        assert torch.equal(F.cross_entropy(logits, tokens[1:]), model(tokens[:-1], tokens[1:], windows))


def test_sampling_is_reproducible_and_greedy_is_top_1(checkpoint, capsys):
    args = [str(checkpoint), "--prompt", "The", "--tokens", "8"]
    greedy = sample.main(args + ["--temperature", "0"])
    assert capsys.readouterr().out == "The" + greedy + "\n"
    assert sample.main(args + ["--temperature", "0"]) == greedy
    one = {sample.main(args + ["--temperature", "1", "--top_k", "1", "--seed", str(s)]) for s in range(3)}
    assert len(one) == 1  # one candidate a step: no randomness left
    assert sample.main(args + ["--seed", "3"]) == sample.main(args + ["--seed", "3"])
    assert len({sample.main(args + ["--temperature", "2", "--top_k", "0", "--seed", str(s)]) for s in range(4)}) > 1


@pytest.mark.parametrize("flags, message", [
    ([], "does not exist (sample.py's CHECKPOINT argument takes a ckpt_<step> directory)"),
    (["--tokens=0"], "--tokens must be >= 1, got 0"),
    (["--temperature=nan"], "--temperature must be a finite number >= 0, got nan"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0, got inf"),
    (["--top_k=-1"], "--top_k must be >= 0, got -1"),
    (["--top_k=50305"], "--top_k must be at most this model's vocabulary, 50304 tokens (0: all of them), got 50305"),
    (["--tokens=100000"], "this model takes at most 1024"),
    (["--device=cuda"], "--device=cuda but no CUDA GPU is visible; use --device=cpu (or auto)"),
    (["--device=bogus"], "error: --device must be auto, cpu, cuda or cuda:N, got bogus\n"),  # not torch's own list
    (["--device=cuda:x"], "error: --device must be auto, cpu, cuda or cuda:N, got cuda:x\n"),
])
def test_bad_input_is_one_line(checkpoint, tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without CUDA, GPU or not
    target = str(tmp_path / "nope") if not flags else str(checkpoint)
    with pytest.raises(SystemExit) as exit_info:
        sample.main([target, *flags])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err and out == "", err


def corrupt(folder):  # model.pt's first bytes overwritten: the same size, another checksum
    with open(folder / "model.pt", "r+b") as f:
        f.write(b"\0" * 64)


@pytest.mark.parametrize("damage, message", [
    (None, "is not a checkpoint: sample.py's CHECKPOINT argument takes a ckpt_<step> directory"),
    (corrupt, "model.pt does not match its checksum in meta.json: corrupt or from another checkpoint; use another "
              "checkpoint"),
])
def test_a_bad_checkpoint_is_one_line_that_does_not_speak_of_resuming(checkpoint, tmp_path, capsys, damage, message):
    folder = REPO / "data" / "sample"  # the battery's: a folder of shards
    if damage is not None:
        folder = tmp_path / "ckpt_4"
        shutil.copytree(checkpoint, folder)
        damage(folder)
    with pytest.raises(SystemExit) as exit_info:
        sample.main([str(folder)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err and "resum" not in err, err
