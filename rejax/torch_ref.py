"""Torch path: the rejax decoder forward and the ReSET policy re-stated in PyTorch.

Used to compare frameworks on the same weights: `forward(params, tokens)` runs a small eager
PyTorch Qwen2/Qwen3 forward over a `Params` pytree (weights moved with DLPack, or through numpy
for dtypes DLPack does not carry), including NVFP4 linears: W4A16 multiplies by the dequantized
weight; W4A4 also fake-quantizes the activations with the recipe of the paper (static
`input_scale` when the linear has one, else the per-row dynamic global scale). `TorchReSET`
re-states the ReSET temperature policy of the official implementation's reference semantics over a batch of rows, so its decisions
can be compared with `rejax.sampling` on the same logits.

Numerics follow rejax's float path (HF conventions): RMSNorm normalizes in float32 and casts
back before the scale; RoPE cos/sin in float32 cast to the activation dtype; attention scores
and softmax in float32; the head runs in the activation dtype, logits are returned as float32.
NVFP4 linears take bf16 activations and give bf16 outputs, as `rejax.layers.linear` does; the
products are summed by a float32 matmul of dequantized values, so they can differ from the
block-ordered reference by float32 rounding (and then by one bf16 ulp).

torch is imported lazily: importing this module does not import torch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rejax import params as rparams
from rejax.nvfp4 import BLOCK, Nvfp4Tensor

E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
_E4M3_MAX = 448.0
_E2M1_MAX = 6.0


def _torch():
    import torch

    return torch


# ----------------------------------------------------------------------------- moving weights


def to_torch(a: Any):
    """A jax / numpy array as a CPU torch tensor with the same dtype and bytes.

    DLPack carries standard dtypes without a copy; bfloat16 and float8_e4m3fn go through a
    same-width integer view of the numpy bytes.
    """
    torch = _torch()
    arr = np.asarray(a)
    name = arr.dtype.name
    if name == "bfloat16":
        return torch.from_numpy(arr.view(np.uint16).copy()).view(torch.bfloat16)
    if name == "float8_e4m3fn":
        return torch.from_numpy(arr.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    try:
        return torch.from_dlpack(a)
    except (TypeError, RuntimeError, BufferError, AttributeError):
        return torch.from_numpy(np.array(arr))


def torch_weights(params) -> dict:
    """The weights pytree of `params` with every array as a torch tensor.

    An Nvfp4Tensor becomes {"packed", "scales", "global_scale", "shape"}.
    """

    def convert(node):
        if isinstance(node, dict):
            return {k: convert(v) for k, v in node.items()}
        if isinstance(node, (tuple, list)):  # float linears: one array per layer
            return tuple(convert(v) for v in node)
        if isinstance(node, Nvfp4Tensor):
            return {
                "packed": to_torch(node.packed),
                "scales": to_torch(node.scales),
                "global_scale": to_torch(node.global_scale),
                "shape": tuple(node.shape),
            }
        return to_torch(node)

    return convert(params.weights)


# ----------------------------------------------------------------------------- NVFP4 in torch


def dequantize_weight(w: dict):
    """NVFP4 weight {"packed" u8 [N, K/2], "scales" e4m3 [N, K/16], "global_scale"} -> f32 [N, K].

    Element 2j is the low nibble of byte j, 2j+1 the high nibble.
    """
    torch = _torch()
    packed = w["packed"]
    n, k = w["shape"]
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(n, k).long()
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)[codes]
    scale = w["scales"].float() * w["global_scale"].float().reshape(-1, 1)  # [N, K/16]
    return (values.reshape(n, k // BLOCK, BLOCK) * scale[..., None]).reshape(n, k)


def _e2m1_round(v):
    """float32 values within [-6, 6] -> nearest E2M1 value (RNE, ties to the even code)."""
    torch = _torch()
    a = v.abs()
    code = sum((a > t).to(torch.int64) for t in (0.25, 1.25, 2.5, 5.0))
    code = code + sum((a >= t).to(torch.int64) for t in (0.75, 1.75, 3.5))
    mag = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32)[code]
    return torch.where(torch.signbit(v), -mag, mag)


def fake_quantize_activation(x, input_scale=None):
    """NVFP4 quantize-dequantize of activations (the NVFP4 W4A4 recipe of the paper), float32 out.

    Per row and 16-block: SF = E4M3_satfinite(amax_blk / 6 / g); x_q = e2m1(x * (1/g) / SF)
    * SF * g, with g = input_scale (static) or amax(|x_row|) / (6 * 448) (dynamic; 1 for a
    zero row); a block with SF = 0 quantizes to 0.

    Args:
        x: torch [M, K] (any float dtype), K % 16 == 0.
        input_scale: None or a positive float / 0-d tensor.

    Returns:
        torch float32 [M, K].
    """
    torch = _torch()
    m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"x.shape={tuple(x.shape)}: K must be a multiple of {BLOCK}")
    xf = x.float().reshape(m, k // BLOCK, BLOCK)
    if input_scale is None:
        g = xf.abs().amax(dim=(1, 2)) / (_E2M1_MAX * _E4M3_MAX)
        g = torch.where(g > 0, g, torch.ones_like(g))[:, None]  # [M, 1]
    else:
        g = torch.as_tensor(input_scale, dtype=torch.float32).reshape(())
    sf = (xf.abs().amax(dim=-1) / _E2M1_MAX) / g
    sf = sf.clamp(0.0, _E4M3_MAX).to(torch.float8_e4m3fn).float()  # [M, K/16]
    safe = torch.where(sf > 0, sf, torch.ones_like(sf))
    out_scale = torch.where(sf > 0, (1.0 / g) / safe, torch.zeros_like(sf))
    q = _e2m1_round((xf * out_scale[..., None]).clamp(-_E2M1_MAX, _E2M1_MAX))
    return (q * (sf * g)[..., None]).reshape(m, k)


# ----------------------------------------------------------------------------- forward


def _linear(x, p: dict, quant: str | None):
    torch = _torch()
    w = p["weight"]
    if isinstance(w, dict):  # NVFP4
        lead = x.shape[:-1]
        xb = x.to(torch.bfloat16).reshape(-1, x.shape[-1])
        if quant == "nvfp4":
            xa = fake_quantize_activation(xb, p.get("input_scale"))
        else:
            xa = xb.float()
        y = (xa @ dequantize_weight(w).T).to(torch.bfloat16).reshape(*lead, -1).to(x.dtype)
    else:
        y = x @ w.to(x.dtype).T
    if "bias" in p:
        y = y + p["bias"].to(x.dtype)
    return y


def _shard_linear(x, p: dict, scales, sizes, quant):
    """A fused NVFP4 linear whose shards carry their own static input scales."""
    torch = _torch()
    w = p["weight"]
    outs, start = [], 0
    for j, rows in enumerate(sizes):
        g = w["global_scale"]
        part = {
            "packed": w["packed"][start : start + rows],
            "scales": w["scales"][start : start + rows],
            "global_scale": g[start : start + rows] if g.ndim else g,
            "shape": (rows, w["shape"][1]),
        }
        outs.append(_linear(x, {"weight": part, "input_scale": scales[j]}, quant))
        start += rows
    y = torch.cat(outs, dim=-1)
    return y + p["bias"].to(x.dtype) if "bias" in p else y


def _rms_norm(x, scale, eps: float):
    torch = _torch()
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (scale * xf.to(x.dtype)).to(x.dtype)


def _rope(x, positions, theta: float):
    torch = _torch()
    h = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, h, 2, dtype=torch.float32) / h))
    freqs = positions.float()[..., None] * inv_freq  # [B, T, H/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]  # [B, T, 1, H]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : h // 2], x[..., h // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _attention(q, k, v):
    """Causal GQA: q [B, T, N, H], k/v [B, T, K, H] -> [B, T, N, H]."""
    torch = _torch()
    _b, t, n, h = q.shape
    g = n // k.shape[2]
    k = k.repeat_interleave(g, dim=2)
    v = v.repeat_interleave(g, dim=2)
    scores = torch.einsum("bqnh,bknh->bnqk", q.float(), k.float()) * (h**-0.5)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    probs = scores.softmax(-1).to(v.dtype)
    return torch.einsum("bnqk,bknh->bqnh", probs, v).to(q.dtype)


def forward(params, tokens, weights: dict | None = None):
    """Full-sequence logits of `params` computed in PyTorch (no cache, no padding).

    Args:
        params: rejax `Params` (float or NVFP4 linears, cfg.quant selects W4A4 / W4A16).
        tokens: [B, T] int token ids (numpy, jax or torch).
        weights: optional `torch_weights(params)` to reuse across calls.

    Returns:
        torch float32 [B, T, V].
    """
    torch = _torch()
    cfg = params.cfg
    w = torch_weights(params) if weights is None else weights
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
    b, t = tokens.shape
    embedding = w["embed_tokens"]["embedding"]
    x = embedding[tokens]  # [B, T, D]
    positions = torch.arange(t)[None, :].expand(b, t)
    n, kv, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    f = cfg.intermediate_size
    lw = w["layers"]

    def at(tree, i):
        """Layer i of a stacked tensor, a per-layer tuple, or a stacked NVFP4 dict."""
        if isinstance(tree, (tuple, list)):
            return tree[i]
        if isinstance(tree, dict) and "packed" in tree:
            fields = {k: tree[k][i] for k in ("packed", "scales", "global_scale")}
            return {**fields, "shape": tree["shape"]}
        return tree[i]

    def lin(x_in, p, i, name):
        q = {"weight": at(p["weight"], i)}
        if "bias" in p:
            q["bias"] = p["bias"][i]
        if "input_scale" in p:
            s_in = p["input_scale"][i]
            if s_in.ndim:  # per-shard input scales: one fake quantization per shard
                return _shard_linear(x_in, q, s_in, rparams.shards(cfg, name), cfg.quant)
            q["input_scale"] = s_in
        return _linear(x_in, q, cfg.quant)

    with torch.no_grad():
        for i in range(cfg.num_layers):
            att, mlp = lw["self_attn"], lw["mlp"]
            hs = _rms_norm(x, lw["input_layernorm"]["scale"][i], cfg.rms_norm_eps)
            qkv = lin(hs, att["qkv_proj"], i, "qkv_proj")
            q = qkv[..., : n * h].reshape(b, t, n, h)
            k = qkv[..., n * h : (n + kv) * h].reshape(b, t, kv, h)
            v = qkv[..., (n + kv) * h :].reshape(b, t, kv, h)
            if cfg.arch == "qwen3":
                q = _rms_norm(q, att["q_norm"]["scale"][i], cfg.rms_norm_eps)
                k = _rms_norm(k, att["k_norm"]["scale"][i], cfg.rms_norm_eps)
            q = _rope(q, positions, cfg.rope_theta)
            k = _rope(k, positions, cfg.rope_theta)
            o = _attention(q, k, v).reshape(b, t, n * h)
            x = x + lin(o, att["o_proj"], i, "o_proj")
            hs = _rms_norm(x, lw["post_attention_layernorm"]["scale"][i], cfg.rms_norm_eps)
            gate_up = lin(hs, mlp["gate_up_proj"], i, "gate_up_proj")
            act = torch.nn.functional.silu(gate_up[..., :f]) * gate_up[..., f:]
            x = x + lin(act, mlp["down_proj"], i, "down_proj")
        x = _rms_norm(x, w["norm"]["scale"], cfg.rms_norm_eps)
        head = embedding if cfg.tie_word_embeddings else w["lm_head"]["weight"]
        if isinstance(head, dict):  # an NVFP4 head (rejax.params.quantize_head), W4A16
            head = dequantize_weight(head)
        return (x @ head.to(x.dtype).T).float()


# ----------------------------------------------------------------------------- ReSET in torch


def _f32(logits):
    torch = _torch()
    if isinstance(logits, torch.Tensor):
        return logits.float()
    return torch.from_numpy(np.asarray(logits, dtype=np.float32))


def entropy(logits):
    """Entropy in nats of softmax(logits) over the full vocabulary, float32 [B]."""
    torch = _torch()
    z = _f32(logits)
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    return -(torch.where(p > 0, p * logp, torch.zeros_like(p))).sum(-1)


class TorchReSET:
    """The ReSET temperature policy (the official implementation's reference semantics) for B rows, in PyTorch, float32 state.

    Call `temperature(logits)` before sampling each position and `observe(tokens)` after;
    `sample(logits, generator)` does both with vLLM top-p. Reference semantics by default;
    `include_current=True` gives the figure semantics (as in `rejax.sampling.ReSET`).
    """

    def __init__(
        self,
        batch_size: int,
        *,
        nl_mask,
        dnl_mask,
        t_high=1.0,
        t_low=0.3,
        tau_0=0.6349,
        window=32,
        top_p=0.95,
        include_current=False,
    ):
        torch = _torch()
        if window < 1 or batch_size < 1:
            raise ValueError(f"window={window} and batch_size={batch_size} must be >= 1")
        self.nl = torch.as_tensor(np.array(nl_mask), dtype=torch.bool)
        self.dnl = torch.as_tensor(np.array(dnl_mask), dtype=torch.bool)
        self.t_high, self.t_low, self.tau_0 = float(t_high), float(t_low), float(tau_0)
        self.top_p, self.w, self.include_current = float(top_p), int(window), include_current
        b = batch_size
        self.ring = [[] for _ in range(b)]  # last <= w entropies (float32 tensors), oldest first
        self.s_sum = torch.zeros(b)
        self.s_n = torch.zeros(b, dtype=torch.long)
        self.g_sum = torch.zeros(b)
        self.g_n = torch.zeros(b, dtype=torch.long)
        self.y1 = [-1] * b
        self.y2 = [-1] * b

    @classmethod
    def from_rejax(cls, cfg, batch_size: int) -> TorchReSET:
        """Builds the policy from a `rejax.sampling.ReSET` (masks must be set)."""
        return cls(
            batch_size,
            nl_mask=cfg.nl_mask,
            dnl_mask=cfg.dnl_mask,
            t_high=cfg.t_high,
            t_low=cfg.t_low,
            tau_0=cfg.tau_0,
            window=cfg.window,
            top_p=cfg.top_p,
            include_current=cfg.include_current,
        )

    def temperature(self, logits):
        """(temperature f32 [B], entropy f32 [B]) for raw logits [B, V]; records the entropy."""
        torch = _torch()
        hs = entropy(logits)
        temps = torch.empty_like(hs)
        for r, h in enumerate(hs):
            ring = self.ring[r]
            if self.include_current:
                ring_now = (ring + [h])[-self.w :]
                s_sum, s_n = self.s_sum[r] + h, int(self.s_n[r]) + 1
                step = s_sum / s_n if s_n > self.w else torch.stack(ring_now).sum() / len(ring_now)
                bar = (self.g_sum[r] + h) / (int(self.g_n[r]) + 1)
            else:
                if int(self.s_n[r]) >= self.w:
                    step = self.s_sum[r] / int(self.s_n[r])
                elif ring:
                    step = torch.stack(ring).sum() / len(ring)
                else:
                    step = h
                bar = self.g_sum[r] / int(self.g_n[r]) if int(self.g_n[r]) > 0 else step
            tau = step if step > bar else torch.tensor(self.tau_0)
            temps[r] = self.t_high if h >= tau else self.t_low
            self.ring[r] = (ring + [h])[-self.w :]
            self.s_sum[r] += h
            self.s_n[r] += 1
            self.g_sum[r] += h
            self.g_n[r] += 1
        return temps, hs

    def observe(self, tokens) -> None:
        """Records the generated ids [B]; a double newline or two newlines start a new step."""

        def member(mask, i):
            return 0 <= i < mask.shape[0] and bool(mask[i])

        for r, tok in enumerate(np.asarray(tokens).tolist()):
            prev = self.y1[r]
            if member(self.dnl, tok) or (member(self.nl, tok) and member(self.nl, prev)):
                self.s_sum[r] = 0.0
                self.s_n[r] = 0
            self.y2[r], self.y1[r] = prev, tok

    def sample(self, logits, generator=None):
        """Samples one token per row: policy temperature, then top-p (vLLM), then multinomial."""
        torch = _torch()
        z = _f32(logits)
        temps, _ = self.temperature(z)
        out = []
        for r in range(z.shape[0]):
            if temps[r] <= 1e-6:
                out.append(int(z[r].argmax()))
                continue
            probs = (z[r] / temps[r]).softmax(-1)
            keep = top_p_keep(probs, self.top_p)
            probs = torch.where(keep, probs, torch.zeros_like(probs))
            out.append(int(torch.multinomial(probs / probs.sum(), 1, generator=generator)))
        tokens = torch.tensor(out)
        self.observe(tokens)
        return tokens


def top_p_keep(probs, top_p: float):
    """vLLM top-p: sort ascending, drop tokens whose ascending cumulative sum <= 1 - p, keep top."""
    torch = _torch()
    if not 0.0 < top_p <= 1.0 or math.isnan(top_p):
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    sorted_p, idx = probs.sort(dim=-1)
    drop = sorted_p.cumsum(-1) <= 1.0 - top_p
    drop[..., -1] = False
    keep = torch.empty_like(drop)
    keep.scatter_(-1, idx, ~drop)
    return keep
