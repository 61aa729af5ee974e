"""Median of measured / sampled KL over a bench recording's pairs; sampled = estimated / the calibration it read with."""
import json, statistics, sys
used = float(sys.argv[1])
ratios = []
for f in sys.argv[2:]:
    d = json.load(open(f))
    for method, rows in d["fidelity"]["results"].items():
        for budget, row in rows.items():
            w = row["per_window"]
            for e, m in zip(w["estimated_kl"], w["kl"]):
                if e and m > 0:
                    ratios.append(m / (e / used))
q = statistics.quantiles(ratios, n=10)
print(f"{len(ratios)} pairs: measured / sampled median {statistics.median(ratios):.3f} (10-90 % {q[0]:.2f}-{q[-1]:.2f})")
