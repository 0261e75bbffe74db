"""The `rejax` command: generate (streamed, with per-step entropy/temperature), eval, calibrate.

    rejax generate [--model PATH|tiny] [--quant Q] [--sampler S] ... PROMPT
    rejax eval [--task math|mcq|code] --data FILE [--n 8] ... [--out results.jsonl] [--summary FILE]
    rejax calibrate [--data problems.jsonl] [--n-problems 5] [--quant nvfp4] [--out DIR]

Bad input (a missing model or data file, malformed JSONL, a bad sampler spec, n <= 0) exits
with status 2 and one `rejax <command>: error: ...` line that names the value (set
REJAX_TRACEBACK=1 to get the traceback instead).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from rejax import evaluate as ev

TINY = "tiny"
QUANTS = {"bf16": None, "nvfp4": "nvfp4", "nvfp4-w4a16": "nvfp4-w4a16"}


# ----------------------------------------------------------------------------------------------
# Shared helpers


def bundled_model_dir() -> Path:
    """Directory of the tiny reasoning model shipped in the package (may be absent)."""
    return Path(__file__).resolve().parent / "data" / "tiny"


def resolve_model(spec: str) -> Path:
    """`tiny` -> the bundled model; anything else is a checkpoint directory.

    Raises:
      ValueError: the directory or its config.json is missing.
    """
    if spec == TINY:
        path = bundled_model_dir()
        if not (path / "config.json").is_file():
            raise ValueError(
                "the bundled tiny model is missing from this installation (expected "
                "rejax/data/tiny/config.json); pass --model PATH to a Hugging Face checkpoint"
            )
        return path
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model path {spec!r} does not exist (expected a checkpoint directory "
            "with config.json and *.safetensors, or 'tiny')"
        )
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model path {spec!r} has no config.json (expected a Hugging Face checkpoint directory)"
        )
    return path


def load_model(spec: str, quant: str):
    """Loads `--model` with `--quant` (bf16 | nvfp4 | nvfp4-w4a16) through `rejax.load`."""
    import logging

    from rejax.checkpoint import load

    path = resolve_model(spec)
    log = logging.getLogger("rejax.checkpoint")
    # The CLI states the activation-scale mode in its own header line instead.
    quiet = _DropMessage("without calibration data")
    log.addFilter(quiet)
    try:
        return load(path, quant=QUANTS[quant])
    finally:
        log.removeFilter(quiet)


class _DropMessage:
    def __init__(self, text: str):
        self.text = text

    def filter(self, record) -> bool:
        return self.text not in record.getMessage()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _add_model_args(p: argparse.ArgumentParser, *, quant_default: str = "nvfp4") -> None:
    p.add_argument(
        "--model",
        default=TINY,
        metavar="PATH|tiny",
        help="Hugging Face Qwen3/Qwen2 checkpoint directory, or 'tiny' for the "
        "bundled tiny reasoning model (default: tiny)",
    )
    p.add_argument(
        "--quant",
        default=quant_default,
        choices=sorted(QUANTS),
        help=f"linear format: bf16, nvfp4 (W4A4) or nvfp4-w4a16 (default: {quant_default})",
    )


def _add_sampler_args(p: argparse.ArgumentParser, *, sampler_default: str = "reset") -> None:
    p.add_argument(
        "--sampler",
        default=sampler_default,
        metavar="SPEC",
        help=f"greedy | temp:T (e.g. temp:0.6) | reset (default: {sampler_default})",
    )
    p.add_argument(
        "--t-low",
        type=_float,
        default=ev.DEFAULT_T_LOW,
        metavar="X",
        help=f"ReSET T_low (default: {ev.DEFAULT_T_LOW})",
    )
    p.add_argument(
        "--tau0",
        type=_float,
        default=ev.DEFAULT_TAU0,
        metavar="X",
        help=f"ReSET confident-step entropy threshold in nats "
        f"(default: {ev.DEFAULT_TAU0}; see `rejax calibrate`)",
    )
    p.add_argument(
        "--t-high",
        type=_float,
        default=ev.DEFAULT_T_HIGH,
        metavar="X",
        help=f"ReSET T_high (default: {ev.DEFAULT_T_HIGH})",
    )
    p.add_argument(
        "--top-p",
        type=_float,
        default=ev.DEFAULT_TOP_P,
        metavar="P",
        help=f"nucleus mass for temp:T and reset (default: {ev.DEFAULT_TOP_P})",
    )


def _add_prompt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="render prompts as one user message with the checkpoint's chat "
        "template (default: when the checkpoint has one)",
    )
    p.add_argument("--seed", type=int, default=0, metavar="S", help="PRNG seed (default: 0)")


def _sampler(args):
    return ev.parse_sampler(
        args.sampler, t_low=args.t_low, tau0=args.tau0, t_high=args.t_high, top_p=args.top_p
    )


def _chat(args, params) -> bool:
    if args.chat is None:
        return ev.has_chat_template(params)
    return args.chat


def _model_line(args, params) -> str:
    cfg = params.cfg
    n_bytes = sum(getattr(x, "nbytes", 0) for x in _leaves(params.weights))
    quant = {None: "bf16", "nvfp4-w4a16": "NVFP4 W4A16"}.get(cfg.quant, "NVFP4 W4A4")
    if cfg.quant == "nvfp4":
        static = any("input_scale" in p for p in _jax_paths(params.weights))
        quant += " (static activation scales)" if static else " (dynamic per-row activation scales)"
    return (
        f"model {args.model} ({cfg.arch}, {cfg.num_layers} layers, D={cfg.hidden_size}, "
        f"V={cfg.vocab_size}, {n_bytes / 2**20:.2f} MiB of weights), {quant}"
    )


def _leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def _jax_paths(tree) -> list[str]:
    import jax

    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def sampler_label(sampler) -> str:
    """A short human-readable description of a sampler."""
    from rejax import sampling

    if isinstance(sampler, sampling.Greedy):
        return "greedy"
    if isinstance(sampler, sampling.Temperature):
        return f"temperature T={float(sampler.t):g}, top-p {float(sampler.top_p):g}"
    return (
        f"ReSET T_low={float(sampler.t_low):g} tau0={float(sampler.tau_0):g} "
        f"T_high={float(sampler.t_high):g} w={sampler.window} top-p {float(sampler.top_p):g}"
    )


def _err(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# generate


def _stop_ids(params) -> set[int]:
    ids = set(params.cfg.eos_token_ids)
    eos = dict(params.generation_config).get("eos_token_id")
    if eos is not None:
        ids |= set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}
    return ids


class _StepPrinter:
    """Tracks step boundaries while streaming and formats one summary line per step."""

    def __init__(self, nl, dnl, sampler):
        from rejax import sampling

        self.nl, self.dnl = nl, dnl
        self.reset = isinstance(sampler, sampling.ReSET)
        self.t_low = float(sampler.t_low) if self.reset else None
        self.index, self.entropy, self.temperature = 1, [], []
        self.prev = None

    def push(self, token: int, entropy: float, temperature: float) -> str | None:
        """Records one token; returns the finished step's line if this token ends a step."""
        self.entropy.append(entropy)
        self.temperature.append(temperature)
        ends = bool(self.dnl[token]) or (
            bool(self.nl[token]) and self.prev is not None and bool(self.nl[self.prev])
        )
        self.prev = token
        return self.flush() if ends else None

    def flush(self) -> str | None:
        if not self.entropy:
            return None
        import numpy as np

        h = np.asarray(self.entropy)
        t = np.asarray(self.temperature, np.float32)
        line = (
            f"[step {self.index} | {len(h)} tok | entropy mean {h.mean():.2f} "
            f"max {h.max():.2f} nats | "
        )
        if self.reset:
            low = float(np.mean(t == np.float32(self.t_low)))
            line += f"T_low {100 * low:.0f}% T_high {100 * (1 - low):.0f}%]"
        elif np.all(t == 0):
            line += "greedy]"
        else:
            line += f"T {float(t.mean()):g}]"
        self.index += 1
        self.entropy, self.temperature = [], []
        return line


