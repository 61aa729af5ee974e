"""The tolerance runs' share within 1.5x of the tolerance over the first half of each run's windows — the windows
the last round read (a run's first windows are a shorter run's; round.sh reads twice as many) — beside all of them.
python first_windows.py FILES (maxkl-*.json)"""
import json, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))
from klevict_cli.results import TOLERANCE_PREFIX, within_factor  # noqa: E402

totals = {}
for path in sys.argv[1:]:
    data = json.loads(Path(path).read_text())
    key = f"{data['settings']['model']} {data['settings']['context']}"
    half = data["settings"]["windows"] // 2
    for label, row in data["fidelity"]["results"]["kl"].items():
        if label.startswith(TOLERANCE_PREFIX):
            ratios = [m / float(label[len(TOLERANCE_PREFIX):]) for m in row["per_window"]["kl"]]
            t = totals.setdefault(key, [0, 0, 0, 0])
            t[0] += within_factor(ratios[:half]); t[1] += len(ratios[:half]); t[2] += within_factor(ratios); t[3] += len(ratios)
for key, (a, b, c, d) in [*totals.items(), ("all", [sum(t[i] for t in totals.values()) for i in range(4)])]:
    print(f"{key}: first half of the windows {a} / {b} ({a / b:.0%}); all {c} / {d} ({c / d:.0%})")
