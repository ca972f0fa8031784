"""GPU memory per rank at the recipe's real shapes, from traces on the meta device (nothing allocated, no GPU).

    python tools/memory_estimate.py [--json FILE] [--cards]
    SPEEDRUN_TRAINER=records/snapshots/2026-11-25_record28/train_gpt.py python tools/memory_estimate.py  # a snapshot's

For the recipe (its Triton kernels and FP8 on, as on a GPU; and its torch path: no Triton kernels, FP8 still on, as a
GPU resolves --relu2_kernel=false --fused_head=false), on 1 GPU (8 micro-steps) and on 8 (one each), per rank:
- static: the parameters' buckets, the gradient buckets (and the reduce-scatter's shard on 8), the optimizer
  state of the rank's shard, and the model's buffers ("tables": RoPE, the FP8 MLP weights' e4m3 copies, the
  bigram sign table), from the objects train_gpt.py builds;
- warmup snapshot: the device-side clones of the parameter buckets, the optimizer state and the persistent buffers
  that train_gpt.warmup holds while it trains every stage's length (it never validates): they add to the train peak;
- saved: the activations one micro-step keeps for its backward, as torch.compile's partitioner (AOTAutograd,
  min-cut rematerialization) splits the training graph;
- train peak: the most a micro-step holds beyond static, by a liveness walk of the forward and backward graphs
  (every node's output held from its op to its last use: no fusion, so an upper bound on what inductor's fused
  kernels hold); the node where it peaks is named (the recipe's: its fused head; the torch path's: the head's
  backward, where the fp32 logits' gradient lives);
- validation peak: the same walk over one validation sequence's forward.
total = static + the larger of train peak + warmup snapshot and validation peak: torch.cuda.max_memory_allocated
over the whole run, warmup included, which is what the logs report.
FlexAttention has no CPU/meta backward, so a stand-in with its memory takes its place: it keeps q, k, v, the
output and the fp32 log-sum-exp for backward and returns dq, dk, dv (FA3's varlen kernel keeps the same). The
custom ops are traced through their fake kernels and are opaque to the walk; their own buffers are added while they
run: the fused head's (--fused_head: a chunk of logits; in training its fp32 dW and the FP8 gradient's copies) and
the FP8 MLP's (speedrun::mlp_fp8: the e4m3 copies of its input and of relu^2 in the forward, the two bf16 hidden-
sized products of its backward).

With the repository's trainer, one more preset, "record #89 itself": record #89's own memory (its logs: 30220-30935
MiB allocated per GPU on 8xH100), from the same traces with #89's storage and materialization (its train_gpt.py):
bf16 parameters without fp32 copies (a 16-bit mantissa per Muon shard instead), its banks padded (Q/K and V/O to a
multiple of the world size, the MLP to 12 layers), autograd's bf16 gradients (the Adam ones kept from an even step
through the next), bf16 RoPE tables of 2 x val_seq_len positions, e4m3 copies of the 12 MLP layers, deep copies of
the parameters and the optimizer state through a warmup that validates at every step (one validation batch each);
validation through a plain bf16 head: the (val_seq_len, vocab) bf16 logits exist (the torch path's validation
graph); training through its FP8 head and CE kernel: bf16 logits and their e5m2 gradient, on top of the recipe's
trunk. #89's parameters are stated here (RECORD89_PARAMS), not read from train_gpt.py, whose model is now upstream's.
And "upstream f411b3d itself": upstream's current code (spec: 377,280 x 768 bigram table, 8192 x 768 sign table, the
MUDD gate network, the prefix table, DC on layer 10) with the same storage, its parameters read from train_gpt.py's
model; set beside the peak #85 v3 logged (MuddGatedAndDC/this_pr_v3, 10 logs: 31,765-32,160 MiB on 8xH100), the
nearest logged code (no log runs f411b3d itself). DC's own buffers: the backward's dS and mixture (dc_workspace); its
forward's log-sum-exp is a graph output. The table after the main one sets #89's and upstream's peaks against the
recipe's, term by term, on 8 GPUs.
A total above an H100's limit fails (exit 1): its 80 GB (10^9 bytes; it has 79.6 GiB) less RESERVE_BYTES (3 GiB) for
the CUDA context and the allocator's fragmentation; limit_bytes states the rule for every card.

--cards adds the per-card table (behind a flag: it traces each card's kernel path, and the splits it needs, on top
of the default run's; --json then holds its rows too, each with "card"): for an RTX 4090 (24 GB, sm89), A100 40GB
(sm80), L40S (48 GB, sm89), A100 80GB (sm80), H100 (80 GB, sm90), H200 (141 GB, sm90) and B200 (192 GB, sm100), on 1
GPU and on 8, the recipe as the trainer resolves it at the card's compute capability (train_gpt.resolve_for_device,
gpt_kernels.RUNS_ON; train_gpt.gpu_capability faked), its total per rank, whether it fits limit_bytes(GB), and if
not the smallest --micro_split of 1, 2, 4, 8, 16 that does (a split cuts each training sequence into micro-steps of
seq_len / N tokens: it lowers a training micro-step's activations, not static, the warmup snapshot or validation's
peak), or what does not fit. Each kernel path and split is traced once (a split's training alone: validation is the
unsplit trace's); a card on the recipe preset's path (the H100's, the H200's) reuses its trace.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

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
RECORD89 = "record #89 itself"  # the preset of #89's own memory (the repository's trainer only)
RECORD89_MLP_MATRICES = 24  # #89's MLP bank has 12 layers (a zero 12th: whole matrices on each of up to 8 ranks)
GiB = 2**30
# What fits: a card's memory as sold, in GB read as 10^9 bytes (below what each card reports: an H100's "80 GB" is
# 79.6 GiB = 85.5e9 bytes, an RTX 4090's "24 GB" 25.4e9, an L40S's "48 GB" 48.3e9 with ECC on), less RESERVE_BYTES for
# what this estimate (torch.cuda.max_memory_allocated) does not count: the CUDA context with cuBLAS's and NCCL's
# workspaces (about 1 GiB) and the caching allocator's fragmentation, what it cannot reuse at the peak (it frees its
# cache and retries before an out-of-memory error: not the 1.45x record #28's logs show reserved over allocated, but a
# few GiB of split blocks). One fixed reserve on every card: the context does not grow with the card.
RESERVE_BYTES = 3 * GiB


def limit_bytes(gb: int) -> int:
    """The most a rank may hold (the estimate's total) on a card of gb GB: gb x 10^9 bytes less RESERVE_BYTES."""
    return gb * 10**9 - RESERVE_BYTES


LIMIT_BYTES = limit_bytes(80)  # the presets' check (exit 1 above it): the H100, the recipe's GPU
# The per-card table (--cards): name, memory as sold (GB, 10^9 bytes), compute capability (what the trainer resolves
# its kernel paths from: train_gpt.resolve_for_device, gpt_kernels.RUNS_ON).
CARDS = (("RTX 4090", 24, (8, 9)), ("A100 40GB", 40, (8, 0)), ("L40S", 48, (8, 9)), ("A100 80GB", 80, (8, 0)),
         ("H100", 80, (9, 0)), ("H200", 141, (9, 0)), ("B200", 192, (10, 0)))
SPLITS = (1, 2, 4, 8, 16)  # the --micro_split settings tried, smallest first (the recipe's stages allow up to 128)
PATH_FLAGS = ("fp8_head", "fp8_mlp", "relu2_kernel", "fused_head", "dc_kernel")  # what a card's resolution changes


def recipe_config(args: list[str]) -> T.Config:
    """A preset's config as a GPU run resolves it (compiled, FP8 head on), at its real shapes."""
    cfg = T.parse_config(args)
    names = [n for n in ("relu2_kernel", "fused_head", "dc_kernel") if hasattr(cfg, n)]  # dc_kernel: upstream's DC
    kernels = {name: getattr(cfg, name) in (None, True) for name in names}  # auto: CUDA's
    for name in names:  # resolve_for_device refuses them without a GPU; their fakes trace
        setattr(cfg, name, False)
    T.resolve_for_device(cfg, cuda=False)
    cfg.compile, cfg.fp8_head = True, True
    if hasattr(cfg, "fp8_mlp"):  # the FP8 MLP (#89; a snapshot's trainer may predate it): on, as CUDA resolves it
        cfg.fp8_mlp = True
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
    stand_in = lambda q, k, v, block_mask, scale: FlexStandIn.apply(q, k, v)  # noqa: E731
    if hasattr(model, "blocks"):  # a snapshot's model (#28, #70): an attention module per block
        for block in model.blocks:
            if block.attn is not None:
                block.attn.flex = stand_in
    else:  # the flat model (#89): GPT.attention calls model.flex
        model.flex = stand_in
    return model


def nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def static_bytes(cfg: T.Config, world_size: int) -> tuple[dict[str, int], int]:
    """Rank 0's long-lived tensors, by kind, from the optimizer's buckets (the parameters live in them); and the
    bytes of the persistent buffers (the state_dict's non-parameters: the warmup clones them)."""
    model = meta_model(cfg)
    optimizer = T.ShardedMuonAdam(model, cfg, 0, world_size, compile_ns=False)
    buckets = optimizer.buckets
    tables = {key(b): nbytes(b) for b in model.buffers()}
    params = dict(model.named_parameters())
    persistent = sum(nbytes(t) for n, t in model.state_dict().items() if n not in params)
    return {"parameters": sum(nbytes(b.data) for b in buckets),
            "gradients": sum(nbytes(b.grad) + (nbytes(b.grad_shard) if world_size > 1 else 0) for b in buckets),
            "optimizer": optimizer.state_bytes(), "tables": sum(tables.values())}, persistent


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


def liveness_peak(graph: torch.fx.Graph, static: set[int], transient: Callable[[torch.fx.Node], int] = lambda n: 0
                  ) -> tuple[int, torch.fx.Node | None]:
    """The most bytes live at once over the graph's nodes, each materialized storage from the node that makes
    it (inputs: from the start) to the last node reading it (outputs: to the end), static storages left out,
    plus transient(node) while a node runs (an opaque op's own buffers); and that node. Fused intermediates take
    no memory; no buffer reuse beyond that."""
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
        if live + transient(node) > peak:
            peak, at = live + transient(node), node
        live -= sum(size[k] for k in made if last_use[k] == i)
    return peak, at


def fused_head_workspace(cfg: T.Config, training: bool) -> int:
    """softcap_ce's own buffers at their most (gpt_kernels.softcap_ce): one chunk of bf16 logits (its gradient in
    place); in training also the fp32 dW accumulator and the chunk's fp32 dW, and with the FP8 head the gradient's
    e5m2 copy and the transposed copy its dW GEMM reads (1 byte a logit each; without FP8 the chunk's dW is bf16)."""
    if not cfg.fused_head:
        return 0
    chunk = T.gpt_kernels.HEAD_CHUNK_ROWS * cfg.vocab_size
    if not training:
        return 2 * chunk
    dw = cfg.vocab_size * cfg.model_dim
    return 2 * chunk + 4 * dw + (2 * chunk + 4 * dw if cfg.fp8_head else 2 * dw)


def mlp_fp8_workspace(node: torch.fx.Node) -> int:
    """The FP8 MLP's own buffers while it runs (gpt_kernels.mlp_fp8_forward, mlp_backward): in the forward the
    e4m3 copies of x (M, d) and of relu(pre)^2 (M, hidden), 1 byte each; in the backward dpre, bf16 (M, hidden),
    and on the torch path (kernel=False) g W_proj^T before it (the ReLU^2 GEMM's epilogue never writes that one).
    Its outputs and saved post are the graph's own (the bf16 MLP's mlp_relu2_forward: all of its buffers)."""
    forward = node.target._opname == "mlp_fp8_forward"
    x, w_fc = (node.args[i].meta["val"] for i in ((0, 1) if forward else (1, 2)))  # backward: (g, x, w_fc, ...)
    m, d, hidden = x.shape[0], x.shape[-1], w_fc.shape[0]
    return m * d + m * hidden if forward else (1 if node.args[-1] else 2) * 2 * m * hidden


def dc_workspace(node: torch.fx.Node) -> int:
    """DC attention's backward's own buffers (gpt_kernels.dc_attention's backward, layer 10): dS_h[t, t - j] (T, H,
    window) in q's dtype and the mixture A[t, t - j] (T, window) fp32. Its forward writes only its outputs (out and
    the (T, H) fp32 log-sum-exp it saves): the graph's own."""
    q = node.args[1].meta["val"]  # (grad, q, k, v, w1, w2, cu_seqlens, lse, scale, window)
    window = node.args[9] if len(node.args) > 9 else node.kwargs["window"]
    T, H = q.shape[1], q.shape[2]
    return T * window * (H * q.element_size() + 4)


def activation_bytes(cfg: T.Config, validation: bool = True) -> dict[str, int | str]:
    """One training micro-step at the last stage's length (its micro_len: seq_len / --micro_split) through
    AOTAutograd's partitioner, and one validation forward (val_seq_len, never split; validation=False leaves it
    out): saved activations and each graph's liveness peak above the static tensors, the fused head's own buffers
    counted while it runs (forward_trunk_peak: the forward's without them, for record89_rows)."""
    model = meta_model(cfg)
    last = T.schedule_table(cfg)[-2]  # the last training step (the table ends with the final validation)
    micro_len = getattr(last, "micro_len", last.seq_len)  # a snapshot's trainer predates --micro_split
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
        mtp = torch.tensor(last.mtp_weights) if getattr(cfg, "mtp_stages", True) else None  # #28's: "", none
        tokens = torch.zeros(micro_len + 1, dtype=torch.int32)  # a micro-step's batch: its own buffer
        val_tokens = torch.zeros(cfg.val_seq_len + 1, dtype=torch.int32)
    call = lambda state, *inputs: torch.func.functional_call(model, state, inputs)  # noqa: E731
    step = aot_function(call, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                        partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())
    with fake:
        step(state, tokens[:micro_len], tokens[1:micro_len + 1].long(), windows, mtp).backward()
        model.eval()
        with torch.no_grad():
            val = make_fx(call, decomposition_table=select_decomp_table())(
                state, val_tokens[:-1], val_tokens[1:].long(), windows
            ) if validation else None
    static = leading_inputs(graphs["forward"].graph, len(state))  # the backward's are the same fake tensors
    forward_out = next(n for n in graphs["forward"].graph.nodes if n.op == "output").args[0]
    saved = {key(t): nbytes(t) for node in forward_out[1:] if isinstance(node, torch.fx.Node)
             for t in tensors(node.meta.get("val")) if key(t) not in static}
    def head(training: bool) -> Callable[[torch.fx.Node], int]:  # the custom ops' own buffers, while they run
        size = fused_head_workspace(cfg, training)

        def workspace(node: torch.fx.Node) -> int:
            name = getattr(node.target, "_opname", None)
            if name == "softcap_ce":
                return size
            if name == "dc_attention_backward":
                return dc_workspace(node)
            return mlp_fp8_workspace(node) if name in ("mlp_fp8_forward", "mlp_backward") else 0
        return workspace

    fw_trunk, _ = liveness_peak(graphs["forward"].graph, static)
    (fw_peak, fw_at), (bw_peak, bw_at) = (liveness_peak(graphs[g].graph, static, head(True))
                                          for g in ("forward", "backward"))
    def where(phase: str, node: torch.fx.Node) -> str:  # the op and its (largest) output's shape (the fused head:
        name = getattr(node.target, "_opname", node.name)  # its chunk)
        if name == "softcap_ce":
            return f"{phase}, softcap_ce's chunk {T.gpt_kernels.HEAD_CHUNK_ROWS}x{cfg.vocab_size}"
        largest = max(tensors(node.meta["val"]), key=lambda t: t.numel())
        return f"{phase}, {name} {'x'.join(map(str, largest.shape))}"

    out = {"seq_len": last.seq_len, "micro_len": micro_len, "saved": sum(saved.values()),
           "forward_trunk_peak": fw_trunk, "backward_peak": bw_peak, "train_peak": max(fw_peak, bw_peak),
           "train_peak_at": where("backward", bw_at) if bw_peak >= fw_peak else where("forward", fw_at)}
    if val is not None:
        val_peak, val_at = liveness_peak(val.graph, leading_inputs(val.graph, len(state)), head(False))
        out.update(validation_peak=val_peak, validation_peak_at=where("validation", val_at))
    return out


def peak_row(preset: str, world_size: int, micro_steps: int, static: dict[str, int], snapshot: int,
             dynamic: dict[str, int | str], snapshot_in_validation: bool) -> dict:
    """A row of the table: static, the phase whose peak is the larger (the warmup snapshot held through training,
    and through validation too when the warmup validates) and the total per rank."""
    train = dynamic["train_peak"] + snapshot
    val = dynamic["validation_peak"] + (snapshot if snapshot_in_validation else 0)
    phase = "train" if train >= val else "validation"
    total = sum(static.values()) + max(train, val)
    return {"preset": preset, "gpus": world_size, "micro_steps": micro_steps, **static, "static": sum(static.values()),
            "warmup_snapshot": snapshot, **dynamic, "peak_phase": phase,
            "peak_activations": dynamic[f"{phase}_peak"], "peak_snapshot": max(train, val) - dynamic[f"{phase}_peak"],
            "total": total, "ok": total <= LIMIT_BYTES}


_TRACES: dict[str, dict[str, int | str]] = {}


def traced(cfg: T.Config) -> dict[str, int | str]:
    """activation_bytes(cfg), once per config (a card on the recipe preset's path resolves to the same config and
    reuses its trace); with --micro_split its training traced alone and its validation the unsplit config's
    (validation is never split)."""
    key = json.dumps(dataclasses.asdict(cfg), sort_keys=True)
    if key not in _TRACES:
        if getattr(cfg, "micro_split", 1) == 1:
            _TRACES[key] = activation_bytes(cfg)
        else:
            unsplit = traced(dataclasses.replace(cfg, micro_split=1))
            _TRACES[key] = {**activation_bytes(cfg, validation=False),
                            **{k: v for k, v in unsplit.items() if k.startswith("validation")}}
    return _TRACES[key]


def config_rows(name: str, cfg: T.Config, world_sizes: tuple[int, ...] = (1, 8)) -> list[dict]:
    """The table's rows of one config: its static tensors on each world size with its traced activations."""
    dynamic = traced(cfg)
    rows = []
    for world_size in world_sizes:
        static, persistent = static_bytes(cfg, world_size)
        # What train_gpt.warmup clones: every bucket (the parameters), the optimizer state and the persistent buffers.
        snapshot = static["parameters"] + static["optimizer"] + persistent if cfg.warmup_steps else 0
        micro_steps = cfg.global_batch_seqs // world_size * getattr(cfg, "micro_split", 1)
        rows.append(peak_row(name, world_size, micro_steps, static, snapshot, dynamic, False))
    return rows


def estimate(name: str, args: list[str]) -> list[dict]:
    return config_rows(name, recipe_config(args))


def card_config(capability: tuple[int, int], micro_split: int, world_size: int) -> T.Config:
    """The recipe as the trainer resolves it on a GPU of this compute capability (train_gpt.resolve_for_device told
    the capability: gpt_kernels.RUNS_ON decides), at
    --micro_split, checked by validate_config. --attention=flex: FA3 (sm90's auto) saves the same tensors (FlexStandIn)
    and resolving it would load it from the hub."""
    cfg = T.parse_config([f"--micro_split={micro_split}", "--attention=flex"])
    T.resolve_for_device(cfg, cuda=True, capability=capability)
    T.validate_config(cfg, world_size)
    return cfg


def path_words(cfg: T.Config) -> str:
    """The kernel paths a config takes, in short: what is off."""
    off = [name for name in PATH_FLAGS if not getattr(cfg, name)]
    return "all kernels, FP8" if not off else "no " + ", ".join(off)


def card_rows() -> list[dict]:
    """Per card and world size (1, 8): the recipe's total per rank unsplit and, where it does not fit (above
    limit_bytes), the smallest --micro_split of SPLITS that fits. The split lowers only a training micro-step's
    activations: where the peak is validation's (or the split runs out), nothing in SPLITS fits."""
    rows = []
    for name, gb, capability in CARDS:
        limit = limit_bytes(gb)
        for world_size in (1, 8):
            tried = []
            for split in SPLITS:
                cfg = card_config(capability, split, world_size)
                row = config_rows(name, cfg, (world_size,))[0]
                tried.append({"micro_split": split, "total": row["total"], "peak_phase": row["peak_phase"],
                              "train_peak": row["train_peak"], "saved": row["saved"], "static": row["static"],
                              "validation_peak": row["validation_peak"], "fits": row["total"] <= limit})
                if tried[-1]["fits"] or row["peak_phase"] == "validation":  # the split cannot lower validation's
                    break
            fit = next((t for t in tried if t["fits"]), None)
            last = tried[-1]
            rows.append({"card": name, "gb": gb, "capability": f"sm{capability[0]}{capability[1]}",
                         "path": path_words(cfg), **{f: getattr(cfg, f) for f in PATH_FLAGS}, "gpus": world_size,
                         "limit": limit, "total_unsplit": tried[0]["total"], "phase_unsplit": tried[0]["peak_phase"],
                         "fits_unsplit": tried[0]["fits"], "micro_split": fit and fit["micro_split"],
                         "total": fit and fit["total"], "dominant": None if fit else last["peak_phase"],
                         "tried": tried})
    return rows


def card_markdown(rows: list[dict]) -> str:
    g = lambda b: f"{b / GiB:.1f}"  # noqa: E731
    lines = ["| card | GB | capability | kernel paths (auto) | GPUs | limit | total per rank, unsplit | fits | "
             "--micro_split that fits (total) |", "|---|---:|---|---|---:|---:|---:|---|---|"]
    for r in rows:
        if r["fits_unsplit"]:
            verdict = "-"
        elif r["micro_split"]:
            verdict = f"{r['micro_split']} ({g(r['total'])}, {r['tried'][-1]['peak_phase']})"
        else:
            last = r["tried"][-1]
            verdict = (f"does not fit: {last['peak_phase']} peaks at {g(last['total'])} with --micro_split="
                       f"{last['micro_split']}" + (" (the split cannot lower it)"
                                                   if last["peak_phase"] == "validation" else ""))
        lines.append(f"| {r['card']} | {r['gb']} | {r['capability']} | {r['path']} | {r['gpus']} | {g(r['limit'])} | "
                     f"{g(r['total_unsplit'])} ({r['phase_unsplit']}) | {'yes' if r['fits_unsplit'] else 'no'} | "
                     f"{verdict} |")
    return "\n".join(lines) + (
        f"\n\nGiB per rank. limit: the card's GB as 10^9 bytes less {RESERVE_BYTES / GiB:.0f} GiB (RESERVE_BYTES: the "
        f"CUDA context and the allocator's fragmentation). Kernel paths: train_gpt.resolve_for_device at the card's "
        f"capability (gpt_kernels.RUNS_ON). --micro_split=N cuts each training sequence into N micro-steps of "
        f"seq_len / N tokens: it lowers a training micro-step's activations only (static, the warmup snapshot and "
        f"validation's {T.Config.val_seq_len:,}-token forward stay); tried: {', '.join(map(str, SPLITS))}.")


BF16, FP32 = torch.bfloat16, torch.float32
# Record #89's parameters as its train_gpt.py builds them (record89_spec.md §4.1): name, shape, dtype, optimizer. Stated
# here, not read from train_gpt.py: the repository's model is upstream's current one (f411b3d), and the snapshot
# records/snapshots/2026-11-28_record89/ still runs #89.
RECORD89_PARAMS = (
    ("qk_bank", (60, 256, 768), BF16, "muon"), ("vo_bank", (20, 768, 768), BF16, "muon"),
    ("mlp_bank", (11, 2, 3072, 768), BF16, "muon"),
    ("embed.weight", (50304, 768), BF16, "adam"), ("lm_head.weight", (50304, 768), BF16, "adam"),
    ("value_embeds", (5, 50304, 768), BF16, "adam"), ("bigram_embed.weight", (754_560, 192), BF16, "adam"),
    ("attn_gate_bank", (10, 6, 12), BF16, "adam"), ("ve_gate_bank", (5, 6, 12), BF16, "adam"),
    ("smear_gate.weight", (1, 12), BF16, "adam"), ("skip_gate.weight", (1, 12), BF16, "adam"),
    ("mudd_w1", (2, 64, 768), BF16, "adam"), ("mudd_w2", (2, 14, 64), BF16, "adam"), ("mudd_b2", (2, 14), BF16, "adam"),
    ("scalars", (24,), FP32, "adam"), ("resid_lambdas", (11, 2), FP32, "adam"), ("post_lambdas", (11, 2), FP32, "adam"),
    ("x0_lambdas", (11,), FP32, "adam"), ("bigram_lambdas", (11,), FP32, "adam"), ("xsa_alphas", (11, 6), FP32, "adam"))
RECORD89_SIGNS = (8192, 192)  # its bigram sign table, bf16
RECORD89_VAL_SEQ_LEN, RECORD89_HEAD_DIM, RECORD89_VOCAB = 262_144, 128, 50304  # its RoPE tables' rows; Adam sharding
UPSTREAM = "upstream f411b3d itself"  # upstream's current code with its own storage (#89's, spec §2.10: same class)
# Peaks torch.cuda.max_memory_allocated logged on 8xH100 ("peak memory allocated: N MiB", each log's last line), MiB
LOGGED_MIB = {
    RECORD89: ("#89, FP8DownProjection/this_pr, 13 logs", 30_220, 30_935),
    # the nearest logged code to upstream f411b3d (spec §1.3): #85 v3, records/track_1_short/2026-05-27-MuddGatedAndDC/
    # this_pr_v3/*.txt, 10 logs: 31,765 (5 logs), 32,027, 32,077 (2), 32,160 (2); reserved 47,310-47,530
    UPSTREAM: ("#85 v3, MuddGatedAndDC/this_pr_v3, 10 logs", 31_765, 32_160)}


def model_params(cfg: T.Config) -> list[tuple[str, tuple[int, ...], torch.dtype, str]]:
    """The repository model's parameters (upstream's current ones) in RECORD89_PARAMS' form, from its optimizer table."""
    model = meta_model(cfg)
    return [(name, tuple(p.shape), p.dtype, group.kind) for group in T.build_param_groups(model, cfg)
            for name, p in zip(group.names, group.params)]


def storage_static(params, signs: int, rope: int, vocab: int, world_size: int) -> dict[str, int]:
    """#89's storage (its GPT and NorMuonAndAdam; upstream's current code keeps it) of a parameter list on one rank:
    parameters in their dtype (the banks bf16: no fp32 masters), the Q/K and V/O banks padded to a multiple of the
    world size (60 -> 64, 20 -> 24 on 8), the MLP bank to 12 layers (22 -> 24 matrices); per bank the rank's share
    with an fp32 momentum, a uint16 mantissa (the fp32 master's low half) and an fp32 second moment (per row of a tall
    or square matrix, per column of a wide one); fp32 Adam moments, sharded over the ranks for the vocabulary-sized
    tables (embed, lm_head, value and bigram embeddings), whole for the small rest (a 0-d scale too). Gradients are
    autograd's, one per parameter in its dtype: the Adam ones live from an even step through the next (Adam steps on
    odd steps and frees them then; a validation in between sees them), the Muon ones from backward to the optimizer
    step (muon_gradients). Tables: the RoPE tables (rope bytes), the e4m3 copies of W_fc and W_proj^T of the 12 MLP
    layers, the bigram sign table (signs bytes)."""
    out = dict.fromkeys(("parameters", "gradients", "optimizer", "muon_gradients"), 0)
    mlp_rows, mlp_cols = 0, 0
    for name, shape, dtype, kind in params:
        numel, size = math.prod(shape), math.prod(shape) * dtype.itemsize
        if kind == "muon":
            rows, cols = shape[-2:]
            multiple = RECORD89_MLP_MATRICES if name == "mlp_bank" else world_size
            padded = -(-(numel // (rows * cols)) // multiple) * multiple
            share = padded // world_size
            out["parameters"] += padded * rows * cols * 2
            out["muon_gradients"] += padded * rows * cols * 2
            out["optimizer"] += share * rows * cols * (4 + 2) + 4 * share * (rows if rows >= cols else cols)
            if name == "mlp_bank":
                mlp_rows, mlp_cols = rows, cols
            continue
        out["parameters"] += size
        out["gradients"] += size
        out["optimizer"] += 2 * 4 * numel // (world_size if max(shape, default=1) >= vocab else 1)
    out["tables"] = rope + RECORD89_MLP_MATRICES * mlp_rows * mlp_cols + signs
    return out


def record89_static(cfg: T.Config, world_size: int) -> tuple[dict[str, int], int]:
    """#89's long-lived tensors on one rank (storage_static of RECORD89_PARAMS: #89's own shapes, not this model's),
    its tables bf16 cos and sin of 2 x val_seq_len positions (its per-rank validation length), the paired layout's of
    2 head_dim columns, and its 8192 x 192 sign table; and the bytes its warmup's deep copy of model.state_dict()
    holds besides the parameters (the sign table; the FP8 scale vectors, 144 bytes, left out). cfg: unused (#89's
    numbers are stated), kept for the callers."""
    signs = math.prod(RECORD89_SIGNS) * 2
    rope = 2 * (2 * RECORD89_VAL_SEQ_LEN) * RECORD89_HEAD_DIM * 3 * 2  # cos and sin; normal and paired columns
    return storage_static(RECORD89_PARAMS, signs, rope, RECORD89_VOCAB, world_size), signs


def upstream_static(cfg: T.Config, world_size: int) -> tuple[dict[str, int], int]:
    """Upstream f411b3d's long-lived tensors on one rank: storage_static of this model's parameters (upstream's:
    spec §2.2), RoPE as #89's at cfg's val_seq_len, this model's sign table (8192 x 768) and its prefix table (50304
    int64, not persistent: the warmup's copy leaves it out); and the sign table's bytes (the warmup copies it)."""
    model = meta_model(cfg)
    signs = nbytes(model.bigram_sign_table)
    rope = 2 * (2 * cfg.val_seq_len) * cfg.head_dim * (1 + (2 if T.paired_layers(cfg) else 0)) * 2
    out = storage_static(model_params(cfg), signs, rope, cfg.vocab_size, world_size)
    out["tables"] += nbytes(model.prefix_table)
    return out, signs


def own_rows(preset: str, static_of: Callable, cfg: T.Config, fused: dict, plain: dict) -> list[dict]:
    """A record's own peak per rank (#89's storage): static_of(cfg, W), the warmup's deep copies of its parameters,
    sign table and optimizer state (its warmup runs a validation batch at every step: they are there for both phases),
    and the larger of its validation (the torch path's graph: a plain bf16 head over val_seq_len tokens, softcap and
    CE fused behind the GEMM) and its training: the recipe's trunk (the fused-head traces without their workspace; the
    FP8 MLP's saved x, W_fc, W_proj, pre and post are #89's) plus its head: in the forward 3 bytes a logit (the FP8
    GEMM's bf16 logits and the e5m2 gradient its CE kernel writes and saves), in the backward 2 (that gradient and the
    transposed copy the dW GEMM reads). The traced backward already holds every gradient it outputs (the banks' in
    fp32 here, bf16 in #89): nothing more is added for them, an upper bound. The trunk is this repository's model
    (upstream's: DC on layer 10, 768-wide bigram rows) for #89 too: the activations at #89's peak are its validation
    logits. fused, plain: rows of the recipe and of its torch path (their traces' figures)."""
    seq_len = int(fused["seq_len"])
    logits = seq_len * cfg.vocab_size
    dynamic = {"seq_len": seq_len, "saved": int(fused["saved"]) + logits,
               "validation_peak": plain["validation_peak"], "validation_peak_at": plain["validation_peak_at"],
               "train_peak_at": f"forward, its head: bf16 logits and their e5m2 gradient {seq_len}x{cfg.vocab_size}"}
    train = max(int(fused["forward_trunk_peak"]) + 3 * logits, int(fused["backward_peak"]) + 2 * logits)
    rows = []
    for world_size in (1, 8):
        static, signs = static_of(cfg, world_size)
        static.pop("muon_gradients")
        rows.append(peak_row(preset, world_size, 8 // world_size, static,
                             static["parameters"] + signs + static["optimizer"], {**dynamic, "train_peak": train},
                             True))
    return rows


def record89_rows(cfg: T.Config, fused: dict, plain: dict) -> list[dict]:
    """#89's own peak per rank (own_rows of record89_static)."""
    return own_rows(RECORD89, record89_static, cfg, fused, plain)


def upstream_rows(cfg: T.Config, fused: dict, plain: dict) -> list[dict]:
    """Upstream f411b3d's own peak per rank (own_rows of upstream_static): set beside #85 v3's logged peak."""
    return own_rows(UPSTREAM, upstream_static, cfg, fused, plain)


def markdown(rows: list[dict]) -> str:
    g = lambda b: f"{b / GiB:.1f}"  # noqa: E731
    lines = ["| preset | GPUs | params | grads | optimizer | buffers | static | warmup snapshot | saved activations "
             "| train peak (at) | validation peak | total per rank |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['gpus']} | {g(r['parameters'])} | {g(r['gradients'])} | "
                     f"{g(r['optimizer'])} | {g(r['tables'])} | {g(r['static'])} | {g(r['warmup_snapshot'])} | "
                     f"{g(r['saved'])} | {g(r['train_peak'])} ({r['train_peak_at']}) | {g(r['validation_peak'])} | "
                     f"**{g(r['total'])}** ({r['peak_phase']}) |")
    by = {(r["preset"], r["gpus"]): r for r in rows}
    text = "\n".join(lines) + ("\n\nGiB per rank; total = static + the larger of train peak + warmup snapshot and "
                               "validation peak" + (" (+ the snapshot where the warmup validates: #89, upstream)." if
                                                    (RECORD89, 8) in by else "."))
    logged = logged_lines(by)
    if logged:
        text += "\n\n" + logged
    if (RECORD89, 8) in by and ("recipe", 8) in by:
        text += "\n\n" + comparison([(p, by[p, 8]) for p in (RECORD89, UPSTREAM, "recipe") if (p, 8) in by])
    return text


def logged_lines(by: dict) -> str:
    """Each own-storage estimate on 8 GPUs beside the peaks logged on 8xH100 (LOGGED_MIB), in MiB."""
    lines = []
    for preset, (what, low, high) in LOGGED_MIB.items():
        if (preset, 8) in by:
            total = by[preset, 8]["total"] / 2**20
            lines.append(f"- {preset}, 8 GPUs: estimate {total:,.0f} MiB per rank; logged ({what}): peak memory "
                         f"allocated {low:,}-{high:,} MiB (estimate / logged low: {total / low:.3f})")
    return "\n".join(lines)


def comparison(columns: list[tuple[str, dict]]) -> str:
    """The own-storage peaks against the recipe's on 8 GPUs, term by term: what each holds at the moment of its peak;
    the last column the recipe minus the one before it."""
    g = lambda n: f"{n / GiB:.2f}"  # noqa: E731
    (_, theirs), (_, ours) = columns[-2], columns[-1]
    lines = ["| 8 GPUs, GiB per rank at the peak | " + " | ".join(f"{p} ({r['peak_phase']})" for p, r in columns)
             + f" | recipe - {columns[-2][0]} |", "|---|" + "---:|" * (len(columns) + 1)]
    for name, field in (("parameters", "parameters"), ("gradients", "gradients"), ("optimizer", "optimizer"),
                        ("buffers (RoPE, FP8 copies, sign table)", "tables"), ("warmup snapshot", "peak_snapshot"),
                        ("activations at the peak", "peak_activations"), ("total", "total")):
        lines.append(f"| {name} | " + " | ".join(g(r[field]) for _, r in columns)
                     + f" | {g(ours[field] - theirs[field])} |")
    return "\n".join(lines)


def unwritable(path: Path) -> str | None:
    """Why no file can be written at path, or None: known before minutes of tracing, and nothing is created."""
    if path.is_dir():
        return "a folder, not a file"
    folder = next(p for p in path.absolute().parents if p.exists())  # where the file, or its first new folder, goes
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    try:
        if path.exists():
            path.open("r+b").close()  # opened for writing, left as it is
        else:
            tempfile.TemporaryFile(dir=folder).close()  # nameless on Linux: nothing is left behind
    except OSError as e:
        return f"cannot write a file in {folder} ({e.strerror})"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the rows here (with --cards, the card table's too)")
    parser.add_argument("--cards", action="store_true", help="also the per-card table: each card's total per rank "
                        "and the smallest --micro_split that fits it (the repository's trainer only)")
    args = parser.parse_args()
    if args.cards and not hasattr(T.Config, "micro_split"):
        parser.error(f"--cards: {TRAINER} has no --micro_split")
    if args.json and (problem := unwritable(args.json)):
        print(f"error: --json={args.json}: {problem}", file=sys.stderr)
        return 2
    rows = [row for name, preset in PRESETS.items() for row in estimate(name, preset)]
    if "recipe torch path" in PRESETS:  # the repository's trainer: #89 ran this recipe
        one = {r["preset"]: r for r in rows if r["gpus"] == 1}
        cfg = recipe_config(PRESETS["recipe"])
        rows += record89_rows(cfg, one["recipe"], one["recipe torch path"])
        rows += upstream_rows(cfg, one["recipe"], one["recipe torch path"])
    print(markdown(rows))
    for r in rows:
        if not r["ok"]:
            print(f"FAIL {r['preset']} on {r['gpus']} GPU(s): {r['total'] / 1e9:.1f} GB > {LIMIT_BYTES / 1e9:.1f} GB "
                  f"(80 GB less the reserve)")
    cards = card_rows() if args.cards else []
    if cards:
        print("\n" + card_markdown(cards))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows + cards, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
