"""Sample text from a checkpoint of train_gpt.py: see what a model learned.

    python sample.py logs/<run_id>/ckpt_<step> --prompt "Once upon a time" [--tokens 100]
                     [--temperature 0.8] [--top_k 50] [--seed 0] [--device auto]

The checkpoint must be complete (its files checked as --resume checks them). Text is GPT-2 BPE (the bundled
data/tokenizer/), each prompt starting a document (BOS). Generation runs the whole sequence each token (no
cache: fine for the model sizes trained here and a few hundred tokens), with the attention windows of the
run's last step, dense attention on any device. --temperature=0 picks the most likely token (greedy).
Bad input: one `error:` line, exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "data"))
import train_gpt as T  # noqa: E402
from tokenize_text import load_encoding  # noqa: E402


def saved_config(config: dict) -> T.Config:
    """The Config a checkpoint holds as JSON (T.config_json: the stage table a list of rows, each a dict of lists);
    fields this trainer does not know are left out."""
    rows = [T.Stage(**{k: tuple(v) if isinstance(v, list) else v for k, v in row.items()}) for row in config["stages"]]
    fields = {f.name for f in dataclasses.fields(T.Config)}
    return T.Config(**{k: v for k, v in config.items() if k in fields} | {"stages": tuple(rows)})


def load_model(folder: Path, device: torch.device) -> T.GPT:
    """The model of a complete checkpoint, in eval mode on device."""
    meta = T.read_checkpoint_meta(folder, taker="sample.py's CHECKPOINT argument")
    cfg = saved_config(meta["config"])
    model = T.GPT(cfg, use_flex=False, fp8_head=False)
    model.load_state_dict(T.read_part(folder / T.CKPT_MODEL, meta["files"][T.CKPT_MODEL]["sha256"], load=True))
    s = T.schedule(meta["step"], cfg)  # what the schedule had set when it saved: the untie and YaRN's tables
    model.tie_embedding(s.tied)
    model.apply_yarn(s.yarn_windows)
    return model.to(device).eval()


@torch.no_grad()
def generate(model: T.GPT, prompt: list[int], tokens: int, temperature: float, top_k: int,
             generator: torch.Generator) -> list[int]:
    """`tokens` new token ids after BOS + prompt."""
    cfg = model.cfg
    s = T.schedule(cfg.num_steps, cfg)
    device = model.lm_head.weight.device
    windows = torch.tensor([s.long_window, s.short_window], dtype=torch.int32, device=device)
    ids = [T.BOS_ID, *prompt]
    for _ in range(tokens):
        n = len(ids)
        padded = -(-n // cfg.block_size) * cfg.block_size  # masks work in whole blocks; causal: padding is unseen
        seq = torch.tensor(ids + [T.BOS_ID] * (padded - n), device=device)
        logits = model.logits(seq, windows)[n - 1].float()
        if temperature == 0:
            ids.append(int(logits.argmax()))
            continue
        values, candidates = logits.topk(top_k) if top_k else (logits, torch.arange(logits.numel()))
        probs = torch.softmax(values / temperature, -1).cpu()
        ids.append(int(candidates[torch.multinomial(probs, 1, generator=generator)]))
    return ids[1 + len(prompt):]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a ckpt_<step> folder written by --save_every/--save_final")
    parser.add_argument("--prompt", default="", help="text to continue (default: none, a new document)")
    parser.add_argument("--tokens", type=int, default=100, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=50, help="sample among the k most likely tokens; 0: all (at "
                        "most the model's vocabulary: 50304 for the recipe's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    args = parser.parse_args(argv)
    try:
        for name, ok, rule in (("tokens", args.tokens >= 1, ">= 1"), ("top_k", args.top_k >= 0, ">= 0"),
                               ("temperature", math.isfinite(args.temperature) and args.temperature >= 0,
                                "a finite number >= 0"),
                               ("device", re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device), "auto, cpu, cuda or "
                                "cuda:N")):
            if not ok:
                raise T.UsageError(f"--{name} must be {rule}, got {getattr(args, name)}")
        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                              "cpu" if args.device == "auto" else args.device)
        if device.type == "cuda" and not torch.cuda.is_available():  # else torch's assertion, deep in .to()
            raise T.UsageError("--device=cuda but no CUDA GPU is visible; use --device=cpu (or auto)")
        model = load_model(args.checkpoint, device)
        if args.top_k > model.cfg.vocab_size:
            raise T.UsageError(f"--top_k must be at most this model's vocabulary, {model.cfg.vocab_size} tokens (0: "
                               f"all of them), got {args.top_k}")
        encoding = load_encoding()
        prompt = encoding.encode_ordinary(args.prompt)
        limit = max(model.cfg.train_seq_len, model.cfg.val_seq_len)  # the positions its rotary tables cover
        if 1 + len(prompt) + args.tokens > limit:
            raise T.UsageError(f"prompt + --tokens is {1 + len(prompt) + args.tokens} tokens; this model takes "
                               f"at most {limit}")
    except (T.UsageError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    with T.cpu_math(T.bf16_gemm_path("auto", cuda=device.type == "cuda")):  # as the run's own CPU matmuls
        new = generate(model, prompt, args.tokens, args.temperature, args.top_k,
                       torch.Generator().manual_seed(args.seed))
    text = encoding.decode(new)
    print(args.prompt + text)
    return text


if __name__ == "__main__":
    main()
