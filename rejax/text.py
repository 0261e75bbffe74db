"""Text handling on the host: the tokenizer handle, chat template, prompt ids, stop and newline
masks, and ReSET's step rule.

Nothing here runs on the device: generation (rejax/generate.py), evaluation (rejax/eval/) and
the command line (rejax/cli.py) turn text into token ids, and token ids into step spans, only
through these functions. Token-id sets are boolean [V] masks built once per call. jinja2 (chat
templates) is imported when a template is first rendered: it is an optional dependency.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import itertools
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from rejax.params import Params


class HostTokenizer:
    """Host-side tokenizer handle carried as static pytree metadata.

    Hashes and compares by a digest of its content (vocabulary, chat template, special tokens),
    so two loads of the same checkpoint share every compiled function, and carrying it in
    `Params` never retraces a jitted function.
    """

    def __init__(
        self, tokenizer: Any, chat_template: str | None = None, special_tokens: dict | None = None
    ):
        self.tokenizer = tokenizer  # a `tokenizers.Tokenizer`
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        h = hashlib.sha256()
        body = tokenizer.to_str() if hasattr(tokenizer, "to_str") else repr(id(tokenizer))
        for part in (body, chat_template or "", repr(sorted(self.special_tokens.items()))):
            h.update(part.encode())
            h.update(b"\0")
        self.digest = h.hexdigest()

    def __hash__(self):
        return hash(self.digest)

    def __eq__(self, other):
        return isinstance(other, HostTokenizer) and self.digest == other.digest


def require_tokenizer(params: Params, what: str):
    """The params' `tokenizers.Tokenizer`; a ValueError naming `what` needs it if there is none."""
    if params.tokenizer is None or params.tokenizer.tokenizer is None:
        raise ValueError(
            f"{what} needs a tokenizer, but these params carry none "
            "(load a checkpoint with tokenizer.json or pass token ids)"
        )
    return params.tokenizer.tokenizer


def has_chat_template(params: Params) -> bool:
    """Whether the checkpoint carries a chat template (`chat=True` then works)."""
    return params.tokenizer is not None and bool(params.tokenizer.chat_template)


# ----------------------------------------------------------------------------- prompts


def render_chat(params: Params, content: str) -> str:
    """Renders one user message with the checkpoint's chat template (as transformers does).

    Uses a sandboxed jinja2 environment with transformers' settings (trim_blocks,
    lstrip_blocks, loopcontrols, a non-escaping `tojson`, `raise_exception`,
    `strftime_now`) and add_generation_prompt=True.

    Raises:
        ValueError: if the params carry no chat template.
    """
    host = params.tokenizer
    template = None if host is None else host.chat_template
    if not template:
        raise ValueError(
            "chat=True but the checkpoint has no chat template "
            "(tokenizer_config.json 'chat_template' or chat_template.jinja)"
        )
    return _compile_template(template).render(
        messages=[{"role": "user", "content": content}],
        tools=None,
        documents=None,
        add_generation_prompt=True,
        **host.special_tokens,
    )


