"""Bundled data: the task generators and the tiny model.

`rejax.data.tasks` draws the tiny model's multi-step arithmetic problems; `rejax.data.countdown`
draws Countdown problems with backtracking search traces (graded by `rejax.eval.grading`, task
"countdown"; `experiments/train_search_reasoner.py` trains a model on them).

`TINY_MODEL` is the folder of the shipped tiny Qwen3 reasoning model (a Hugging Face checkpoint:
config.json, bf16 model.safetensors, tokenizer.json, tokenizer_config.json with a chat template,
generation_config.json), trained by experiments/train_tiny_reasoner.py on `tasks` problems.
Load it with `rejax.load(rejax.data.TINY_MODEL)`.

`COUNTDOWN_MODEL` is the shipped Countdown search reasoner (the same files, plus
countdown_difficulty.json: the problem family it was trained on, `countdown.load_difficulty`),
trained by experiments/train_search_reasoner.py: a Qwen3 of 8 layers, 6.5M parameters, that
solves about half of its validation problems greedily. The CLI names it `--model countdown`.
"""

from pathlib import Path

TINY_MODEL = Path(__file__).resolve().parent / "tiny"
COUNTDOWN_MODEL = Path(__file__).resolve().parent / "countdown"

__all__ = ["COUNTDOWN_MODEL", "TINY_MODEL"]
