"""Paired: the drift estimate with its tokens drawn from the whole distribution (p1) and from its nucleus (p0.9 ...),
on the same reads (the caches and the measured KL are the same). Files: {variant}-{text}-{context}-{model}.json."""
import glob, json, math, os, statistics, sys
sys.path.insert(0, "/work/main")
import torch
from klevict_cli.oracle import spearman
folder = sys.argv[1]
groups = {}
for f in sorted(glob.glob(f"{folder}/p*.json")):
    variant, rest = os.path.basename(f)[:-5].split("-", 1)
    d = json.load(open(f))
    xs = [(e, k) for bb in d["fidelity"]["results"].values() for cell in bb.values()
          for e, k in zip(cell["per_window"]["estimated_kl"], cell["per_window"]["kl"]) if e is not None]
    groups.setdefault(variant, {})[rest] = xs
def line(name, xs):
    r = [e / k for e, k in xs]
    rho = spearman(torch.tensor([e for e, _ in xs]), torch.tensor([k for _, k in xs]))
    within = sum(1 / 1.5 <= x <= 1.5 for x in r)
    spread = statistics.pstdev(math.log(x) for x in r)
    print(f"{name:40s} n {len(xs):3d} Spearman {rho:.3f} median est/measured {statistics.median(r):.2f} "
          f"sd(log) {spread:.2f} within 1.5x {within} ({100 * within / len(xs):.0f} %)")
for variant, per in sorted(groups.items()):
    for rest, xs in per.items():
        line(f"{variant} {rest}", xs)
    line(f"{variant} pooled", [x for xs in per.values() for x in xs])
