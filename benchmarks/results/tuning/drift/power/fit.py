"""The drift calibration klevict ships: measured KL = scale(L) * sampled KL ** slope, fitted on seed-0 tuning runs
only (every drift measurement's per-token KL recorded: record.sh's here, the three-window 4,096-token runs, and
../refit/record.sh's at 512 and 1,024 tokens), one slope per model over its read lengths (least squares in logs,
each length centred on its own mean), and at each length the scale that makes the median of measured over
estimated 1 on those windows (held out, the drift table's runs measure it: docs/benchmarks.md). python fit.py"""
import math, statistics, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[5]
sys.path.insert(0, str(ROOT / "examples"))
from drift_lanes import pairs  # noqa: E402

HERE = Path(__file__).parent
REFIT = HERE.parent / "refit"  # refit/record.sh: 512 and 1,024 tokens recorded again with the code as it is
RUNS = {"smollm2-135m": {256: [HERE / "lanes4-smol-moby-256", HERE / "lanes4-smol-hamlet-256"],
                         512: [REFIT / "lanes4-smol-moby-512", REFIT / "lanes4-smol-hamlet-512"],
                         1024: [REFIT / "lanes4-smol-moby-1024", REFIT / "lanes4-smol-hamlet-1024"],
                         4096: [HERE / "lanes4-smol-moby-4096-w3", HERE / "lanes4-smol-hamlet-4096-w3"]},
        "gemma3-270m": {256: [HERE / "lanes4-gemma-moby-256", HERE / "lanes4-gemma-hamlet-256"],
                        512: [REFIT / "lanes4-gemma-moby-512", REFIT / "lanes4-gemma-hamlet-512"],
                        1024: [HERE / "lanes4-gemma-moby-1024", HERE / "lanes4-gemma-hamlet-1024"]}}
# Every recording is of one vintage of the code (bfloat16 probes, the drift from the logits' change): the 512- and
# 1,024-token recordings of the earlier code (../lanes/: float32 probes, two windows a text) gave SmolLM2 slope 0.838
# and scales 0.268 / 0.297 / 0.431 / 0.598, Gemma 0.62 and 0.2025 / 0.2361 / 0.3659 (shipped until these were refitted)
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


if __name__ == "__main__":
    for model, runs in RUNS.items():
        by_length = {n: log_pairs(outs, n) for n, outs in runs.items()
                     if all(Path(f"{o}.json").exists() for o in outs)}
        slope, scales = fit(by_length)
        print(f"{model}: slope {slope:.3f}; scales " + ", ".join(f"{n}: {c:.4g}" for n, c in scales.items())
              + "; pairs " + ", ".join(f"{n}: {len(xy)}" for n, xy in by_length.items()))
