"""Replays of --max-kl's budget search with variants of its guide (klevict_cli/tolerance.py): the exponent used
through one measurement (`BETA_THROUGH_ONE`), a rule that keeps each guess at least 10 % above the bracket's lower
end, the first guess's prior ratio (`PRIOR_RATIO`), how many same-side guesses it takes to give the guide up for
bisection (`GIVE_UP`), and a guard that keeps each guess a share of the bracket away from both its ends. The search compares sampled KLs against the tolerance carried
back through the model's drift calibration (Engine._sampled_tolerance); these curves hold the drift as estimated when
they were recorded, a single factor per model (SmolLM2's 0.5, Gemma's 0.73 at 512 tokens), divided out here.
python replay_variants.py SMOL_CURVES[,..] GEMMA_CURVES[,..]"""
import bisect, json, statistics, sys
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "examples"))
import klevict_cli.tolerance as T
from maxkl_search import drift_calibration  # the calibration a model's reads use
TOLS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.3)
shipped = {"BETA_THROUGH_ONE": T.BETA_THROUGH_ONE, "PRIOR_RATIO": T.PRIOR_RATIO, "GIVE_UP": T.GIVE_UP,
           "_guess": T._guess}
RECORDED_WITH = {"smol": 0.5, "gemma": 0.73}
CALIBRATION = {"smol": drift_calibration(None), "gemma": drift_calibration("gemma3-270m")}


def opening(measured, predicted, lo, hi, tolerance):
    """The shipped guess, raised to at least the budget whose success would close the bracket above `lo`."""
    guess = shipped["_guess"](measured, predicted, lo, hi, tolerance)
    return min(max(guess, lo + max(1, lo // (T.PRECISION - 1))), hi - 1)


def guarded(share):
    """The shipped guess, kept `share` of the bracket away from both its ends."""
    def guess(measured, predicted, lo, hi, tolerance):
        margin = max(1, int((hi - lo) * share))
        return min(max(shipped["_guess"](measured, predicted, lo, hi, tolerance), lo + margin), hi - margin)
    return guess


def use(beta_one=shipped["BETA_THROUGH_ONE"], opening_rule=False, prior=shipped["PRIOR_RATIO"],
        give_up=shipped["GIVE_UP"], guard=0.0):
    T.BETA_THROUGH_ONE, T.PRIOR_RATIO, T.GIVE_UP = beta_one, prior, give_up
    T._guess = opening if opening_rule else guarded(guard) if guard else shipped["_guess"]


def run(files, model):
    """Mean and most measurements per search, and the sizes found over bisection's (geometric mean)."""
    curves = [c for f in files for c in json.loads(Path(f).read_text())]
    counts, sizes = [], []
    for c in curves:
        budgets = [r[0] for r in c["curve"]]; ev = {r[0]: r[2] for r in c["curve"]}
        drift = {r[0]: r[1] / RECORDED_WITH[model] for r in c["curve"]}  # the sampled KL
        on = lambda b: budgets[min(bisect.bisect_left(budgets, b), len(budgets) - 1)]
        for t in (CALIBRATION[model].sampled_within(t, c["context"]) for t in TOLS):
            old = T.smallest_within(lambda b: drift[on(b)], None, c["least"], c["most"], t, known=0.0)  # bisection
            new = T.smallest_within(lambda b: drift[on(b)], lambda b: ev[on(b)], c["least"], c["most"], t, known=0.0)
            counts.append(new[1]); sizes.append(new[0] / old[0])
    return statistics.mean(counts), max(counts), statistics.geometric_mean(sizes)


def main():
    variants = {"current": {}, "opening": {"opening_rule": True}}
    for b1 in (0.5, 0.7):
        variants[f"beta_one {b1}"] = {"beta_one": b1}
        variants[f"beta_one {b1} + opening"] = {"beta_one": b1, "opening_rule": True}
    for pr in (0.4, 0.6, 0.8, 1.3):
        variants[f"prior {pr}"] = {"prior": pr}
    for k in (3, 2):
        variants[f"give up after {k}"] = {"give_up": k}
    for share in (0.1, 0.2):
        variants[f"guard {share}"] = {"guard": share}
    groups = {"smol": sys.argv[1].split(","), "gemma": sys.argv[2].split(",")} if len(sys.argv) > 2 else {"smol": sys.argv[1].split(",")}
    for name, kw in variants.items():
        use(**kw)
        out = []
        for g, files in groups.items():
            m, mx, sz = run(files, g)
            out.append(f"{g}: {m:.2f} (max {mx}) size {sz:.3f}")
        print(f"{name:28s}", " | ".join(out))


if __name__ == "__main__":
    main()
