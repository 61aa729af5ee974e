"""Paired: the drift estimate with its tokens sampled on the probe copy (default) and on the model (modelsample)."""
import json, math, statistics, sys, torch
sys.path.insert(0, "/work/main")
from klevict_cli.oracle import spearman
folder = sys.argv[1]  # benchmarks/results/tuning/drift/copy-vs-model-sampling
pool = {"default": [], "modelsample": []}
for text in ("hamlet", "moby-dick"):
    rows = {}
    for v in ("default", "modelsample"):
        d = json.load(open(f"{folder}/{v}-{text}-512-gemma.json"))
        xs = []
        for method, bb in d["fidelity"]["results"].items():
            for b, cell in bb.items():
                w = cell["per_window"]
                xs += [(e, k) for e, k in zip(w["estimated_kl"], w["kl"]) if e is not None]
        rows[v] = xs
        pool[v] += xs
    for v, xs in rows.items():
        r = [e / k for e, k in xs]
        rho = spearman(torch.tensor([e for e, _ in xs]), torch.tensor([k for _, k in xs]))
        print(f"{text:10s} {v:12s} n {len(xs)} rho {rho:.3f} median est/measured {statistics.median(r):.2f} within 1.5x {sum(1/1.5 <= x <= 1.5 for x in r)}")
    same = all(abs(a[1] - b[1]) < 1e-12 for a, b in zip(rows["default"], rows["modelsample"]))
    pr = [a[0] / b[0] for a, b in zip(rows["default"], rows["modelsample"])]
    print(f"{text:10s} measured identical: {same}; copy over model estimate: geo {math.exp(sum(map(math.log, pr)) / len(pr)):.3f}, median {statistics.median(pr):.3f}, copy lower in {sum(x < 1 for x in pr)}/{len(pr)}")
for v, xs in pool.items():
    r = [e / k for e, k in xs]
    rho = spearman(torch.tensor([e for e, _ in xs]), torch.tensor([k for _, k in xs]))
    print(f"pooled     {v:12s} n {len(xs)} rho {rho:.3f} median {statistics.median(r):.2f} within 1.5x {sum(1/1.5 <= x <= 1.5 for x in r)}")
