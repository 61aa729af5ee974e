"""How precisely can a cache's drift be estimated, and against which truth? On the recordings of `lanes.sh` (the
drift sampled on 16 lanes of 32 tokens, every token's KL kept; each cache measured on the real next page, the
bench's `kl`, and on 4 continuations the full cache's model writes itself, `kl_sampled`): for each way of reading
the samples (lanes x tokens, from the recorded ones), a calibration fitted on the seed-0 windows — measured =
scale * sampled ** slope, least squares in the logarithms, the scale then centred on the median as the shipped one is
— and applied to the held-out seed-1 windows: Spearman, median estimate / truth, within 1.5x and 2x, averaged over
the groups of lanes a recording holds. Then how precisely 4 continuations measure a cache (the spread s of one
continuation's log KL about their mean: the mean of 4 scatters by about s / 2).

    python benchmarks/results/tuning/drift/sampled-truth/sampled_truth.py
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..", "..", "..", "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from drift_check import spearman  # noqa: E402
from drift_lanes import VARIANTS, pairs  # noqa: E402

TEXTS = ("moby", "hamlet")
SHOWN = ("4x16 (of 16)", "4x32 (of 16)", "8x16 (of 16)", "8x32 (of 16)", "16x8", "16x16", "16x32")


def recordings(seed: int, truth: str) -> list[tuple[float, list[list[float]]]]:
    return [p for text in TEXTS for p in pairs(os.path.join(HERE, f"lanes16-s{seed}-{text}-512"), truth)]


def read(found, group: list[int], steps: int) -> list[tuple[float, float]]:
    """(sampled KL as this group of lanes and steps reads it, truth) per cache."""
    return [(statistics.fmean(grid[s][lane] for s in range(steps) for lane in group), truth) for truth, grid in found]


def fit(found: list[tuple[float, float]]) -> tuple[float, float]:
    """(scale, slope): least squares of log truth on log sampled, the scale centred on the median ratio."""
    xs, ys = zip(*((math.log(s), math.log(t)) for s, t in found))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return statistics.median(t / s ** slope for s, t in found), slope


def held_out(tuning, held, group, steps) -> list[float]:
    scale, slope = fit(read(tuning, group, steps))
    found = read(held, group, steps)
    ratios = [scale * s ** slope / t for s, t in found]
    inside = [sum(1 / f <= r <= f for r in ratios) / len(ratios) for f in (1.5, 2.0)]
    return [spearman([s for s, _ in found], [t for _, t in found]), statistics.median(ratios), *inside, slope]


def main() -> None:
    for truth, words in (("kl", "the real next page (kl)"), ("kl_sampled", "the model's own text (kl_sampled)")):
        tuning, held = recordings(0, truth), recordings(1, truth)
        print(f"\nagainst {words}: fitted on {len(tuning)} seed-0 caches, held out {len(held)} seed-1 caches")
        print("| lanes x tokens | Spearman | median est./truth | within 1.5x | within 2x | slope |")
        print("|---|---|---|---|---|---|")
        for name in SHOWN:
            groups, steps = VARIANTS[name]
            rows = [held_out(tuning, held, group, steps) for group in groups]
            m = [statistics.fmean(r[i] for r in rows) for i in range(5)]
            print(f"| {name} | {m[0]:.3f} | {m[1]:.2f} | {100 * m[2]:.0f} % | {100 * m[3]:.0f} % | {m[4]:.2f} |")
    spread = []
    for seed in (0, 1):
        for text in TEXTS:
            result = json.load(open(os.path.join(HERE, f"lanes16-s{seed}-{text}-512.json")))
            for per in result["fidelity"]["results"].values():
                for row in per.values():
                    for lanes in row["per_window"]["kl_sampled_lanes"]:
                        centre = math.log(statistics.fmean(lanes))
                        spread += [math.log(x) - centre for x in lanes if x > 0]
    s = statistics.pstdev(spread) * math.sqrt(4 / 3)
    print(f"\none continuation's log KL about the mean of its 4: s = {s:.2f}; the mean of 4 within 1.5x of the "
          f"expectation for {100 * math.erf(math.log(1.5) / (s / 2 * math.sqrt(2))):.0f} % of caches (normal)")


if __name__ == "__main__":
    main()
