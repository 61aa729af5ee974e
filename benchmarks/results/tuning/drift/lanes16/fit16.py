"""The drift calibration for sixteen lanes of 16 tokens (engine.DRIFT_LANES x DRIFT_STEPS), fitted as power/fit.py
fits: measured KL = scale(L) * sampled KL ** slope on seed-0 tuning recordings only, one slope per model (least
squares in logs over every length, each centred on its own means), at each length the scale that makes the median of
measured over estimated 1, and the 80 % range factor there (range/range.py's `factor`, on the same caches and,
where there are any, the caches of drift tables read on other tuning windows with this calibration: `RANGE_MORE`).

Sources, per model and read length: recordings of 16 lanes (record.sh here, ../sampled-truth/lanes.sh), read as 16
lanes x 16 tokens; where there are none, recordings of 4 lanes (../power/record.sh, ../refit/record.sh) read as
4 x 16. Both read the same expected sampled KL (the mean over lanes of the first 16 tokens' KL), four lanes more
noisily (that length's range is then wider than sixteen lanes' would be). Gemma-3-270M on sixteen lanes is recorded
at 512 tokens only (24 caches; sixteen lanes of 32 tokens over its 262,144-token vocabulary took about five minutes a
measurement at 256 tokens, two runs sharing two cores), so its slope is fitted over every length with the lanes each
has (at 512 tokens alone it would be 0.50, from 4 windows).

Then the held-out check: the seed-1 recordings of ../sampled-truth/ (never fitted on), read as 16 x 16 at this
calibration, against the 4 x 16 reading at the calibration the model shipped with before; and how many of the caches
of the held-out bench runs read on sixteen lanes (heldout/: the `--max-kl` runs on seeds 1 and 5, the seed-1 drift
table at 256 tokens) land in the 80 % range fitted here, from the estimate each recorded.

    python benchmarks/results/tuning/drift/lanes16/fit16.py          (output: fit16.txt)
"""
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent
DRIFT = HERE.parent
ROOT = HERE.parents[4]
for path in (DRIFT / "power", DRIFT / "range", ROOT / "examples", ROOT / "benchmarks", ROOT):
    sys.path.insert(0, str(path))
from drift_check import spearman  # noqa: E402
from drift_lanes import pairs  # noqa: E402
from fit import fit  # noqa: E402
from range import MODELS, bench_logs, coverage, factor  # noqa: E402

STEPS = 16
TRUTH = DRIFT / "sampled-truth"
POWER, REFIT = DRIFT / "power", DRIFT / "refit"
RUNS = {  # length -> recordings (stems) of 16 lanes, read as 16 x 16
    "smollm2-135m": {256: [HERE / "lanes16-smol-moby-256", HERE / "lanes16-smol-hamlet-256"],
                     512: [TRUTH / "lanes16-s0-moby-512", TRUTH / "lanes16-s0-hamlet-512"],
                     1024: [TRUTH / "lanes16-s0-moby-1024", TRUTH / "lanes16-s0-hamlet-1024"]},
    "gemma3-270m": {512: [TRUTH / "lanes16-gemma-s0-moby-512", TRUTH / "lanes16-gemma-s0-hamlet-512"]}}
FOUR_LANES = {  # length -> recordings of 4 lanes, read as 4 x 16 where there are none of 16
    "smollm2-135m": {256: [POWER / "lanes4-smol-moby-256", POWER / "lanes4-smol-hamlet-256"],
                     4096: [POWER / "lanes4-smol-moby-4096-w3", POWER / "lanes4-smol-hamlet-4096-w3"]},
    "gemma3-270m": {256: [POWER / "lanes4-gemma-moby-256", POWER / "lanes4-gemma-hamlet-256"],
                    1024: [POWER / "lanes4-gemma-moby-1024", POWER / "lanes4-gemma-hamlet-1024"]}}
