"""What `--max-kl` would gain with an exact estimate: per window, the smallest cache whose *measured* KL is within
the tolerance (the measured KL interpolated log-log between the length sweep's six budgets), against one flat size
with the same mean kept share; and the best split of that mean size between windows (equal marginal KL per entry).
Both texts' windows pooled per length and reading. Run from the repository root:

    python benchmarks/results/drift/exact_tolerance.py

Prints, per length and method, the ratio of mean measured KL (tolerance met exactly / flat; best split / flat).
"""

from __future__ import annotations

import json
import math
import statistics


def curve(rows: dict, w: int) -> list[tuple[float, float]]:
    """Window w's (log kept share, log measured KL) at every budget, by kept share."""
    points = sorted((r["per_window"]["cache_fraction"][w], r["per_window"]["kl"][w]) for r in rows.values())
    return [(math.log(f), math.log(k)) for f, k in points if k > 0]


def log_kl(c: list, x: float) -> float:
    if x <= c[0][0]:
        return c[0][1]
    for (x0, y0), (x1, y1) in zip(c, c[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y0
    return c[-1][1]


def kl(c: list, share: float) -> float:
    return math.exp(log_kl(c, math.log(share)))


def grid(c: list, n: int = 400) -> list[float]:
    return [math.exp(c[0][0] + (c[-1][0] - c[0][0]) * i / n) for i in range(n + 1)]


def smallest_within(c: list, tolerance: float) -> float:
    return next((s for s in grid(c, 2000) if kl(c, s) <= tolerance), math.exp(c[-1][0]))


def best_split(curves: list, mean_share: float) -> list[float]:
    """Per window the share minimising KL + λ·share, λ bisected until the shares average `mean_share`."""
    lo, hi = 1e-7, 10.0
    for _ in range(60):
        lam = math.sqrt(lo * hi)
        picks = [min(grid(c), key=lambda s, c=c: kl(c, s) + lam * s) for c in curves]
        lo, hi = (lam, hi) if statistics.fmean(picks) > mean_share else (lo, lam)
    return picks


def main() -> None:
    for length in (256, 512, 1024, 4096):
        for method in ("kl", "kl-reconstruct"):
            curves = []
            for text in ("moby", "hamlet"):
                path = f"benchmarks/results/lengths-{text}-{length}.json"
                rows = json.load(open(path))["fidelity"]["results"][method]
                curves += [curve(rows, w) for w in range(len(next(iter(rows.values()))["per_window"]["kl"]))]
            cells = []
            for tolerance in (0.01, 0.03, 0.1):
                shares = [smallest_within(c, tolerance) for c in curves]
                mean = statistics.fmean(shares)
                exact = statistics.fmean(kl(c, s) for c, s in zip(curves, shares))
                flat = statistics.fmean(kl(c, mean) for c in curves)
                picks = best_split(curves, mean)
                best = statistics.fmean(kl(c, s) for c, s in zip(curves, picks))
                flat_best = statistics.fmean(kl(c, statistics.fmean(picks)) for c in curves)
                cells.append(f"{tolerance:g} ({100 * mean:.0f} % kept): exact {exact / flat:.2f}x, "
                             f"best split {best / flat_best:.2f}x")
            print(f"{length} {method} ({len(curves)} windows): " + " | ".join(cells))


if __name__ == "__main__":
    main()
