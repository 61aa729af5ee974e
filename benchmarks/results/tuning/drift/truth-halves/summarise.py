"""How far the bench's own truth moves within a window: each cache's KL on the continuation's first and second half.

    python benchmarks/results/tuning/drift/truth-halves/summarise.py
"""
import json, math, os, statistics
from statistics import NormalDist
here = os.path.dirname(os.path.abspath(__file__))
for name in ("hamlet-512", "moby-512"):
    rows = [json.loads(line) for line in open(os.path.join(here, f"{name}.jsonl"))]
    lr = [math.log(r["first"] / r["second"]) for r in rows if r["first"] > 0 and r["second"] > 0]
    sd = statistics.pstdev(lr)
    ceiling = 2 * NormalDist().cdf(math.log(1.5) / (sd / 2)) - 1  # halves as independent draws: sd of the mean = sd/2
    print(f"{name}: caches {len(lr)}; halves within 1.5x of each other {sum(abs(x) <= math.log(1.5) for x in lr)}; "
          f"median first/second {math.exp(statistics.median(lr)):.2f}; sd of log ratio {sd:.2f}; "
          f"a perfect estimate of the expected KL within 1.5x of the 256-token one for about {ceiling:.0%}")
