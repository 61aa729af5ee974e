"""Is the measured KL a power of the sampled one with an exponent below 1? Fit log(measured) = a_L + g log(sampled)
on the seed-0 lanes runs (4 lanes x 16 steps under 2,048 tokens, 32 from 2,048), then apply each fit to the held-out
seed-1 drift files as they were then (sampled = estimate / the calibration they were read with; the files have since
been made again with the slope, so a run now no longer reproduces power.txt). python power.py"""
import sys, math, statistics
ROOT = __import__("pathlib").Path(__file__).resolve().parents[5]
sys.path.insert(0, str(ROOT / "examples")); sys.path.insert(0, str(ROOT))
from drift_lanes import pairs
D = str(ROOT / "benchmarks/results/tuning/drift/lanes") + "/"
HERE = str(ROOT / "benchmarks/results/tuning/drift/power") + "/"  # the seed-0 runs recorded for this fit (record.sh)
groups = {"smol 256": [HERE + "lanes4-smol-moby-256", HERE + "lanes4-smol-hamlet-256"],
          "smol 512": ["lanes4-moby-512", "lanes4-hamlet-512"], "smol 1024": ["lanes4-moby-1024", "lanes4-hamlet-1024"],
          "smol 4096": ["lanes4-moby-4096", "lanes4-hamlet-4096"],
          "gemma 256": [HERE + "lanes4-gemma-moby-256", HERE + "lanes4-gemma-hamlet-256"],
          "gemma 512": ["lanes4-gemma-moby-512", "lanes4-gemma-hamlet-512"]}
import os
groups = {g: outs for g, outs in groups.items() if all(os.path.exists((o if o.startswith("/") else D + o) + ".json")
                                                        for o in outs)}
data = {}
for g, outs in groups.items():
    steps = 32 if "4096" in g else 16
    xs = []
    for o in outs:
        for measured, grid in pairs(o if o.startswith("/") else D + o):
            s = statistics.fmean(v for row in grid[:steps] for v in row)
            if s > 0:  # a cache that keeps every entry drifts 0 on the samples
                xs.append((math.log(s), math.log(measured)))
    data[g] = xs
def fit(groups_used):
    # common slope, per-group intercepts: within-group centred least squares
    num = den = 0.0
    for g in groups_used:
        xs = data[g]; mx = statistics.fmean(x for x, _ in xs); my = statistics.fmean(y for _, y in xs)
        num += sum((x - mx) * (y - my) for x, y in xs); den += sum((x - mx) ** 2 for x, _ in xs)
    return num / den
for g in data:
    print(g, len(data[g]), "slope", round(fit([g]), 3))
print("smol pooled slope", round(fit([g for g in data if g.startswith("smol")]), 3))
import json, glob
from klevict_cli.engine import DriftCalibration
# the proportional calibration the held-out files were read with when this was run (before the slope)
DRIFT_CALIBRATION = ((256, 0.44), (512, 0.52), (1024, 0.81), (4096, 0.87))
drift_calibration = lambda points, tokens: DriftCalibration(points).scale(tokens)
import torch
from klevict_cli.oracle import spearman
def heldout(model, L):
    out = []
    for f in glob.glob(f"{ROOT}/benchmarks/results/drift/drift-{model}-s1-*-{L}.json"):
        d = json.load(open(f)); toks = d["settings"]["budget_tokens"]
        for bb in d["fidelity"]["results"].values():
            for cell in bb.values():
                w = cell["per_window"]
                out += [(e, k) for e, k in zip(w["estimated_kl"], w["kl"]) if e]
    return out
gem_points = ((512, 0.73), (1024, 1.78))
for g in data:
    model, L = g.split(); L = int(L)
    xs = data[g]; gam = fit([g])
    mx = statistics.fmean(x for x, _ in xs); my = statistics.fmean(y for _, y in xs)
    a = my - gam * mx
    # the same, as a median-centred version: intercept so that the median log ratio on seed 0 is 0
    a_med = statistics.median(y - gam * x for x, y in xs)
    pts = DRIFT_CALIBRATION if model == "smol" else gem_points
    c = drift_calibration(pts, L + (24 if model == "smol" else 1))  # the window in its chat frame (24 tokens of prefix; Gemma 1)
    ho = heldout(model, L)
    cur = [e / k for e, k in ho]
    new = [math.exp(a_med + gam * math.log(e / c)) / k for e, k in ho]
    w = lambda r: sum(1 / 1.5 <= x <= 1.5 for x in r) / len(r)
    print(f"{g}: held out {len(ho)} | current median {statistics.median(cur):.2f} within {w(cur):.0%} | power {gam:.2f} median {statistics.median(new):.2f} within {w(new):.0%}")
print("one slope per model (SmolLM2's pooled over its lengths):")
gs = fit([g for g in data if g.startswith("smol")])
for g in data:
    model, L = g.split(); L = int(L)
    gam = gs if model == "smol" else fit([g])
    xs = data[g]; a_med = statistics.median(y - gam * x for x, y in xs)
    pts = DRIFT_CALIBRATION if model == "smol" else gem_points
    c = drift_calibration(pts, L + (24 if model == "smol" else 1))
    ho = heldout(model, L)
    new = [math.exp(a_med + gam * math.log(e / c)) / k for e, k in ho]
    w = lambda r: sum(1 / 1.5 <= x <= 1.5 for x in r) / len(r)
    print(f"{g}: power {gam:.2f} median {statistics.median(new):.2f} within {w(new):.0%}")
