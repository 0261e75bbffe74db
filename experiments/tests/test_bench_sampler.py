"""experiments/bench_sampler.py: the decode loop's cost over greedy from rounds."""

import pytest

from experiments import bench_sampler as bs


def test_over_greedy_takes_each_rounds_difference_then_the_median():
    # greedy drifts between rounds (2460 -> 2550): a difference is taken within a round, so
    # the drift does not leak into the cost (the medians of the raw times would give +30)
    rounds = [
        {"greedy": 2460.0, "temp": 2472.0, "reset": 2475.0},
        {"greedy": 2550.0, "temp": 2558.0, "reset": 2570.0},
        {"greedy": 2500.0, "temp": 2530.0, "reset": 2511.0},
    ]
    out = bs.over_greedy(rounds)
    assert out["temp_over_greedy_us_rounds"] == [12.0, 8.0, 30.0]
    assert out["temp_over_greedy_us"] == 12.0
    assert out["reset_over_greedy_us"] == 15.0  # median of 15, 20, 11
    assert out["greedy_us_per_token"] == 2500.0 and out["temp_us_per_token"] == 2530.0
    assert set(out) == {"greedy_us_per_token"} | {
        f"{k}_{s}" for k in ("temp", "reset")
        for s in ("us_per_token", "over_greedy_us", "over_greedy_us_rounds")
    }  # fmt: skip


def test_alternated_rounds_take_the_greedy_runs_beside_each_sampler():
    # greedy climbs 10 us a run inside each round: the round's first greedy would charge the
    # last sampler with the drift, the greedy runs beside it do not
    rounds = [
        [("greedy", 2500.0), ("temp", 2515.0), ("greedy", 2510.0), ("reset", 2532.0),
         ("greedy", 2520.0)],
        [("greedy", 2400.0), ("temp", 2417.0), ("greedy", 2410.0), ("reset", 2430.0),
         ("greedy", 2420.0)],
        [("greedy", 2450.0), ("temp", 2461.0), ("greedy", 2460.0), ("reset", 2471.0),
         ("greedy", 2470.0)],
    ]  # fmt: skip
    out = bs.over_greedy(rounds)
    assert out["temp_over_greedy_us_rounds"] == [10.0, 12.0, 6.0]
    assert out["reset_over_greedy_us_rounds"] == [17.0, 15.0, 6.0]
    assert out["temp_over_greedy_us"] == 10.0 and out["reset_over_greedy_us"] == 15.0
    assert out["greedy_us_per_token"] == 2460.0  # median of the rounds' median greedy
    assert out["reset_us_per_token"] == 2471.0


def test_a_sampler_before_any_greedy_takes_the_greedy_after_it():
    out = bs.over_greedy([[("temp", 2515.0), ("greedy", 2500.0)]])
    assert out["temp_over_greedy_us"] == 15.0


@pytest.mark.parametrize(
    "rounds",
    [
        [[("temp", 1.0)]],
        [[("greedy", 1.0), ("temp", 2.0), ("temp", 3.0)]],
        [{"greedy": 1.0, "temp": 2.0}, {"greedy": 1.0, "reset": 2.0}],
    ],
)
def test_malformed_alternated_rounds_are_refused(rounds):
    with pytest.raises(ValueError, match="round"):
        bs.over_greedy(rounds)


@pytest.mark.parametrize("rounds", [[], [{"temp": 1.0}]])
def test_over_greedy_refuses_rounds_without_greedy(rounds):
    with pytest.raises(ValueError, match="greedy"):
        bs.over_greedy(rounds)


def test_zero_decode_rounds_are_refused():
    with pytest.raises(ValueError, match="--decode-rounds 0"):
        bs.main(["--decode-rounds", "0", "--vocab", "4096", "--batch", "1"])