# Drift tables on seed-2 windows (tuning: as ../range/record.sh read for the four-lane range), read with this
# calibration (`lanes16/range/`, the command in each file): the seed-0 recordings alone gave the default model's range
# at 256 tokens 1.66, which held 72 % of a held-out drift table there (docs/research-log.md, "sixteen lanes")
RANGE = HERE / "range"
RANGE_MORE = {"smollm2-135m": {256: [RANGE / "drift-smol-s2-moby-256.json", RANGE / "drift-smol-s2-hamlet-256.json"],
                               512: [RANGE / "drift-smol-s2-moby-512.json", RANGE / "drift-smol-s2-hamlet-512.json"]},
              # Gemma-3-270M's on seeds 2 and 3, 2 windows a text (record.sh there), as the four-lane range read 2-4
              "gemma3-270m": {n: [RANGE / f"drift-gemma-s{seed}-{text}-{n}.json" for seed in (2, 3)
                                  for text in ("moby", "hamlet")] for n in (256, 512, 1024)}}
HELD_OUT = {"smollm2-135m": {512: [TRUTH / "lanes16-s1-moby-512", TRUTH / "lanes16-s1-hamlet-512"],
                             1024: [TRUTH / "lanes16-s1-moby-1024", TRUTH / "lanes16-s1-hamlet-1024"]},
            "gemma3-270m": {512: [TRUTH / "lanes16-gemma-s1-moby-512", TRUTH / "lanes16-gemma-s1-hamlet-512"]}}
# bench runs on held-out windows read with the estimate on sixteen lanes: how often a cache lands in its 80 % range
HELD_OUT_RUNS = {"--max-kl caches, seed 1": "maxkl-*-s1-*.json", "--max-kl caches, seed 5": "maxkl-*-s5-*.json",
                 "drift table, seed 1": "drift-*-s1-*.json"}
# the calibrations the models read with before (four lanes of 16 tokens under 2,048 tokens): scale points, slope
BEFORE = {"smollm2-135m": (((256, 0.2595), (512, 0.3053), (1024, 0.4187), (4096, 0.5752)), 0.822),
          "gemma3-270m": (((256, 0.2156), (512, 0.2257), (1024, 0.3794)), 0.641)}


def readings(outs, lanes: range | None = None) -> list[tuple[float, float, int]]:
    """(sampled KL over the first STEPS tokens of `lanes` — every recorded lane where None —, measured, lanes read)
    per cache with a drift; a cache that keeps everything drifts 0 and is skipped."""
    found = []
    for out in outs:
        for measured, grid in pairs(str(out)):
            chosen = range(len(grid[0])) if lanes is None else lanes
            width = len(chosen)
            sampled = statistics.fmean(row[lane] for row in grid[:STEPS] for lane in chosen)
            if sampled > 0:
                found.append((sampled, measured, width))
    return found


def sources(model: str) -> dict[int, list[tuple[float, float, int]]]:
    """length -> readings, from sixteen lanes where they are recorded, else from four."""
    found = {}
    for runs in (FOUR_LANES[model], RUNS[model]):
        for length, outs in runs.items():
            if all(Path(f"{o}.json").exists() for o in outs):
                found[length] = readings(outs)
    return dict(sorted(found.items()))


def calibrate(model: str):
    by_length = sources(model)
    slope, _ = fit({n: [(math.log(s), math.log(m)) for s, m, _ in xs] for n, xs in by_length.items()})
    scales, ranges, sizes = {}, {}, {}
    for n, xs in by_length.items():
        logs = [(math.log(s), math.log(m)) for s, m, _ in xs]
        scales[n] = math.exp(statistics.median(y - slope * x for x, y in logs))
        more = [pair for path in RANGE_MORE.get(model, {}).get(n, []) if path.exists()
                for pairs in bench_logs(str(path)).values() for pair in pairs]
        ranges[n] = factor([(scales[n] * s ** slope, m) for s, m, _ in xs] + more)
        sizes[n] = (len(xs), xs[0][2], len(more))
    return slope, scales, ranges, sizes


def scale_at(points, tokens):
    from klevict_cli.calibrations import in_log_length

    return in_log_length(tuple(points.items()) if isinstance(points, dict) else points, tokens)


