"""`--max-kl`'s read time over the `--budget 10%` read of the same window (bench results of `--budgets 10% --max-kl
0.01,0.03,0.1`): per tolerance and pooled, the median and range over windows.

    python benchmarks/results/tuning/probe-precision/scoring/maxkl/time_ratios.py idle-moby.json idle-hamlet.json
"""
import json, statistics, sys
pooled = {}
for f in sys.argv[1:]:
    r = json.load(open(f))["fidelity"]["results"]["kl"]
    base = r["10%"]["per_window"]["seconds"]
    for tol in ("max-kl 0.01", "max-kl 0.03", "max-kl 0.1"):
        ratios = [s / b for s, b in zip(r[tol]["per_window"]["seconds"], base)]
        pooled.setdefault(tol, []).extend(ratios)
for tol, xs in pooled.items():
    print(tol, "median %.2f (%.2f-%.2f) n %d" % (statistics.median(xs), min(xs), max(xs), len(xs)))
allx = [x for xs in pooled.values() for x in xs]
print("pooled median %.2f n %d" % (statistics.median(allx), len(allx)))