def stream_generate(
    params,
    prompt: str,
    *,
    sampler,
    max_new_tokens: int,
    seed: int = 0,
    chat: bool = False,
    stats: bool = True,
    out=None,
    err=None,
) -> dict:
    """Generates one response token by token, writing text to `out` as it appears and a
    per-step entropy/temperature line to `err` after every reasoning step.

    Uses the same jitted `prefill` / `decode_step` and the same keys as
    `rejax.generate(params, prompt, key=seed)`, so the tokens agree with it.

    Returns:
      dict with `text`, `tokens`, `entropy`, `temperature`, `finish_reason`, `seconds`,
      `first_token_s` (includes compilation).
    """
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from rejax import sampling
    from rejax.cache import init_cache
    from rejax.generate import decode_step, prefill

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    tok = params.tokenizer.tokenizer if params.tokenizer is not None else None
    if tok is None:
        raise ValueError("the checkpoint has no tokenizer.json; `rejax generate` needs one")
    ids = ev.prompt_ids(params, prompt, chat=chat)
    limit = params.cfg.max_position_embeddings
    if len(ids) + max_new_tokens > limit:
        raise ValueError(
            f"the prompt has {len(ids)} tokens; with --max-new-tokens "
            f"{max_new_tokens} that exceeds max_position_embeddings={limit}"
        )
    nl, dnl = (np.asarray(m) for m in sampling.newline_masks(tok, params.cfg.vocab_size))
    if isinstance(sampler, sampling.ReSET):
        sampler = dataclasses.replace(sampler, nl_mask=jnp.asarray(nl), dnl_mask=jnp.asarray(dnl))
    stop = _stop_ids(params)
    printer = _StepPrinter(nl, dnl, sampler)

    t0 = time.perf_counter()
    dtype = params.weights["embed_tokens"]["embedding"].dtype
    cache = init_cache(params.cfg, 1, len(ids) + max_new_tokens, dtype)
    tokens = jnp.asarray([ids], jnp.int32)
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    logits, cache = prefill(params, tokens, positions, cache)
    state = sampling.sampler_init(sampler, 1)
    # generate's key for row 0: fold_in(key, row); decode_step folds the step in per row.
    key = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(
        jax.random.key(seed), jnp.arange(1, dtype=jnp.uint32)
    )
    pos = jnp.asarray([len(ids)], jnp.int32)
    gen, ent, temp, shown, finish, first = [], [], [], "", "length", None
    for step in range(max_new_tokens):
        t, logits, cache, state, info = decode_step(
            params, logits, cache, pos, sampler, state, key, jnp.int32(step)
        )
        pos = pos + 1
        t = int(t[0])
        if first is None:
            first = time.perf_counter() - t0
        gen.append(t)
        ent.append(float(info["entropy"][0]))
        temp.append(float(info["temperature"][0]))
        text = tok.decode(gen, skip_special_tokens=True)
        if not text.endswith("\ufffd") and text.startswith(shown):
            out.write(text[len(shown) :])
            out.flush()
            shown = text
        line = printer.push(t, ent[-1], temp[-1])
        if stats and line:
            err.write(f"    {line}\n")
            err.flush()
        if t in stop:
            finish = "stop"
            break
    text = tok.decode(gen, skip_special_tokens=True)
    if text.startswith(shown) and len(text) > len(shown):
        out.write(text[len(shown) :])
    if not text.endswith("\n"):
        out.write("\n")
    out.flush()
    line = printer.flush()
    if stats and line:
        err.write(f"    {line}\n")
    seconds = time.perf_counter() - t0
    return {
        "text": text,
        "tokens": gen,
        "entropy": ent,
        "temperature": temp,
        "finish_reason": finish,
        "seconds": seconds,
        "first_token_s": first,
    }


