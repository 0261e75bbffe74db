"""`make demo`: the main job on the bundled tiny reasoning model, on CPU in well under 2 minutes.

    python -m rejax.demo [--short] [--problem TEXT] [--seed S]

Streams one answer of the bundled tiny Qwen3-format reasoner with NVFP4 W4A4 weights and
activations and the ReSET sampler (`rejax generate --quant nvfp4 --sampler reset`), with a line
per reasoning step (entropy and the share of tokens at T_low / T_high), then one BF16 line at
T = 0.6 for contrast. `--short` (CI) generates fewer tokens.

If the bundled model is missing (a checkout without rejax/data/tiny), it runs a generation-free
demo instead: NVFP4 round trip and matmul error on a random weight, and the ReSET temperature
decisions on synthetic logits.
"""

from __future__ import annotations

import argparse
import io
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from rejax import cli, nvfp4, sampling
from rejax import eval as ev
from rejax.cli import format_nats
from rejax.data import tasks
from rejax.eval.grading import extract_answer, grade
from rejax.text import has_chat_template

# T_high for the bundled model is the paper's; tau0 and T_low come from the model directory's
# reset.json (see `rejax.cli.read_reset_settings`), the values `rejax generate` uses by default.
TINY_T_HIGH = 1.0


def _banner(text: str) -> None:
    print(f"\n== {text} ==", flush=True)


def run_model_demo(*, short: bool, problem: str | None, seed: int) -> None:
    t0 = time.perf_counter()
    if problem is None:
        example = tasks.split("test", 1, seed=seed)[0]
        problem, answer = example["problem"], example["answer"]
    else:
        answer = None
    max_new = 48 if short else 256
    saved = cli.read_reset_settings(cli.bundled_model_dir()) or {}
    reset = ev.parse_sampler(
        "reset",
        t_low=saved.get("t_low", ev.DEFAULT_T_LOW),
        tau0=saved.get("tau_0", ev.DEFAULT_TAU0),
        t_high=saved.get("t_high", TINY_T_HIGH),
    )
    temp = ev.parse_sampler("temp:0.6")

    _banner(f"rejax demo: the bundled tiny reasoner (Hugging Face Qwen3 format), on {_backend()}")
    print(f"problem: {problem}" + (f"   (reference answer {answer})" if answer else ""))
    params = cli.load_model(cli.TINY, "nvfp4")
    cfg = params.cfg
    print(
        f"model: {cfg.num_layers} layers, D={cfg.hidden_size}, V={cfg.vocab_size}; "
        f"every decoder linear NVFP4 W4A4 (dynamic per-row activation scales)"
    )
    _banner(f"NVFP4 W4A4 + {cli.sampler_label(reset)}")
    chat = has_chat_template(params)
    res = cli.stream_response(
        params,
        problem,
        sampler=reset,
        max_new_tokens=max_new,
        seed=seed,
        chat=chat,
        out=sys.stdout,
        err=sys.stdout,
    )
    _result_line("nvfp4 + ReSET", res, answer, grade)

    _banner("contrast: BF16 weights, temperature 0.6")
    bf16 = cli.load_model(cli.TINY, "bf16")
    quiet = io.StringIO()
    ref = cli.stream_response(
        bf16,
        problem,
        sampler=temp,
        max_new_tokens=max_new,
        seed=seed,
        chat=chat,
        stats=False,
        out=quiet,
        err=quiet,
    )
    last = [s for s in ref["text"].strip().splitlines() if s.strip()]
    print(f"bf16 final line: {last[-1] if last else '(empty)'}")
    _result_line("bf16 T=0.6", ref, answer, grade)
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s (including JIT compilation)")


def _result_line(name, res, answer, grade) -> None:
    got = extract_answer(res["text"])
    verdict = ""
    if res["finish_reason"] == "length" and "\\boxed" not in res["text"]:
        got, verdict = "none yet", f" (stopped at the {len(res['tokens'])}-token limit)"
    elif answer is not None:
        verdict = " (correct)" if grade(res["text"], answer) else f" (reference {answer})"
    t = np.asarray(res["temperature"])
    temps = ", ".join(f"T={v:g}: {np.mean(t == v):.0%}" for v in np.unique(t))
    print(
        f"{name}: answer {got}{verdict}; {len(res['tokens'])} tokens "
        f"({res['finish_reason']}), mean entropy {format_nats(np.mean(res['entropy']))} nats; "
        f"{temps}"
    )


