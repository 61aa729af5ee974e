"""What a drift calibration whose scale is fitted on every tuning set of windows would do, offline: at each read
length, the scale that makes the median of measured over estimated 1 over the seed-0 recordings and the drift
tables of record.sh (seeds 2-4) together, instead of the seed-0 recordings alone (the slope as shipped). Under
`--budget` the calibration changes no cache, only its estimate (a multiple of the scale), so the held-out seed-1
drift table's estimates are rescaled exactly; the `--max-kl` runs would have to be read again. Prints each scale,
then the held-out Spearman, median estimated / measured and share within 1.5×, shipped against pooled.

    python benchmarks/results/tuning/drift/range/pooled_scale.py   (output: pooled_scale.txt)"""
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import range as fitted  # noqa: E402
from drift_check import spearman  # noqa: E402  (benchmarks/, on the path through range.py's ROOT)

from klevict_cli.results import within_factor  # noqa: E402

sys.path.insert(0, str(fitted.ROOT / "benchmarks"))


def describe(pairs):
    ratios = [e / m for e, m in pairs]
    return (f"Spearman {spearman(*map(list, zip(*pairs))):.3f}, median {statistics.median(ratios):.2f}×, "
            f"{100 * within_factor(ratios) / len(ratios):.0f} % within 1.5×")


held = fitted.bench_logs(str(fitted.ROOT / "benchmarks/results/drift/drift-*-s1-*.json"))
tuning = fitted.bench_logs(str(HERE / "drift-*-s[2-9]-*.json"))
every = {"shipped": [], "pooled": []}
for model in fitted.MODELS:
    shipped = fitted.drift_calibration(None if model == "smol" else fitted.MODELS[model])
    recorded = fitted.recorded(model)
    points = []
    for length, scale in shipped.points:
        pairs = recorded.get(length, []) + tuning.get((model, length), [])
        points.append((length, scale * statistics.median(m / e for e, m in pairs)))
    pooled = fitted.DriftCalibration(tuple(points), slope=shipped.slope)
    print(f"{model}: scale " + ", ".join(f"{n}: {a:.4g} -> {b:.4g}" for (n, a), (_, b) in zip(shipped.points, points)))
    mine = {"shipped": [], "pooled": []}
    for (m, length), pairs in sorted(held.items()):
        if m != model:
            continue
        at = length + fitted.FRAME[model]
        ratio = pooled.scale(at) / shipped.scale(at)
        rescaled = [(e * ratio, k) for e, k in pairs]
        print(f"  held out {length}: shipped {describe(pairs)} | pooled {describe(rescaled)}")
        mine["shipped"] += pairs
        mine["pooled"] += rescaled
    for name in mine:
        every[name] += mine[name]
    print(f"  held out, all: shipped {describe(mine['shipped'])} | pooled {describe(mine['pooled'])}")
print(f"both models: shipped {describe(every['shipped'])} | pooled {describe(every['pooled'])}")
