"""The README's tolerance rows: per tolerance, kept share range, measured KL range and mean top-1 agreement over
both texts' windows."""
import json, statistics, sys
rows = {}
for f in sys.argv[1:]:
    for label, row in json.load(open(f))["fidelity"]["results"]["kl"].items():
        if label.startswith("max-kl"):
            w = row["per_window"]; r = rows.setdefault(label, {"kept": [], "kl": [], "top1": []})
            r["kept"] += w["cache_fraction"]; r["kl"] += w["kl"]; r["top1"] += w["top1"]
for label, r in sorted(rows.items(), key=lambda kv: float(kv[0].split()[1])):
    print(f"| {label.split()[1]} | {100*min(r['kept']):.0f}–{100*max(r['kept']):.0f} % | {min(r['kl']):.3f}–{max(r['kl']):.3f} | {100*statistics.fmean(r['top1']):.0f} % |")
