"""How the 80 % range holds on a set of windows it was not fitted on, for every set in turn (leave one set out): the
seed-0 recordings, the drift tables of record.sh (seeds 2-4) and the seed-1 drift table the range is held out on.
Per model and length: the factor fitted on the other sets and the share of the set's caches inside it, then each
set's median log(measured / estimated) at the shipped calibration (how far its windows sit from the estimate).

    python benchmarks/results/tuning/drift/range/loso.py   (output: loso.txt)"""
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import range as fitted  # noqa: E402  (range.py here: the factor, the recordings, the bench results)

HELD_OUT = str(fitted.ROOT / "benchmarks/results/drift/drift-*-s1-*.json")

for model in fitted.MODELS:
    sets = {0: fitted.recorded(model)}
    for seed in range(2, 10):
        found = fitted.bench_logs(str(HERE / f"drift-{model}-s{seed}-*.json"))
        if found:
            sets[seed] = {n: pairs for (m, n), pairs in found.items() if m == model}
    sets[1] = {n: pairs for (m, n), pairs in fitted.bench_logs(HELD_OUT).items() if m == model}
    print(f"{model}: sets of windows (seeds) {', '.join(map(str, sets))}")
    for length in sorted(sets[0]):
        shares, offsets = [], []
        for seed, by_length in sets.items():
            held = by_length.get(length, [])
            rest = [p for other in sets if other != seed for p in sets[other].get(length, [])]
            if not held or len(rest) < 5:
                continue
            factor = fitted.factor(rest)
            inside = sum(e / factor <= m <= e * factor for e, m in held) / len(held)
            shares.append(f"s{seed} {factor:.2f}: {inside:.0%} of {len(held)}")
            offsets.append(f"s{seed} {statistics.median(math.log(m / e) for e, m in held):+.2f}")
        print(f"  {length} tokens | in range, factor from the other sets: {' / '.join(shares)}")
        print(f"  {length} tokens | median log(measured / estimated): {', '.join(offsets)}")
