"""How close can any estimate built from the model's own drift come to the bench's truth? (issue 40's first target)

The bench measures a cache on one real continuation of 256 tokens; the drift estimate samples what the model itself
would write. Here the estimate is replaced by an oracle: the cache's KL along four continuations of 256 tokens that the
full cache's model wrote (`bench --sampled 4`, `kl_sampled`), the quantity the sampled lanes estimate, measured at full
length. A power law from it to the real page's KL is fitted in hindsight on the very caches it is scored on (the best
calibration of that form; optimistic), and the share of caches within 1.5x / 2x of the page is counted.

Four continuations are themselves a sample of the model's drift. Their noise (the spread of one continuation's KL about
the four's mean, over four, by the delta method) is taken out of the residual variance to give the page's own spread
about an exact oracle, and the share within 1.5x a normal spread of that size allows: what an estimate that knew the
model's expected drift exactly, calibrated in hindsight, would reach. The spread is read two ways, the standard
deviation and 1.4826 x the median absolute deviation (robust to the few caches far off), since the residuals' tails
are not normal.

Inputs: every recording of lanes.sh here (seeds 0 and 1, both texts, `kl` and `kl-reconstruct` at 20 / 10 / 5 %).

    python benchmarks/results/tuning/drift/sampled-truth/oracle_bound.py        (output: oracle_bound.txt)
"""
import glob
import json
import math
import re
import statistics
from pathlib import Path

HERE = Path(__file__).parent


def caches() -> dict[tuple[str, int], list[tuple[float, float, float, str]]]:
    """(model, length) -> (page KL, own KL over the continuations, squared relative error of that mean, text)."""
    found = {}
    for path in sorted(glob.glob(str(HERE / "lanes16-*.json"))):
        name = Path(path).name
        model = "gemma3-270m" if "-gemma-" in name else "smollm2-135m"
        length = int(re.search(r"-(\d+)\.json$", name).group(1))
        text = "moby-dick" if "-moby-" in name else "hamlet"
        for rows in json.loads(Path(path).read_text())["fidelity"]["results"].values():
            for row in rows.values():
                window = row["per_window"]
                for page, own, lanes in zip(window["kl"], window["kl_sampled"], window["kl_sampled_lanes"]):
                    if page > 0 and own > 0:
                        relative = statistics.variance(lanes) / own ** 2 / len(lanes)
                        found.setdefault((model, length), []).append((page, own, relative, text))
    return found


def hindsight_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = slope * x + offset."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def share_within(residuals: list[float], factor: float) -> float:
    return sum(abs(r) <= math.log(factor) for r in residuals) / len(residuals)


def normal_within(spread: float, factor: float = 1.5) -> float:
    return math.erf(math.log(factor) / (spread * math.sqrt(2))) if spread > 0 else 1.0


def robust_spread(residuals: list[float]) -> float:
    middle = statistics.median(residuals)
    return 1.4826 * statistics.median(abs(r - middle) for r in residuals)


def main() -> None:
    print("| model · length | caches | hindsight slope | within 1.5x / 2x of the page (4 continuations, fitted on "
          "themselves) | residual spread: sd / robust | the four's own noise | the page's spread about an exact "
          "oracle: sd / robust | within 1.5x, exact oracle (normal): sd / robust |")
    print("|---|---|---|---|---|---|---|---|")
    pooled = []
    for (model, length), found in sorted(caches().items()):
        page = [math.log(p) for p, _, _, _ in found]
        own = [math.log(o) for _, o, _, _ in found]
        slope, offset = hindsight_fit(own, page)
        residuals = [y - (slope * x + offset) for x, y in zip(own, page)]
        spreads = (statistics.pstdev(residuals), robust_spread(residuals))
        noise = math.sqrt(statistics.fmean(r for _, _, r, _ in found))
        page = [math.sqrt(max(s ** 2 - (slope * noise) ** 2, 0.0)) for s in spreads]
        pooled += [(r, page) for r in residuals]
        print(f"| {model} · {length} | {len(found)} | {slope:.2f} | {share_within(residuals, 1.5):.0%} / "
              f"{share_within(residuals, 2.0):.0%} | {spreads[0]:.2f} / {spreads[1]:.2f} | {noise:.2f} | "
              f"{page[0]:.2f} / {page[1]:.2f} | {normal_within(page[0]):.0%} / {normal_within(page[1]):.0%} |")
    residuals = [r for r, _ in pooled]
    exact = [statistics.fmean(normal_within(s[k]) for _, s in pooled) for k in (0, 1)]
    print(f"| pooled | {len(pooled)} | | {share_within(residuals, 1.5):.0%} / {share_within(residuals, 2.0):.0%} | "
          f"| | | {exact[0]:.0%} / {exact[1]:.0%} |")


if __name__ == "__main__":
    main()
