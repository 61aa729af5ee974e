"""Where the drift estimate's error comes from, on seed-0 tuning recordings (drift_lanes.py record): each cache's
log(measured / estimated) at the model's shipped slope, centred on its length's median, split into the part
shared by a window's twelve caches (between windows) and the rest (within a window), beside the estimate's own sampling
variance (the four lanes' spread, by the delta method: slope² var(lane KL) / (lanes · mean²)), and the within-window
and between-window slopes of log measured on log sampled. python scatter.py"""
import json, math, statistics, sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "power"))
from fit import RUNS, STEPS  # noqa: E402  (RUNS: what the calibration is fitted on)

sys.path.insert(0, str(HERE.parents[4] / "examples"))
from drift_lanes import pairs  # noqa: E402
from maxkl_search import drift_calibration  # noqa: E402  (the calibration a model's reads use)


def caches(out: Path, steps: int):
    """(window, budget label, per-lane sampled KLs, measured KL) of each cache of a recorded run."""
    result = json.loads(Path(f"{out}.json").read_text())["fidelity"]["results"]
    found, by_measurement = [], iter(pairs(str(out)))
    for method, rows in result.items():
        for budget, row in rows.items():
            window = row["per_window"]
            for w, (estimate, measured) in enumerate(zip(window.get("estimated_kl", []), window["kl"])):
                if estimate is None or measured <= 0:
                    continue
                _, grid = next(by_measurement)
                lanes = [statistics.fmean(r[j] for r in grid[:steps]) for j in range(len(grid[0]))]
                if statistics.fmean(lanes) > 0:
                    found.append((f"{out.name}:{w}", f"{method}@{budget}", lanes, measured))
    return found


def slope_of(points):
    mx, my = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else float("nan")


if __name__ == "__main__":
    print("model length | caches windows | total var (sd) | estimate's own sampling var | between-window var | "
          "within-window var | within 1.5x | slope within / between windows | mean residual at 50 %")
    for model, runs in RUNS.items():
        slope = drift_calibration(model).slope
        for length, outs in runs.items():
            if not all(Path(f"{o}.json").exists() for o in outs):
                continue
            rows = [c for o in outs for c in caches(Path(o), STEPS(length))]
            errs = [math.log(m) - slope * math.log(statistics.fmean(l)) for _, _, l, m in rows]
            centre = statistics.median(errs)
            errs = [e - centre for e in errs]
            own = statistics.fmean(slope ** 2 * statistics.variance(l) / len(l) / statistics.fmean(l) ** 2
                                   for _, _, l, _ in rows)
            windows = {}
            for (w, b, l, m), e in zip(rows, errs):
                windows.setdefault(w, []).append((b, e, math.log(statistics.fmean(l)), math.log(m)))
            means = {w: statistics.fmean(e for _, e, _, _ in v) for w, v in windows.items()}
            between = statistics.fmean(mu ** 2 for mu in means.values()) - statistics.fmean(means.values()) ** 2
            within = statistics.fmean((e - means[w]) ** 2 for w, v in windows.items() for _, e, _, _ in v)
            within_points = [(x - statistics.fmean(p[2] for p in v), y - statistics.fmean(p[3] for p in v))
                             for v in windows.values() for _, _, x, y in v]
            window_points = [(statistics.fmean(p[2] for p in v), statistics.fmean(p[3] for p in v))
                             for v in windows.values()]
            half = [e - means[w] for w, v in windows.items() for b, e, _, _ in v if b.endswith("@50%")]
            share = sum(abs(e) < math.log(1.5) for e in errs) / len(errs)
            print(f"{model} {length} | {len(rows)} {len(windows)} | {statistics.fmean(e * e for e in errs):.3f} "
                  f"({statistics.fmean(e * e for e in errs) ** 0.5:.2f}) | {own:.3f} | {between:.3f} | {within:.3f} | "
                  f"{share:.0%} | {slope_of(within_points):.2f} / {slope_of(window_points):.2f} | "
                  f"{statistics.fmean(half):+.2f}")
