"""The `rejax` command: generate, eval, calibrate, bench and compare.

    rejax generate [--model PATH|tiny] [--quant Q] [--sampler S] ... PROMPT | - | --prompts FILE
    rejax eval [--task math|mcq|code|countdown] --data FILE [--n 8] ... [--out results.jsonl] [--summary FILE]
    rejax calibrate [--data problems.jsonl] [--n-problems 5] [--quant nvfp4] [--scale-texts FILE] [--out DIR]
    rejax bench [--model PATH|tiny | --preset NAME] [--quant Q] [--batch 1 8] [--out FILE]
    rejax compare [--model PATH|tiny] [--quant Q] [--steps N] [--out FILE]

Every command is a front end over the library (`rejax.generate`, `rejax.eval`,
`rejax.bench`, `rejax.compare`). Bad input (a missing model or data file, malformed JSONL, a bad
sampler spec, n <= 0, an unwritable output path, an option the chosen sampler does not use)
exits with status 2 and one `rejax <command>: error: ...` line that names the value, before any
generation starts (set REJAX_TRACEBACK=1 to get the traceback instead).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from rejax import bench, compare, sampling
from rejax import eval as ev
from rejax.checkpoint import load
from rejax.config import KV_DTYPES, PRESETS
from rejax.data import tasks
from rejax.eval.grading import extract_answer
from rejax.generate import calibrate_input_scales, generate
from rejax.text import encode_prompt, ends_step, has_chat_template, newline_masks, prompt_ids

TINY = "tiny"
COUNTDOWN = "countdown"  # the bundled Countdown search reasoner (rejax/data/countdown)
QUANTS = {"bf16": "bf16", "nvfp4": "nvfp4", "nvfp4-w4a16": "nvfp4-w4a16"}


# ----------------------------------------------------------------------------------------------
# Shared helpers


def bundled_model_dir() -> Path:
    """Directory of the tiny reasoning model shipped in the package (may be absent)."""
    return Path(__file__).resolve().parent / "data" / "tiny"


def resolve_model(spec: str) -> Path:
    """`tiny` / `countdown` -> a bundled model; anything else is a checkpoint directory.

    Raises:
      ValueError: the directory or its config.json is missing.
    """
    if spec in (TINY, COUNTDOWN):
        path = bundled_model_dir() if spec == TINY else bundled_model_dir().parent / COUNTDOWN
        if not (path / "config.json").is_file():
            raise ValueError(
                f"the bundled {spec} model is missing from this installation (expected "
                f"rejax/data/{spec}/config.json); pass --model PATH to a Hugging Face checkpoint"
            )
        return path
    path = Path(spec).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(
            f"model path {spec!r} is a file; expected a checkpoint directory (with config.json "
            "and *.safetensors), 'tiny' or 'countdown'"
        )
    if not path.is_dir():
        raise ValueError(
            f"model path {spec!r} does not exist (expected a checkpoint directory "
            "with config.json and *.safetensors, 'tiny' or 'countdown')"
        )
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model path {spec!r} has no config.json (expected a Hugging Face checkpoint directory)"
        )
    return path


def load_model(spec: str, quant: str):
    """Loads `--model` with `--quant` (bf16 | nvfp4 | nvfp4-w4a16) through `rejax.load`."""

    path = resolve_model(spec)
    # The filter sits on the logger that emits the record: a parent's filters do not see
    # records propagated from its children.
    log = logging.getLogger("rejax.checkpoint.reader")
    # The CLI states the activation-scale mode in its own header line instead.
    quiet = _DropMessage("without calibration data")
    log.addFilter(quiet)
    try:
        # "bf16" asks for float linears: load refuses it for an NVFP4 checkpoint instead of
        # silently running that checkpoint's own W4A4.
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
        metavar="PATH|tiny|countdown",
        help="Hugging Face Qwen3/Qwen2 checkpoint directory, or a bundled model: 'tiny' (the "
        "arithmetic reasoner) or 'countdown' (the Countdown search reasoner) (default: tiny)",
    )
    p.add_argument(
        "--quant",
        default=quant_default,
        choices=sorted(QUANTS),
        help=f"linear format: bf16, nvfp4 (W4A4) or nvfp4-w4a16 (default: {quant_default})",
    )


def _add_reset_threshold_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--t-low",
        type=_float,
        default=None,
        metavar="X",
        help=f"ReSET T_low (default: the model's {RESET_FILE}, else {ev.DEFAULT_T_LOW})",
    )
    p.add_argument(
        "--tau0",
        type=_float,
        default=None,
        metavar="X",
        help=f"ReSET confident-step entropy threshold in nats (default: the model's "
        f"{RESET_FILE}, else {ev.DEFAULT_TAU0}; see `rejax calibrate`)",
    )


def _add_sampler_args(p: argparse.ArgumentParser, *, sampler_default: str = "reset") -> None:
    p.add_argument(
        "--sampler",
        default=sampler_default,
        metavar="SPEC",
        help=f"greedy | temp:T (e.g. temp:0.6) | reset (default: {sampler_default})",
    )
    _add_reset_threshold_args(p)
    p.add_argument(
        "--t-high",
        type=_float,
        default=None,
        metavar="X",
        help=f"ReSET T_high (default: the model's {RESET_FILE}, else {ev.DEFAULT_T_HIGH})",
    )
    p.add_argument(
        "--top-p",
        type=_float,
        default=None,
        metavar="P",
        help=f"nucleus mass for temp:T and reset (default: {ev.DEFAULT_TOP_P}, the paper's; "
        "rejax.Temperature's API default is 1.0)",
    )
    p.add_argument(
        "--include-current",
        action="store_const",
        const=True,
        default=None,
        help="ReSET: count the token being sampled in the step-entropy estimates "
        "(ReSET(include_current=True), the paper's figure semantics; default: the reference "
        "semantics, which exclude it)",
    )


# ReSET settings a model directory may carry (written by `rejax calibrate --reset-json`).
RESET_FILE = "reset.json"
_RESET_KEYS = {"tau_0": "--tau0", "t_low": "--t-low", "t_high": "--t-high"}
# Which sampler-tuning options each sampler kind reads.
_SAMPLER_OPTIONS = {
    "greedy": (),
    "temp": ("top_p",),
    "reset": ("t_low", "tau0", "t_high", "top_p"),
}


def read_reset_settings(model_dir: str | Path) -> dict | None:
    """Reads a model directory's calibrated ReSET settings (`reset.json`), if it has one.

    The file is one JSON object with any of `tau_0` (nats), `t_low` and `t_high` (numbers);
    other keys must be strings (notes such as `source`). `rejax generate` and `rejax eval` use
    these values instead of the paper's when the flags are not given.

    Args:
      model_dir: the checkpoint directory.

    Returns:
      {"tau_0": ..., "t_low": ..., "t_high": ...} with the keys the file sets, or None when
      the directory has no reset.json.

    Raises:
      ValueError: malformed JSON, a non-numeric or negative value, or an unknown numeric key.
    """
    path = Path(model_dir) / RESET_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: malformed JSON ({e.msg})") from None
    if type(raw) is not dict:
        raise ValueError(f"{path}: expected a JSON object with tau_0 / t_low / t_high")
    out = {}
    for k, v in raw.items():
        if k in _RESET_KEYS:
            if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{path}: {k} must be a finite number >= 0, got {v!r}")
            out[k] = float(v)
        elif not isinstance(v, str):
            raise ValueError(
                f"{path}: unknown setting {k!r}={v!r}; expected {sorted(_RESET_KEYS)} "
                "(other keys hold notes as strings)"
            )
    return out


def _sampler(args, model_dir: Path | None = None):
    """The sampler of `--sampler` and its options; returns (sampler, where the values came from).

    Raises ValueError for a tuning option the chosen sampler does not read (it would be ignored).
    """
    kind = args.sampler.strip().partition(":")[0].lower()
    kind = "temp" if kind == "temperature" else kind
    include_current = getattr(args, "include_current", None)
    if include_current and kind in _SAMPLER_OPTIONS and kind != "reset":
        raise ValueError(
            f"--include-current does not apply to --sampler {args.sampler!r} (only to reset); "
            "drop it or change --sampler"
        )
    for name in ("t_low", "tau0", "t_high", "top_p"):
        # An unknown kind is left to parse_sampler, whose message lists the valid specs.
        if kind not in _SAMPLER_OPTIONS:
            break
        if getattr(args, name) is not None and name not in _SAMPLER_OPTIONS[kind]:
            flag = "--" + name.replace("_", "-")
            users = " or ".join(k for k, v in _SAMPLER_OPTIONS.items() if name in v)
            raise ValueError(
                f"{flag} {getattr(args, name):g} does not apply to --sampler {args.sampler!r} "
                f"(only to {users}); drop it or change --sampler"
            )
    values = {"t_low": ev.DEFAULT_T_LOW, "tau0": ev.DEFAULT_TAU0, "t_high": ev.DEFAULT_T_HIGH}
    source = ""
    saved = read_reset_settings(model_dir) if kind == "reset" and model_dir else None
    if saved:
        used = []
        for key, flag in _RESET_KEYS.items():
            name = flag[2:].replace("-", "_")
            if key in saved and getattr(args, name) is None:
                values[name] = saved[key]
                used.append(flag[2:])
        if used:
            source = f" ({', '.join(used)} from the model's {RESET_FILE})"
    for name in values:
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    top_p = ev.DEFAULT_TOP_P if args.top_p is None else args.top_p
    sampler = ev.parse_sampler(args.sampler, top_p=top_p, **values)
    if include_current:
        sampler = dataclasses.replace(sampler, include_current=True)
    return sampler, source


def check_output_path(path: str | Path, flag: str, *, directory: bool = False) -> Path:
    """Checks, before any work, that `path` can be written (as a file, or a directory).

    Missing parent directories are fine (they are created on writing); the nearest existing
    ancestor must be a writable directory.

    Raises:
      ValueError: naming the flag and the offending path.
    """
    path = Path(path).expanduser()
    if directory and path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a file; expected a directory")
    if not directory and path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a directory; expected a file name")
    parent = path if directory else path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(
            f"{flag} {str(path)!r} cannot be created: {str(parent)!r} is a file, not a directory"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {str(path)!r} cannot be written: {str(parent)!r} is read-only")
    return path


def _max_new_tokens(requested, default: int, params, prompts: list[list[int]]) -> int:
    """`--max-new-tokens`, or its default clamped to what the model's context leaves.

    An explicit value is kept (generate rejects one that does not fit, naming the prompt); the
    default shrinks to the context minus the longest prompt, with a notice on stderr.
    """
    limit = params.cfg.max_position_embeddings
    longest = max(len(p) for p in prompts)
    room = limit - longest
    if room <= 0:
        raise ValueError(
            f"the longest prompt has {longest} tokens, which fills the model's context of "
            f"{limit} (max_position_embeddings); shorten it"
        )
    if requested is not None:
        return requested
    if default <= room:
        return default
    _err(
        f"# --max-new-tokens {room} (the default {default} does not fit: the model's context is "
        f"{limit} tokens and the longest prompt has {longest})"
    )
    return room


def _add_prompt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="render prompts as one user message with the checkpoint's chat "
        "template (default: when the checkpoint has one)",
    )
    p.add_argument("--seed", type=int, default=0, metavar="S", help="PRNG seed (default: 0)")


def _add_scale_texts_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--scale-texts",
        default=None,
        metavar="FILE",
        help='JSONL, one {"text": ...} object per line: before running, set every NVFP4 '
        "linear's static activation scale from these texts (rejax.calibrate_input_scales, the "
        "ModelOpt recipe: each linear's input amax over all texts, run with NVFP4 weights and "
        "bf16 activations, gives input_scale = amax / (6 * 448)), replacing the dynamic "
        "per-row scales (or the checkpoint's own input_scale). The texts are tokenized as "
        "written, with no chat template: write them in the model's prompt format, e.g. "
        "reference solutions from rejax.data.countdown.write_trace_jsonl. Needs --quant nvfp4",
    )


def _read_scale_texts(args) -> list[tuple[int, str]] | None:
    """--scale-texts FILE as (line number, text) pairs; None without the option.

    Checked before any work: --quant must be nvfp4 (W4A4), the file readable, every non-blank
    line a JSON object with a non-empty string `text`, and at least one text.

    Raises:
      ValueError: naming the option, the file (and line) and what was expected.
    """
    if args.scale_texts is None:
        return None
    if args.quant != "nvfp4":
        raise ValueError(
            f"--scale-texts calibrates the static activation scales of NVFP4 W4A4; it needs "
            f"--quant nvfp4, got --quant {args.quant}"
        )
    path = Path(args.scale_texts).expanduser()
    if not path.is_file():
        raise ValueError(
            f"--scale-texts {str(path)!r} does not exist or is not a file (expected JSONL "
            "with a 'text' field per line)"
        )
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--scale-texts {str(path)!r} cannot be read: {e}") from None
    texts = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--scale-texts {path}:{lineno}: malformed JSON ({e.msg})") from None
        text = row.get("text") if isinstance(row, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise ValueError(
                f"--scale-texts {path}:{lineno}: expected a JSON object with a non-empty "
                f"string field 'text', got {line.strip()!r:.80}"
            )
        texts.append((lineno, text))
    if not texts:
        raise ValueError(
            f"--scale-texts {str(path)!r} holds no texts; expected at least one JSON line "
            "with a 'text' field"
        )
    return texts


def _with_scale_texts(args, params, texts: list[tuple[int, str]] | None):
    """params with static activation scales calibrated on `texts` (`_read_scale_texts`);
    unchanged for None. Takes one-device params: call it before `_shard`."""
    if texts is None:
        return params
    limit = params.cfg.max_position_embeddings
    ids = prompt_ids(params, [t for _, t in texts], chat=False)
    for (lineno, _), row in zip(texts, ids):
        if len(row) > limit:
            raise ValueError(
                f"--scale-texts {args.scale_texts}:{lineno}: the text has {len(row)} tokens, "
                f"more than the model's context of {limit} (max_position_embeddings); shorten it"
            )
    t0 = time.perf_counter()
    params = calibrate_input_scales(params, [t for _, t in texts])
    _err(
        f"# static activation scales calibrated on {len(texts)} texts "
        f"({sum(map(len, ids))} tokens) from --scale-texts {args.scale_texts} in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    return params


def _scale_texts_note(args, texts) -> dict | None:
    """--scale-texts for a JSON summary: the file and its text count (None without it)."""
    return None if texts is None else {"file": str(args.scale_texts), "n_texts": len(texts)}


def _chat(args, params) -> bool:
    if args.chat is None:
        return has_chat_template(params)
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
    return jax.tree_util.tree_leaves(tree)


def _jax_paths(tree) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def sampler_label(sampler) -> str:
    """A short human-readable description of a sampler."""
    if isinstance(sampler, sampling.Greedy):
        return "greedy"
    if isinstance(sampler, sampling.Temperature):
        return f"temperature T={float(sampler.t):g}, top-p {float(sampler.top_p):g}"
    return (
        f"ReSET T_low={float(sampler.t_low):g} tau0={float(sampler.tau_0):g} "
        f"T_high={float(sampler.t_high):g} w={sampler.window} top-p {float(sampler.top_p):g}"
        + (" include_current" if sampler.include_current else "")
    )


def _err(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# generate


def format_nats(x: float) -> str:
    """An entropy in nats for display: two decimals, or scientific notation below 0.01.

    Confident tokens have entropies of 1e-5 nats and less, which two decimals show as 0.00.
    """
    x = float(x)
    return "0" if x == 0 else f"{x:.2f}" if abs(x) >= 0.01 else f"{x:.1e}"


class _StepPrinter:
    """Tracks step boundaries while streaming and formats one summary line per step."""

    def __init__(self, nl, dnl, sampler):
        self.nl, self.dnl = nl, dnl
        self.reset = isinstance(sampler, sampling.ReSET)
        self.t_low = float(sampler.t_low) if self.reset else None
        self.index, self.entropy, self.temperature = 1, [], []
        self.prev = None

    def push(self, token: int, entropy: float, temperature: float) -> str | None:
        """Records one token; returns the finished step's line if this token ends a step."""
        self.entropy.append(entropy)
        self.temperature.append(temperature)
        before = self.prev is not None and bool(self.nl[self.prev])
        ends = ends_step(bool(self.nl[token]), bool(self.dnl[token]), before)
        self.prev = token
        return self.flush() if ends else None

    def flush(self) -> str | None:
        if not self.entropy:
            return None
        h = np.asarray(self.entropy)
        t = np.asarray(self.temperature, np.float32)
        line = (
            f"[step {self.index} | {len(h)} tok | entropy mean {format_nats(h.mean())} "
            f"max {format_nats(h.max())} nats | "
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


def stream_response(
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
    """Streams one response through `rejax.generate(..., stream=...)`: text to `out` as it
    appears, and a per-step entropy/temperature line to `err` after every reasoning step.

    The tokens are those of `rejax.generate(params, prompt, key=seed)` (the library's one
    streaming loop, with its prompt checks and buckets).

    Args:
      params: the model, with a tokenizer.
      prompt: the prompt text.
      sampler: Greedy / Temperature / ReSET.
      max_new_tokens: tokens to generate at most.
      seed: PRNG seed.
      chat: render the prompt with the chat template.
      stats: write the per-step lines.
      out, err: text streams (default stdout / stderr).

    Returns:
      dict with `text`, `tokens`, `entropy`, `temperature`, `finish_reason`, `seconds`,
      `first_token_s` (includes compilation).
    """

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    if params.tokenizer is None or params.tokenizer.tokenizer is None:
        raise ValueError("the checkpoint has no tokenizer.json; `rejax generate` needs one")
    tok = params.tokenizer.tokenizer
    nl, dnl = (np.asarray(m) for m in newline_masks(tok, params.cfg.vocab_size))
    if isinstance(sampler, sampling.ReSET) and sampler.nl_mask is None:
        sampler = dataclasses.replace(sampler, nl_mask=jnp.asarray(nl), dnl_mask=jnp.asarray(dnl))
    printer = _StepPrinter(nl, dnl, sampler)
    first: list[float] = []
    t0 = time.perf_counter()

    def piece(text: str) -> None:
        out.write(text)
        out.flush()

    def on_token(token: int, entropy: float, temperature: float) -> None:
        if not first:
            first.append(time.perf_counter() - t0)
        line = printer.push(token, entropy, temperature)
        if stats and line:
            err.write(f"    {line}\n")
            err.flush()

    gen = generate(
        params,
        prompt,
        max_new_tokens=max_new_tokens,
        sampler=sampler,
        key=seed,
        chat=chat,
        stream=piece,
        on_token=on_token,
    )
    text = gen.text[0]
    if not text.endswith("\n"):
        out.write("\n")
    out.flush()
    line = printer.flush()
    if stats and line:
        err.write(f"    {line}\n")
    return {
        "text": text,
        "tokens": gen.tokens[0],
        "entropy": gen.entropy[0],
        "temperature": gen.temperature[0],
        "finish_reason": gen.finish_reason[0],
        "seconds": time.perf_counter() - t0,
        "first_token_s": first[0] if first else None,
    }


def _read_prompts(args) -> list[str]:
    """PROMPT, `-` (stdin) or --prompts FILE (one per line, or JSONL with `prompt`/`problem`)."""
    if (args.prompt is None) == (args.prompts is None):
        raise ValueError(
            "give either a PROMPT (or '-' to read it from stdin) or --prompts FILE, "
            f"got {'both' if args.prompt is not None else 'neither'}"
        )
    if args.prompt is not None:
        text = sys.stdin.read().rstrip("\n") if args.prompt == "-" else args.prompt
        where = "the prompt read from stdin" if args.prompt == "-" else "PROMPT"
        if not text.strip():
            raise ValueError(f"{where} is empty ({text!r}); expected a problem to answer")
        return [text]
    path = Path(args.prompts)
    if not path.is_file():
        raise ValueError(f"--prompts {str(path)!r} does not exist or is not a file")
    prompts = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        text = line
        if line.lstrip().startswith("{"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
            key = "prompt" if "prompt" in row else "problem"
            text = row.get(key)
            if not isinstance(text, str) or not text.strip():
                raise ValueError(
                    f"{path}:{lineno}: expected a non-empty string field 'prompt' or 'problem'"
                )
        prompts.append(text)
    if not prompts:
        raise ValueError(f"--prompts {str(path)!r} holds no prompts")
    return prompts


def _cmd_generate(args) -> int:

    prompts = _read_prompts(args)
    model_dir = resolve_model(args.model)
    sampler, source = _sampler(args, model_dir)
    scale_texts = _read_scale_texts(args)
    t0 = time.perf_counter()
    params = load_model(args.model, args.quant)
    params = _with_kv_dtype(args, _with_scale_texts(args, params, scale_texts))
    chat = _chat(args, params)
    ids = [encode_prompt(params, p, chat=chat) for p in prompts]
    max_new = _max_new_tokens(args.max_new_tokens, 512, params, ids)
    _err(
        f"# {_model_line(args, params)}; sampler {sampler_label(sampler)}{source}; "
        f"loaded in {time.perf_counter() - t0:.1f} s"
    )
    if len(prompts) == 1 and args.n == 1 and not args.json:
        res = stream_response(
            params,
            prompts[0],
            sampler=sampler,
            max_new_tokens=max_new,
            seed=args.seed,
            chat=chat,
            stats=not args.no_stats,
        )
        n = len(res["tokens"])
        rest = res["seconds"] - res["first_token_s"]
        rate = f"{(n - 1) / rest:.1f} tok/s after the first" if n > 1 and rest > 0 else ""
        _err(
            f"# {n} tokens, finish: {res['finish_reason']}, mean entropy "
            f"{format_nats(np.mean(res['entropy']))} nats, first token "
            f"{res['first_token_s']:.1f} s (incl. compile), {rate}; "
            f"answer: {extract_answer(res['text'])}"
        )
        return 0
    t0 = time.perf_counter()
    gen = generate(
        params,
        prompts,
        max_new_tokens=max_new,
        sampler=sampler,
        key=args.seed,
        n=args.n,
        chat=chat,
    )
    for r in range(len(gen.tokens)):
        i, j = divmod(r, args.n)
        if args.json:
            row = {
                "prompt_index": i,
                "sample": j,
                "prompt": prompts[i],
                "text": gen.text[r],
                "tokens": gen.tokens[r],
                "entropy": gen.entropy[r],
                "temperature": gen.temperature[r],
                "finish_reason": gen.finish_reason[r],
            }
            print(json.dumps(row, ensure_ascii=False, allow_nan=False), flush=True)
        else:
            print(f"=== prompt {i}, sample {j} ===\n{gen.text[r].rstrip()}", flush=True)
            _err(
                f"# prompt {i} sample {j}: {len(gen.tokens[r])} tokens, finish: "
                f"{gen.finish_reason[r]}, answer: {extract_answer(gen.text[r])}"
            )
    total = sum(len(t) for t in gen.tokens)
    _err(
        f"# {len(prompts)} prompts x n={args.n}: {total} tokens in "
        f"{time.perf_counter() - t0:.1f} s (incl. compile)"
    )
    return 0


# ----------------------------------------------------------------------------------------------
# eval


def _add_mesh_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mesh",
        default=None,
        metavar="data=D,model=M",
        help="run on D x M devices through jax.sharding: batch rows over data, heads and "
        "feed-forward width over model (rejax.shard; default: one device)",
    )


def _add_kv_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-dtype",
        default="bf16",
        choices=KV_DTYPES,
        help="KV-cache storage: bf16, or fp8 (E4M3 codes with a scale per slot and kv head: "
        "half the cache bytes; Config.kv_dtype) (default: bf16)",
    )
    p.add_argument(
        "--xla-autotune",
        default="off",
        choices=["on", "off"],
        help="on a GPU, whether XLA times matmul algorithms per program (Config.xla_autotune). "
        "off (default): cuBLAS's untimed pick per shape (no Triton GEMMs), so float matmuls round "
        "alike in every program and every run, and --slots compaction works on a GPU; on: timed "
        "picks per program (on the H200, 36 layers of Qwen3-8B: 1-2%% faster at batch 1, 8%% "
        "slower for bf16 at batch 64)",
    )


def _with_kv_dtype(args, params):
    """params with Config.kv_dtype = --kv-dtype and Config.xla_autotune = --xla-autotune (a
    loaded model's defaults are "bf16" and on; the CLI's are "bf16" and off)."""
    if args.kv_dtype == "bf16" and args.xla_autotune == "on":
        return params
    cfg = dataclasses.replace(
        params.cfg, kv_dtype=args.kv_dtype, xla_autotune=args.xla_autotune == "on"
    )
    return dataclasses.replace(params, cfg=cfg)


def _shard(args, params):
    """params placed on the --mesh (unchanged without one); a bad mesh is a ValueError."""
    if args.mesh is None:
        return params
    from rejax import sharding

    return sharding.shard(params, sharding.make_mesh(**sharding.parse_mesh(args.mesh)))


def _cmd_eval(args) -> int:
    model_dir = resolve_model(args.model)
    for flag in ("out", "summary"):
        if getattr(args, flag):
            check_output_path(getattr(args, flag), f"--{flag}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    scale_texts = _read_scale_texts(args)
    problems = ev.load_problems(args.data, args.task, limit=args.limit)
    sampler, source = _sampler(args, model_dir)
    params = _with_scale_texts(args, load_model(args.model, args.quant), scale_texts)
    params = _shard(args, _with_kv_dtype(args, params))
    chat = _chat(args, params)
    ids = [encode_prompt(params, p["prompt"], chat=chat) for p in problems]
    max_new = _max_new_tokens(args.max_new_tokens, 1024, params, ids)
    _err(
        f"# {_model_line(args, params)}; sampler {sampler_label(sampler)}{source}; "
        f"{args.task}: {len(problems)} problems x n={args.n}"
    )
    res = ev.evaluate(
        params,
        problems,
        sampler,
        n=args.n,
        max_new_tokens=max_new,
        batch_size=args.batch_size,
        key=args.seed,
        chat=chat,
        progress=not args.no_progress,
        slots=args.slots,
        compact=args.slots_compact,
        prefill_rows=args.prefill_rows,
        ci_method=args.ci,
        task=args.task,
        timeout_s=args.timeout,
    )
    summary = dict(
        res.summary,
        model=args.model,
        quant=args.quant,
        kv_dtype=args.kv_dtype,
        scale_texts=_scale_texts_note(args, scale_texts),
        data=str(args.data),
        versions=bench.versions(),
    )
    if args.out:
        ev.write_jsonl(args.out, res.records)
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        # allow_nan=False: a strict JSON parser rejects a bare NaN; fail here instead.
        Path(args.summary).write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    a = summary["avg_at_n"]
    print(
        f"avg@{args.n} = {100 * a['avg']:.2f}%  (95% CI {100 * a['lo']:.2f}-"
        f"{100 * a['hi']:.2f}%, {a['method']} over {a['n_problems']} problems; "
        f"{summary['mean_response_tokens']:.0f} tokens/response, "
        f"{100 * summary['frac_length_capped']:.1f}% hit --max-new-tokens)"
    )
    if args.slots is not None:
        sizes = ", ".join(f"{c}: {k}" for c, k in summary["slot_steps_by_size"].items())
        _err(
            f"# {args.slots} slots{' (compacting)' if args.slots_compact is not False else ''}: "
            f"occupancy {summary['slot_occupancy']:.3f} per step, "
            f"{summary['slot_row_occupancy']:.3f} of row-steps, decode steps by program rows "
            f"{{{sizes}}}, "
            f"{summary['tokens_per_s'] or 0:.0f} tok/s"
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
        if args.task in ("code", "countdown"):
            fails = ", ".join(f"{k} {v}" for k, v in summary["failure_status"].items())
            line += f"; failures: {fails or 'none'}"
        print(line)
    return 0


# ----------------------------------------------------------------------------------------------
# calibrate


def _validation_problems(model_dir, n: int, seed: int = 0) -> tuple[list[dict], str]:
    """`n` validation problems of the task MODEL_DIR was trained on, and their source's name:
    Countdown for a model that records its Countdown difficulty (the bundled `countdown`),
    else the bundled arithmetic task."""
    from rejax.data import countdown

    difficulty = countdown.load_difficulty(model_dir)
    if difficulty is not None:
        problems = countdown.split("validation", n, seed=seed, difficulty=difficulty)
        return problems, "rejax.data.countdown validation split (the model's difficulty)"
    return tasks.split("validation", n, seed=seed), "rejax.data.tasks validation split"


def _cmd_calibrate(args) -> int:
    model_dir = resolve_model(args.model)  # a bad --model fails before any work
    check_output_path(args.out, "--out", directory=True)
    if args.reset_json:
        check_output_path(args.reset_json, "--reset-json")
    scale_texts = _read_scale_texts(args)
    if args.data is not None:
        problems = ev.load_jsonl(args.data)
        source = str(args.data)
    else:
        problems, source = _validation_problems(model_dir, args.n_problems)
    if len(problems) < args.n_problems:
        raise ValueError(f"--n-problems {args.n_problems} but {source} holds {len(problems)}")
    params = _with_scale_texts(args, load_model(args.model, args.quant), scale_texts)
    chat = _chat(args, params)
    ids = [encode_prompt(params, p["problem"], chat=chat) for p in problems[: args.n_problems]]
    max_new = _max_new_tokens(args.max_new_tokens, 4096, params, ids)
    _err(
        f"# calibrating tau0 on {args.n_problems} problems from {source}: "
        f"{_model_line(args, params)}"
    )
    res = ev.calibrate_tau0(
        params,
        problems,
        n_problems=args.n_problems,
        max_new_tokens=max_new,
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
            max_new_tokens=max_new,
            percentile=args.percentile,
            key=args.seed,
            chat=chat,
        )
    meta = {
        "model": args.model,
        "data": source,
        "scale_texts": _scale_texts_note(args, scale_texts),
        "versions": bench.versions(),
    }
    files = ev.write_calibration(
        args.out, res, ref, quant=args.quant, meta=meta, prefix=args.prefix
    )
    print(
        f"tau0 = {res['tau0']:.4g} nats  ({args.percentile:g}th percentile of the raw T=1 "
        f"full-vocab entropy of {res['n_tokens']} {args.quant} tokens)"
    )
    if res["tau0_processed"] is not None:
        print(
            f"       processed-score percentile (T={res['sampler']['t']:g}, top-p/top-k): "
            f"{res['tau0_processed']:.4g} nats (not used)"
        )
    if ref is not None:
        print(
            f"bf16 reference: raw percentile {ref['tau0_raw']:.4g} nats over "
            f"{ref['n_tokens']} tokens"
        )
    for f in files:
        print(f"wrote {f}")
    # The T_low in use stays (calibration sets tau0 only): the model's file, else the default.
    saved = read_reset_settings(model_dir) or {}
    t_low = saved.get("t_low", ev.DEFAULT_T_LOW)
    tau0 = float(f"{res['tau0']:.4g}")
    scales = "" if scale_texts is None else f" --scale-texts {args.scale_texts}"
    print(
        f"use it: rejax generate --model {args.model} --quant {args.quant}{scales} --sampler "
        f"reset --tau0 {tau0:g} --t-low {t_low:g} ..."
    )
    if args.reset_json:
        settings = dict(
            saved,
            tau_0=tau0,
            t_low=t_low,
            source=f"rejax calibrate{scales}: p{args.percentile:g} of {res['n_tokens']} "
            f"{args.quant} token entropies on {args.n_problems} problems from {source}",
        )
        path = Path(args.reset_json).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings, indent=2, allow_nan=False) + "\n")
        print(
            f"wrote {path} (put it in the model directory as {RESET_FILE} to make these the "
            "defaults of `rejax generate` and `rejax eval`)"
        )
    return 0


# ----------------------------------------------------------------------------------------------
# bench


def _cmd_bench(args) -> int:

    if args.out:
        check_output_path(args.out, "--out")
    if args.preset is not None:
        cfg = PRESETS[args.preset]
        if args.layers is not None:
            cfg = dataclasses.replace(cfg, num_layers=args.layers)
        label = f"preset {args.preset} ({cfg.num_layers} layers, random weights)"
    else:
        if args.layers is not None:
            raise ValueError("--layers applies to --preset only (a checkpoint has its own depth)")
        args.model = TINY if args.model is None else args.model
        resolve_model(args.model)
        label = args.model
    need = args.prompt_len + max(args.new_tokens)
    models = {}
    for q in dict.fromkeys(args.quant):
        if args.preset is not None:
            limit = cfg.max_position_embeddings
            if need > limit:
                raise ValueError(
                    f"--prompt-len {args.prompt_len} + --new-tokens {max(args.new_tokens)} = "
                    f"{need} exceeds the context of {limit}"
                )
            # Random weights are built in full before timing: refuse what cannot fit (the
            # bf16 weights are made first even for NVFP4, which then quantizes them).
            need_bytes = bench.estimate_weight_bytes(cfg, "bf16")
            have = bench.device_memory_bytes()
            if have is not None and need_bytes > 0.8 * have:
                raise ValueError(
                    f"--preset {args.preset} with {cfg.num_layers} layers needs about "
                    f"{need_bytes / 2**30:.1f} GiB for its random weights, more than this "
                    f"device's {have / 2**30:.1f} GiB allows; pass --layers N for fewer layers"
                )
            models[q] = _shard(args, bench._random_params(cfg, q, args.seed))
        else:
            models[q] = _shard(args, load_model(args.model, q))
            limit = models[q].cfg.max_position_embeddings
            if need > limit:
                raise ValueError(
                    f"--prompt-len {args.prompt_len} + --new-tokens {max(args.new_tokens)} = "
                    f"{need} exceeds the model's context of {limit}"
                )
    _err(f"# bench {label}: {', '.join(models)}; batch {args.batch}; new tokens {args.new_tokens}")
    result = bench.run(
        models,
        batches=args.batch,
        new_tokens=args.new_tokens,
        prompt_len=args.prompt_len,
        repeats=args.repeats,
        copy_mib=args.copy_mib,
        seed=args.seed,
        label=label,
        log=_err,
    )
    print(bench.format_table(result))
    if args.out:
        _write_json(args.out, result)
        print(f"wrote {args.out}")
    return 0


def _write_json(path, value: dict) -> None:
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, allow_nan=False) + "\n")


