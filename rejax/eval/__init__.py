"""Evaluation: problem files, batched sampling + grading, avg@n with a CI, τ0 calibration, and
the paper's observation statistics (how often low-entropy tokens leave the BF16 argmax).

Everything here is host glue around `rejax.generate.generate` (one compiled decode loop per
batch shape) and `rejax.generate.logits` (teacher forcing); nothing in this package is jitted.
One module per concern:

    problems.py   load_problems (AIME math JSONL, GPQA CSV / JSONL, LiveCodeBench code JSONL),
                  load_jsonl (the math layout alone, for calibration), write_jsonl
    samplers.py   parse_sampler / describe_sampler: samplers from a command-line spec
    grading.py    answer extraction and grading per task (math, mcq, code)
    sandbox.py    the separate, limited process that runs generated code
    stats.py      avg@n with a CI over problems; paired differences
    harness.py    evaluate: generate, grade, summarise
    forcing.py    teacher-forced logits; the entropy of the processed distribution
    calibrate.py  τ0 calibration (the paper's recipe) and its files
    observe.py    the observation statistics and their bootstrap CIs
"""

from rejax.eval.calibrate import (
    CALIBRATION_PERCENTILE,
    CALIBRATION_TEMPERATURE,
    calibrate_tau0,
    write_calibration,
)
from rejax.eval.forcing import processed_entropy, teacher_forced_logits
from rejax.eval.harness import EvalResult, evaluate
from rejax.eval.observe import OBSERVATION_SETS, observation_stats, summarize_observations
from rejax.eval.problems import (
    GPQA_TEMPLATE,
    LCB_WITH_STARTER,
    LCB_WITHOUT_STARTER,
    load_jsonl,
    load_problems,
    write_jsonl,
)
from rejax.eval.samplers import (
    DEFAULT_T_HIGH,
    DEFAULT_T_LOW,
    DEFAULT_TAU0,
    DEFAULT_TOP_P,
    DEFAULT_WINDOW,
    describe_sampler,
    parse_sampler,
)
from rejax.eval.stats import CI_METHODS, avg_at_n_ci, paired_difference_ci, wilson_interval

__all__ = [
    "CALIBRATION_PERCENTILE",
    "CALIBRATION_TEMPERATURE",
    "CI_METHODS",
    "DEFAULT_TAU0",
    "DEFAULT_TOP_P",
    "DEFAULT_T_HIGH",
    "DEFAULT_T_LOW",
    "DEFAULT_WINDOW",
    "GPQA_TEMPLATE",
    "LCB_WITHOUT_STARTER",
    "LCB_WITH_STARTER",
    "OBSERVATION_SETS",
    "EvalResult",
    "avg_at_n_ci",
    "calibrate_tau0",
    "describe_sampler",
    "evaluate",
    "load_jsonl",
    "load_problems",
    "observation_stats",
    "paired_difference_ci",
    "parse_sampler",
    "processed_entropy",
    "summarize_observations",
    "teacher_forced_logits",
    "wilson_interval",
    "write_calibration",
    "write_jsonl",
]