def _cmd_generate(args) -> int:
    from rejax.grading import extract_answer

    sampler = _sampler(args)
    t0 = time.perf_counter()
    params = load_model(args.model, args.quant)
    chat = _chat(args, params)
    _err(
        f"# {_model_line(args, params)}; sampler {sampler_label(sampler)}; "
        f"loaded in {time.perf_counter() - t0:.1f} s"
    )
    res = stream_generate(
        params,
        args.prompt,
        sampler=sampler,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        chat=chat,
        stats=not args.no_stats,
    )
    n = len(res["tokens"])
    rest = res["seconds"] - res["first_token_s"]
    rate = f"{(n - 1) / rest:.1f} tok/s after the first" if n > 1 and rest > 0 else ""
    import numpy as np

    _err(
        f"# {n} tokens, finish: {res['finish_reason']}, mean entropy "
        f"{np.mean(res['entropy']):.3f} nats, first token {res['first_token_s']:.1f} s "
        f"(incl. compile), {rate}; answer: {extract_answer(res['text'])}"
    )
    return 0


# ----------------------------------------------------------------------------------------------
# eval


def _versions() -> dict:
    import jax

    from rejax import __version__

    return {"rejax": __version__, "jax": jax.__version__, "backend": jax.default_backend()}


def _cmd_eval(args) -> int:
    resolve_model(args.model)
    problems = ev.load_problems(args.data, args.task, limit=args.limit)
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    sampler = _sampler(args)
    params = load_model(args.model, args.quant)
    chat = _chat(args, params)
    _err(
        f"# {_model_line(args, params)}; sampler {sampler_label(sampler)}; "
        f"{args.task}: {len(problems)} problems x n={args.n}"
    )
    res = ev.evaluate(
        params,
        problems,
        sampler,
        n=args.n,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        key=args.seed,
        chat=chat,
        progress=not args.no_progress,
        ci_method=args.ci,
        task=args.task,
        timeout_s=args.timeout,
    )
    summary = dict(
        res.summary, model=args.model, quant=args.quant, data=str(args.data), versions=_versions()
    )
    if args.out:
        ev.write_jsonl(args.out, res.records)
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary).write_text(json.dumps(summary, indent=2) + "\n")
    a = summary["avg_at_n"]
    print(
        f"avg@{args.n} = {100 * a['avg']:.2f}%  (95% CI {100 * a['lo']:.2f}-"
        f"{100 * a['hi']:.2f}%, {a['method']} over {a['n_problems']} problems; "
        f"{summary['mean_response_tokens']:.0f} tokens/response, "
        f"{100 * summary['frac_length_capped']:.1f}% hit --max-new-tokens)"
    )
    graded = summary["n_problems"] * args.n
    if args.task == "math":
        print(
            f"{summary['n_last_number_fallback']} of {graded} graded answers came from the "
            f"last-number fallback (no \\boxed{{}}), {summary['n_last_number_fallback_correct']} "
            "of them graded correct"
        )
    else:
        rules = ", ".join(f"{k} {v}" for k, v in summary["extracted_by"].items())
        line = f"{graded} graded answers, extracted by: {rules}"
        if args.task == "code":
            fails = ", ".join(f"{k} {v}" for k, v in summary["failure_status"].items())
            line += f"; failures: {fails or 'none'}"
        print(line)
    return 0


