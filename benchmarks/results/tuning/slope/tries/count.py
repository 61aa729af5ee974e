"""How many budgets each --max-kl search measures, with the drift calibration as shipped (a slope) or as it was (one
factor per length, slope 1: the default model's points, so for the default model only), or the search's prior ratio
set to X: the bench's tolerance run on the same windows, the engine's search wrapped to count.
python count.py shipped|proportional|prior=X BENCH-ARGS..."""
import json, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[5]))
from klevict_cli import engine
from klevict_cli.cli import app

variant, args = sys.argv[1], sys.argv[2:]
if variant == "proportional":  # the calibration before the slope (SmolLM2's points; slope 1)
    engine.DRIFT_CALIBRATION = engine.DriftCalibration(((256, 0.44), (512, 0.52), (1024, 0.81), (4096, 0.87)))
if variant.startswith("prior="):
    from klevict_cli import tolerance
    tolerance.PRIOR_RATIO = float(variant.split("=")[1])
counts = []
search = engine.smallest_within


def counted(*a, **k):
    budget, n = search(*a, **k)
    counts.append(n)
    return budget, n


engine.smallest_within = counted
try:
    app(args, standalone_mode=False)
finally:
    print(json.dumps({"variant": variant, "args": args, "counts": counts, "mean": sum(counts) / max(1, len(counts))}))
