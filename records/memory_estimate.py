"""GPU memory per rank at the recipe's real shapes, from traces on the meta device (nothing allocated, no GPU).

    python records/memory_estimate.py [--json FILE]
    SPEEDRUN_TRAINER=records/2026-11-25_record28/train_gpt.py python records/memory_estimate.py  # a snapshot's

For the recipe (its Triton kernels on, as on a GPU, and its torch path), on 1 GPU (8 micro-steps) and on 8 (one
each), per rank:
- static: the parameters' buckets, the gradient buckets (and the reduce-scatter's shard on 8), the optimizer
  state of the rank's shard, and the tables (RoPE), from the objects train_gpt.py builds;
- saved: the activations one micro-step keeps for its backward, as torch.compile's partitioner (AOTAutograd,
  min-cut rematerialization) splits the training graph;
- train peak: the most a micro-step holds beyond static, by a liveness walk of the forward and backward graphs
  (every node's output held from its op to its last use: no fusion, so an upper bound on what inductor's fused
  kernels hold); the node where it peaks is named (the head's backward, where the logits' gradient lives);
- validation peak: the same walk over one validation sequence's forward.
FlexAttention has no CPU/meta backward, so a stand-in with its memory takes its place: it keeps q, k, v, the
output and the fp32 log-sum-exp for backward and returns dq, dk, dv. The fused head (--fused_head) is opaque to
the trace; its chunk of logits and its fp32 gradient accumulator are added from its chunk size.
A total above 80 GB (10^9 bytes) fails (exit 1): an H100 has 79.6 GiB, and the CUDA context and the allocator's
fragmentation take a few of them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# The trainer to estimate: the repository's, or a record's snapshot (its default recipe; e.g. #28's, whose logged
# peak on 8xH100 calibrates the method: tests/test_memory_estimate.py).
TRAINER = Path(os.environ.get("SPEEDRUN_TRAINER", REPO / "train_gpt.py")).resolve()
if TRAINER == REPO / "train_gpt.py":
    import train_gpt as T
else:
    _spec = importlib.util.spec_from_file_location("train_gpt", TRAINER)
    T = sys.modules["train_gpt"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(T)

PRESETS = ({"recipe": [], "recipe torch path": ["--relu2_kernel=false", "--fused_head=false"]}
           if TRAINER == REPO / "train_gpt.py" else {TRAINER.parent.name: []})
LIMIT_BYTES = 80 * 10**9
GiB = 2**30


def recipe_config(args: list[str]) -> T.Config:
    """A preset's config as a GPU run resolves it (compiled, FP8 head on), at its real shapes."""
    cfg = T.parse_config(args)
    kernels = {name: getattr(cfg, name) in (None, True) for name in ("relu2_kernel", "fused_head")}  # auto: CUDA's
    cfg.relu2_kernel = cfg.fused_head = False  # resolve_for_device refuses them without a GPU; their fakes trace
    T.resolve_for_device(cfg, cuda=False)
    cfg.compile, cfg.fp8_head = True, True
    for name, value in kernels.items():
        setattr(cfg, name, value)
    return cfg


class FlexStandIn(torch.autograd.Function):
    """FlexAttention's memory without its kernel: saves what flex saves, returns what its backward returns."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))  # + log-sum-exp
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def meta_model(cfg: T.Config) -> T.GPT:
    with torch.device("meta"):
        model = T.GPT(cfg, use_flex=True, fp8_head=cfg.fp8_head)
    for block in model.blocks:
        if block.attn is not None:
            block.attn.flex = lambda q, k, v, block_mask, scale: FlexStandIn.apply(q, k, v)
    return model


def nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def static_bytes(cfg: T.Config, world_size: int) -> dict[str, int]:
    """Rank 0's long-lived tensors, by kind, from the optimizer's buckets (the parameters live in them)."""
    model = meta_model(cfg)
    optimizer = T.ShardedMuonAdam(model, cfg, 0, world_size, compile_ns=False)
    buckets = optimizer.buckets
    tables = {key(b): nbytes(b) for b in model.buffers()}
    return {"parameters": sum(nbytes(b.data) for b in buckets),
            "gradients": sum(nbytes(b.grad) + (nbytes(b.grad_shard) if world_size > 1 else 0) for b in buckets),
            "optimizer": optimizer.state_bytes(), "tables": sum(tables.values())}


def tensors(value: object) -> list[torch.Tensor]:
    values = value if isinstance(value, (tuple, list)) else [value]
    return [v for v in values if isinstance(v, torch.Tensor)]


def key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the storage itself: views share it


def leading_inputs(graph: torch.fx.Graph, count: int) -> set[int]:
    """The storages of the graph's first `count` inputs (the parameters and buffers: static, counted apart)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"][:count]
    return {key(t) for n in placeholders for t in tensors(n.meta.get("val"))}


