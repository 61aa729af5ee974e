"""The drift estimate's 80 % range (calibrations.DriftCalibration.range80). Per model and read length, the factor
within which the measured KL of 80 % of the tuning caches fell, either side of their estimate at the shipped
calibration: the seed-0 recordings the calibration is fitted on (power/fit.py's RUNS) and the drift tables of
record.sh here (seed 2; Gemma-3-270M seeds 3 and 4 as well), pooled. Then how often caches of windows it was not fitted on land in their range: the seed-1
drift table (benchmarks/results/drift/drift-*.json) and the caches the seed-1 `--max-kl` runs kept (maxkl-*.json).

    python benchmarks/results/tuning/drift/range/range.py [--shipped]   (output: range.txt)

--shipped: the held-out check with the factors the calibrations ship, instead of those fitted here."""
import glob, json, math, re, statistics, sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parents[4]
sys.path.insert(0, str(HERE.parent / "power"))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))
from fit import RUNS, log_pairs  # noqa: E402  (RUNS: what the calibration is fitted on)
from maxkl_search import drift_calibration  # noqa: E402  (the calibration a model's reads use)

from klevict_cli.calibrations import DriftCalibration  # noqa: E402

MODELS = {"smol": "smollm2-135m", "gemma": "gemma3-270m"}
FRAME = {"smol": 24, "gemma": 1}  # tokens of chat frame before a window: a read of L tokens ends at L + FRAME
SHARE = 0.8


def bench_logs(pattern: str) -> dict[tuple[str, int], list[tuple[float, float]]]:
    """(model, length) -> (estimate, measured) of every cache with an estimate in the bench results matching."""
    found = {}
    for path in sorted(glob.glob(pattern)):
        model, length = re.search(r"-(smol|gemma)-s\d+-\w+-(\d+)\.json$", path).groups()
        for rows in json.loads(Path(path).read_text())["fidelity"]["results"].values():
            for row in rows.values():
                window = row["per_window"]
                found.setdefault((model, int(length)), []).extend(
                    (e, m) for e, m in zip(window.get("estimated_kl", []), window["kl"]) if e and m > 0)
    return found


def recorded(model: str) -> dict[int, list[tuple[float, float]]]:
    """length -> (estimate at the shipped calibration, measured) of every seed-0 recorded cache."""
    calibration = drift_calibration(None if model == "smol" else MODELS[model])
    return {n: [(calibration.scale(n) * math.exp(calibration.slope * x), math.exp(y)) for x, y in log_pairs(outs, n)]
            for n, outs in RUNS[MODELS[model]].items() if all(Path(f"{o}.json").exists() for o in outs)}


def factor(pairs: list[tuple[float, float]]) -> float:
    """The smallest factor within which SHARE of the measured KLs lie of their estimates (either way)."""
    errors = sorted(abs(math.log(m / e)) for e, m in pairs)
    return math.exp(statistics.quantiles(errors, n=100, method="inclusive")[round(100 * SHARE) - 1])


def coverage(pairs, factors: tuple[tuple[int, float], ...], length: int, model: str) -> tuple[int, int, int]:
    """How many caches measured below, within and above their range (as a read that ends at its window's end
    position gets it: DriftCalibration.likely)."""
    ranges = [DriftCalibration(((1, 1.0),), range80=factors).likely(e, length + FRAME[model]) for e, _ in pairs]
    below = sum(m < low for (low, _), (_, m) in zip(ranges, pairs))
    above = sum(m > high for (_, high), (_, m) in zip(ranges, pairs))
    return below, len(pairs) - below - above, above


if __name__ == "__main__":
    tuning = bench_logs(str(HERE / "drift-*-s[2-9]-*.json"))
    fitted = {}
    print("model length | tuning caches (seed 0 + seeds 2-4) | factor: seed 0 / seeds 2-4 / pooled")
    for model in MODELS:
        for length, pairs in recorded(model).items():
            more = tuning.get((model, length), [])
            fitted.setdefault(model, []).append((length, round(factor(pairs + more), 2)))
            print(f"{model} {length} | {len(pairs)} + {len(more)} | {factor(pairs):.2f} / "
                  f"{factor(more) if len(more) > 4 else float('nan'):.2f} / {fitted[model][-1][1]:.2f}")
    for model in MODELS:
        print(f"{model}: range80 = {tuple(fitted[model])}")
    shipped = "--shipped" in sys.argv
    for label, pattern in (("drift table", "benchmarks/results/drift/drift-*-s1-*.json"),
                           ("--max-kl caches", "benchmarks/results/drift/maxkl-*-s1-*.json")):
        held = bench_logs(str(ROOT / pattern))
        print(f"\nheld out, {label} ({'shipped' if shipped else 'fitted'} factors): model length | caches | "
              "below / in / above the range")
        totals = {}
        for (model, length), pairs in sorted(held.items()):
            factors = (drift_calibration(None if model == "smol" else MODELS[model]).range80 if shipped
                       else tuple(fitted[model]))
            below, inside, above = coverage(pairs, factors, length, model)
            t = totals.setdefault(model, [0, 0, 0])
            t[0], t[1], t[2] = t[0] + below, t[1] + inside, t[2] + above
            print(f"{model} {length} | {len(pairs)} | {below / len(pairs):.0%} / {inside / len(pairs):.0%} / "
                  f"{above / len(pairs):.0%}")
        for model, (below, inside, above) in totals.items():
            n = below + inside + above
            print(f"{model} all | {n} | {below / n:.0%} / {inside / n:.0%} / {above / n:.0%}")
