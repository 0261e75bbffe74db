"""The shipped tiny reasoning model (rejax/data/tiny): format, transformers parity, accuracy.

Numbers measured when the model was trained (experiments/results/tiny_train_metrics.json):
greedy accuracy 494/500 = 98.8% on validation problems (seed 0); on CPU, rejax.generate in
bf16 solved 16/16 of the first validation problems, and transformers' fp32 logits matched
rejax's with max |diff| 1.3e-5 (relative norm 3e-7).
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import rejax
from rejax.data import TINY_MODEL, tasks
from rejax.eval.grading import grade

MAX_CHECKPOINT_BYTES = 20 * 2**20  # the package must stay small
# Greedy accuracy threshold on N_GREEDY validation problems: 12/16 = 75%, far below the 98.8%
# measured on 500 validation problems, so only a broken model or decode path fails it.
N_GREEDY, MIN_CORRECT = 16, 12


@pytest.fixture(scope="module")
def params_f32():
    return rejax.load(TINY_MODEL, dtype=jnp.float32)


def test_checkpoint_files_and_config():
    files = {p.name for p in TINY_MODEL.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= files
    assert (TINY_MODEL / "model.safetensors").stat().st_size <= MAX_CHECKPOINT_BYTES
    hf = json.loads((TINY_MODEL / "config.json").read_text())
    assert hf["model_type"] == "qwen3" and hf["architectures"] == ["Qwen3ForCausalLM"]
    # Decoder linears' input dims (D, N*H, F) suit the CUDA NVFP4 GEMV (multiples of 256).
    for k in (
        hf["hidden_size"],
        hf["num_attention_heads"] * hf["head_dim"],
        hf["intermediate_size"],
    ):
        assert k % 256 == 0, hf
    tcfg = json.loads((TINY_MODEL / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"] == tasks.CHAT_TEMPLATE


def test_rejax_load_and_tokenizer(params_f32):
    cfg = params_f32.cfg
    assert cfg.arch == "qwen3" and cfg.quant is None
    tok = params_f32.tokenizer.tokenizer
    assert tok.get_vocab_size() <= cfg.vocab_size
    eos = tok.token_to_id("<|im_end|>")
    assert eos is not None and eos in cfg.eos_token_ids
    # "\n", "\n\n" (the step boundary) and each digit are single tokens.
    for piece in ["\n", "\n\n"] + list("0123456789"):
        ids = tok.encode(piece).ids
        assert len(ids) == 1 and tok.decode(ids) == piece, piece
    assert len(tok.encode("12345").ids) == 5
    text = tasks.training_text(tasks.split("validation", 1)[0])
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_transformers_logits_match(params_f32):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from rejax.generate import logits

    model = transformers.AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    model.eval()
    tok = params_f32.tokenizer.tokenizer
    problem = tasks.split("test", 1)[0]
    ids = tok.encode(tasks.chat_prompt(problem["problem"]) + problem["solution"]).ids
    ours = np.asarray(logits(params_f32, jnp.asarray([ids], jnp.int32)))
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits.float().numpy()
    assert ours.shape == theirs.shape == (1, len(ids), params_f32.cfg.vocab_size)
    # fp32 on both sides: measured max |diff| 1.3e-5 with |logits| up to ~26.
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    rel = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
    assert rel < 1e-5, rel
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_transformers_tokenizer_agrees():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    hf_tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
    messages = [{"role": "user", "content": "Evaluate 3 + 4 * 2."}]
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == tasks.chat_prompt("Evaluate 3 + 4 * 2.")
    assert hf_tok.eos_token == "<|im_end|>"


def test_greedy_solves_validation_problems():
    # Imported from the module: once `rejax.generate` the submodule is imported, the package
    # attribute `rejax.generate` is that module, not the function.
    from rejax.generate import generate

    params = rejax.load(TINY_MODEL)  # bf16, as users run it
    problems = tasks.split("validation", N_GREEDY)
    out = generate(params, [p["problem"] for p in problems], max_new_tokens=256, chat=True)
    correct = [grade(text, p["answer"]) for text, p in zip(out.text, problems)]
    assert sum(correct) >= MIN_CORRECT, list(zip(out.text, correct))
    # The answers come as step-separated reasoning ending in a box.
    assert all("\n\n" in text and "\\boxed{" in text for text in out.text)
