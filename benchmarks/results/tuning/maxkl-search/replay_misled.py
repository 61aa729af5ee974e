"""Replays of --max-kl's budget search (klevict_cli/tolerance.py) with two variants of how it gives up on its guide: bisection after
K measurements on one side of the tolerance (the shipped rule is K = 4), and a guard that moves every guided guess at
least a share of the bracket away from its ends. Each search against the shipped one on the same curves: mean and
most measurements, and the budgets found over the shipped search's (geometric mean).
    python benchmarks/results/tuning/maxkl-search/replay_misled.py   (from the repository root)
"""
import bisect, json, statistics, sys
sys.path.insert(0, "examples")
import klevict_cli.tolerance as T
from maxkl_search import drift_calibration
TOLS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.3)
REC = {"smol": 0.5, "gemma": 0.73}
CAL = {"smol": drift_calibration(None), "gemma": drift_calibration("gemma3-270m")}
def search(drift, predicted, least, most, tolerance, known, k, ratio_guard):
    measured = {}
    def measure(b):
        measured[b] = drift(b); return measured[b]
    if (known if known is not None else measure(most)) > tolerance: return most, len(measured)
    lo, hi = least, most; sides = []
    while hi - lo > max(1, hi // T.PRECISION):
        misled = len(sides) >= k and len(set(sides[-k:])) == 1
        guess = (lo + hi) // 2 if misled else T._guess(measured, predicted, lo, hi, tolerance)
        if ratio_guard and not misled:  # move at least a fixed share of the bracket
            span = hi - lo
            guess = min(max(guess, lo + max(1, int(span * ratio_guard))), hi - max(1, int(span * ratio_guard)))
        sides.append(measure(guess) <= tolerance)
        if sides[-1]: hi = guess
        else: lo = guess
    return hi, len(measured)
files = {"smol": ["benchmarks/results/tuning/maxkl-search/curves-kl-512.json", "benchmarks/results/tuning/maxkl-search/curves-kl-reconstruct-512.json"], "gemma": ["benchmarks/results/tuning/maxkl-search/gemma-curves-kl-512.json"]}
for k, guard in ((4, 0), (3, 0), (2, 0), (4, 0.1), (4, 0.2)):
    out = []
    for g, fs in files.items():
        curves = [c for f in fs for c in json.load(open(f))]
        counts, sizes = [], []
        for c in curves:
            budgets = [r[0] for r in c["curve"]]; ev = {r[0]: r[2] for r in c["curve"]}
            drift = {r[0]: r[1] / REC[g] if c.get("drift") != "sampled" else r[1] for r in c["curve"]}
            on = lambda b: budgets[min(bisect.bisect_left(budgets, b), len(budgets) - 1)]
            for t in (CAL[g].sampled_within(t, c["context"]) for t in TOLS):
                ref = search(lambda b: drift[on(b)], lambda b: ev[on(b)], c["least"], c["most"], t, 0.0, 4, 0)
                new = search(lambda b: drift[on(b)], lambda b: ev[on(b)], c["least"], c["most"], t, 0.0, k, guard)
                counts.append(new[1]); sizes.append(new[0] / ref[0])
        out.append(f"{g}: {statistics.mean(counts):.2f} (max {max(counts)}) size {statistics.geometric_mean(sizes):.3f}")
    print(f"misled after {k}, guard {guard}:", " | ".join(out))
