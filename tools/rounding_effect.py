"""How far a rounding-level difference from the record moves training, against the floor of a 1-ulp perturbation.

    python tools/rounding_effect.py [--steps 8]

From identical weights and batches (the tiny preset's shapes, its bf16 activations, W=1, YaRN's attention gain
already above 1), every variant trains `--steps` steps beside the recipe as the file has it:
- floor: the recipe itself, one weight the forward reads moved by one bf16 ulp (run-to-run noise: any rounding
  that flips once);
- softmax scale: YaRN's attention gain in the kernel's scale, as #89 has it, not a factor rounding q to bf16;
- half the gradient: a difference that is not rounding (the scale of every gradient, which Adam's eps sees), to
  show the measure tells one apart.
For each it prints the parameters' distance from the recipe's after every step, relative to how far the recipe's
parameters moved from their start, and the last loss; a variant near the floor is rounding noise, one far above it
changes the run.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import train_gpt as T  # noqa: E402

MATRICES = ("qk_bank", "vo_bank", "mlp_bank")


def recipe_config() -> T.Config:
    cfg = T.parse_config(["--preset=tiny", "--device=cpu", "--adam_every=1"])
    T.resolve_for_device(cfg, cuda=False)
    return cfg


def sample_tokens(cfg: T.Config) -> torch.Tensor:
    """The bundled sample's first train shard."""
    return torch.from_numpy(T.load_shard(T.find_shards(str(REPO / "data/sample/sample_train_*.bin"))[0],
                                         cfg.vocab_size).astype("int64"))


def most_steps(cfg: T.Config, tokens: torch.Tensor, seq_len: int) -> int:
    """How many steps' batches the tokens hold, none shared between steps."""
    return tokens.numel() // (cfg.global_batch_seqs * (seq_len + 1))


def batches(cfg: T.Config, tokens: torch.Tensor, steps: int, seq_len: int) -> list[torch.Tensor]:
    """steps x (global_batch_seqs, seq_len + 1) token windows from tokens, at fixed offsets."""
    seq = seq_len + 1
    return [torch.stack([tokens[(s * cfg.global_batch_seqs + i) * seq:][:seq] for i in range(cfg.global_batch_seqs)])
            for s in range(steps)]


def one_ulp(model: T.GPT) -> None:
    """The smallest change the forward can see: one element of the first matrix up by one bf16 ulp."""
    with torch.no_grad():
        w = next(p for n, p in model.named_parameters() if n.endswith(MATRICES)).view(-1)
        w[0] = torch.nextafter(w[:1], torch.full((1,), float("inf"), dtype=w.dtype))


def softmax_scale(model: T.GPT) -> None:
    """YaRN's gain as the kernel's scale (#89's softmax_scale), q no longer multiplied by it."""
    model.cfg = dataclasses.replace(model.cfg, attn_scale=model.cfg.attn_scale * model.q_gain.item())
    model.q_gain.fill_(1.0)


def train(model: T.GPT, cfg: T.Config, data: list[torch.Tensor], at: int, loss_scale: float = 1.0) -> tuple[list[dict[str, torch.Tensor]], float]:
    """Train on data with step `at`'s schedule; the parameters after each step, and the last micro-step's loss."""
    opt = T.ShardedMuonAdam(model, cfg, 0, 1, compile_ns=False)
    schedules = T.schedule_table(cfg)
    knobs = T.StepKnobs(cfg, schedules, torch.device("cpu")).train(at)
    trajectory, loss = [], 0.0
    for batch in data:
        opt.set_step(schedules[at])
        for m in range(batch.size(0)):
            loss = model(batch[m, :-1], batch[m, 1:], *knobs)
            (loss * T.train_loss_scale(cfg) * loss_scale).backward()
        opt.step()
        opt.zero_grad()
        trajectory.append({n: p.detach().float().clone() for n, p in model.named_parameters()})
    return trajectory, loss.item() / (batch.size(1) - 1)


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum((a[n] - b[n]).square().sum().item() for n in a) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="steps each variant trains (default 8)")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = recipe_config()
    at = T.stage_starts(cfg)[2]  # the last stage's first step: its sequence length, windows and YaRN
    seq_len, tokens = T.schedule(at, cfg).seq_len, sample_tokens(cfg)
    most = most_steps(cfg, tokens, seq_len)
    if not 1 <= args.steps <= most:
        print(f"error: --steps must be in [1, {most}] (the bundled sample's batches at this shape), got {args.steps}",
              file=sys.stderr)
        raise SystemExit(2)
    data = batches(cfg, tokens, args.steps, seq_len)
    start = T.GPT(cfg, use_flex=False, fp8_head=False)
    start.apply_yarn(T.schedule(at, cfg).yarn_windows)
    initial = {n: p.detach().float().clone() for n, p in start.named_parameters()}
    unchanged = lambda m: None  # noqa: E731  (the change is in train())
    variants = {"recipe": unchanged, "floor (1 ulp, 1 weight)": one_ulp, "softmax scale": softmax_scale,
                "half the gradient": unchanged}
    runs = {}
    for name, change in variants.items():
        model = copy.deepcopy(start)
        change(model)
        runs[name] = train(model, cfg, data, at, loss_scale=0.5 if name == "half the gradient" else 1.0)
    base, base_loss = runs.pop("recipe")
    moved = [distance(step, initial) for step in base]
    print(f"{args.steps} steps of the tiny preset's last stage from identical weights and batches; recipe's last loss "
          f"{base_loss:.5f}")
    print("distance from the recipe / distance the recipe moved, per step:")
    floor = None
    for name, (trajectory, loss) in runs.items():
        rel = [distance(t, b) / d for t, b, d in zip(trajectory, base, moved)]
        floor = floor or max(rel)
        print(f"  {name:22s} " + " ".join(f"{r:.1e}" for r in rel) + f"  | max {max(rel):.1e} = {max(rel) / floor:.1f}x"
              f" floor; last loss {loss - base_loss:+.1e}")


if __name__ == "__main__":
    main()