# ----------------------------------------------------------------------------------------------
# compare


def _cmd_compare(args) -> int:

    if args.out:
        check_output_path(args.out, "--out")
    if args.prompt is not None and not args.prompt.strip():
        raise ValueError(f"--prompt is empty ({args.prompt!r}); expected a problem")
    model_dir = resolve_model(args.model)
    args.sampler = "reset"
    reset, source = _sampler(args, model_dir)
    params = load_model(args.model, args.quant)
    if params.tokenizer is None or params.tokenizer.tokenizer is None:
        raise ValueError(f"{args.model!r} has no tokenizer.json; `rejax compare` needs one")
    if args.prompt is None:
        args.prompt = _validation_problems(model_dir, 1, seed=args.seed)[0][0]["problem"]
    chat = _chat(args, params)
    ids = encode_prompt(params, args.prompt, chat=chat)
    nl, dnl = newline_masks(params.tokenizer.tokenizer, params.cfg.vocab_size)
    reset = dataclasses.replace(reset, nl_mask=jnp.asarray(nl), dnl_mask=jnp.asarray(dnl))
    _err(f"# compare {_model_line(args, params)}; {sampler_label(reset)}{source}")
    result = compare.compare(params, ids, steps=args.steps, reset=reset, repeats=args.repeats)
    result = dict(result, model=args.model, prompt=args.prompt, chat=chat)
    result["versions"] = bench.versions()
    print(compare.format_table(result))
    if args.out:
        _write_json(args.out, result)
        print(f"wrote {args.out}")
    return 0