# ----------------------------------------------------------------------------------------------
# calibrate


def _default_calibration_problems(n: int) -> list[dict]:
    from rejax.data import tasks

    return tasks.split("validation", n)


def _cmd_calibrate(args) -> int:
    resolve_model(args.model)  # a bad --model fails before any work
    if args.data is not None:
        problems = ev.load_jsonl(args.data)
        source = str(args.data)
    else:
        problems = _default_calibration_problems(args.n_problems)
        source = "rejax.data.tasks validation split"
    if len(problems) < args.n_problems:
        raise ValueError(f"--n-problems {args.n_problems} but {source} holds {len(problems)}")
    params = load_model(args.model, args.quant)
    chat = _chat(args, params)
    _err(
        f"# calibrating tau0 on {args.n_problems} problems from {source}: "
        f"{_model_line(args, params)}"
    )
    res = ev.calibrate_tau0(
        params,
        problems,
        n_problems=args.n_problems,
        max_new_tokens=args.max_new_tokens,
        percentile=args.percentile,
        key=args.seed,
        chat=chat,
    )
    ref = None
    if args.reference and args.quant != "bf16":
        _err("# reference: the same problems with the bf16 model")
        ref = ev.calibrate_tau0(
            load_model(args.model, "bf16"),
            problems,
            n_problems=args.n_problems,
            max_new_tokens=args.max_new_tokens,
            percentile=args.percentile,
            key=args.seed,
            chat=chat,
        )
    meta = {"model": args.model, "data": source, "versions": _versions()}
    files = ev.write_calibration(
        args.out, res, ref, quant=args.quant, meta=meta, prefix=args.prefix
    )
    print(
        f"tau0 = {res['tau0']:.4f} nats  ({args.percentile:g}th percentile of the raw T=1 "
        f"full-vocab entropy of {res['n_tokens']} {args.quant} tokens)"
    )
    if res["tau0_processed"] is not None:
        print(
            f"       processed-score percentile (T={res['sampler']['t']:g}, top-p/top-k): "
            f"{res['tau0_processed']:.4f} nats (not used)"
        )
    if ref is not None:
        print(
            f"bf16 reference: raw percentile {ref['tau0_raw']:.4f} nats over "
            f"{ref['n_tokens']} tokens"
        )
    for f in files:
        print(f"wrote {f}")
    return 0


# ----------------------------------------------------------------------------------------------
# parser


