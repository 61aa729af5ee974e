"""Paired comparison of bench results read with `--probe-dtype float32` (FOLDER/f32-*.json) and `bfloat16`
(FOLDER/bf16-*.json), the same windows: per method and budget the geometric mean over windows of KL(bfloat16) /
KL(float32) with a 95 % interval, how many windows bfloat16 is lower, and the drift estimate against the measured KL
(Spearman, median ratio, within 1.5x) for each. The intervals over window x budget pairs are too narrow: a window's
reads at every budget share its drafts, so the last summary takes each window (and method) as one sample.

    python benchmarks/results/tuning/probe-precision/compare.py [FOLDER]   # seed0/ (default) or seed1/
    python benchmarks/results/tuning/probe-precision/compare.py NEW OLD --tag f32   # NEW's f32-* over OLD's f32-*

With two folders, the same-named files of one precision (`--tag`) are paired instead: the second folder's in the
place of float32 (how a change of code moved the reads, e.g. scoring/seed0 against seed0).
"""
import glob, json, math, os, statistics, sys

import torch

from klevict_cli.oracle import spearman

def summary(logs: list[float]) -> str:
    m = statistics.mean(logs)
    half = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs))
    return f"{math.exp(m):.3f} [{math.exp(m - half):.3f}, {math.exp(m + half):.3f}]"


args = [a for a in sys.argv[1:] if not a.startswith("--tag")]
tag = sys.argv[sys.argv.index("--tag") + 1] if "--tag" in sys.argv else None
args = [a for a in args if a != tag]
folder = args[0] if args else os.path.join(os.path.dirname(__file__), "seed0")
baseline = args[1] if len(args) > 1 else None
pairs, est, groups = [], {"f32": [], "bf16": []}, {}
label = "new/old" if baseline else "bf16/f32"
names = {"f32": "old", "bf16": "new"} if baseline else {"f32": "f32", "bf16": "bf16"}
by_window: dict[tuple, list[float]] = {}
for f32 in sorted(glob.glob(os.path.join(baseline or folder, f"{tag or 'f32'}-*.json"))):
    bf = os.path.join(folder, os.path.basename(f32)) if baseline else f32.replace("/f32-", "/bf16-")
    if not os.path.exists(bf):
        continue
    a, b = (json.load(open(p)) for p in (f32, bf))
    if not (a.get("complete") and b.get("complete")):
        continue
    name = os.path.basename(f32).split("-", 1)[1][:-5]
    rows = []
    for method, by_budget in a["fidelity"]["results"].items():
        for budget, cell in by_budget.items():
            ka, kb = cell["per_window"]["kl"], b["fidelity"]["results"][method][budget]["per_window"]["kl"]
            logs = [math.log(y / x) for x, y in zip(ka, kb)]
            m = statistics.mean(logs)
            half = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
            rows.append((method, budget, math.exp(m), math.exp(m - half), math.exp(m + half),
                         sum(y < x for x, y in zip(ka, kb)), len(ka)))
            pairs += logs
            for n, log in enumerate(logs):  # a window's budgets share its drafts: they are one sample of them
                by_window.setdefault((name, method, n), []).append(log)
            groups.setdefault(name.removeprefix("moby-dick-").removeprefix("hamlet-"), []).extend(logs)  # both texts
            for which, cellx in (("f32", cell), ("bf16", b["fidelity"]["results"][method][budget])):
                w = cellx["per_window"]
                est[which] += [(e, k) for e, k in zip(w["estimated_kl"], w["kl"]) if e is not None]
    print(f"## {name}")
    for method, budget, g, lo, hi, lower, n in rows:
        print(f"  {method:15s} {budget:>4s}  {label} {g:.3f} [{lo:.3f}, {hi:.3f}]  lower {lower}/{n}")
for group, logs in sorted(groups.items()):
    print(f"{group}: {len(logs)} window-budgets, geometric mean {label} {summary(logs)}")
print(f"all {len(pairs)} window-budgets: geometric mean {label} {summary(pairs)}")
windows = [statistics.mean(logs) for logs in by_window.values()]
print(f"all {len(windows)} windows x methods (each the mean over its budgets, whose drafts it shares): geometric mean "
      f"{label} {summary(windows)}")
for which, xs in est.items():
    if xs:
        ratios = [e / k for e, k in xs]
        within = sum(1 / 1.5 <= r <= 1.5 for r in ratios)
        rho = spearman(torch.tensor([e for e, _ in xs]), torch.tensor([k for _, k in xs]))
        print(f"estimate {names[which]}: n {len(xs)} Spearman {rho:.3f} "
              f"median ratio {statistics.median(ratios):.2f} within 1.5x {within}/{len(xs)}")
