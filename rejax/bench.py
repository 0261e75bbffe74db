"""Decode benchmark behind `rejax bench`: ms/token, tokens/s and achieved bandwidth.

For a loaded checkpoint or a preset config with random weights, and for each batch size and
output length, it times the public jitted `rejax.generate.prefill` and
`rejax.generate.decode_loop` (greedy, no early stop, so every run makes exactly the requested
steps): the first call (compile + one run) separately, then the median of repeated calls with
warm-up excluded. Bandwidth = (weight bytes + KV-cache bytes) per step / step time, next to a
copy ceiling measured in the same run (a jitted elementwise pass over a large buffer: read +
write). Nothing here walks the weights pytree by name; the weight bytes are the bytes of all its
leaves, less the embedding table (a step reads only B of its rows).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import os
import platform
import statistics
import subprocess
import time
from importlib import metadata
from pathlib import Path

import flax
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from rejax import __version__, sampling, sharding
from rejax.config import Config
from rejax.nvfp4 import BLOCK
from rejax.params import Params, random_params

# Command-line quant names -> Config.quant.
QUANTS = {"bf16": None, "nvfp4": "nvfp4", "nvfp4-w4a16": "nvfp4-w4a16"}


def _gen():
    # The module: the package attribute `rejax.generate` is the function.
    return importlib.import_module("rejax.generate")


def _random_params(cfg: Config, quant: str, seed: int) -> Params:
    """Random weights for a config in one quant mode: the one place bench builds weights.

    `rejax.params.random_params` builds them on the device (NVFP4 as random codes and block
    scales, never through the host quantizer), so full-size presets build in seconds.
    """
    if quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r}; expected one of {sorted(QUANTS)}")
    return random_params(dataclasses.replace(cfg, quant=QUANTS[quant]), seed)


def estimate_weight_bytes(cfg: Config, quant: str) -> int:
    """Approximate bytes of a config's weights in a quant mode, from its shapes alone.

    bf16 embeddings / lm_head / norms, and per decoder linear 2 bytes per weight (bf16) or
    0.5 + 1/16 (NVFP4 codes and E4M3 block scales).
    """
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    linear = cfg.num_layers * d * (2 * q + 2 * kv + 3 * f)
    per_weight = 2.0 if QUANTS[quant] is None else 0.5 + 1 / BLOCK
    tables = cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2)
    return int(linear * per_weight + 2 * tables + 2 * cfg.num_layers * 4 * d)


def device_memory_bytes() -> int | None:
    """Memory of the default device (its allocator limit; host RAM on CPU), None if unknown."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _nbytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)))


def weight_bytes(params: Params) -> int:
    """Bytes of weights one decode step reads: every leaf, less an untied embedding table."""
    cfg = params.cfg
    total = _nbytes(params.weights)
    if not cfg.tie_word_embeddings:
        # The embedding lookup reads B rows, not the [V, D] table (bf16, as loaded or built).
        total -= cfg.vocab_size * cfg.hidden_size * jnp.dtype(jnp.bfloat16).itemsize
    return total


def _time(fn, repeats: int) -> tuple[float, float, list[float]]:
    """(first call s, median s of `repeats` further calls, their times); fn() blocks."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        times.append(fn())
    return first, statistics.median(times), times


def copy_ceiling(nbytes: int, repeats: int = 5, passes: int = 8) -> float:
    """Device bandwidth (bytes/s) of jitted elementwise passes over `nbytes` (read + write).

    One call runs `passes` passes in a device loop (each reads and writes the buffer), so the
    host's dispatch and the first pass's start-up weigh 1 / passes: timed one pass a call, the
    H200 gave 2.9-3.6 TB/s in different runs where kernels streaming the same bytes measured
    4.1-4.25 TB/s."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    x = jnp.zeros((max(nbytes // 4, 1),), jnp.uint32)
    f = jax.jit(lambda a: jax.lax.fori_loop(0, passes, lambda i, y: y + jnp.uint32(1), a))

    def run():
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        return time.perf_counter() - t0

    _, t, _ = _time(run, repeats)
    return 2 * x.size * 4 * passes / t