@functools.lru_cache(maxsize=8)
def _compile_template(template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def _check_ids(ids: Sequence[int], vocab_size: int, where: str) -> list[int]:
    out = [int(t) for t in ids]
    if not out:
        raise ValueError(f"{where} is empty; every prompt needs at least one token")
    bad = [t for t in out if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{where} holds token ids {bad[:5]} outside [0, {vocab_size})")
    return out


def encode_prompt(params: Params, text: str, *, chat: bool) -> list[int]:
    """Token ids of one text prompt: the one tokenisation rule of generation and evaluation.

    chat=True renders one user message through the checkpoint's chat template (`render_chat`)
    and encodes it without extra special tokens; chat=False encodes the raw text with the
    tokenizer's own post-processing.
    """
    tok = require_tokenizer(params, "a text prompt")
    if chat:
        return list(tok.encode(render_chat(params, text), add_special_tokens=False).ids)
    return list(tok.encode(text).ids)


def prompt_ids(params: Params, prompt, chat: bool) -> list[list[int]]:
    """Checks a `generate` prompt argument and returns one id list per prompt.

    Args:
        params: the model (a tokenizer for text prompts).
        prompt: a str, a non-empty list of str, or a list of token-id lists.
        chat: render text prompts with the chat template (text prompts only).

    Returns:
        One list of ids in [0, V) per prompt, none empty.
    """
    v = params.cfg.vocab_size
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise ValueError(
            f"prompt must be a str, a non-empty list of str, or a list of token-id "
            f"lists; got {type(prompt).__name__} {prompt!r:.80}"
        )
    if all(isinstance(p, str) for p in prompt):
        tok = require_tokenizer(params, "a text prompt")
        out = []
        for i, p in enumerate(prompt):
            if not p:
                raise ValueError(f"prompt[{i}] is the empty string")
            if chat:
                ids = tok.encode(render_chat(params, p), add_special_tokens=False).ids
            else:
                ids = tok.encode(p).ids
            out.append(_check_ids(ids, v, f"prompt[{i}] ({p!r:.40} tokenized)"))
        return out
    if all(isinstance(p, (list, tuple, np.ndarray)) for p in prompt):
        if chat:
            raise ValueError("chat=True needs text prompts, got token ids")
        return [_check_ids(p, v, f"prompt[{i}]") for i, p in enumerate(prompt)]
    if all(isinstance(p, (int, np.integer)) for p in prompt):
        raise ValueError(
            f"token-id prompts must be a list of lists (one per prompt), e.g. [{list(prompt)[:4]}]"
            f"; got a flat list of {len(prompt)} ints"
        )
    raise ValueError(
        "prompt must be a str, a list of str, or a list of token-id lists; got a "
        f"list mixing {sorted({type(p).__name__ for p in prompt})}"
    )


# ----------------------------------------------------------------------------- token masks


def stop_mask(params: Params, stop) -> np.ndarray:
    """The stop-token set as a bool [V] mask.

    Args:
        params: the model.
        stop: None (the config's EOS ids and generation_config.json's eos_token_id), or stop
            entries: token ids, or strings that encode to exactly one token.

    Returns:
        bool [V] numpy mask.
    """
    v = params.cfg.vocab_size
    if stop is None:
        ids = set(params.cfg.eos_token_ids)
        eos = dict(params.generation_config).get("eos_token_id")
        if eos is not None:
            ids |= set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}
    else:
        if isinstance(stop, (str, int)):
            stop = [stop]
        ids = set()
        for s in stop:
            if isinstance(s, str):
                enc = require_tokenizer(params, f"stop string {s!r}").encode(
                    s, add_special_tokens=False
                )
                if len(enc.ids) != 1:
                    raise ValueError(
                        f"stop string {s!r} is {len(enc.ids)} tokens {enc.ids}; "
                        "stop entries must be single tokens"
                    )
                ids.add(enc.ids[0])
            else:
                ids.add(int(s))
    bad = sorted(t for t in ids if not 0 <= t < v)
    if bad:
        raise ValueError(f"stop token ids {bad} outside [0, {v})")
    mask = np.zeros((v,), bool)
    mask[sorted(ids)] = True
    return mask


def newline_masks(tokenizer: Any, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """Boolean masks of the single-newline and double-newline token ids (the paper's step rule).

    NL = ids whose single-token decode (special tokens kept) is exactly "\\n"; DNL = ids whose
    decode contains "\\n\\n". Ids the tokenizer does not have (>= its vocabulary size, e.g. the
    padding rows of an embedding) are False.

    Args:
      tokenizer: a `tokenizers.Tokenizer`, a transformers tokenizer, or anything with
        `decode(list[int])` and `get_vocab()`.
      vocab_size: V, the logits' vocabulary size.

    Returns:
      (nl_mask bool [V], dnl_mask bool [V]).
    """
    if not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size!r} is invalid: expected an int >= 1")
    if hasattr(tokenizer, "decode_batch") and hasattr(tokenizer, "get_vocab_size"):
        # tokenizers.Tokenizer: the base vocabulary, decoded in one call into the Rust library.
        n = tokenizer.get_vocab_size(with_added_tokens=False)
        texts = tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    elif hasattr(tokenizer, "batch_decode") and hasattr(tokenizer, "vocab_size"):
        n = tokenizer.vocab_size
        texts = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False)
    elif hasattr(tokenizer, "decode") and hasattr(tokenizer, "get_vocab"):
        n = max(tokenizer.get_vocab().values()) + 1
        texts = [tokenizer.decode([i]) for i in range(n)]
    else:
        raise ValueError(
            f"tokenizer of type {type(tokenizer).__name__} has no decode_batch/batch_decode/"
            "decode: expected a tokenizers.Tokenizer or a transformers tokenizer"
        )
    if n > vocab_size:
        raise ValueError(
            f"the tokenizer has {n} ids but vocab_size={vocab_size}: the logits must cover "
            "every token id"
        )
    arr = np.array(texts, dtype=object).astype(str)
    nl = np.zeros(vocab_size, np.bool_)
    dnl = np.zeros(vocab_size, np.bool_)
    nl[:n] = arr == "\n"
    dnl[:n] = np.char.find(arr, "\n\n") >= 0
    return jnp.asarray(nl), jnp.asarray(dnl)


# ----------------------------------------------------------------------------- step rule


def ends_step(nl_last, dnl_last, nl_before):
    """ReSET's step rule, the one copy: the token just generated ends the current step iff it is
    a double-newline token, or it and the token before it are both single-newline tokens (the
    boundary token belongs to the step it ends). Works elementwise on bools, numpy or jax arrays.

    Args:
        nl_last, dnl_last: whether the last token is in the single / double newline set.
        nl_before: whether the token before it is a single-newline token (False at the start).
    """
    return dnl_last | (nl_last & nl_before)


def step_spans(tokens: Sequence[int], nl_mask, dnl_mask) -> list[tuple[int, int]]:
    """Splits a response into reasoning steps with `ends_step`.

    Args:
        tokens: generated ids (prompt excluded).
        nl_mask, dnl_mask: bool [V] masks from `newline_masks`.

    Returns:
        [(start, end)] half-open spans covering all tokens, in order.
    """
    nl, dnl = np.asarray(nl_mask), np.asarray(dnl_mask)
    ids = np.asarray(tokens, np.int64).reshape(-1)
    if ids.size == 0:
        return []
    before = np.concatenate([[False], nl[ids[:-1]]])
    ends = ends_step(nl[ids], dnl[ids], before)
    bounds = [0, *(int(t) + 1 for t in np.flatnonzero(ends[:-1])), ids.size]
    return list(itertools.pairwise(bounds))
