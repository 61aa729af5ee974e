"""Held-out check of the lane shapes: each calibrated on the seed-0 recordings (lanes8-{moby,hamlet}-512), applied
to the seed-1 ones (lanes8-s1-*-512). Run from anywhere: python benchmarks/results/tuning/drift/lanes8/heldout.py"""
import sys, statistics, math
sys.path.insert(0, "/work/main/examples"); sys.argv = ["x"]
import drift_lanes as d
B = "/work/main/benchmarks/results/tuning/drift/lanes8/"
tune = [p for t in ("moby", "hamlet") for p in d.pairs(B + f"lanes8-{t}-512")]
held = [p for t in ("moby", "hamlet") for p in d.pairs(B + f"lanes8-s1-{t}-512")]
variants = {"4x16": ([[0, 1, 2, 3], [4, 5, 6, 7]], 16), "8x8": ([list(range(8))], 8), "8x16": ([list(range(8))], 16),
            "4x32": ([[0, 1, 2, 3], [4, 5, 6, 7]], 32)}
def est(grid, group, steps): return statistics.fmean(grid[s][l] for s in range(steps) for l in group)
print(f"tuning {len(tune)} pairs, held out {len(held)} pairs")
for name, (groups, steps) in variants.items():
    rows = []
    for group in groups:
        cal = statistics.median(m / est(g, group, steps) for m, g in tune)
        e = [cal * est(g, group, steps) for m, g in held]; m = [m for m, _ in held]
        lr = [math.log(a / b) for a, b in zip(e, m)]
        rows.append((d.spearman(e, m), math.exp(statistics.median(lr)), sum(abs(x) <= math.log(1.5) for x in lr) / len(lr), cal))
    mean = [statistics.fmean(r[i] for r in rows) for i in range(4)]
    print(f"{name}: calibration {mean[3]:.3f}, held-out Spearman {mean[0]:.3f}, median {mean[1]:.2f}x, within 1.5x {100*mean[2]:.0f} %")