def _backend() -> str:
    return f"{jax.default_backend()} ({jax.device_count()} device)"


# ----------------------------------------------------------------------------------------------
# Fallback without the bundled model


def run_fallback_demo(*, seed: int) -> None:
    """NVFP4 quantization error on a random weight and ReSET on synthetic logits."""
    t0 = time.perf_counter()
    _banner("rejax demo (generation-free: the bundled tiny model is not in this checkout)")
    rng = np.random.default_rng(seed)
    n, k, m = 256, 1024, 4
    w = jnp.asarray(rng.standard_normal((n, k)) * 0.02, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    q = nvfp4.quantize_weight(w)
    wf = np.asarray(w, np.float32)
    err = np.asarray(nvfp4.dequantize(q)) - wf
    print(
        f"NVFP4 weight [{n}, {k}]: {q.nbytes} bytes vs {wf.size * 2} in bf16 "
        f"({wf.size * 2 / q.nbytes:.2f}x smaller); relative round-trip error "
        f"{np.linalg.norm(err) / np.linalg.norm(wf):.4f}, max |error| {np.abs(err).max():.2e}"
    )
    ref = np.asarray(x, np.float32) @ wf.T
    for act in ("w4a16", "w4a4"):
        matmul = jax.jit(nvfp4.nvfp4_matmul, static_argnames="act")  # one compile, not per op
        y = np.asarray(matmul(x, q, act=act), np.float32)
        print(
            f"  x[{m}, {k}] @ W.T with {act.upper()}: relative error vs bf16 "
            f"{np.linalg.norm(y - ref) / np.linalg.norm(ref):.4f}"
        )

    # Synthetic response: vocabulary of 8 ids, id 1 = "\n", id 2 = "\n\n". A confident step
    # (peaked logits), a boundary, then an uncertain step (flat logits) with a few sharp tokens.
    v = 8
    nl = jnp.zeros((v,), bool).at[1].set(True)
    dnl = jnp.zeros((v,), bool).at[2].set(True)
    cfg = sampling.ReSET(t_high=1.0, t_low=0.3, tau_0=0.6, window=4, nl_mask=nl, dnl_mask=dnl)
    spread = [6.0] * 6 + [None] + [0.3, 0.5, 0.2, 6.0, 0.4, 0.3, 0.5]
    state = sampling.sampler_init(cfg, 1)
    step = jax.jit(sampling.sample)
    key = jax.random.key(seed)
    print("\nReSET on synthetic logits (tau0 = 0.6 nats, w = 4, T_low 0.3, T_high 1.0):")
    print("  pos  entropy  temperature  token")
    for pos, s in enumerate(spread):
        if s is None:  # force the step boundary token
            logits = jnp.full((1, v), -30.0).at[0, 2].set(30.0)
        else:
            logits = jnp.asarray(rng.standard_normal((1, v)) * 0.1, jnp.float32)
            logits = logits.at[0, 3 + pos % 5].add(s).at[0, 1:3].set(-30.0)
        tok, state, info = step(jax.random.fold_in(key, pos), logits, state, cfg)
        name = "\\n\\n (step boundary)" if int(tok[0]) == 2 else str(int(tok[0]))
        print(
            f"  {pos:3d}  {float(info['entropy'][0]):7.3f}  {float(info['temperature'][0]):11.2f}"
            f"  {name}"
        )
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s")


def main(argv: list[str] | None = None) -> int:
    """Runs the demo; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m rejax.demo", description=__doc__.splitlines()[0])
    p.add_argument("--short", action="store_true", help="fewer tokens (CI)")
    p.add_argument("--problem", default=None, help="a problem text (default: one test problem)")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed (default: 0)")
    args = p.parse_args(argv)
    if (cli.bundled_model_dir() / "config.json").is_file():
        run_model_demo(short=args.short, problem=args.problem, seed=args.seed)
    else:
        run_fallback_demo(seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
