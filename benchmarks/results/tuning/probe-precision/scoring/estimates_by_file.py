"""Per bench result file, the drift estimate against the measured KL: Spearman, median ratio, caches within 1.5x.

    python benchmarks/results/tuning/probe-precision/scoring/estimates_by_file.py FOLDER [FOLDER ...]
"""
import glob, json, os, statistics, sys, torch
from klevict_cli.oracle import spearman
for folder in sys.argv[1:]:
    for f in sorted(glob.glob(os.path.join(folder, "*.json"))):
        d = json.load(open(f))
        xs = []
        for method, bb in d["fidelity"]["results"].items():
            for b, cell in bb.items():
                w = cell["per_window"]
                xs += [(e, k) for e, k in zip(w["estimated_kl"], w["kl"]) if e is not None]
        r = [e / k for e, k in xs]
        rho = spearman(torch.tensor([e for e, _ in xs]), torch.tensor([k for _, k in xs]))
        print(f"{f.split('/')[-2]}/{os.path.basename(f):32s} n {len(xs)} rho {rho:.3f} median {statistics.median(r):.2f} within {sum(1/1.5<=x<=1.5 for x in r)}")