def bench_decode(
    params: Params,
    *,
    batch: int,
    new_tokens: int,
    prompt_len: int,
    repeats: int = 3,
    seed: int = 0,
    sampler: sampling.Sampler | None = None,
    logits_dtype: str | None = None,
) -> dict:
    """Times prefill and the decode loop for one (batch, new_tokens) point.

    Args:
      params: the model (any quant mode).
      batch: B rows.
      new_tokens: M tokens generated per row (greedy, no stop token).
      prompt_len: random prompt length per row.
      repeats: timed calls after the first (median reported).
      seed: prompt token seed.
      sampler: the decode loop's sampler (default Greedy()); a ReSET without newline masks gets
        all-false ones (the whole answer is one step).
      logits_dtype: the logits the loop carries and samples from: None for the head's dtype
        (as `rejax.generate` runs it), "float32" for the head's logits cast.

    Returns:
      dict: batch, new_tokens, prompt_len, prefill_ms, prefill_first_call_s,
      decode_first_call_s, decode_runs_s, steps, ms_per_token, tokens_per_s, weight_bytes,
      kv_bytes, bytes_per_step, bandwidth_GBps.
    """
    cfg = params.cfg
    if min(batch, new_tokens, prompt_len, repeats) <= 0:
        raise ValueError(
            f"batch, new_tokens, prompt_len and repeats must be positive, got {batch=} "
            f"{new_tokens=} {prompt_len=} {repeats=}"
        )
    slots = prompt_len + new_tokens
    if slots > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt_len {prompt_len} + new_tokens {new_tokens} = {slots} exceeds the model's "
            f"context of {cfg.max_position_embeddings}"
        )
    gen = _gen()
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, prompt_len)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
    sampler = sampling.Greedy() if sampler is None else sampler
    if isinstance(sampler, sampling.ReSET) and sampler.nl_mask is None:
        none = jnp.zeros((cfg.vocab_size,), bool)
        sampler = dataclasses.replace(sampler, nl_mask=none, dnl_mask=none)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(
        jax.random.key(seed), jnp.arange(batch, dtype=jnp.uint32)
    )
    never = jnp.zeros((cfg.vocab_size,), bool)  # no stop token: exactly M steps
    done = jnp.zeros((batch,), bool)
    lengths = jnp.full((batch,), prompt_len, jnp.int32)
    filled = {}

    def prefill():
        cache = jax.block_until_ready(sharding.init_cache(params, batch, slots, jnp.bfloat16))
        t0 = time.perf_counter()
        filled["out"] = jax.block_until_ready(
            gen.prefill(params, tokens, positions, cache, logits_dtype=logits_dtype)
        )
        return time.perf_counter() - t0

    prefill_first, prefill_s, _ = _time(prefill, repeats)
    logits, cache = filled["out"]
    kv = _nbytes(cache)
    steps = {}

    def decode():
        c = jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, cache))  # donated below
        t0 = time.perf_counter()
        out = gen.decode_loop(
            params,
            logits,
            c,
            lengths,
            sampler,
            sampling.sampler_init(sampler, batch),
            keys,
            never,
            done,
            max_new_tokens=new_tokens,
        )
        jax.block_until_ready(out.tokens)
        steps["n"] = int(out.step)
        return time.perf_counter() - t0

    decode_first, decode_s, runs = _time(decode, repeats)
    n = steps["n"]
    assert n == new_tokens, (n, new_tokens)  # no stop token: the loop runs every step
    w = weight_bytes(params)
    return {
        "batch": batch,
        "new_tokens": new_tokens,
        "prompt_len": prompt_len,
        "prefill_ms": 1e3 * prefill_s,
        "prefill_first_call_s": prefill_first,
        "decode_first_call_s": decode_first,
        "decode_runs_s": runs,
        "steps": n,
        "ms_per_token": 1e3 * decode_s / n,
        "tokens_per_s": batch * n / decode_s,
        "weight_bytes": w,
        "kv_bytes": kv,
        "bytes_per_step": w + kv,
        "bandwidth_GBps": (w + kv) / (decode_s / n) / 1e9,
    }


