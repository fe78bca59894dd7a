"""The cluster bootstrap of the quality report."""
import numpy as np
import pytest

from benchmarks.quality.stats import bootstrap


def test_interval_holds_the_mean_and_shrinks_with_more_rounds():
    rng = np.random.default_rng(1)
    small = rng.normal(0.3, 1.0, 40)
    large = rng.normal(0.3, 1.0, 400)
    a = bootstrap(small.tolist(), list(range(40)))
    b = bootstrap(large.tolist(), list(range(400)))
    assert a.low < a.mean < a.high and a.n == a.clusters == 40
    assert (b.high - b.low) < 0.5 * (a.high - a.low)
    # About the normal interval's width, 2 * 1.96 * sd / sqrt(n).
    assert (b.high - b.low) == pytest.approx(2 * 1.96 * large.std() / np.sqrt(400), rel=0.15)
    assert bootstrap(small.tolist(), list(range(40))) == a  # seeded


def test_rounds_are_resampled_whole():
    # Three readers per round with the same value: 10 independent values, not 30.
    per_round = np.random.default_rng(2).normal(0, 1, 10)
    values = np.repeat(per_round, 3).tolist()
    rounds = np.repeat(np.arange(10), 3).tolist()
    clustered = bootstrap(values, rounds)
    naive = bootstrap(values, list(range(30)))
    assert clustered.n == 30 and clustered.clusters == 10
    assert (clustered.high - clustered.low) > 1.4 * (naive.high - naive.low)


def test_a_constant_has_no_spread_and_bad_input_is_refused():
    e = bootstrap([0.0] * 12, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])
    assert (e.mean, e.low, e.high) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        bootstrap([], [])
    with pytest.raises(ValueError):
        bootstrap([1.0], [0, 1])
