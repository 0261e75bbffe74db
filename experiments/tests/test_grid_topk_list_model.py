"""experiments/kernels/grid_topk_list_model.py: the grid kernel's top-k list, modelled."""

import numpy as np
import pytest

from cuda_ops import sampler as kernels
from experiments.kernels import grid_topk_list_model as model


@pytest.mark.parametrize("b", [1, 8, 64, 200])
def test_plan_is_the_kernels_at_two_ctas_an_sm(b):
    # the kernels' plan at GRID_CTAS_PER_SM CTAs an SM over SMS; the model's at 2 over 132
    sms = model.SMS * model.CTAS_PER_SM // kernels.GRID_CTAS_PER_SM
    assert model.grid_plan(b, 151936) == kernels.grid_plan(b, 151936, sms=sms)


def test_list_holds_the_top_k_and_grows_when_one_cta_holds_them():
    (z,) = model.rows("lm", 1, 4099 * 4)
    assert model.list_size(z, 1, 20) == 20  # distinct maxima: exactly the top 20
    z[:25] = 30.0 + np.arange(25, dtype=np.float32) * 0.05  # 25 in one thread group's CTA
    n = model.list_size(z, 1, 20)
    assert n > 25  # tau falls below them: a superset, the 25 included
    with pytest.raises(SystemExit):
        model.main(["--k", "0"])
