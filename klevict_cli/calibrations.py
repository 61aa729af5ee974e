"""kl's calibration, measured once per model and shipped with klevict.

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
`drift_calibration` (as engine.DRIFT_CALIBRATION: a scale by read length and a `drift_slope`), where the model's
own samples stand in for the text that follows differently from the default model's.
"""

from __future__ import annotations

import json
from pathlib import Path

from klevict_cli.engine import DriftCalibration

FOLDER = Path(__file__).parent / "model_calibrations"


def shipped_file(weights_sha256: str) -> dict | None:
    """The calibration file measured for these exact weights, or None."""
    for path in sorted(FOLDER.glob("*.json")):
        data = json.loads(path.read_text())
        if data["weights_sha256"] == weights_sha256:
            return data
    return None


def drift_calibration(data: dict | None) -> DriftCalibration | None:
    """A calibration file's drift calibration — (read length, scale) points and a slope (1 where it has none) — where
    the model has its own; None for the engine's."""
    if data is None or "drift_calibration" not in data:
        return None
    points = tuple((int(n), float(c)) for n, c in data["drift_calibration"])
    return DriftCalibration(points, float(data.get("drift_slope", 1.0)))


def state_of(data: dict) -> dict[str, str]:
    """A calibration file's ratios, and the model's copy share and `relied_on` where it has its own, as policy state
    (what `Policy.adopt` takes)."""
    state = {"calibration": json.dumps(data["ratios"])} if "ratios" in data else {}
    for key in ("copy_share", "relied_on"):
        if key in data:
            state[key] = str(data[key])
    return state