# ----------------------------------------------------------------------------------------------
# parser


def build_parser() -> argparse.ArgumentParser:
    """The `rejax` argument parser (sub-commands generate, eval, calibrate, bench, compare)."""
    parser = argparse.ArgumentParser(
        prog="rejax",
        description="NVFP4 (W4A4) reasoning in JAX with the ReSET sampler.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    g = sub.add_parser(
        "generate",
        help="stream one response with per-step entropy/temperature, or sample a prompts file",
        description="Stream one response. The text goes to stdout; after every reasoning step "
        "(a blank line) stderr gets a line with the step's token count, mean/max "
        "raw entropy (nats) and the share of tokens at T_low / T_high. With --prompts, "
        "--n > 1 or --json the rows are decoded together (one compiled loop) and printed "
        "when done.",
    )
    _add_model_args(g)
    _add_scale_texts_arg(g)
    _add_kv_args(g)
    _add_sampler_args(g)
    g.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=None,
        metavar="N",
        help="tokens to generate at most (default: 512, or what the model's context leaves)",
    )
    _add_prompt_args(g)
    g.add_argument("--no-stats", action="store_true", help="do not print per-step statistics")
    g.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="read prompts from FILE: one per line, or JSONL with a 'prompt' (or 'problem') field",
    )
    g.add_argument(
        "--n", type=_positive_int, default=1, metavar="N", help="samples per prompt (default: 1)"
    )
    g.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per row (prompt_index, sample, prompt, text, tokens, "
        "entropy, temperature, finish_reason) instead of the text",
    )
    g.add_argument(
        "prompt",
        nargs="?",
        default=None,
        metavar="PROMPT",
        help="the prompt text (a problem); '-' reads it from stdin",
    )
    g.set_defaults(func=_cmd_generate)

    e = sub.add_parser(
        "eval",
        help="avg@n with a 95%% CI on a math, multiple-choice or code problem file",
        description="Sample n responses per problem (problems x n rows per compiled batch), "
        "grade them (math: the last \\boxed{} answer, else the last number, with numeric "
        "normalisation; mcq: the answer letter; code: every test in a sandboxed process) "
        "and report avg@n with a 95% CI that treats problems as the sampling unit (normal "
        "approximation over per-problem means, a bootstrap over problems, or a Wilson score "
        "interval; the first two fall back to Wilson when they are degenerate).",
    )
    e.add_argument(
        "--task",
        default="math",
        choices=("math", "mcq", "code", "countdown"),
        help="math: AIME-style JSONL (problem, answer); mcq: GPQA CSV/JSONL; code: "
        "LiveCodeBench code_generation_lite JSONL; countdown: the bundled search task's JSONL "
        "(problem, numbers, target) (default: math)",
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
    _add_scale_texts_arg(e)
    _add_kv_args(e)
    _add_sampler_args(e)
    e.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=None,
        metavar="N",
        help="tokens per response at most (default: 1024, or what the model's context leaves)",
    )
    e.add_argument(
        "--batch-size",
        type=_positive_int,
        default=None,
        metavar="B",
        help="problems decoded together (B x n rows; default: max(1, 64 // n))",
    )
    e.add_argument(
        "--slots",
        type=_positive_int,
        default=None,
        metavar="B",
        help="decode through B row slots, refilling a slot with the next (problem, sample) "
        "as soon as its row ends (same responses as batches; excludes --batch-size)",
    )
    e.add_argument(
        "--slots-compact",
        action=argparse.BooleanOptionalAction,
        default="auto",
        help="with --slots, move the last rows into smaller programs once no problem is left "
        "to refill a slot: by default B/2, B/4, ... down to 16 rows (the same responses; on a "
        "GPU only with --xla-autotune off, on the CPU for float32 weights only, else all B "
        "slots are kept); --slots-compact down "
        "to 1 row (below 16 a GPU's rounding may change a token); --no-slots-compact keeps "
        "all B",
    )
    e.add_argument(
        "--prefill-rows",
        type=_positive_int,
        default=None,
        metavar="P",
        help="rows prefilled together: batches in chunks of P prompts, --slots refills of P "
        "rows (default: a batch at once, refills of max(1, B // 16)); the same P gives "
        "batches and slots the same prefill shapes, and so the same responses on a GPU",
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
        choices=ev.CI_METHODS,
        help="95%% CI method; normal and bootstrap fall back to wilson for one problem or "
        "when every problem scores the same (default: normal)",
    )
    e.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    _add_mesh_arg(e)
    _add_prompt_args(e)
    e.set_defaults(func=_cmd_eval)

    c = sub.add_parser(
        "calibrate",
        help="calibrate ReSET's tau0 (80th entropy percentile)",
        description="tau0 = the 80th percentile of the raw (T=1, full-vocabulary) token "
        "entropy of the quantized model sampling at T=0.6 on calibration problems "
        "(the entropy ReSET thresholds). Also reports the processed-score "
        "percentile, dumps every token entropy (npz) with a JSON summary, plots bf16 vs "
        "quantized entropy histograms (PNG, needs matplotlib) and prints the flags to paste "
        f"(--reset-json writes them as the model's {RESET_FILE}).",
    )
    _add_model_args(c)
    _add_scale_texts_arg(c)
    c.add_argument(
        "--data",
        default=None,
        metavar="FILE",
        help=(
            "JSONL calibration problems (default: validation problems of the bundled task the "
            "model was trained on: Countdown for --model countdown, else arithmetic)"
        ),
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
        default=None,
        metavar="N",
        help="tokens per response at most (default: 4096, or what the model's context leaves)",
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
    c.add_argument(
        "--reset-json",
        default=None,
        metavar="FILE",
        help=f"also write the ReSET settings (tau_0, t_low) as JSON to FILE; saved as "
        f"MODEL_DIR/{RESET_FILE} they become the model's defaults",
    )
    _add_prompt_args(c)
    c.set_defaults(func=_cmd_calibrate)

    b = sub.add_parser(
        "bench",
        help="decode speed: ms/token, tokens/s, bandwidth against a copy ceiling",
        description="Time the jitted prefill and decode loop (greedy, no early stop) of a "
        "checkpoint or of a preset config with random weights: ms/token, tokens/s, weight + "
        "KV-cache bytes per step and the bandwidth they imply next to a copy ceiling "
        "measured in the same run, prefill time and first-call (compile + run) time. "
        "Medians of --repeats calls, warm-up excluded.",
    )
    src = b.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        default=None,  # None, not "tiny": argparse sees a conflict only for a non-default value
        metavar="PATH|tiny|countdown",
        help="checkpoint directory, or a bundled model, 'tiny' or 'countdown' (default: tiny)",
    )
    src.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        help="a preset config with random weights instead of a checkpoint",
    )
    b.add_argument(
        "--layers",
        type=_positive_int,
        default=None,
        metavar="N",
        help="with --preset: keep only N decoder layers (quick runs)",
    )
    b.add_argument(
        "--quant",
        nargs="+",
        default=["bf16", "nvfp4"],
        choices=sorted(QUANTS),
        help="linear formats to time (default: bf16 nvfp4)",
    )
    b.add_argument(
        "--batch",
        nargs="+",
        type=_positive_int,
        default=[1],
        metavar="B",
        help="batch sizes (default: 1)",
    )
    b.add_argument(
        "--new-tokens",
        nargs="+",
        type=_positive_int,
        default=[128],
        metavar="N",
        help="generated tokens per row (default: 128)",
    )
    b.add_argument(
        "--prompt-len",
        type=_positive_int,
        default=64,
        metavar="N",
        help="random prompt tokens per row (default: 64)",
    )
    b.add_argument(
        "--repeats",
        type=_positive_int,
        default=3,
        metavar="R",
        help="timed calls per point, median reported (default: 3)",
    )
    b.add_argument(
        "--copy-mib",
        type=_positive_int,
        default=256,
        metavar="M",
        help="copy-ceiling buffer size in MiB (default: 256)",
    )
    b.add_argument("--seed", type=int, default=0, metavar="S", help="PRNG seed (default: 0)")
    b.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="write the results (numbers, config, git sha, versions, device) as JSON",
    )
    _add_mesh_arg(b)
    b.set_defaults(func=_cmd_bench)

    k = sub.add_parser(
        "compare",
        help="JAX against the Torch path on the same weights",
        description="Decode a greedy trace with JAX, teacher-force prompt + trace through "
        "rejax.logits and rejax.torch_ref.forward, and report logits max |diff| and relative "
        "error, top-1 agreement and entropy difference on the trace, ReSET decision agreement "
        "(rejax.sampling vs TorchReSET) and time per step / forward of each.",
    )
    _add_model_args(k)
    k.add_argument(
        "--prompt",
        default=None,
        metavar="TEXT",
        help="prompt text (default: a validation problem of the bundled task the model was trained on)",
    )
    k.add_argument(
        "--steps",
        type=_positive_int,
        default=32,
        metavar="N",
        help="greedy trace length (default: 32)",
    )
    _add_reset_threshold_args(k)
    k.add_argument(
        "--repeats",
        type=_positive_int,
        default=3,
        metavar="R",
        help="timed calls per measurement, median reported (default: 3)",
    )
    k.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="write the results as JSON",
    )
    _add_prompt_args(k)
    k.set_defaults(func=_cmd_compare, t_high=None, top_p=None)
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
