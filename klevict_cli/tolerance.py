"""The budget a tolerance allows (`--max-kl`): the smallest cache whose measured drift is within it, found with as
few measurements as the policy's own scores allow.

Each budget tried costs an eviction of a copy of the stream, its refit and a forward of the sampled continuation, so
the search is guided by what is free: the scores of the entries an eviction to a budget would drop, summed
(`predicted`). Summed single-removal scores are not the drift (removals interact), but on the tuning windows they
moved with it over three orders of magnitude (the sampled drift was 0.36-14x their sum over four windows, a factor
of 2-13 from the 10th to the 90th percentile within one), so a power law fitted to the budgets already measured,
drift = c * predicted^beta, places the next trial near the crossing. Where the guide is poor the bracket still shrinks: the guarantee is the measurements',
never the guide's (docs/method.md, "Budgets in nats")"""

from __future__ import annotations

import math
from collections.abc import Callable

# The search stops once the bracket is within 1/PRECISION of the budget returned (10 %): the drift changes by about
# 30 % across it (a median elasticity of 3 on the tuning curves), finer than the estimate's own scatter, and on
# those curves 5 % took 0.5-0.7 more measurements for budgets 1.3-1.8 % smaller (docs/research-log.md)
PRECISION = 10
# Drift over summed scores where nothing is measured yet; it only places the first trial. The drift searched is the
# sampled KL (before its calibration: Engine._sampled_tolerance), whose median over the summed scores on the
# 512-token tuning windows was 1.04 (`kl`, both texts; replayed, 0.6-1.3 change the mean count by under 0.1).
PRIOR_RATIO = 1.0
# The power law's exponent through a single measurement, and the range an exponent fitted through two is held to
# (two noisy measurements close together must not send the next trial far off); replayed variants of these in
# benchmarks/results/tuning/maxkl-search/replay_variants.py
BETA_THROUGH_ONE = 1.0
BETA_BOUNDS = (0.25, 4.0)
# The guide is given up for bisection after this many guesses in a row on one side of the tolerance (a drift that is
# not monotone in the budget can hold the power law near one end); 3 or 2, replayed, took more measurements
GIVE_UP = 4


def smallest_within(drift: Callable[[int], float], predicted: Callable[[int], float] | None, least: int, most: int,
                    tolerance: float, known: float | None = None) -> tuple[int, int]:
    """The smallest budget in (least, most] whose `drift` is at most `tolerance`, to within 10 % of it: the budget
    returned was measured within the tolerance (or is `most`, known to drift `known`, without a measurement), and a
    budget at most 10 % smaller (or `least`) was measured beyond it or is the floor. `most` when even it drifts
    further. `predicted(budget)`: a free guess that falls as the budget grows (None: bisection, which the guided
    search is measured against). Returns (budget, measurements)."""
    measured: dict[int, float] = {}

    def measure(budget: int) -> float:
        measured[budget] = drift(budget)
        return measured[budget]

    if (known if known is not None else measure(most)) > tolerance:
        return most, len(measured)
    lo, hi = least, most
    sides: list[bool] = []  # each measurement's: within the tolerance or not
    while hi - lo > max(1, hi // PRECISION):
        misled = len(sides) >= GIVE_UP and len(set(sides[-GIVE_UP:])) == 1  # GIVE_UP guesses on one side
        if predicted is None or misled:
            guess = (lo + hi) // 2
        else:
            guess = _guess(measured, predicted, lo, hi, tolerance)
        sides.append(measure(guess) <= tolerance)
        if sides[-1]:
            hi = guess
        else:
            lo = guess
    return hi, len(measured)


def _guess(measured: dict[int, float], predicted: Callable[[int], float], lo: int, hi: int, tolerance: float) -> int:
    """The next budget to measure, strictly inside (lo, hi): where a power law drift = c * predicted^beta through the
    measurements crosses the tolerance; moved to the budget that would close the bracket when it falls within 10 %
    of `hi`."""
    if not predicted(lo + 1) > predicted(hi):  # the guide does not fall across the bracket: it cannot place one
        return (lo + hi) // 2
    # the power law through the bracket's ends where both were measured (so it interpolates), else through the two
    # measurements nearest the tolerance (BETA_THROUGH_ONE through one)
    usable = {b: d for b, d in measured.items() if d > 0 and predicted(b) > 0}
    pair = [(b, usable[b]) for b in (lo, hi) if b in usable]
    if len(pair) < 2:
        pair = sorted(usable.items(), key=lambda p: abs(math.log(p[1] / tolerance)))[:2]
    anchor = pair[0] if pair else None
    beta = BETA_THROUGH_ONE
    if len(pair) == 2 and predicted(pair[0][0]) != predicted(pair[1][0]):
        (b1, d1), (b2, d2) = pair
        low, high = BETA_BOUNDS
        beta = min(high, max(low, math.log(d1 / d2) / math.log(predicted(b1) / predicted(b2))))
    if anchor is None:
        target = tolerance / PRIOR_RATIO
    else:
        target = predicted(anchor[0]) * (tolerance / anchor[1]) ** (1 / beta)
    a, b = lo, hi  # smallest budget in (lo, hi] predicted to be at or under the target: predicted falls with budget
    while b - a > 1:
        middle = (a + b) // 2
        if predicted(middle) <= target:
            b = middle
        else:
            a = middle
    closing = hi - max(1, hi // PRECISION)
    guess = closing if b >= closing else b
    return min(max(guess, lo + 1), hi - 1)
