"""The drift calibration klevict ships: measured KL = scale(L) * sampled KL ** slope, fitted on seed-0 tuning runs
only (every drift measurement's per-token KL recorded: the lanes runs at 512-4,096 tokens and record.sh's), one
slope per model over its read lengths (least squares in logs, each length centred on its own mean), and at each
length the scale that makes the median of measured over estimated 1 on those windows. Then, as a preview, the fit
applied to the held-out seed-1 drift files (their sampled KL is their estimate over the calibration they were read
with, `--calibration-was`). python fit.py [--calibration-was smollm2|gemma3 POINTS...]"""
import glob, json, math, os, statistics, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[5]
sys.path.insert(0, str(ROOT / "examples"))
from drift_lanes import pairs  # noqa: E402

LANES, HERE = ROOT / "benchmarks/results/tuning/drift/lanes", Path(__file__).parent
RUNS = {"smollm2-135m": {256: [HERE / "lanes4-smol-moby-256", HERE / "lanes4-smol-hamlet-256"],
                         512: [LANES / "lanes4-moby-512", LANES / "lanes4-hamlet-512"],
                         1024: [LANES / "lanes4-moby-1024", LANES / "lanes4-hamlet-1024"],
                         4096: [LANES / "lanes4-moby-4096", LANES / "lanes4-hamlet-4096"]},
        "gemma3-270m": {256: [HERE / "lanes4-gemma-moby-256", HERE / "lanes4-gemma-hamlet-256"],
                        512: [LANES / "lanes4-gemma-moby-512", LANES / "lanes4-gemma-hamlet-512"],
                        1024: [HERE / "lanes4-gemma-moby-1024", HERE / "lanes4-gemma-hamlet-1024"]}}
STEPS = lambda length: 32 if length >= 2048 else 16  # engine.drift_steps: what a read of this length samples per lane


def log_pairs(outs, length):
    """(log sampled, log measured) per window and budget; a cache that keeps everything drifts 0 and is skipped."""
    found = []
    for out in outs:
        for measured, grid in pairs(str(out)):
            sampled = statistics.fmean(v for row in grid[: STEPS(length)] for v in row)
            if sampled > 0:
                found.append((math.log(sampled), math.log(measured)))
    return found


def fit(by_length):
    """One slope over every length (each centred on its own means), then each length's median-centred scale."""
    num = den = 0.0
    for xy in by_length.values():
        mx, my = statistics.fmean(x for x, _ in xy), statistics.fmean(y for _, y in xy)
        num += sum((x - mx) * (y - my) for x, y in xy)
        den += sum((x - mx) ** 2 for x, _ in xy)
    slope = num / den
    return slope, {n: math.exp(statistics.median(y - slope * x for x, y in xy)) for n, xy in by_length.items()}


def interpolate(points, tokens):  # as engine.DriftCalibration.scale
    points = sorted(points.items())
    if tokens <= points[0][0]:
        return points[0][1]
    for (n0, c0), (n1, c1) in zip(points, points[1:]):
        if tokens <= n1:
            return c0 + (c1 - c0) * math.log(tokens / n0) / math.log(n1 / n0)
    return points[-1][1]


# the calibrations the held-out drift files were read with (proportional: sampled = estimate / scale)
WAS = {"smollm2-135m": {256: 0.44, 512: 0.52, 1024: 0.81, 4096: 0.87}, "gemma3-270m": {512: 0.73, 1024: 1.78}}
SHORT = {"smollm2-135m": "smol", "gemma3-270m": "gemma"}

if __name__ == "__main__":
    fits = {}
    for model, runs in RUNS.items():
        by_length = {n: log_pairs(outs, n) for n, outs in runs.items()
                     if all(Path(f"{o}.json").exists() for o in outs)}
        slope, scales = fit(by_length)
        fits[model] = slope, scales
        print(f"{model}: slope {slope:.3f}; scales " + ", ".join(f"{n}: {c:.4g}" for n, c in scales.items())
              + "; pairs " + ", ".join(f"{n}: {len(xy)}" for n, xy in by_length.items()))
    within = lambda r: sum(1 / 1.5 <= x <= 1.5 for x in r) / len(r)
    print("held out (seed 1): measured over estimated, proportional as read -> fitted")
    for model, (slope, scales) in fits.items():
        for path in sorted(glob.glob(str(ROOT / f"benchmarks/results/drift/drift-{SHORT[model]}-s1-*.json"))):
            d = json.loads(Path(path).read_text())
            n = d["settings"]["context"]
            old, new = [], []
            for cells in d["fidelity"]["results"].values():
                for cell in cells.values():
                    w = cell["per_window"]
                    for e, k in zip(w["estimated_kl"], w["kl"]):
                        if e:
                            s = e / interpolate(WAS[model], n)
                            old.append(k / e)
                            new.append(k / (interpolate(scales, n) * s ** slope))
            print(f"  {Path(path).stem}: {len(old)} | median {statistics.median(old):.2f} within {within(old):.0%}"
                  f" -> median {statistics.median(new):.2f} within {within(new):.0%}")
