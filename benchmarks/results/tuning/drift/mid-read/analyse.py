"""Does a window's measured / estimated drift after reading its first 512 tokens (measured on the 256 tokens that
follow them, inside the window) predict the same ratio after reading the whole 1,024-token window (measured on the 256
that follow it)? If a document's text were harder or easier than the samples throughout, it would, and the read could
calibrate its estimate on its own text. Usage: python analyse.py NAME... (smol-moby, smol-haml, gemma-moby, ...)."""

import json
import math
import statistics
import sys
from pathlib import Path

here = Path(__file__).resolve().parent
sys.path.insert(0, str(here.parents[3]))
from drift_check import spearman  # noqa: E402


def pearson(a: list[float], b: list[float]) -> float:
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    return cov / (sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b)) ** 0.5


def rows(path: Path) -> dict:
    fidelity = json.loads(path.read_text())["fidelity"]
    out = {}
    for method, per in fidelity["results"].items():
        for label, row in per.items():
            window = row["per_window"]
            for w, (measured, estimated) in enumerate(zip(window["kl"], window["estimated_kl"])):
                if estimated and measured:
                    out[(fidelity["offsets"][w], method, label)] = (estimated, measured)
    return out


pairs = []
for name in sys.argv[1:]:
    mid, whole = rows(here / f"{name}-512.json"), rows(here / f"{name}-1024.json")
    pairs += [(mid[key], whole[key]) for key in sorted(mid.keys() & whole.keys())]
log_mid = [math.log(m / e) for (e, m), _ in pairs]
log_whole = [math.log(m / e) for _, (e, m) in pairs]
print(f"{' + '.join(sys.argv[1:])}: {len(pairs)} window x budget pairs")
print(f"  log(measured / estimated), first half against whole: Pearson {pearson(log_mid, log_whole):.2f},"
      f" Spearman {spearman(log_mid, log_whole):.2f}")
for alpha in (0.0, 0.5, 1.0):  # the whole read's estimate times the first half's ratio ** alpha, centred by one scale
    ratios = [e * math.exp(alpha * a) / m for a, (_, (e, m)) in zip(log_mid, pairs)]
    scale = statistics.median(ratios)
    within = sum(1 / 1.5 <= r / scale <= 1.5 for r in ratios) / len(ratios)
    print(f"  estimate x (first half's ratio)^{alpha}: within 1.5x after centring {within:.0%},"
          f" Spearman against measured {spearman([r * m for r, (_, (_, m)) in zip(ratios, pairs)], [m for _, (_, m) in pairs]):.2f}")
