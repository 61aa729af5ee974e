"""Each --max-kl read's seconds over the --budget 10% read of the same window, median per tolerance, pooled."""
import json, statistics, sys
pooled, per = [], {}
for f in sys.argv[1:]:
    r = json.load(open(f))["fidelity"]["results"]["kl"]
    base = r["10%"]["per_window"]["seconds"]
    for label, row in r.items():
        if label.startswith("max-kl"):
            ratios = [s / b for s, b in zip(row["per_window"]["seconds"], base)]
            per.setdefault(label, []).extend(ratios); pooled += ratios
for label, v in per.items():
    print(label, f"median {statistics.median(v):.2f}x ({min(v):.2f}-{max(v):.2f}), {len(v)} windows")
print(f"pooled median {statistics.median(pooled):.3f}x over {len(pooled)}")