REDUCTIONS = {"sum", "amax", "amin", "mean", "prod", "var_mean", "logsumexp", "max", "min", "any", "all"}
INDEXING = {"gather", "index", "select", "slice", "embedding", "slice_scatter", "select_scatter"}  # indexed loads
FILLS = {"full", "zeros", "empty", "scalar_tensor", "arange", "iota", "full_like", "zeros_like", "empty_like"}


def op_name(node: torch.fx.Node) -> str | None:
    """An aten op's name without its overload (sum for sum.dim_IntList); None for anything else."""
    target = node.target
    return target.overloadpacket.__name__ if isinstance(target, torch._ops.OpOverload) else None


def fusible(node: torch.fx.Node) -> bool:
    """Inductor computes this op inside the kernel that reads it (pointwise, views, indexed loads) or the
    producers inside it (reductions): an op whose inputs need not exist in memory."""
    if node.op != "call_function" or op_name(node) is None:
        return node.op == "call_function" and node.target.__name__ == "getitem"
    return (torch.Tag.pointwise in node.target.tags or node.target.is_view or op_name(node) in
            REDUCTIONS | INDEXING | FILLS | {"convert_element_type", "_to_copy", "clone", "where"})


def materialized(graph: torch.fx.Graph) -> set[int]:
    """The storages inductor writes to memory: inputs, outputs of ops it does not fuse (GEMMs, custom ops,
    attention, reductions' results), and anything a graph output or such an op reads. A fill read by a scatter
    is the scatter's own output buffer (written in place), counted once there."""
    keep = set()
    for node in graph.nodes:
        if op_name(node) in FILLS:
            continue
        needed = (node.op == "placeholder" or (node.op == "call_function" and not fusible(node)) or
                  any(u.op == "output" or not fusible(u) for u in node.users))
        if needed or op_name(node) in REDUCTIONS:  # a reduction writes its (small) result
            keep |= {key(t) for t in tensors(node.meta.get("val"))}
    return keep


def liveness_peak(graph: torch.fx.Graph, static: set[int]) -> tuple[int, torch.fx.Node | None]:
    """The most bytes live at once over the graph's nodes, each materialized storage from the node that makes
    it (inputs: from the start) to the last node reading it (outputs: to the end), static storages left out;
    and that node. Fused intermediates take no memory; no buffer reuse beyond that."""
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    every = materialized(graph)
    real = every - static

    # The last node whose kernel reads each node's value: through a fused user, the kernel it fuses into.
    read_until: dict[torch.fx.Node, int] = {}
    for node in reversed(nodes):
        written = node.op != "placeholder" and any(key(t) in every for t in tensors(node.meta.get("val")))
        read_until[node] = (len(nodes) if node.op == "output" else order[node] if written else
                            max([order[node]] + [read_until[u] for u in node.users]))

    last_use, size = {}, {}
    for i, node in enumerate(nodes):
        for t in tensors(node.meta.get("val")):
            k = key(t)
            size.setdefault(k, nbytes(t))
            last_use[k] = max([last_use.get(k, i)] + [read_until[u] for u in node.users])
    live, peak, at, made = 0, 0, None, set()
    for i, node in enumerate(nodes):
        for t in tensors(node.meta.get("val")):
            k = key(t)
            if k not in made and k in real:
                made.add(k)
                live += size[k]
        if live > peak:
            peak, at = live, node
        live -= sum(size[k] for k in made if last_use[k] == i)
    return peak, at


def fused_head_workspace(cfg: T.Config) -> int:
    """softcap_ce's own buffers: one chunk of bf16 logits (its gradient in place) and the fp32 dW accumulator."""
    if not cfg.fused_head:
        return 0
    return T.gpt_kernels.HEAD_CHUNK_ROWS * cfg.vocab_size * 2 + cfg.vocab_size * cfg.model_dim * 4