def build_parser() -> argparse.ArgumentParser:
    """The `rejax` argument parser (sub-commands generate, eval, calibrate)."""
    parser = argparse.ArgumentParser(
        prog="rejax",
        description="NVFP4 (W4A4) reasoning in JAX with the ReSET sampler.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    g = sub.add_parser(
        "generate",
        help="stream one response with per-step entropy/temperature",
        description="Stream one response. The text goes to stdout; after every reasoning step "
        "(a blank line) stderr gets a line with the step's token count, mean/max "
        "raw entropy (nats) and the share of tokens at T_low / T_high.",
    )
    _add_model_args(g)
    _add_sampler_args(g)
    g.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=512,
        metavar="N",
        help="tokens to generate at most (default: 512)",
    )
    _add_prompt_args(g)
    g.add_argument("--no-stats", action="store_true", help="do not print per-step statistics")
    g.add_argument("prompt", metavar="PROMPT", help="the prompt text (a problem)")
    g.set_defaults(func=_cmd_generate)

    e = sub.add_parser(
        "eval",
        help="avg@n with a 95%% CI on a math, multiple-choice or code problem file",
        description="Sample n responses per problem (problems x n rows per compiled batch), "
        "grade them (math: the last \\boxed{} answer, else the last number, with numeric "
        "normalisation; mcq: the answer letter; code: every test in a sandboxed process) "
        "and report avg@n with a 95% CI that treats problems as the sampling unit (normal "
        "approximation over per-problem means, or a bootstrap over problems).",
    )
    e.add_argument(
        "--task",
        default="math",
        choices=("math", "mcq", "code"),
        help="math: AIME-style JSONL (problem, answer); mcq: GPQA CSV/JSONL; code: "
        "LiveCodeBench code_generation_lite JSONL (default: math)",
    )
    e.add_argument(
        "--data",
        required=True,
        metavar="FILE",
        help="the problem file in the --task's format",
    )
    e.add_argument(
        "--timeout",
        type=_float,
        default=8.0,
        metavar="S",
        help="code: seconds per test run (default: 8)",
    )
    e.add_argument(
        "--n", type=_positive_int, default=8, metavar="N", help="samples per problem (default: 8)"
    )
    _add_model_args(e)
    _add_sampler_args(e)
    e.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=1024,
        metavar="N",
        help="tokens per response at most (default: 1024)",
    )
    e.add_argument(
        "--batch-size",
        type=_positive_int,
        default=None,
        metavar="B",
        help="problems decoded together (B x n rows; default: max(1, 64 // n))",
    )
    e.add_argument(
        "--limit",
        type=_positive_int,
        default=None,
        metavar="K",
        help="evaluate only the first K problems",
    )
    e.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="write per-problem results (responses, extracted answers, grades; for code the "
        "first failing test and its stderr tail) as JSONL",
    )
    e.add_argument(
        "--summary",
        default=None,
        metavar="FILE",
        help="write the summary (avg@n, CI, settings, timing) as JSON",
    )
    e.add_argument(
        "--ci",
        default="normal",
        choices=("normal", "bootstrap"),
        help="95%% CI method (default: normal)",
    )
    e.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    _add_prompt_args(e)
    e.set_defaults(func=_cmd_eval)

    c = sub.add_parser(
        "calibrate",
        help="calibrate ReSET's tau0 (80th entropy percentile)",
        description="tau0 = the 80th percentile of the raw (T=1, full-vocabulary) token "
        "entropy of the quantized model sampling at T=0.6 on calibration problems "
        "(the entropy ReSET thresholds). Also reports the processed-score "
        "percentile, dumps every token entropy (npz) with a JSON summary and plots bf16 vs quantized "
        "entropy histograms (PNG, needs matplotlib).",
    )
    _add_model_args(c)
    c.add_argument(
        "--data",
        default=None,
        metavar="FILE",
        help="JSONL calibration problems (default: the bundled task's validation split)",
    )
    c.add_argument(
        "--n-problems",
        type=_positive_int,
        default=5,
        metavar="K",
        help="calibration problems, one response each (default: 5)",
    )
    c.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=4096,
        metavar="N",
        help="tokens per response at most (default: 4096)",
    )
    c.add_argument(
        "--percentile",
        type=_float,
        default=ev.CALIBRATION_PERCENTILE,
        metavar="Q",
        help=f"entropy percentile (default: {ev.CALIBRATION_PERCENTILE:g})",
    )
    c.add_argument(
        "--reference",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the bf16 model for the comparison plot (default: on)",
    )
    c.add_argument(
        "--out",
        default="calibration",
        metavar="DIR",
        help="output directory (default: ./calibration)",
    )
    c.add_argument(
        "--prefix",
        default="calibrate",
        metavar="NAME",
        help="output file name prefix (default: calibrate)",
    )
    _add_prompt_args(c)
    c.set_defaults(func=_cmd_calibrate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `rejax` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        if os.environ.get("REJAX_TRACEBACK"):
            raise
        print(f"rejax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nrejax {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
