"""Each tolerance's mean kept size over both texts' windows, in entries per head of the scored layers (SmolLM2: all
30 layers x 3 KV heads; Gemma-3-270M: its 3 global layers, the 15 sliding ones keeping their 512-token window), for
reading the same windows again with a flat --budget (the equal-size comparison)."""
import json, statistics, sys
files = sys.argv[1:]
per = {}
for f in files:
    d = json.load(open(f)); gemma = "gemma" in f
    for label, row in d["fidelity"]["results"]["kl"].items():
        if not label.startswith("max-kl"):
            continue
        for kept in row["per_window"]["kept_entries"]:
            per.setdefault(label, []).append((kept - 15 * 512) / 3 if gemma else kept / 90)
print(",".join(str(round(statistics.fmean(v))) for _, v in sorted(per.items(), key=lambda kv: float(kv[0].split()[1]))))