def activation_bytes(cfg: T.Config) -> dict[str, int | str]:
    """One training micro-step at the last stage's length through AOTAutograd's partitioner, and one validation
    forward: saved activations and each graph's liveness peak above the static tensors."""
    model = meta_model(cfg)
    last = T.schedule_table(cfg)[-2]  # the last training step (the table ends with the final validation)
    graphs: dict[str, torch.fx.GraphModule] = {}

    def keep(name: str):
        def compiler(gm: torch.fx.GraphModule, _inputs: list) -> torch.fx.GraphModule:
            graphs[name] = gm
            return gm
        return compiler

    fake = FakeTensorMode()  # fake CPU tensors: AOTAutograd's trace loses the gradients of meta ones
    with fake:
        state = {name: torch.empty(t.shape, dtype=t.dtype).requires_grad_(t.requires_grad)
                 for name, t in [*model.named_parameters(), *model.named_buffers()]}  # first inputs of each graph
        windows = torch.tensor([last.long_window, last.short_window], dtype=torch.int32)
        mtp = torch.tensor(last.mtp_weights) if cfg.mtp_stages else None
        tokens = torch.zeros(max(last.seq_len, cfg.val_seq_len) + 1, dtype=torch.int32)
    call = lambda state, *inputs: torch.func.functional_call(model, state, inputs)  # noqa: E731
    step = aot_function(call, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                        partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())
    with fake:
        step(state, tokens[:last.seq_len], tokens[1:last.seq_len + 1].long(), windows, mtp).backward()
        model.eval()
        with torch.no_grad():
            val = make_fx(call, decomposition_table=select_decomp_table())(
                state, tokens[:cfg.val_seq_len], tokens[1:cfg.val_seq_len + 1].long(), windows)
    static = leading_inputs(graphs["forward"].graph, len(state))  # the backward's are the same fake tensors
    forward_out = next(n for n in graphs["forward"].graph.nodes if n.op == "output").args[0]
    saved = {key(t): nbytes(t) for node in forward_out[1:] if isinstance(node, torch.fx.Node)
             for t in tensors(node.meta.get("val")) if key(t) not in static}
    (fw_peak, fw_at), (bw_peak, bw_at) = (liveness_peak(graphs[g].graph, static) for g in ("forward", "backward"))
    val_peak, val_at = liveness_peak(val.graph, leading_inputs(val.graph, len(state)))
    workspace = fused_head_workspace(cfg)
    where = lambda phase, node: (f"{phase}, {getattr(node.target, '_opname', node.name)} "  # noqa: E731
                                 f"{'x'.join(map(str, node.meta['val'].shape))}")
    return {"seq_len": last.seq_len, "saved": sum(saved.values()),
            "train_peak": max(fw_peak, bw_peak) + workspace,
            "train_peak_at": where("backward", bw_at) if bw_peak >= fw_peak else where("forward", fw_at),
            "validation_peak": val_peak + workspace, "validation_peak_at": where("validation", val_at)}


def estimate(name: str, args: list[str]) -> list[dict]:
    cfg = recipe_config(args)
    dynamic = activation_bytes(cfg)
    rows = []
    for world_size in (1, 8):
        static = static_bytes(cfg, world_size)
        total = sum(static.values()) + max(dynamic["train_peak"], dynamic["validation_peak"])
        rows.append({"preset": name, "gpus": world_size, "micro_steps": cfg.global_batch_seqs // world_size,
                     **static, "static": sum(static.values()), **dynamic, "total": total, "ok": total <= LIMIT_BYTES})
    return rows


def markdown(rows: list[dict]) -> str:
    g = lambda b: f"{b / GiB:.1f}"  # noqa: E731
    lines = ["| preset | GPUs | params | grads | optimizer | tables | static | saved activations | train peak (at) "
             "| validation peak | total per rank |", "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['gpus']} | {g(r['parameters'])} | {g(r['gradients'])} | "
                     f"{g(r['optimizer'])} | {g(r['tables'])} | {g(r['static'])} | {g(r['saved'])} | "
                     f"{g(r['train_peak'])} ({r['train_peak_at']}) | {g(r['validation_peak'])} | "
                     f"**{g(r['total'])}** |")
    return "\n".join(lines) + "\n\nGiB per rank; total = static + the larger of the two peaks."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = [row for name, preset in PRESETS.items() for row in estimate(name, preset)]
    print(markdown(rows))
    for r in rows:
        if not r["ok"]:
            print(f"FAIL {r['preset']} on {r['gpus']} GPU(s): {r['total'] / 1e9:.1f} GB > {LIMIT_BYTES / 1e9:.0f} GB")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
