"""Linear-layer shapes (N out, K in) of the models the paper evaluates (the paper's models).

qkv is the fused q/k/v projection, N = (q heads + 2 kv heads) * 128; gate/up is one of the two
(unfused) projections; down maps the FFN back to the hidden size. GEMM letters: N, K.
"""

from __future__ import annotations

HEAD_DIM = 128

# model -> (hidden, intermediate, q heads, kv heads)
MODELS = {
    "Qwen3-8B": (4096, 12288, 32, 8),
    "Qwen3-14B": (5120, 17408, 40, 8),
    "Qwen3-32B": (5120, 25600, 64, 8),
    "R1-Distill-Qwen-7B": (3584, 18944, 28, 4),
    "R1-Distill-Qwen-14B": (5120, 13824, 40, 8),
}


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """{layer: (N, K)} for qkv, o, gate/up and down of `model`."""
    d, f, nq, nkv = MODELS[model]
    return {
        "qkv": ((nq + 2 * nkv) * HEAD_DIM, d),
        "o": (d, nq * HEAD_DIM),
        "gate_up": (f, d),
        "down": (d, f),
    }


def all_shapes() -> list[tuple[str, str, int, int]]:
    """[(model, layer, N, K)] for every model and layer (duplicates across models kept)."""
    return [(m, layer, n, k) for m in MODELS for layer, (n, k) in layer_shapes(m).items()]


def unique_shapes() -> list[tuple[int, int]]:
    seen = []
    for _, _, n, k in all_shapes():
        if (n, k) not in seen:
            seen.append((n, k))
    return seen
