"""What klevict measures once per model and ships: kl's calibration, and how the model's own samples stand in for the
text that follows (the drift calibration).

`kl` multiplies each KV head's direct-path scores by the median ratio of Fisher to direct score (docs/method.md,
"Calibration"). Measured on each document, that costs a backward pass at the first eviction, about 0.1x a read.
But the ratios belong mostly to the model: on the default model they spread over a factor of about 3.4 between
heads and 1.3-1.5 between windows of one head, and ratios averaged over Hamlet scored Moby Dick's tuning windows as
well as each window's own did (0.94-1.04x the KL; docs/research-log.md). So for the models klevict ships with it
carries the ratios averaged over many windows of texts outside the benchmark (`examples/calibrate.py`), keyed by
the weights' fingerprint; other models calibrate on each document.

A file may also carry the model's `copy_share` (kl's share of the budget for the read's own estimate of what a
re-reading needs), where it was measured to differ from the default: the estimate's worth belongs to the model too
(docs/method.md, "the copy share is the model's"); and its `relied_on`, where the model's re-reading relies on so
much of a document that its scores stop telling which entries it needs more (`KL.relied_on`). And its
`drift_calibration` (as DRIFT_CALIBRATION below: a scale by read length and a `drift_slope`), where the model's
own samples stand in for the text that follows differently from the default model's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

FOLDER = Path(__file__).parent / "model_calibrations"


def in_log_length(points: tuple[tuple[int, float], ...], tokens: int) -> float:
    """The value at a read of `tokens` tokens of (read length, value) `points`: interpolated in log(length) between
    them, the nearest beyond them."""
    points = tuple(sorted(points))
    if tokens <= points[0][0]:
        return points[0][1]
    for (n0, c0), (n1, c1) in zip(points, points[1:]):
        if tokens <= n1:
            return c0 + (c1 - c0) * math.log(tokens / n0) / math.log(n1 / n0)
    return points[-1][1]


@dataclass(frozen=True)
class DriftCalibration:
    """What the model's own samples say about the text that follows: measured KL = scale(read length) * sampled
    KL ** slope, the scale at each of `points` (read length in tokens, scale) interpolated in log(length) between
    them and the nearest beyond them; and how far the text that follows strays from that, `range80` (read length,
    factor): the measured KL of 80 % of the tuning windows' caches fell within the estimate times or divided by the
    factor (none where it was not measured)."""

    points: tuple[tuple[int, float], ...]
    slope: float = 1.0
    range80: tuple[tuple[int, float], ...] = ()

    def scale(self, tokens: int) -> float:
        """The scale at a read of `tokens` tokens."""
        return in_log_length(self.points, tokens)

    def likely(self, estimate: float, tokens: int) -> tuple[float, float] | None:
        """Where the KL of the text that follows a read of `tokens` lands for 80 % of caches estimated at
        `estimate`: the estimate divided and multiplied by the factor at that length; None where it is not known."""
        if not self.range80:
            return None
        factor = in_log_length(self.range80, tokens)
        return estimate / factor, estimate * factor

    def estimate(self, sampled: float, ci95: float, tokens: int) -> tuple[float, float]:
        """The estimated KL of a read of `tokens` from its `sampled` KL, and how far above it the upper end of the
        sampled KL's 95 % interval (+ `ci95`) lands, carried through the same power: the estimate plus it is that
        end (where slope < 1 the lower end lies further below than this; at slope 1 the interval is symmetric)."""
        c = self.scale(tokens)

        def power(s: float) -> float:
            return c * max(s, 0.0) ** self.slope  # float32 passes may leave a KL of -1e-9

        return power(sampled), power(sampled + ci95) - power(sampled)

    def sampled_within(self, tolerance: float, tokens: int) -> float:
        """The largest sampled KL whose estimate at a read of `tokens` is at most `tolerance` (to float rounding, and
        never above it): a tolerance carried back through the calibration, for a search that compares sampled KLs
        (`--max-kl`). 0 for a tolerance of 0; infinite for one beyond any float's estimate."""
        if tolerance <= 0:
            return 0.0
        try:
            sampled = (tolerance / self.scale(tokens)) ** (1 / self.slope)
        except OverflowError:
            return math.inf
        while sampled > 0 and self.estimate(sampled, 0.0, tokens)[0] > tolerance:
            sampled = math.nextafter(sampled, 0.0)
        return sampled


# The model's own samples (temperature 1) move further than the text that follows, the less so the longer the read
# (the real text of a long read needs more of what was evicted: names copied from far back), and the more so the
# further a cache moved (measured over sampled KL falls as the budget tightens). So the estimate is a power of the
# sampled KL, scaled by the read's length: `DriftCalibration`, fitted on the seed-0 tuning windows of the default
# model (both texts, kl and kl-reconstruct at every budget of the recordings; one slope over every length, and at
# each length the scale that makes the median of measured over estimated 1: docs/method.md,
# "Estimated drift"); every model reads with it unless klevict ships its own (`drift_calibration`). The real next
# page still scatters about the estimate by window, by about 1.9x either way for one cache in five: its 80 % range
# on those windows and, at 256 and 512 tokens, seed-2 drift tables (docs/method.md, "How far to trust the estimate";
# benchmarks/results/tuning/drift/lanes16/fit16.py).
DRIFT_CALIBRATION = DriftCalibration(((256, 0.2494), (512, 0.3364), (1024, 0.4530), (4096, 0.5742)), slope=0.836,
                                     range80=((256, 1.72), (512, 1.85), (1024, 2.06), (4096, 1.79)))


def shipped_file(weights_sha256: str) -> dict | None:
    """The calibration file measured for these exact weights, or None."""
    for path in sorted(FOLDER.glob("*.json")):
        data = json.loads(path.read_text())
        if data["weights_sha256"] == weights_sha256:
            return data
    return None


def drift_calibration(data: dict | None) -> DriftCalibration | None:
    """A calibration file's drift calibration — (read length, scale) points, a slope (1 where it has none) and the
    (read length, factor) points of its 80 % range (none where it has none) — where the model has its own; None for
    the engine's."""
    if data is None or "drift_calibration" not in data:
        return None
    points = tuple((int(n), float(c)) for n, c in data["drift_calibration"])
    range80 = tuple((int(n), float(f)) for n, f in data.get("drift_range80", ()))
    return DriftCalibration(points, float(data.get("drift_slope", 1.0)), range80)


def state_of(data: dict) -> dict[str, str]:
    """A calibration file's ratios, and the model's copy share and `relied_on` where it has its own, as policy state
    (what `Policy.adopt` takes)."""
    state = {"calibration": json.dumps(data["ratios"])} if "ratios" in data else {}
    for key in ("copy_share", "relied_on"):
        if key in data:
            state[key] = str(data[key])
    return state
