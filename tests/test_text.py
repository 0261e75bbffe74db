"""rejax.text: ReSET's step rule (one copy for the device loop, the evaluator and the CLI), the
one prompt tokenisation rule, and the stop-token mask."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from rejax.config import Config
from rejax.params import init_params
from rejax.sampling import ReSET, reset_init, reset_observe
from rejax.text import HostTokenizer, encode_prompt, ends_step, prompt_ids, step_spans, stop_mask

NL, DNL = 1, 2  # token ids of "\n" and "\n\n" in the scripted vocabularies below


def _masks(v: int = 8):
    nl, dnl = np.zeros(v, bool), np.zeros(v, bool)
    nl[NL], dnl[DNL] = True, True
    return nl, dnl


@pytest.mark.parametrize(
    "nl_last,dnl_last,nl_before,ends",
    [
        (False, False, False, False),  # text
        (True, False, False, False),  # one newline after text
        (True, False, True, True),  # the second newline in a row
        (False, True, False, True),  # a double newline ends a step on its own
        (False, True, True, True),
        (False, False, True, False),  # text after a newline
    ],
)
def test_ends_step_table(nl_last, dnl_last, nl_before, ends):
    assert bool(ends_step(nl_last, dnl_last, nl_before)) is ends
    vec = ends_step(np.array([nl_last]), np.array([dnl_last]), np.array([nl_before]))
    assert vec.tolist() == [ends]


def test_step_spans_scripted():
    a, b = 3, 4
    tokens = [a, NL, b, NL, NL, a, DNL, b, DNL]
    assert step_spans(tokens, *_masks()) == [(0, 5), (5, 7), (7, 9)]
    assert step_spans([NL, NL, NL], *_masks()) == [(0, 2), (2, 3)]


def test_device_rule_cuts_where_the_host_rule_does():
    """`reset_observe` (jitted loop) clears the in-step sums exactly after the tokens that end a
    `step_spans` span."""
    nl, dnl = _masks()
    cfg = ReSET(window=2, nl_mask=jnp.asarray(nl), dnl_mask=jnp.asarray(dnl))
    rng = np.random.default_rng(0)
    tokens = rng.choice([NL, NL, DNL, 3, 4, 5], size=120).tolist()
    state = reset_init(1, 2)
    cleared = []
    for t, tok in enumerate(tokens):
        state = dataclasses.replace(state, s_n=jnp.ones((1,), jnp.int32))
        state = reset_observe(state, jnp.asarray([tok], jnp.int32), cfg)
        if int(state.s_n[0]) == 0:
            cleared.append(t + 1)
    ends = [end for _, end in step_spans(tokens, nl, dnl)]
    assert cleared[: len(ends) - 1] == ends[:-1]
    assert len(cleared) in (len(ends) - 1, len(ends))  # the last token may end a step too


def _word_params(v: int = 16, eos=(9,)):
    words = ["<unk>", "\n", "\n\n", "hello", "world", "a", "b"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    host = HostTokenizer(tok, chat_template=template)
    cfg = Config(vocab_size=v, eos_token_ids=eos, max_position_embeddings=64)
    return init_params(cfg, 0, jnp.float32, tokenizer=host)


def test_prompt_ids_encode_each_text_with_the_one_rule():
    params = _word_params()
    assert encode_prompt(params, "hello world", chat=False) == [3, 4]
    assert prompt_ids(params, ["hello world", "a"], chat=False) == [[3, 4], [5]]
    assert prompt_ids(params, [[1, 2], [3]], chat=False) == [[1, 2], [3]]
    with pytest.raises(ValueError, match=r"prompt\[1\] is the empty string"):
        prompt_ids(params, ["a", ""], chat=False)
    with pytest.raises(ValueError, match="outside"):
        prompt_ids(params, [[1, 99]], chat=False)


def test_stop_mask():
    params = _word_params(eos=(9,))
    assert np.flatnonzero(stop_mask(params, None)).tolist() == [9]
    assert np.flatnonzero(stop_mask(params, ["world", 7])).tolist() == [4, 7]
    with pytest.raises(ValueError, match="stop token ids"):
        stop_mask(params, [16])
