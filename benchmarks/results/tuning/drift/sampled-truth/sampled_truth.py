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
sys.path.insert(0, ROOT)
from drift_check import spearman  # noqa: E402
from drift_lanes import VARIANTS, pairs  # noqa: E402

sys.path.insert(0, os.path.join(HERE, "..", "power"))
from fit import fit as fit_power  # noqa: E402

TEXTS = ("moby", "hamlet")
SETS = {"SmolLM2-135M · 512": ("", 512), "Gemma-3-270M · 512": ("-gemma", 512), "SmolLM2-135M · 1,024": ("", 1024)}
SHOWN = ("4x16 (of 16)", "4x32 (of 16)", "8x16 (of 16)", "8x32 (of 16)", "16x8", "16x16", "16x32")


def stem(tag: str, seed: int, text: str, context: int) -> str:
    return os.path.join(HERE, f"lanes16{tag}-s{seed}-{text}-{context}")


def recordings(tag: str, context: int, seed: int, truth: str) -> list[tuple[float, list[list[float]]]]:
    return [p for text in TEXTS for p in pairs(stem(tag, seed, text, context), truth)]


def shipped(tag: str, context: int) -> tuple[float, float]:
    """(scale, slope) of the calibration the model reads with at this length."""
    from klevict_cli.calibrations import DRIFT_CALIBRATION, drift_calibration, shipped_file

    settings = json.load(open(stem(tag, 0, TEXTS[0], context) + ".json"))["settings"]
    calibration = drift_calibration(shipped_file(settings["model_weights_sha256"])) or DRIFT_CALIBRATION
    return calibration.scale(context), calibration.slope


def read(found, group: list[int], steps: int) -> list[tuple[float, float]]:
    """(sampled KL as this group of lanes and steps reads it, truth) per cache."""
    return [(statistics.fmean(grid[s][lane] for s in range(steps) for lane in group), truth) for truth, grid in found]


def fit(found: list[tuple[float, float]]) -> tuple[float, float]:
    """(scale, slope) as the shipped calibration is fitted (power/fit.py): least squares of log truth on log sampled,
    the scale centred on the median ratio."""
    slope, scales = fit_power({0: [(math.log(s), math.log(t)) for s, t in found]})
    return scales[0], slope


def scored(found: list[tuple[float, float]], scale: float, slope: float) -> list[float]:
    """Spearman, median estimate / truth, within 1.5x and 2x, the slope."""
    ratios = [scale * s ** slope / t for s, t in found]
    inside = [sum(1 / f <= r <= f for r in ratios) / len(ratios) for f in (1.5, 2.0)]
    return [spearman([s for s, _ in found], [t for _, t in found]), statistics.median(ratios), *inside, slope]


def row(name: str, rows: list[list[float]]) -> str:
    m = [statistics.fmean(r[i] for r in rows) for i in range(5)]
    return f"| {name} | {m[0]:.3f} | {m[1]:.2f} | {100 * m[2]:.0f} % | {100 * m[3]:.0f} % | {m[4]:.2f} |"


def report(label: str, tag: str, context: int) -> None:
    for truth, words in (("kl", "the real next page (kl)"), ("kl_sampled", "the model's own text (kl_sampled)")):
        tuning, held = recordings(tag, context, 0, truth), recordings(tag, context, 1, truth)
        print(f"\n{label}, against {words}: fitted on {len(tuning)} seed-0 caches, held out {len(held)} seed-1 caches")
        print("| lanes x tokens | Spearman | median est./truth | within 1.5x | within 2x | slope |")
        print("|---|---|---|---|---|---|")
        if truth == "kl":  # the estimate as the model reads it now: four lanes of 16 under 2,048 tokens
            groups, steps = VARIANTS["4x16 (of 16)"]
            print(row("4x16 (of 16), calibration as shipped",
                      [scored(read(held, group, steps), *shipped(tag, context)) for group in groups]))
        for name in SHOWN:
            groups, steps = VARIANTS[name]
            print(row(name, [scored(read(held, group, steps), *fit(read(tuning, group, steps))) for group in groups]))
    spread = []
    for seed in (0, 1):
        for text in TEXTS:
            result = json.load(open(stem(tag, seed, text, context) + ".json"))
            for per in result["fidelity"]["results"].values():
                for cache in per.values():
                    for lanes in cache["per_window"]["kl_sampled_lanes"]:
                        centre = math.log(statistics.fmean(lanes))
                        spread += [math.log(x) - centre for x in lanes if x > 0]
    s = statistics.pstdev(spread) * math.sqrt(4 / 3)
    print(f"\none continuation's log KL about the mean of its 4: s = {s:.2f}; the mean of 4 within 1.5x of the "
          f"expectation for {100 * math.erf(math.log(1.5) / (s / 2 * math.sqrt(2))):.0f} % of caches (normal)")


def main() -> None:
    for label, (tag, context) in SETS.items():
        if all(os.path.exists(stem(tag, seed, text, context) + ".json") for seed in (0, 1) for text in TEXTS):
            report(label, tag, context)


if __name__ == "__main__":
    main()
