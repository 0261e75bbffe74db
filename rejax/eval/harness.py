"""`evaluate`: batched sampling through `rejax.generate` and grading, one record per problem,
and the avg@n summary. Host glue only: nothing here is jitted."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from tqdm.auto import tqdm

from rejax.eval.grading import TASKS, check_reference, grade_detail
from rejax.eval.samplers import describe_sampler
from rejax.eval.stats import avg_at_n_ci
from rejax.generate import generate
from rejax.text import has_chat_template

# ----------------------------------------------------------------------------------------------
# Evaluation


@dataclasses.dataclass
class EvalResult:
    """Output of `evaluate`.

    Attributes:
      records: one JSON-able dict per problem (the input fields plus `responses`, `extracted`,
        `correct`, `n_correct`, `num_tokens`, `finish_reason`, `mean_entropy`).
      correct: bool [P, n] grading of every sample.
      summary: JSON-able dict: `avg_at_n` (see `avg_at_n_ci`), token counts, timing, sampler.
      tokens: generated ids per sample, problem-major ([P * n] lists), for teacher forcing.
    """

    records: list[dict]
    correct: np.ndarray
    summary: dict
    tokens: list[list[int]]


def evaluate(
    params,
    problems: Sequence[dict],
    sampler,
    *,
    n: int = 8,
    max_new_tokens: int = 1024,
    batch_size: int | None = None,
    key: int = 0,
    chat: bool | None = None,
    progress: bool = True,
    ci_method: str = "normal",
    task: str = "math",
    timeout_s: float = 8.0,
    grade_workers: int | None = None,
    slots: int | None = None,
    compact: bool | str = "auto",
    prefill_rows: int | None = None,
) -> EvalResult:
    """Samples n responses per problem, grades them and computes avg@n with a 95% CI.

    One `rejax.generate` call: problems are decoded `batch_size` at a time (batch_size * n
    rows in one jitted prefill + while_loop); every batch has the same shape (the last is
    padded), so the decode loop compiles once per prompt-length bucket, and row r samples with
    fold_in(key, r), so the results do not depend on batch_size. Grading:
    `rejax.eval.grading.grade_detail` for `task` (math: last `\\boxed{}` else the last number; mcq:
    the letter rules; code: every test in the sandbox; countdown: the last boxed expression,
    exactly), after every reference was checked.

    Args:
      params: the model (`rejax.load`), with a tokenizer.
      problems: dicts with `prompt` and `reference` (see `load_problems`), or for math
        `problem` and `answer` (see `load_jsonl`), or for countdown `problem`, `numbers` and
        `target` (`rejax.data.countdown` problems).
      sampler: Greedy / Temperature / ReSET (see `parse_sampler`).
      n: samples per problem (> 0).
      max_new_tokens: generation budget per sample (> 0).
      batch_size: problems per batch (default: min(#problems, max(1, 64 // n))).
      key: int seed.
      chat: render prompts with the chat template (None: when the checkpoint has one).
      progress: a tqdm bar on stderr counting problems done, with problems/s and the
        generated tokens/s (it moves when a batch finishes).
      ci_method: one of CI_METHODS (see `avg_at_n_ci`).
      task: one of `rejax.eval.grading.TASKS` (how the responses are graded).
      timeout_s: code: wall-clock limit per test run.
      grade_workers: code: sandboxed runs at a time (default: min(4, CPU count)).
      slots: decode the problems x n rows through this many refilled slots (rejax/slots.py)
        instead of batches (excludes batch_size; same responses); the bar then counts rows
        and the summary adds `slots`, `slot_occupancy` (mean over decode steps of live rows /
        program rows), `slot_row_occupancy` (live row-steps / program row-steps) and
        `slot_steps_by_size`.
      compact: with `slots`, compact the draining rows into smaller programs ("auto": down
        to 16 rows, True: down to 1; see `rejax.generate`); False keeps all slots to the end.
      prefill_rows: rows prefilled together, batches and slot refills alike (see
        `rejax.generate`; the same value gives both the same prefill shapes on a GPU).

    Returns:
      EvalResult. Records hold `extracted` (math answer / letter / program), `extracted_by`
      (the rule that found it) and for code `failure` (the first failing test per sample, with
      its stderr tail; None when it passed). The summary adds `task`, `extracted_by` (counts
      per rule), `grade_s` (grading time; `wall_s` is generation only) and for math
      `n_last_number_fallback` / `n_last_number_fallback_correct`, for code `failure_status`
      (counts per failure kind).
    """
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"n must be a positive number of samples per problem, got {n!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not problems:
        raise ValueError("evaluate needs at least one problem")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    if not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    prompts, refs = [], []
    for i, p in enumerate(problems):
        prompt, ref = _prompt_and_reference(p, i, task)
        try:
            check_reference(ref, task)
        except ValueError as e:
            raise ValueError(f"problem {i}: {e}") from None
        prompts.append(prompt)
        refs.append(ref)
    if slots is not None and batch_size is not None:
        raise ValueError(f"slots={slots!r} excludes batch_size={batch_size!r}")
    if batch_size is None and slots is None:
        batch_size = min(len(problems), max(1, 64 // n))
    if slots is None and (not isinstance(batch_size, int) or batch_size <= 0):
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if chat is None:
        chat = has_chat_template(params)
    t0 = time.perf_counter()
    bar = _ProblemProgress(len(problems), n) if progress and slots is None else None
    try:
        gen = generate(
            params,
            prompts,
            max_new_tokens=max_new_tokens,
            sampler=sampler,
            key=key,
            n=n,
            batch_size=batch_size,
            chat=chat,
            progress=bar.update if bar is not None else bool(progress),
            slots=slots,
            compact=compact,
            prefill_rows=prefill_rows,
        )
    finally:
        if bar is not None:
            bar.close()
    wall = time.perf_counter() - t0  # generation only: code grading can take a while

    def _grade(r):
        return grade_detail(gen.text[r], refs[r // n], task, timeout_s=timeout_s)

    workers = grade_workers or (min(4, os.cpu_count() or 1) if task == "code" else 1)
    if workers > 1:  # each code grade waits on sandbox processes, so threads overlap them
        with ThreadPoolExecutor(workers) as pool:
            grades = list(pool.map(_grade, range(len(problems) * n)))
    else:
        grades = [_grade(r) for r in range(len(problems) * n)]
    records, correct = [], []
    for i, p in enumerate(problems):
        rows = range(i * n, (i + 1) * n)
        texts = [gen.text[r] for r in rows]
        ok = [grades[r].correct for r in rows]
        rec = dict(p)
        if task == "code":  # the tests can be megabytes: keep their count, not a copy
            rec["reference"] = {"n_tests": len(refs[i]["tests"]), "fn_name": refs[i]["fn_name"]}
        rec.update(
            index=i,
            responses=texts,
            extracted=[grades[r].extracted for r in rows],
            extracted_by=[grades[r].rule for r in rows],
            correct=ok,
            n_correct=sum(ok),
            num_tokens=[len(gen.tokens[r]) for r in rows],
            finish_reason=[gen.finish_reason[r] for r in rows],
            mean_entropy=[float(np.mean(gen.entropy[r])) if gen.entropy[r] else None for r in rows],
        )
        if task == "code":
            rec["failure"] = [grades[r].failure for r in rows]
        records.append(rec)
        correct.append(ok)
    tokens = gen.tokens
    correct = np.asarray(correct, dtype=bool)
    lengths = np.array([len(t) for t in tokens])
    finish = [f for r in records for f in r["finish_reason"]]
    summary = {
        "avg_at_n": avg_at_n_ci(correct, method=ci_method),
        "n": n,
        "n_problems": len(problems),
        "sampler": describe_sampler(sampler),
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        "chat": chat,
        "seed": key,
        "tokens_generated": int(lengths.sum()),
        "mean_response_tokens": float(lengths.mean()),
        "frac_length_capped": float(np.mean([f == "length" for f in finish])),
        "frac_no_answer": float(np.mean([a is None for r in records for a in r["extracted"]])),
        "task": task,
        "extracted_by": _counts(str(g.rule) if g.rule else "none" for g in grades),
        "wall_s": wall,
        "tokens_per_s": float(lengths.sum() / wall) if wall > 0 else None,
        "grade_s": time.perf_counter() - t0 - wall,
    }
    if slots is not None:
        summary["slots"] = slots
        summary["slot_occupancy"] = gen.slot_stats["occupancy"]
        summary["slot_row_occupancy"] = gen.slot_stats["row_occupancy"]
        summary["slot_compact"] = compact
        summary["slot_steps_by_size"] = gen.slot_stats["steps_by_size"]
    if task == "math":
        fallback = [g for g in grades if g.rule == "last_number"]
        summary["n_last_number_fallback"] = len(fallback)
        summary["n_last_number_fallback_correct"] = sum(g.correct for g in fallback)
    if task in ("code", "countdown"):
        summary["failure_status"] = _counts(g.failure["status"] for g in grades if g.failure)
    return EvalResult(records=records, correct=correct, summary=summary, tokens=tokens)


def _counts(items) -> dict:
    out: dict = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return dict(sorted(out.items()))


def _prompt_and_reference(p: dict, i: int, task: str):
    if "prompt" in p and "reference" in p:
        return p["prompt"], p["reference"]
    if task == "math" and "problem" in p and "answer" in p:
        return p["problem"], p["answer"]
    if task == "countdown" and {"problem", "numbers", "target"} <= set(p):
        return p["problem"], {"numbers": p["numbers"], "target": p["target"]}
    raise ValueError(
        f"problem {i} needs 'prompt' and 'reference' (see load_problems)"
        + (" or 'problem' and 'answer'" if task == "math" else "")
        + (" or 'problem', 'numbers' and 'target'" if task == "countdown" else "")
        + f", got keys {sorted(p)}"
    )


class _ProblemProgress:
    """tqdm bar over problems fed by `generate`'s per-batch progress callback."""

    def __init__(self, n_problems: int, n: int):
        self.bar = tqdm(total=n_problems, desc=f"eval (n={n})", unit="problem")
        self.tokens = 0
        self.t0 = time.perf_counter()

    def update(self, prompts: int, tokens: int) -> None:
        self.tokens += tokens
        wall = time.perf_counter() - self.t0
        rate = f"{self.tokens / wall:.0f} tok/s" if wall > 0 else ""
        self.bar.set_postfix_str(rate, refresh=False)  # drawn once, by the update below
        self.bar.update(prompts)

    def close(self) -> None:
        self.bar.close()
