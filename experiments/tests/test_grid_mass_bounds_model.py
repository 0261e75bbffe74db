"""experiments/kernels/grid_mass_bounds_model.py: the grid kernel's keep tests from mass ranges."""

import pathlib

import numpy as np
import pytest

from experiments.kernels import grid_mass_bounds_model as model

PATCH = pathlib.Path(model.__file__).with_name("sampler_grid_mass_bounds.patch")
# once the patch has landed (and left experiments/kernels/), the constants are the source's
SOURCE = pathlib.Path(model.__file__).parents[2] / "cuda_ops" / "sampler.cu"
V = 20_000


@pytest.mark.parametrize("kind,t", [("flat", 0.6), ("flat", 1.0), ("lm", 0.6), ("flat", 0.1)])
@pytest.mark.parametrize("skew", [0.0, 2.0**-16, -(2.0**-16)])
def test_range_verdicts_agree_with_the_exact_ones(kind, t, skew):
    # estimates moved to the edge of what MASS_ERR allows (half its relative part, plus one a
    # token) still give no verdict the exact sums would not, and the same draws
    rng = np.random.default_rng(3)
    for z in model.rows(kind, 12, V, seed=5):
        r = model.row_verdicts(z, t, 0.95, rng, est_skew=skew)
        assert r["wrong"] == 0 and r["exact"] == r["ranges"] is not None


F32 = np.float32


def _adversarial(rng, n, top_p):
    """n cases of exact sums (mass above x, x's band and up less x, x's mass, total) near the
    keep limit, with a direction (+-1) for the estimates to err in."""
    for _ in range(n):
        total = int(rng.integers(2**29, 2**30 + 2**20))
        above = int(F32(top_p) * F32(total)) + int(rng.integers(-12 * V, 12 * V))
        band = above + int(rng.integers(0, 3 * V))
        yield above, band, int(rng.integers(1, 5000)), total, int(rng.choice([-1, 1]))


def _estimate(s, sign):
    """An estimate e of the exact sum s with |e - s| = MASS_ERR(e) - 1 (a fixed point)."""
    e = s
    for _ in range(4):
        e = max(s + sign * (int(model.mass_err(e, V)) - 1), 0)
    return e


@pytest.mark.parametrize("top_p", [0.95, 0.5])
def test_range_verdicts_hold_for_estimates_at_the_error_bound(top_p, monkeypatch):
    # exact sums next to the limit, estimates off by nearly MASS_ERR in the misleading
    # direction: a decided verdict is the exact one; without MASS_ERR some are not
    cases = list(_adversarial(np.random.default_rng(7), 4000, top_p))
    decided = 0
    for above, band, w_x, total, sign in cases:
        exact = F32(above) < F32(F32(top_p) * F32(total))
        s_above, s_band, t_est = (_estimate(s, sign) for s in (above, band + w_x, total))
        vd = model.range_verdict(s_above, s_band, w_x, t_est, top_p, V)
        assert vd == "open" or (vd == "kept") == exact, (above, band, w_x, total, sign)
        decided += vd != "open"
    assert decided > 0  # the cases reach decided verdicts
    wrong = 0
    for above, band, w_x, total, sign in cases:
        exact = F32(above) < F32(F32(top_p) * F32(total))
        s_above, s_band, t_est = (_estimate(s, sign) for s in (above, band + w_x, total))
        with monkeypatch.context() as mp:
            mp.setattr(model, "mass_err", lambda s, v: np.asarray(s) * 0)
            vd = model.range_verdict(s_above, s_band, w_x, t_est, top_p, V)
        wrong += vd != "open" and (vd == "kept") != exact
    assert wrong > 0


def test_rows_of_ties_open_every_time_and_draw_the_exact_token():
    # every logit equal but 8: all the mass in one bin, so the ranges cannot decide
    rng = np.random.default_rng(0)
    for z in model.rows("ties", 6, V, seed=1):
        r = model.row_verdicts(z, 0.6, 0.95, rng)
        assert r["opened"] >= 1 and r["wrong"] == 0 and r["exact"] == r["ranges"]


def test_a_planted_bug_gives_wrong_verdicts():
    # the least mass above x counted from x's band (its own bin and those below it included):
    # the check sees verdicts the exact sums contradict
    rng = np.random.default_rng(0)
    wrong = [model.row_verdicts(z, 0.6, 0.95, rng, above_from_band=True)["wrong"]
             for z in model.rows("ties", 6, V, seed=1)]  # fmt: skip
    assert sum(wrong) > 0


def test_mass_bin_is_monotone_and_covers_the_range():
    zt = np.sort(np.random.default_rng(0).uniform(-30.0, 0.0, 200_000).astype(np.float32))
    b = model.mass_bin(zt)
    assert (np.diff(b) >= 0).all()
    edge = np.array([0.0, -21.5, -np.inf, -1e30], np.float32)
    assert model.mass_bin(edge).tolist() == [model.NB - 1, 0, 0, 0]
    assert (
        len(np.unique(model.mass_bin(np.linspace(-21.5, 0, 50_000, dtype=np.float32)))) == model.NB
    )


def test_the_cli_refuses_bad_arguments():
    for argv in (
        ["--rows", "0"],
        ["--top-p", "1"],
        ["--vocab", "8"],
        ["--temperatures", "0"],
        ["--kinds", "normal"],
    ):
        with pytest.raises(SystemExit):
            model.main(argv)


def test_the_model_uses_the_patchs_constants():
    text = (PATCH if PATCH.exists() else SOURCE).read_text()
    assert "#define MASS_ERR(s) (((s) >> 15) + (u32)V_SIZE + 2u)" in text
    assert "#define MASS_BAND 1e-4f" in text
    assert "#define MASS_BIN_SCALE (((float)NB - 0.5f) / 21.5f)" in text
    assert "__fmaf_rn(zt, MASS_BIN_SCALE, (float)NB - 0.5f)" in text
    assert "__fmaf_rn(zt, 1.44269504f, mass_log2)" in text
    assert "const float mass_log2 = 30.0f - log2f(den);" in text
    assert int(model.mass_err(0, V)) == V + 2 and model.BAND == np.float32(1e-4)


def test_npz_rows_are_read_in_turn(tmp_path):
    saved = np.random.default_rng(2).standard_normal((2, V)).astype(np.float32)
    np.savez(tmp_path / "rows.npz", logits=saved)
    got = list(model.rows("npz", 5, V, npz=str(tmp_path / "rows.npz")))
    assert len(got) == 5 and all((g == saved[i % 2]).all() for i, g in enumerate(got))
    rng = np.random.default_rng(0)
    r = model.row_verdicts(got[0], 0.6, 0.95, rng)
    assert r["wrong"] == 0 and r["exact"] == r["ranges"]
    with pytest.raises(SystemExit):
        model.main(["--kinds", "npz"])  # no --npz
