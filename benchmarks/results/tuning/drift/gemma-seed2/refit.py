# Run from the repository root: python benchmarks/results/tuning/drift/gemma-seed2/refit.py
"""Gemma 1,024-token drift calibration: median measured / sampled over the seed-0 tail-probe rows and the seed-2
bench runs (tuning windows only), per source and pooled; and the held-out seed-1 ratio estimate / measured under it."""
import glob, json, statistics
CAL = 1.78
s0 = [r["measured"] / r["sampled"] for r in json.load(open("benchmarks/results/tuning/tail-probe/warm-gemma-1024-s0.json"))["rows"] if r["sampled"] > 0]
s2 = []
for f in sorted(glob.glob("benchmarks/results/tuning/drift/gemma-seed2/drift-gemma-s2-*-1024.json")):
    r = json.load(open(f))
    for m, rows in r["fidelity"]["results"].items():
        for b, row in rows.items():
            w = row["per_window"]
            s2 += [k / (e / CAL) for k, e in zip(w["kl"], w["estimated_kl"]) if e]
print(f"seed 0: {len(s0)} pairs, median {statistics.median(s0):.3f}; seed 2: {len(s2)} pairs, median {statistics.median(s2) if s2 else float('nan'):.3f}; "
      f"pooled {statistics.median(s0 + s2):.3f}")
