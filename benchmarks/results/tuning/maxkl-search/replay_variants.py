"""Replays of --max-kl's budget search with variants of its guide (klevict_cli/tolerance.py `_guess`): the exponent
used through one measurement, a rule that keeps each guess at least 10 % above the bracket's floor, the first
guess's prior ratio. python replay_variants.py SMOL_CURVES[,..] GEMMA_CURVES[,..]"""
import bisect, json, math, statistics, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import klevict_cli.tolerance as T
TOLS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.3)
orig_guess = T._guess

def make_guess(beta_one=1.0, opening=False, prior=0.4, beta_lo=0.25):
    def _guess(measured, predicted, lo, hi, tolerance):
        if not predicted(lo + 1) > predicted(hi):
            return (lo + hi) // 2
        usable = {b: d for b, d in measured.items() if d > 0 and predicted(b) > 0}
        pair = [(b, usable[b]) for b in (lo, hi) if b in usable]
        if len(pair) < 2:
            pair = sorted(usable.items(), key=lambda p: abs(math.log(p[1] / tolerance)))[:2]
        anchor = pair[0] if pair else None
        beta = beta_one
        if len(pair) == 2 and predicted(pair[0][0]) != predicted(pair[1][0]):
            (b1, d1), (b2, d2) = pair
            beta = min(4.0, max(beta_lo, math.log(d1 / d2) / math.log(predicted(b1) / predicted(b2))))
        if anchor is None:
            target = tolerance / prior
        else:
            target = predicted(anchor[0]) * (tolerance / anchor[1]) ** (1 / beta)
        a, b = lo, hi
        while b - a > 1:
            m = (a + b) // 2
            if predicted(m) <= target: b = m
            else: a = m
        closing = hi - max(1, hi // T.PRECISION)
        op = lo + max(1, lo // (T.PRECISION - 1))
        guess = closing if b >= closing else (op if opening and b < op else b)
        return min(max(guess, lo + 1), hi - 1)
    return _guess

def run(files):
    curves = [c for f in files for c in json.loads(Path(f).read_text())]
    counts, sizes = [], []
    for c in curves:
        budgets = [r[0] for r in c["curve"]]; drift = {r[0]: r[1] for r in c["curve"]}; ev = {r[0]: r[2] for r in c["curve"]}
        on = lambda b: budgets[min(bisect.bisect_left(budgets, b), len(budgets) - 1)]
        for t in TOLS:
            T._guess = orig_guess
            old = T.smallest_within(lambda b: drift[on(b)], None, c["least"], c["most"], t, known=0.0)
            T._guess = current
            new = T.smallest_within(lambda b: drift[on(b)], lambda b: ev[on(b)], c["least"], c["most"], t, known=0.0)
            counts.append(new[1]); sizes.append(new[0] / old[0])
    return statistics.mean(counts), max(counts), statistics.geometric_mean(sizes)

variants = {"current": {}, "opening": {"opening": True}}
for b1 in (0.5, 0.7):
    variants[f"beta_one {b1}"] = {"beta_one": b1}
    variants[f"beta_one {b1} + opening"] = {"beta_one": b1, "opening": True}
for pr in (0.2, 0.3, 0.6):
    variants[f"prior {pr}"] = {"prior": pr}
groups = {"smol": sys.argv[1].split(","), "gemma": sys.argv[2].split(",")} if len(sys.argv) > 2 else {"smol": sys.argv[1].split(",")}
for name, kw in variants.items():
    current = make_guess(**kw)
    out = []
    for g, files in groups.items():
        m, mx, sz = run(files)
        out.append(f"{g}: {m:.2f} (max {mx}) size {sz:.3f}")
    print(f"{name:28s}", " | ".join(out))
