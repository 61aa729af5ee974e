"""The budget search behind `--max-kl` (klevict_cli/tolerance.py): whatever guides it, the budget it returns was
measured within the tolerance and a budget at most 10 % smaller was measured beyond it (or is the floor)."""

from __future__ import annotations

import math
import random

import pytest

from klevict_cli.tolerance import PRECISION, smallest_within


def power_law(scale: float, exponent: float):
    """A drift that falls with the budget as measured drifts do (monotone), and its summed-score guess."""
    return (lambda b: scale * b ** -exponent), (lambda b: 2.3 * scale * b ** -exponent)


def bisection_count(drift, least: int, most: int, tolerance: float) -> int:
    """Measurements plain bisection takes to the same precision (the search the guided one replaced)."""
    return smallest_within(drift, None, least, most, tolerance)[1]


def check_bracket(drift, least: int, most: int, tolerance: float, found: int) -> None:
    """For a monotone drift: `found` is within the tolerance and no more than 10 % above the smallest budget that is."""
    exact = next(b for b in range(least + 1, most + 1) if drift(b) <= tolerance)
    assert drift(found) <= tolerance
    assert exact <= found <= exact + max(1, found // PRECISION)


@pytest.mark.parametrize("exponent", [0.7, 1.5, 3.0])
@pytest.mark.parametrize("headroom", [3.0, 30.0, 300.0])  # the tolerance over the largest budget's drift
def test_a_good_guide_finds_the_budget_in_fewer_measurements_than_bisection(exponent, headroom):
    drift, guide = power_law(5.0, exponent)
    least, most = 6, 4096
    tolerance = headroom * drift(most)
    measured = []
    found, count = smallest_within(lambda b: measured.append(b) or drift(b), guide, least, most, tolerance)
    check_bracket(drift, least, most, tolerance, found)
    assert count == len(set(measured)) == len(measured)  # nothing measured twice
    assert count <= 4 and count < bisection_count(drift, least, most, tolerance)


@pytest.mark.parametrize("guide", [
    lambda b: 1.0,  # no information
    lambda b: float(b),  # rises where drift falls
    lambda b: 1e-9 / b,  # a million times too small
    lambda b: 0.0,  # a policy whose scores are all zero
])
def test_a_misleading_guide_still_brackets_the_budget_and_stays_logarithmic(guide):
    drift, _ = power_law(2.0, 1.2)
    least, most = 6, 4096
    for tolerance in (1e-3, 3e-3, 2e-2):
        found, count = smallest_within(drift, guide, least, most, tolerance)
        check_bracket(drift, least, most, tolerance, found)
        assert count <= 3 * math.ceil(math.log2(most))


def test_a_noisy_drift_returns_a_measured_budget_within_the_tolerance():
    """Measured drifts are not monotone (a refit switching on, the sampled continuation): the budget returned is
    always one that was measured within the tolerance, with a smaller one measured beyond it within 10 %."""
    rng = random.Random(0)
    noise = {b: math.exp(rng.gauss(0, 0.3)) for b in range(1, 600)} | {600: 1.0}
    drift = lambda b: 3.0 / b * noise[b]  # noqa: E731
    for tolerance in (0.006, 0.02, 0.1):
        measured = {}
        found, _ = smallest_within(lambda b: measured.setdefault(b, drift(b)), lambda b: 7.0 / b, 4, 600, tolerance)
        assert measured[found] <= tolerance
        below = [b for b, d in measured.items() if d > tolerance and b < found]
        assert found - max(below, default=4) <= max(1, found // PRECISION)


def test_without_a_guide_it_is_bisection():
    drift, _ = power_law(2.0, 1.0)
    measured = []
    found, count = smallest_within(lambda b: measured.append(b) or drift(b), None, 0, 1024, 0.01)
    assert measured[:4] == [1024, 512, 256, 128] and count == len(measured)
    check_bracket(drift, 0, 1024, 0.01, found)


def test_the_largest_budget_decides_the_ends():
    drift, guide = power_law(1.0, 1.0)
    measured = []
    assert smallest_within(lambda b: measured.append(b) or drift(b), guide, 4, 100, 1e-3) == (100, 1)
    assert measured == [100]  # even the largest drifts further: keep it, nothing else measured
    measured.clear()
    found, count = smallest_within(lambda b: measured.append(b) or drift(b), guide, 4, 100, 0.05, known=0.0)
    assert 100 not in measured and count == len(measured) and drift(found) <= 0.05  # known: never measured
    assert smallest_within(drift, guide, 4, 4, 1e-9, known=0.0) == (4, 0)  # nothing between the floor and it

