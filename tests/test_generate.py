"""Generation tests: the jitted loop, determinism, retracing, stops, streaming, chat, ReSET."""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from rejax.config import Config
from rejax.params import init_params
from rejax.sampling import Greedy, ReSET, Temperature, sample, sampler_init
from rejax.text import HostTokenizer, newline_masks, render_chat

# The module, not the `rejax.generate` function the package exports.
gen = importlib.import_module("rejax.generate")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EOS = 257


def _byte_tokenizer() -> Tokenizer:
    """Byte-level BPE: 256 byte tokens, one merge "\\n\\n" (id 256), two special tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["ĊĊ"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Ċ", "Ċ")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_end|>", "<|im_start|>"])  # ids 257, 258
    return tok


@pytest.fixture(scope="module")
def params():
    """A tiny random Qwen3 (V=272) whose logits are far from uniform, with a tokenizer."""
    cfg = Config(vocab_size=272, eos_token_ids=(EOS,), max_position_embeddings=128)
    host = HostTokenizer(
        _byte_tokenizer(), chat_template=CHAT_TEMPLATE, special_tokens={"eos_token": "<|im_end|>"}
    )
    p = init_params(cfg, 7, jnp.float32, tokenizer=host)
    # normal(0.02) weights give near-uniform logits; scale matrices up for a peaked model.
    w = jax.tree_util.tree_map(lambda x: x * 10.0 if x.ndim == 2 else x, p.weights)
    return dataclasses.replace(p, weights=w)


def test_text_prompt_roundtrip_and_fields(params):
    out = gen.generate(params, "hello\n\nworld", max_new_tokens=6, stop=[])
    assert len(out.tokens) == 1 and len(out.tokens[0]) == 6
    assert out.text[0] == params.tokenizer.tokenizer.decode(out.tokens[0], skip_special_tokens=True)
    assert len(out.entropy[0]) == 6 and len(out.temperature[0]) == 6
    assert out.temperature[0] == [0.0] * 6  # greedy
    assert all(0 < e < np.log(272) + 1e-4 for e in out.entropy[0])
    assert out.finish_reason == ["length"]


def test_greedy_equals_argmax_of_full_logits(params):
    prompt = [3, 99, 4, 120, 7]
    out = gen.generate(params, [prompt], max_new_tokens=8, stop=[])
    # Causal: the full sequence's logits at position p are the step-by-step logits.
    lg = gen.logits(params, [prompt + out.tokens[0]])[0, len(prompt) - 1 : -1]
    assert np.asarray(jnp.argmax(lg, axis=-1)).tolist() == out.tokens[0]
    assert len(set(out.tokens[0])) > 1


def test_deterministic_for_a_key_and_independent_of_batching(params):
    prompts = ["abc", "a much longer prompt here", "xy"]
    s = Temperature(1.0)
    a = gen.generate(params, prompts, max_new_tokens=10, sampler=s, key=3, n=2, stop=[])
    b = gen.generate(
        params, prompts, max_new_tokens=10, sampler=s, key=3, n=2, stop=[], batch_size=1
    )
    c = gen.generate(params, prompts, max_new_tokens=10, sampler=s, key=4, n=2, stop=[])
    assert len(a.tokens) == 6
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    assert a.tokens[0] != a.tokens[1]  # the n samples of one prompt differ
    np.testing.assert_allclose(a.entropy[2], b.entropy[2], rtol=1e-5)


def test_no_retrace_on_second_call(params):
    s1, s2 = Temperature(0.7, top_p=0.9), Temperature(1.3, top_p=0.5)
    gen.generate(params, ["first", "second"], max_new_tokens=5, sampler=s1, key=0)
    before = dict(gen.TRACE_COUNTS)
    # New prompts of the same bucket, new traced hyperparameters, new key: same shapes.
    gen.generate(params, ["third!", "4"], max_new_tokens=5, sampler=s2, key=1)
    gen.generate(params, [[1, 2, 3], [4]], max_new_tokens=5, sampler=s1, key=2)
    assert dict(gen.TRACE_COUNTS) == before
    # The last batch of three prompts with batch_size=2 is padded with a dummy row: the same
    # [2, bucket] shapes again, so still no retrace, and the padding row is dropped.
    out = gen.generate(params, ["a", "b", "c"], max_new_tokens=5, sampler=s1, batch_size=2)
    assert dict(gen.TRACE_COUNTS) == before
    assert len(out.tokens) == 3 and all(len(t) == 5 for t in out.tokens)


def test_decode_step_does_not_retrace(params):
    sampler = Greedy()
    cache = gen.init_cache(params.cfg, 1, 40, jnp.float32)
    tokens = jnp.array([[5, 6, 7]], jnp.int32)
    logits, cache = gen.prefill(params, tokens, jnp.arange(3, dtype=jnp.int32)[None], cache)
    state = sampler_init(sampler, 1)
    keys = gen._row_keys(jax.random.key(0), 0, 1)
    pos = jnp.array([3], jnp.int32)
    _, logits, cache, state, _ = gen.decode_step(
        params, logits, cache, pos, sampler, state, keys, jnp.int32(0)
    )
    before = gen.TRACE_COUNTS["decode_step"]
    for step in range(1, 4):
        _, logits, cache, state, _ = gen.decode_step(
            params, logits, cache, pos + step, sampler, state, keys, jnp.int32(step)
        )
    assert gen.TRACE_COUNTS["decode_step"] == before


def test_stop_tokens_end_rows(params):
    full = gen.generate(params, ["abc", "zz"], max_new_tokens=8, stop=[])
    # a token row 0 generates and row 1 never does: row 0 stops at it, row 1 runs to the end
    only_row0 = [t for t in full.tokens[0][1:] if t not in full.tokens[1]]
    assert only_row0, (full.tokens, "pick other prompts: the rows share every token")
    stop_tok = only_row0[0]
    out = gen.generate(params, ["abc", "zz"], max_new_tokens=8, stop=[stop_tok])
    first = full.tokens[0].index(stop_tok)
    assert out.tokens[0] == full.tokens[0][: first + 1]
    assert out.finish_reason[0] == "stop"
    assert out.tokens[1] == full.tokens[1] and out.finish_reason[1] == "length"
    # Default stop ids: the config's EOS.
    eos_params = dataclasses.replace(
        params, cfg=dataclasses.replace(params.cfg, eos_token_ids=(stop_tok,))
    )
    out2 = gen.generate(eos_params, ["abc"], max_new_tokens=8)
    assert out2.tokens[0] == out.tokens[0] and out2.finish_reason == ["stop"]


def test_stream_matches_batch_generation(params):
    pieces = []
    s = Temperature(0.8)
    out = gen.generate(
        params, "stream me", max_new_tokens=9, sampler=s, key=11, stream=pieces.append, stop=[]
    )
    ref = gen.generate(params, "stream me", max_new_tokens=9, sampler=s, key=11, stop=[])
    assert out.tokens == ref.tokens
    assert "".join(pieces) == ref.text[0]
    np.testing.assert_allclose(out.entropy[0], ref.entropy[0], rtol=1e-5)


def test_stream_prints_to_stdout(params, capsys):
    out = gen.generate(params, "hi", max_new_tokens=4, stream=True, stop=[])
    assert capsys.readouterr().out == out.text[0]


def test_progress_bar_for_batches(params, capsys):
    gen.generate(params, ["a", "b", "c"], max_new_tokens=2, batch_size=1)
    assert "generate" in capsys.readouterr().err
    gen.generate(params, ["a", "b", "c"], max_new_tokens=2, batch_size=1, progress=False)
    assert "generate" not in capsys.readouterr().err


def test_chat_template_matches_transformers(params):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=params.tokenizer.tokenizer, eos_token="<|im_end|>"
    )
    hf.chat_template = CHAT_TEMPLATE
    want = hf.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert render_chat(params, "2+2?") == want
    ids = params.tokenizer.tokenizer.encode(want, add_special_tokens=False).ids
    a = gen.generate(params, "2+2?", chat=True, max_new_tokens=4, stop=[])
    b = gen.generate(params, [ids], max_new_tokens=4, stop=[])
    assert a.tokens == b.tokens


def test_reset_inside_generate_equals_sampling_step_by_step(params):
    prompts = ["Step one.\n\nStep", "x = 1\n"]
    probe = gen.generate(params, prompts, max_new_tokens=16, stop=[])
    ent = np.concatenate([np.asarray(e) for e in probe.entropy])
    # A threshold inside the observed entropy range, so both temperatures occur.
    sampler = ReSET(t_high=1.0, t_low=0.3, tau_0=float(np.median(ent)), window=4)
    out = gen.generate(params, prompts, max_new_tokens=16, sampler=sampler, key=9, stop=[])
    nl, dnl = newline_masks(params.tokenizer.tokenizer, params.cfg.vocab_size)
    full = dataclasses.replace(sampler, nl_mask=nl, dnl_mask=dnl)
    temps = set()
    step = jax.jit(sample)
    for r, text in enumerate(prompts):
        seq = params.tokenizer.tokenizer.encode(text).ids
        # Causal: the full sequence's logits at position p are the step-by-step logits.
        all_logits = gen.logits(params, [seq + out.tokens[r]])[0, len(seq) - 1 : -1]
        state = sampler_init(full, 1)
        for i, tok in enumerate(out.tokens[r]):
            lg = all_logits[i][None]
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(9), r), i)
            got, state, info = step(key[None], lg, state, full)
            assert int(got[0]) == tok, f"row {r} step {i}"
            np.testing.assert_allclose(
                out.temperature[r][i], float(info["temperature"][0]), rtol=1e-6
            )
            # the logits of the full-sequence forward and of the decode steps are two programs;
            # on a GPU their bf16 rounding differs (entropies 1.02e-4 apart on the H200)
            rtol = 1e-4 if jax.default_backend() == "cpu" else 5e-4
            np.testing.assert_allclose(out.entropy[r][i], float(info["entropy"][0]), rtol=rtol)
            temps.add(round(out.temperature[r][i], 4))
    assert temps == {1.0, 0.3}


@pytest.mark.parametrize(
    "prompt,kw,match",
    [
        ("", {}, "empty"),
        ([], {}, "non-empty list"),
        ([[]], {}, "empty"),
        ([[1, 300]], {}, "outside"),
        (["ok", [1, 2]], {}, "mixing"),
        ([1, 2, 3], {}, "list of lists"),
        ("ok", {"max_new_tokens": 0}, "max_new_tokens"),
        ("ok", {"max_new_tokens": -3}, "max_new_tokens"),
        ("ok", {"max_new_tokens": 130}, "max_position_embeddings"),
        ("x" * 120, {"max_new_tokens": 10}, "max_position_embeddings"),
        ("ok", {"sampler": "greedy"}, "unknown sampler type"),
        ("ok", {"n": 0}, "n must be"),
        ("ok", {"batch_size": 0}, "batch_size"),
        ("ok", {"stop": ["ab"]}, "single tokens"),
        ("ok", {"stop": [999]}, "outside"),
        (["a", "b"], {"stream": True}, "single prompt"),
        ([[1, 2]], {"chat": True}, "text prompts"),
    ],
)
def test_bad_input_raises(params, prompt, kw, match):
    with pytest.raises(ValueError, match=match):
        gen.generate(params, prompt, **{"max_new_tokens": 4, **kw})


def test_missing_tokenizer_or_template_raises(params):
    bare = dataclasses.replace(params, tokenizer=None)
    with pytest.raises(ValueError, match="tokenizer"):
        gen.generate(bare, "text", max_new_tokens=2)
    with pytest.raises(ValueError, match="tokenizer"):
        gen.generate(bare, [[1, 2]], max_new_tokens=2, sampler=ReSET())
    no_template = dataclasses.replace(params, tokenizer=HostTokenizer(_byte_tokenizer()))
    with pytest.raises(ValueError, match="chat template"):
        gen.generate(no_template, "text", chat=True, max_new_tokens=2)
    out = gen.generate(bare, [[1, 2]], max_new_tokens=2, stop=[])
    assert out.text == [""] and len(out.tokens[0]) == 2


def test_command_buffer_while_reaches_xla_and_keeps_the_tokens(params):
    """Config.command_buffer="while" compiles the decode loop with XLA's command-buffer types as
    per-executable compiler options (a bad type is refused by XLA, so the options do reach
    it); its tokens equal "default"'s (CPU ignores GPU command buffers); each choice compiles
    once; an unknown choice is refused."""
    from rejax import decode as rdecode
    from rejax.config import COMMAND_BUFFER_OPTIONS

    assert "WHILE" in COMMAND_BUFFER_OPTIONS["while"]["xla_gpu_enable_command_buffer"]
    looped = dataclasses.replace(
        params, cfg=dataclasses.replace(params.cfg, command_buffer="while")
    )
    sampler = ReSET(t_low=0.3, t_high=1.0, tau_0=0.5, window=4, top_p=0.9)
    want = gen.generate(params, ["one", "two!"], max_new_tokens=7, sampler=sampler, key=3, n=2)
    got = gen.generate(looped, ["one", "two!"], max_new_tokens=7, sampler=sampler, key=3, n=2)
    assert got.tokens == want.tokens and got.temperature == want.temperature
    assert rdecode.decode_loop.jitted(looped) is not rdecode.decode_loop.jitted(params)
    # "listed" (the control: XLA's default types, no WHILE) and "while_unroll" (WHILE, and
    # known-trip-count loops unrolled in the graph: an option XLA must accept) compile and keep
    # the tokens too; every choice but "default" names the dynamic-slice fusions, without which
    # no while loop around them converts
    listed_types = COMMAND_BUFFER_OPTIONS["listed"]["xla_gpu_enable_command_buffer"].split(",")
    assert "WHILE" not in listed_types
    assert COMMAND_BUFFER_OPTIONS["while"]["xla_gpu_enable_command_buffer"].split(",") == [
        *listed_types,
        "WHILE",
    ]
    assert COMMAND_BUFFER_OPTIONS["while_unroll"]["xla_gpu_command_buffer_unroll_loops"] is True
    for choice in ("while", "while_unroll", "listed"):
        types = COMMAND_BUFFER_OPTIONS[choice]["xla_gpu_enable_command_buffer"].split(",")
        assert "DYNAMIC_SLICE_FUSION" in types and "CONDITIONAL" in types, choice
    for choice in ("listed", "while_unroll"):
        other = dataclasses.replace(
            params, cfg=dataclasses.replace(params.cfg, command_buffer=choice)
        )
        got = gen.generate(other, ["one", "two!"], max_new_tokens=7, sampler=sampler, key=3, n=2)
        assert got.tokens == want.tokens, choice
    before = dict(gen.TRACE_COUNTS)
    gen.generate(looped, ["six", "7"], max_new_tokens=7, sampler=sampler, key=4, n=2)
    assert dict(gen.TRACE_COUNTS) == before

    bad = rdecode._PerCompilerOptions(
        lambda p, x: x + 1,
        options={"default": None, "while": {"xla_gpu_enable_command_buffer": "NOT_A_TYPE"}},
    )
    assert float(bad(params, jnp.float32(1))) == 2.0
    with pytest.raises(Exception, match="xla_gpu_enable_command_buffer"):
        bad(looped, jnp.float32(1))
    with pytest.raises(ValueError, match="unknown command_buffer 'graph'"):
        Config(command_buffer="graph")


def test_xla_autotune_off_reaches_xla_and_keeps_the_tokens(params, monkeypatch):
    """Config.xla_autotune=False compiles every decode program with NO_AUTOTUNE_OPTIONS (no
    timed matmul picks, cuBLAS rather than Triton GEMMs) as per-executable compiler options, alongside the
    command-buffer ones; the tokens are the same on the CPU (no autotuning there); a non-bool
    is refused."""
    from rejax import config as rconfig
    from rejax import decode as rdecode

    off = dataclasses.replace(params, cfg=dataclasses.replace(params.cfg, xla_autotune=False))
    assert rconfig.compiler_options(params.cfg) is None
    no_tuning = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}
    assert rconfig.compiler_options(off.cfg) == no_tuning
    both = dataclasses.replace(off.cfg, command_buffer="while")
    assert rconfig.compiler_options(both) == {
        **rconfig.COMMAND_BUFFER_OPTIONS["while"],
        **no_tuning,
    }
    sampler = ReSET(t_low=0.3, t_high=1.0, tau_0=0.5, window=4, top_p=0.9)
    want = gen.generate(params, ["one", "two!"], max_new_tokens=7, sampler=sampler, key=3, n=2)
    got = gen.generate(off, ["one", "two!"], max_new_tokens=7, sampler=sampler, key=3, n=2)
    assert got.tokens == want.tokens and got.temperature == want.temperature
    for fn in (rdecode.decode_loop, rdecode.prefill, rdecode.decode_step):
        assert fn.jitted(off) is not fn.jitted(params) and fn.jitted(off) is fn.jitted(off)
    # the options do reach XLA: a bad value in their place is refused by it
    monkeypatch.setattr(rconfig, "NO_AUTOTUNE_OPTIONS", {"xla_gpu_autotune_level": "NOT_A_LEVEL"})
    fresh = rdecode._PerCompilerOptions(lambda p, x: x + 1)
    assert float(fresh(params, jnp.float32(1))) == 2.0
    with pytest.raises(Exception, match="xla_gpu_autotune_level"):
        fresh(off, jnp.float32(1))
    with pytest.raises(TypeError, match="xla_autotune must be True or False, got 'off'"):
        Config(xla_autotune="off")


def _unrolled(params, k):
    return dataclasses.replace(params, cfg=dataclasses.replace(params.cfg, decode_unroll=k))


def test_decode_unroll_keeps_tokens_stops_and_lengths(params):
    """Config.decode_unroll runs k steps per check of the loop's predicate: the same tokens,
    entropies, temperatures, stops and lengths as one step per check, with a row that stops
    inside a k-step chunk, batch padding, and M that k does not divide (the largest divisor
    up to k is taken)."""
    sampler = ReSET(t_low=0.3, t_high=1.0, tau_0=0.5, window=4, top_p=0.9)
    prompts = ["abc", "zz", "q"]
    one = _unrolled(params, 1)
    full = gen.generate(one, prompts, max_new_tokens=12, sampler=sampler, key=5, stop=[])
    stop_tok = full.tokens[0][4]  # row 0 stops at step 4 at the latest: inside a 4-step chunk
    want = gen.generate(one, prompts, max_new_tokens=12, sampler=sampler, key=5, stop=[stop_tok])
    assert "stop" in want.finish_reason and "length" in want.finish_reason, want.finish_reason
    for k in (2, 4, 5, Config.decode_unroll):  # 5: 12 % 5 != 0, so 4 steps per check
        got = gen.generate(
            _unrolled(params, k), prompts, max_new_tokens=12, sampler=sampler, key=5,
            stop=[stop_tok],
        )  # fmt: skip
        assert got.tokens == want.tokens, k
        assert got.finish_reason == want.finish_reason, k
        for a, b in zip(got.entropy, want.entropy, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6)
        assert got.temperature == want.temperature, k
    with pytest.raises(ValueError, match="decode_unroll must be an int >= 1, got 0"):
        Config(decode_unroll=0)


def test_decode_unroll_masks_steps_past_the_limit_and_checks_less_often(params):
    """A `steps` limit inside a chunk: the outputs, lengths and step count stop at the limit,
    equal to one step per check; the k-step loop is a while loop of known trip count (the
    fori_loop) inside the predicate's loop, and `_steps_per_check` takes k's largest divisor."""
    from rejax import decode as rdecode
    from rejax.cache import init_cache

    assert [rdecode._steps_per_check(4, m) for m in (12, 10, 9, 7, 2, 1)] == [4, 2, 3, 1, 2, 1]
    b, t, m = 2, 5, 8
    tokens = jnp.asarray(np.arange(b * t).reshape(b, t) % 200, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def run(p, steps):
        cache = init_cache(p.cfg, b, t + m, jnp.float32)
        logits, cache = rdecode.prefill(p, tokens, positions, cache)
        smp = Temperature(0.9)
        return rdecode.decode_loop(
            p, logits, cache, jnp.full((b,), t, jnp.int32), smp, sampler_init(smp, b),
            jax.random.split(jax.random.key(2), b), jnp.zeros((params.cfg.vocab_size,), bool),
            jnp.zeros((b,), bool), max_new_tokens=m, steps=jnp.int32(steps),
        )  # fmt: skip

    for steps in (3, 8):
        want, got = run(_unrolled(params, 1), steps), run(_unrolled(params, 4), steps)
        assert int(got.step) == int(want.step) == steps
        np.testing.assert_array_equal(got.lengths, want.lengths)
        np.testing.assert_array_equal(got.tokens[:, :steps], want.tokens[:, :steps])
        np.testing.assert_array_equal(got.tokens[:, steps:], 0)

    def loops(k):  # while and scan loops in the decode loop's program at k steps per check
        jaxpr = str(jax.make_jaxpr(rdecode._decode_loop, static_argnums=(9,))(
            _unrolled(params, k), jnp.zeros((b, params.cfg.vocab_size)),
            init_cache(params.cfg, b, t + m, jnp.float32), jnp.full((b,), t, jnp.int32),
            Greedy(), sampler_init(Greedy(), b), jax.random.split(jax.random.key(0), b),
            jnp.zeros((params.cfg.vocab_size,), bool), jnp.zeros((b,), bool), m,
        ))  # fmt: skip
        return jaxpr.count("while["), jaxpr.count("scan[")

    # k > 1 adds one loop of static length (fori_loop: a scan) inside the predicate's loop
    (w1, s1), (w4, s4) = loops(1), loops(4)
    assert w1 >= 1 and (w4, s4) == (w1, s1 + 1), ((w1, s1), (w4, s4))


@pytest.fixture(scope="module")
def bf16_params(params):
    """The tiny model in bfloat16 (a bfloat16 head: bfloat16 logits)."""
    w = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params.weights)
    return dataclasses.replace(params, weights=w)


def test_head_dtype_logits_are_the_heads_rounding_and_narrower_raises(params, bf16_params):
    # prefill(logits_dtype=None) returns the head's own logits (bfloat16 for a bfloat16 model,
    # as transformers and vLLM compute them): the float32 logits rounded to bfloat16 (XLA may
    # fuse the default's cast into the dot, so those need not be bfloat16 values); a dtype
    # that would round a float32 head's logits is refused before anything runs
    tokens = jnp.asarray([[3, 9, 27, 81]], jnp.int32)
    positions = jnp.arange(4, dtype=jnp.int32)[None]
    f32, _ = gen.prefill(bf16_params, tokens, positions, None)
    head, _ = gen.prefill(bf16_params, tokens, positions, None, logits_dtype=None)
    assert f32.dtype == jnp.float32 and head.dtype == jnp.bfloat16
    f32, head = np.asarray(f32), np.asarray(head.astype(jnp.float32))
    assert np.all(np.abs(head - f32) <= 2.0**-7 * np.abs(f32) + 1e-6), np.abs(head - f32).max()
    assert gen.prefill(params, tokens, positions, None, logits_dtype=None)[0].dtype == jnp.float32
    with pytest.raises(ValueError, match="logits_dtype=bfloat16 would round the head's float32"):
        gen.prefill(params, tokens, positions, None, logits_dtype="bfloat16")


@pytest.mark.parametrize(
    "sampler",
    [Greedy(), Temperature(t=0.8, top_p=0.9), Temperature(t=0.8, top_p=0.9, top_p_method="kernel"),
     ReSET(t_high=1.0, t_low=0.3, top_p=0.9, top_p_method="kernel")],
    ids=["greedy", "temperature", "temperature-kernel", "reset-kernel"],
)  # fmt: skip
def test_decode_loop_and_steps_carry_the_logits_dtype_they_are_given(bf16_params, sampler):
    # bfloat16 prefill logits (what generate passes for a bfloat16 model): the loop carries
    # bfloat16 logits, and its tokens, entropies and temperatures are those of decode_step
    # called step by step on them (each step returning bfloat16 logits); float32 ones stay
    # float32
    from rejax import decode as rdecode
    from rejax.cache import init_cache

    cfg = bf16_params.cfg
    if isinstance(sampler, ReSET):
        nl, dnl = newline_masks(bf16_params.tokenizer.tokenizer, cfg.vocab_size)
        sampler = dataclasses.replace(sampler, nl_mask=nl, dnl_mask=dnl)
    b, p, m = 3, 4, 8
    tokens = jnp.asarray(np.arange(b * p).reshape(b, p) % 250, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    keys = jax.random.split(jax.random.key(4), b)
    never = jnp.zeros((cfg.vocab_size,), bool)

    def prefilled(dtype):
        cache = init_cache(cfg, b, p + m, jnp.bfloat16)
        return gen.prefill(bf16_params, tokens, positions, cache, logits_dtype=dtype)

    logits, cache = prefilled(None)
    assert logits.dtype == jnp.bfloat16
    out = rdecode.decode_loop(
        bf16_params, logits, cache, jnp.full((b,), p, jnp.int32), sampler,
        sampler_init(sampler, b), keys, never, jnp.zeros((b,), bool), max_new_tokens=m,
    )  # fmt: skip
    assert out.logits.dtype == jnp.bfloat16
    logits, cache = prefilled(None)
    state, pos = sampler_init(sampler, b), jnp.full((b,), p, jnp.int32)
    for i in range(m):
        t, logits, cache, state, info = rdecode.decode_step(
            bf16_params, logits, cache, pos, sampler, state, keys, jnp.int32(i)
        )
        assert logits.dtype == jnp.bfloat16
        pos = pos + 1
        np.testing.assert_array_equal(np.asarray(out.tokens[:, i]), np.asarray(t), f"step {i}")
        np.testing.assert_array_equal(np.asarray(out.entropy[:, i]), np.asarray(info["entropy"]))
        np.testing.assert_array_equal(
            np.asarray(out.temperature[:, i]), np.asarray(info["temperature"])
        )
    logits, cache = prefilled("float32")
    t, logits, *_ = rdecode.decode_step(bf16_params, logits, cache, pos - m, sampler,
                                        sampler_init(sampler, b), keys, jnp.int32(0))  # fmt: skip
    assert logits.dtype == jnp.float32


def test_slot_and_chunked_prefill_paths_carry_the_heads_logits(params, bf16_params):
    # slot refill (rejax.slots) and the chunked static prefill keep the head's logits too:
    # bfloat16 for a bfloat16 model, float32 for a float32 one
    from rejax import slots
    from rejax.cache import init_cache

    smp = Temperature(t=0.8, top_p=0.9)
    for p, want in ((bf16_params, jnp.bfloat16), (params, jnp.float32)):
        state = slots.init_slots(p, 2, 32, 4, smp)
        assert state.logits.dtype == want
        cache = init_cache(p.cfg, 3, 64, p.weights["embed_tokens"]["embedding"].dtype)
        logits, _ = gen.prefill_chunked(p, [[1, 2, 3], [4, 5]], cache, 2)
        assert logits.dtype == want and logits.shape == (3, p.cfg.vocab_size)
    out = gen.generate(bf16_params, ["hi", "yo"], max_new_tokens=4, stop=[], prefill_rows=2)
    assert [len(t) for t in out.tokens] == [4, 4]