def scores(found, points, slope, ranges=None) -> list[float]:
    """Spearman, median estimate / measured, within 1.5x, within 2x (and within the 80 % range) of held-out caches."""
    est = [(scale_at(points, n) * s ** slope, m, n) for s, m, n in found]
    ratios = [e / m for e, m, _ in est]
    out = [spearman([e for e, _, _ in est], [m for _, m, _ in est]), statistics.median(ratios),
           *(sum(1 / f <= r <= f for r in ratios) / len(ratios) for f in (1.5, 2.0))]
    if ranges is not None:
        out.append(sum(1 / scale_at(ranges, n) <= r <= scale_at(ranges, n) for r, (_, _, n) in zip(ratios, est))
                   / len(est))
    return out


def shown(groups: list[list[float]]) -> str:
    """The mean of each statistic over separate estimators (groups of lanes), as a table's cells."""
    m = [statistics.fmean(g[i] for g in groups) for i in range(len(groups[0]))]
    cells = [f"{m[0]:.3f}", f"{m[1]:.2f}"] + [f"{100 * x:.0f} %" for x in m[2:]]
    return " | ".join(cells + [""] * (5 - len(cells)))


if __name__ == "__main__":
    fitted = {}
    for model in RUNS:
        slope, scales, ranges, sizes = calibrate(model)
        fitted[model] = (scales, slope, ranges)
        print(f"{model}: slope {slope:.3f}")
        print("| read length | caches | lanes read | scale | 80 % range factor (+ other tuning caches) |\n"
              "|---|---|---|---|---|")
        for n in scales:
            print(f"| {n} | {sizes[n][0]} | {sizes[n][1]} | {scales[n]:.4f} | {ranges[n]:.2f} (+ {sizes[n][2]}) |")
        print(f"drift_calibration {[[n, round(c, 4)] for n, c in scales.items()]}, drift_slope {round(slope, 3)}, "
              f"drift_range80 {[[n, round(f, 2)] for n, f in ranges.items()]}\n")
    print("held out (seed-1 windows): | model · length | caches | reading | Spearman | median est./measured | "
          "within 1.5x | within 2x | within the 80 % range |")
    print("|---|---|---|---|---|---|---|---|")
    before_pooled, after_pooled = [[] for _ in range(4)], []  # (estimate, measured, _) of every held-out cache
    for model, lengths in HELD_OUT.items():
        scales, slope, ranges = fitted[model]
        for n, outs in lengths.items():
            if not all(Path(f"{o}.json").exists() for o in outs):
                continue
            sixteen = [(s, m, n) for s, m, _ in readings(outs)]
            points, before = BEFORE[model]
            fours = [scores([(s, m, n) for s, m, _ in readings(outs, range(k, k + 4))], points, before)
                     for k in range(0, 16, 4)]  # each quarter of the lanes a separate estimator
            print(f"| {model} · {n} | {len(sixteen)} | 4 x 16 at the calibration before (mean of 4 quarters) | "
                  f"{shown(fours)} |")
            print(f"| {model} · {n} | {len(sixteen)} | 16 x 16, fitted here | "
                  f"{shown([scores(sixteen, scales, slope, ranges)])} |")
            after_pooled += [(scale_at(scales, n) * s ** slope, m, 1) for s, m, _ in sixteen]
            for k, quarter in enumerate(before_pooled):
                quarter += [(scale_at(points, n) * s ** before, m, 1) for s, m, _ in readings(outs, range(4 * k, 4 * k + 4))]
    calibrated = (((1, 1.0),), 1.0)  # each estimate already carried through its calibration
    print(f"| pooled | {len(after_pooled)} | 4 x 16 as before (mean of 4 quarters) | "
          f"{shown([scores(quarter, *calibrated) for quarter in before_pooled])} |")
    print(f"| pooled | {len(after_pooled)} | 16 x 16 | {shown([scores(after_pooled, *calibrated)])} |")
    print("\nheld-out bench runs in their 80 % range fitted here: | set | model | length | caches | below / in / above |")
    print("|---|---|---|---|---|")
    for label, pattern in HELD_OUT_RUNS.items():
        for (tag, n), pairs in sorted(bench_logs(str(HERE / "heldout" / pattern)).items()):
            ranges = tuple(fitted[MODELS[tag]][2].items())
            below, inside, above = coverage(pairs, ranges, n, tag)
            print(f"| {label} | {MODELS[tag]} | {n} | {len(pairs)} | {below / len(pairs):.0%} / {inside / len(pairs):.0%}"
                  f" / {above / len(pairs):.0%} |")