def run(
    models: dict[str, Params],
    *,
    batches: list[int],
    new_tokens: list[int],
    prompt_len: int,
    repeats: int = 3,
    copy_mib: int = 256,
    seed: int = 0,
    label: str = "",
    log=None,
) -> dict:
    """Benchmarks every (quant, batch, new_tokens) point and measures the copy ceiling.

    Args:
      models: quant name (bf16 | nvfp4 | nvfp4-w4a16) -> Params.
      batches, new_tokens: the points to time.
      prompt_len: prompt length per row.
      repeats: timed calls per point (median).
      copy_mib: size of the copy-ceiling buffer in MiB.
      seed: prompt seed.
      label: what was benchmarked (a checkpoint path or a preset name), recorded.
      log: optional callable receiving progress lines.

    Returns:
      JSON-able dict: model, config, versions (git sha, python, jax, jaxlib, flax, torch,
      device), copy_ceiling_GBps, runs (bench_decode results with quant and share_of_copy).
    """
    if copy_mib <= 0:
        raise ValueError(f"copy_mib must be positive, got {copy_mib}")
    ceiling = copy_ceiling(copy_mib << 20, repeats=max(repeats, 3)) / 1e9
    rows = []
    for quant, params in models.items():
        for b in batches:
            for m in new_tokens:
                if log is not None:
                    log(f"# {quant} batch {b} new tokens {m}: compiling and timing")
                r = bench_decode(
                    params, batch=b, new_tokens=m, prompt_len=prompt_len, repeats=repeats, seed=seed
                )
                r = {"quant": quant, **r, "share_of_copy": r["bandwidth_GBps"] / ceiling}
                rows.append(r)
    first = next(iter(models.values()))
    cfg = first.cfg
    return {
        "model": label,
        "mesh": None if first.sharding is None else dict(first.sharding.mesh.shape),
        "config": dataclasses.asdict(dataclasses.replace(cfg, quant=None)),
        "prompt_len": prompt_len,
        "repeats": repeats,
        "versions": versions(),
        "copy_ceiling_GBps": ceiling,
        "copy_buffer_MiB": copy_mib,
        "runs": rows,
    }


def format_table(result: dict) -> str:
    """The runs of `run` as a fixed-width table."""
    head = (
        f"{'quant':<12} {'batch':>5} {'new':>5} {'prefill ms':>10} {'ms/token':>9} "
        f"{'tokens/s':>9} {'GB/s':>8} {'% copy':>6} {'first call s':>12}"
    )
    lines = [head, "-" * len(head)]
    for r in result["runs"]:
        lines.append(
            f"{r['quant']:<12} {r['batch']:>5} {r['new_tokens']:>5} {r['prefill_ms']:>10.2f} "
            f"{r['ms_per_token']:>9.3f} {r['tokens_per_s']:>9.1f} {r['bandwidth_GBps']:>8.2f} "
            f"{100 * r['share_of_copy']:>6.1f} "
            f"{r['prefill_first_call_s'] + r['decode_first_call_s']:>12.1f}"
        )
    lines.append(
        f"copy ceiling {result['copy_ceiling_GBps']:.1f} GB/s ({result['copy_buffer_MiB']} MiB, "
        f"same run); device {result['versions']['device']}; first call = compile + one run of "
        "prefill and of the decode loop"
    )
    return "\n".join(lines)


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_digest(roots: list[Path] | None = None) -> str:
    """16 hex digits of sha256 over the code that runs (every .py / .cu / .cuh file under rejax/
    and cuda_ops/, by relative path and content): names the tree even where git's HEAD is stale
    or absent (a copied working tree)."""
    if roots is None:
        here = Path(__file__).resolve().parent
        roots = [here, here.parent / "cuda_ops"]
    h = hashlib.sha256()
    for root in roots:
        files = sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cu", ".cuh"))
        for f in files:
            name = f"{root.name}/{f.relative_to(root).as_posix()}".encode()
            h.update(len(name).to_bytes(4, "little") + name)
            data = f.read_bytes()
            h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:16]


def versions() -> dict:
    """What produced a result file, the one copy every script and command records: rejax, git sha
    and whether the checkout has uncommitted changes (None outside a checkout), the digest of the
    sources that ran (`source_digest`), python, jax, jaxlib, flax, torch (None without it),
    backend and device; and `git_sha_declared`, the commit the caller names in the GIT_SHA
    environment variable (None when unset): a copied working tree (a device machine's) may carry
    an older git HEAD than the sources it holds."""
    out = {
        "rejax": __version__,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
    }
    try:  # the installed version, without importing torch
        out["torch"] = metadata.version("torch")
    except metadata.PackageNotFoundError:  # torch is optional
        out["torch"] = None
    out["git_sha"] = _git("rev-parse", "HEAD") or None
    status = _git("status", "--porcelain")
    out["git_dirty"] = None if status is None else bool(status)
    out["git_sha_declared"] = os.environ.get("GIT_SHA") or None
    out["source_digest"] = source_digest()
    return out
