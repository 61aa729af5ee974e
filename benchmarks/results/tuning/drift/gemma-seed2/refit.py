"""Gemma-3-270M's 1,024-token drift calibration on its tuning windows: the median of measured over sampled KL on the
seed-0 tail-probe rows and on the seed-2 bench runs here, each and pooled (research log, "Gemma's 1,024-token drift
calibration, on more tuning windows"). Run from the repository root:

    python benchmarks/results/tuning/drift/gemma-seed2/refit.py
"""

import glob
import json
import statistics

SHIPPED = 1.78  # the calibration the seed-2 runs' estimates were made with (sampled KL = estimate / SHIPPED)
SEED0 = "benchmarks/results/tuning/tail-probe/warm-gemma-1024-s0.json"
SEED2 = "benchmarks/results/tuning/drift/gemma-seed2/drift-gemma-s2-*-1024.json"

seed0 = [r["measured"] / r["sampled"] for r in json.load(open(SEED0))["rows"] if r["sampled"] > 0]
seed2 = []
for path in sorted(glob.glob(SEED2)):
    for rows in json.load(open(path))["fidelity"]["results"].values():
        for row in rows.values():
            window = row["per_window"]
            seed2 += [k / (e / SHIPPED) for k, e in zip(window["kl"], window["estimated_kl"]) if e]
print(f"seed 0: {len(seed0)} pairs, median {statistics.median(seed0):.3f}; seed 2: {len(seed2)} pairs, median "
      f"{statistics.median(seed2):.3f}; pooled {statistics.median(seed0 + seed2):.3f}")
