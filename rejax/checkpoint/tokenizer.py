"""Tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja) and
generation_config.json: read into `HostTokenizer` / a hashable tuple, and written back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from rejax.checkpoint.files import read_json, write_json
from rejax.text import HostTokenizer

# ----------------------------------------------------------------------------- tokenizer, gen cfg


def _special_token(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(directory: Path) -> HostTokenizer | None:
    tok_path = directory / "tokenizer.json"
    if not tok_path.exists():
        return None
    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as e:  # the tokenizers library raises a bare Exception on bad files
        raise ValueError(f"{tok_path}: cannot be loaded by tokenizers ({e})") from e
    tcfg_path = directory / "tokenizer_config.json"
    tcfg = read_json(tcfg_path) if tcfg_path.exists() else {}
    chat_template = tcfg.get("chat_template")
    if isinstance(chat_template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
        chat_template = named.get("default") or next(iter(named.values()), None)
    jinja = directory / "chat_template.jinja"
    if jinja.exists():
        chat_template = jinja.read_text()
    special = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = _special_token(tcfg.get(key))
        if token is not None:
            special[key] = token
    extra = [_special_token(t) for t in tcfg.get("additional_special_tokens") or []]
    if extra:
        special["additional_special_tokens"] = tuple(t for t in extra if t is not None)
    return HostTokenizer(tokenizer, chat_template=chat_template, special_tokens=special)


def _hashable(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


def load_generation_config(directory: Path) -> tuple:
    gpath = directory / "generation_config.json"
    if not gpath.exists():
        return ()
    return _hashable(read_json(gpath))


def unhashable(value: Any) -> Any:
    if isinstance(value, tuple):
        if value and all(
            isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str) for v in value
        ):
            return {k: unhashable(v) for k, v in value}
        return [unhashable(v) for v in value]
    return value


def save_tokenizer(host: HostTokenizer, directory: Path) -> None:
    host.tokenizer.save(str(directory / "tokenizer.json"))
    tcfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, value in host.special_tokens.items():
        tcfg[key] = list(value) if isinstance(value, tuple) else value
    if host.chat_template is not None:
        tcfg["chat_template"] = host.chat_template
    write_json(directory / "tokenizer_config.json", tcfg)
    jinja = directory / "chat_template.jinja"
    if jinja.exists():  # a stale template would override the one just written
        jinja.unlink()
