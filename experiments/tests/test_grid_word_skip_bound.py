"""experiments/kernels/grid_word_skip_bound.py: the word bound of the grid word-skip patch."""

import pathlib
import re

import numpy as np
import pytest

from experiments.kernels import grid_word_skip_bound as bound

PATCH = pathlib.Path(bound.__file__).with_name("sampler_grid_word_skip.patch")
# once the patch has landed (and left experiments/kernels/), the constants are the source's
SOURCE = pathlib.Path(bound.__file__).parents[2] / "cuda_ops" / "sampler.cu"


def test_no_word_above_the_bound_passes_the_kernels_test():
    r = bound.check(bound.floor_grid(20_000))
    assert r["violations"] == 0
    assert r["max_hi_max"] < 3e9  # the patch's comment: a u32 with room to spare
    assert r["min_relative_slack"] > 5e-4  # about the 1e-3 margin, never below it by much


def test_without_the_margin_words_above_the_bound_pass():
    # the check can fail: with no margin, __logf's error alone lets such words through
    assert bound.check(bound.floor_grid(20_000), margin=0.0)["violations"] > 0


def test_floors_at_or_below_the_no_bound_threshold_are_refused():
    with pytest.raises(ValueError, match="floors must exceed"):
        bound.check(np.array([0.36652, 1.0], np.float32))
    with pytest.raises(SystemExit):
        bound.main(["--floors", "0"])


def test_the_model_uses_the_patchs_constants():
    text = (PATCH if PATCH.exists() else SOURCE).read_text()
    assert "if (floor <= 0.36652f) return 0xFFFFFFFFu;" in text
    m = re.search(r"__expf\(([\d.]+)f \+ ([\de.-]+)f - floor\)", text)
    assert m, "hi_max's expression not found in the patch"
    assert np.float32(m.group(1)) == np.float32(22.18081)
    assert float(m.group(2)) == 1e-3  # check()'s default margin
    # scores4's own bound constant, as the kernel source folds it
    src = pathlib.Path(bound.__file__).parents[2] / "cuda_ops" / "sampler.cu"
    assert "return 22.18071f + 1e-4f - __logf((float)hi);" in src.read_text()
    # hi_max's constant is gumbel_bound's up to float32 rounding (check() models each as is)
    assert abs(float(np.float32(22.18081)) - float(bound.C_BOUND)) < 4e-6
