"""The model's forward and one optimizer step against the recipe's formulas (record #28, as the anchor spec
states them), written out plainly here in float64: not the file's code, the spec's math. A structural slip
(a skip taken from the wrong layer, a lambda on the wrong term, a rotation of the wrong dims, a step with the
wrong scale) moves these far outside the bf16 rounding the tolerances allow."""

import math

import torch

import train_gpt as T
from test_recipe28 import mask_tokens, reference_mask

CFG = T.parse_config(["--preset=tiny", "--model_dim=64", "--num_heads=2", "--head_dim=32", "--train_seq_len=256",
                      "--block_size=32", "--gate_channels=8"])
WINDOWS = (3, 1)  # long, short in blocks: both leave out some blocks of the 8


def rms(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm with the records' eps: none given, so torch's, fp32's machine epsilon (it counts where a row is
    small, e.g. q and k under a lambda near 0)."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + torch.finfo(torch.float32).eps)


def rope(x: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
    """(T, H, D): pairs (x[j], x[j + D/2]) turn by pos * w_j, w_j = (1/1024)^(j / (D/4 - 1)) for j < D/4, else 0;
    pos: (T, H) positions, by default token t's t."""
    n, d = x.size(0), x.size(-1)
    w = torch.zeros(d // 2, dtype=torch.float64)
    w[: d // 4] = (1 / 1024) ** (torch.arange(d // 4, dtype=torch.float64) / (d // 4 - 1))
    pos = torch.arange(n, dtype=torch.float64)[:, None] if pos is None else pos.double()
    theta = pos[..., None] * w
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * theta.cos() + x2 * theta.sin(), -x1 * theta.sin() + x2 * theta.cos()], -1)


def spec_loss(p: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of the spec's forward, every parameter taken by its role from the model's names."""
    cfg, L = CFG, CFG.num_layers
    inp, tgt = tokens[:-1], tokens[1:]
    skip, resid, lam = p["scalars"][: L // 2], p["scalars"][L // 2: 3 * L // 2], p["scalars"][3 * L // 2:]
    masks = {w: reference_mask(tokens[:-1], cfg.block_size, w) for w in WINDOWS}
    ve_layers = {i: int(t) for i, t in enumerate(cfg.value_embeds) if t != "-"}  # layer -> its table
    x = x0 = rms(p["embed.weight"][inp])
    stack = []
    for i, kind in enumerate(cfg.attn_pattern):
        if i >= L // 2:  # U-net: layer L/2 + j adds skip_j times the output of layer L/2 - 1 - j
            x = x + skip[i - L // 2] * stack.pop()
        x = resid[i] * x + p["x0_lambdas"][i] * x0
        if kind != "-":
            h = rms(x)
            w = p[f"blocks.{i}.attn.qkvo_w"]
            q, k, v = ((h @ w[j].T).view(-1, cfg.num_heads, cfg.head_dim) for j in range(3))
            q, k = rope(rms(q)), rope(rms(k))
            ve = p[f"value_embeds.{ve_layers[i]}.weight"][inp].view_as(v) if i in ve_layers else 0
            v = lam[2 * i] * v + (lam[2 * i + 1] * ve if i in ve_layers else 0)
            scores = torch.einsum("qhd,khd->hqk", q, k) * cfg.attn_scale
            allowed = masks[WINDOWS[0] if kind == "L" else WINDOWS[1]]
            att = torch.softmax(scores.masked_fill(~allowed, -math.inf), -1)
            y = torch.einsum("hqk,khd->qhd", att, v)
            gate = torch.sigmoid(h[:, : cfg.gate_channels] @ p[f"blocks.{i}.attn.gate_w"].T)  # one per head
            w_o = w[3].T  # the spec's W_o (the model keeps it transposed)
            x = x + (y * gate[..., None]).flatten(1) @ w_o.T
        h = rms(x)
        x = x + torch.relu(h @ p[f"blocks.{i}.mlp.c_fc"]) ** 2 @ p[f"blocks.{i}.mlp.c_proj"].T
        if i < L // 2:
            stack.append(x)
    z = rms(x) @ p["lm_head.weight"].T
    z = cfg.logit_cap * torch.sigmoid(z / cfg.logit_temp)
    return torch.nn.functional.cross_entropy(z, tgt, reduction="sum")


def quintic(g: torch.Tensor) -> torch.Tensor:
    """Newton-Schulz, 5 steps of X <- aX + (bA + cA^2)X, A = XX^T, on the Frobenius-normalized (wide) matrix."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.T if g.size(0) > g.size(1) else g
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        m = x @ x.T
        x = a * x + (b * m + c * m @ m) @ x
    return x.T if g.size(0) > g.size(1) else x


def model_and_tokens() -> tuple[T.GPT, torch.Tensor]:
    torch.manual_seed(0)
    model = T.GPT(CFG, use_flex=False, fp8_head=False)
    with torch.no_grad():  # every parameter away from its init, so every term counts
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model, mask_tokens(4, length=CFG.train_seq_len + 1)


def test_forward_and_its_gradients_equal_the_spec():
    model, tokens = model_and_tokens()
    loss = model(tokens[:-1], tokens[1:].long(), torch.tensor(WINDOWS))
    loss.backward()
    params = {n: p.detach().double().requires_grad_() for n, p in model.named_parameters()}
    spec = spec_loss(params, tokens)
    spec.backward()
    assert abs(loss.item() - spec.item()) < 1e-4 * spec.item()  # bf16 activations against float64
    # The loss alone barely moves with small random weights; every gradient does (a swapped pair of lambdas,
    # a reversed skip order or another window changes some by 10-90%; bf16 rounding stays under 3%).
    for name, p in model.named_parameters():
        ref = params[name].grad
        assert (p.grad.double() - ref).norm() < 0.05 * ref.norm(), name


def test_two_optimizer_steps_equal_the_spec():
    # Two steps, so the momentum and the moments matter (orthogonalization ignores a gradient's scale).
    model, tokens = model_and_tokens()
    optimizer = T.ShardedMuonAdam(model, CFG, 0, 1, compile_ns=False)  # parameters move into its buckets
    state: dict[str, dict[str, torch.Tensor]] = {}
    for step, seed in enumerate((4, 5)):
        s = T.schedule(step, CFG)
        optimizer.lr_mult, optimizer.momentum = s.lr_mult, s.muon_momentum
        tokens = mask_tokens(seed, length=CFG.train_seq_len + 1)
        before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        (model(tokens[:-1], tokens[1:].long(), torch.tensor(WINDOWS)) * T.train_loss_scale(CFG)).backward()
        grads = {n: p.grad.double().clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        for name, p in model.named_parameters():
            g, mu, st = grads[name], s.muon_momentum, state.setdefault(name, {})
            if name.startswith("blocks."):  # Muon: Nesterov momentum, then each matrix orthogonalized
                st["buf"] = mu * st.get("buf", torch.zeros_like(g)) + (1 - mu) * g
                u = (1 - mu) * g + mu * st["buf"]
                rows, cols = u.shape[-2:]
                ortho = torch.stack([quintic(m) for m in u.view(-1, rows, cols)])
                spec = -CFG.muon_lr * s.lr_mult * math.sqrt(max(1, rows / cols)) * ortho
                # bf16 Newton-Schulz against the float64 iteration: ~2% on these matrices, up to ~10% on the
                # 2x8 gates (their result moves that much when only the input's rounding changes).
                tol = 0.05 if min(rows, cols) >= 32 else 0.15
            else:  # Adam with bias correction; eps on the raw sqrt(v)
                lr = {"lm_head.weight": CFG.head_lr, "scalars": CFG.scalar_lr, "x0_lambdas": CFG.scalar_lr}.get(
                    name, CFG.embed_lr) * s.lr_mult
                b1, b2, t = CFG.adam_beta1, CFG.adam_beta2, step + 1
                st["m"] = b1 * st.get("m", torch.zeros_like(g)) + (1 - b1) * g
                st["v"] = b2 * st.get("v", torch.zeros_like(g)) + (1 - b2) * g * g
                spec = -lr * (math.sqrt(1 - b2**t) / (1 - b1**t)) * st["m"] / (st["v"].sqrt() + CFG.adam_eps)
                tol = 0.02 if p.dtype == torch.bfloat16 else 1e-4  # bf16 embeddings round their new values
            taken = (p.detach().double() - before[name]).view_as(spec)
            assert (taken - spec).norm() < tol * spec.norm(), (step, name)
