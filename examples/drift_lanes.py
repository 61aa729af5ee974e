"""How many lanes, and how many tokens each, should a cache's drift be measured on? (docs/research-log.md, "the drift
in lanes, again")

    # a bench run that also writes every drift measurement's per-token KL (steps x lanes) next to its results
    python examples/drift_lanes.py record OUT -- ../shared/data/moby-dick.txt --methods kl,kl-reconstruct \
        --budgets 50%,20%,10%,5%,32,64 --windows 2 --context 512 --seed 0 --estimate
    # (record OUT --lanes 8 -- ...: eight lanes, each sampled RECORDED_STEPS tokens whatever the read's length)
    # then: what fewer lanes or fewer tokens per lane would have estimated, against the KL the bench measured
    python examples/drift_lanes.py compare OUT1 OUT2 ...
    # (compare --truth own OUT...: against the KL on the model's own continuations, from runs with bench --sampled)

`record OUT` writes OUT.json (the bench's results) and OUT.tokens.jsonl. The first k steps of a recorded run are
exactly what a run of k steps samples (the lanes are sampled step by step from one generator); fewer lanes are
read off the recorded ones, each group of lanes a separate estimator, and the table averages their statistics.
Each variant is calibrated at its own median ratio, so the table compares ranking and spread, not calibration.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from drift_check import TRUTHS, spearman  # noqa: E402

from klevict_cli.results import within_factor  # noqa: E402

# variant: (groups of recorded lanes, each one estimator; steps per lane); a variant is read where every recorded
# measurement has its lanes and steps (8-lane variants from `record --lanes 8` runs)
FOUR, EIGHT, SIXTEEN = [0, 1, 2, 3], list(range(8)), list(range(16))
VARIANTS = {"1x16": ([[0], [1], [2], [3]], 16), "1x32": ([[0], [1], [2], [3]], 32), "2x16": ([[0, 1], [2, 3]], 16),
            "2x32": ([[0, 1], [2, 3]], 32), "4x8": ([FOUR], 8), "4x16": ([FOUR], 16), "4x32": ([FOUR], 32),
            "8x4": ([EIGHT], 4), "8x8": ([EIGHT], 8), "8x16": ([EIGHT], 16)}
# from `record --lanes 16` runs: each group of lanes a separate estimator, as many groups as the lanes make
QUARTERS, HALVES = [SIXTEEN[i : i + 4] for i in range(0, 16, 4)], [SIXTEEN[:8], SIXTEEN[8:]]
VARIANTS.update({"4x16 (of 16)": (QUARTERS, 16), "4x32 (of 16)": (QUARTERS, 32), "8x16 (of 16)": (HALVES, 16),
                 "8x32 (of 16)": (HALVES, 32), "16x8": ([SIXTEEN], 8), "16x16": ([SIXTEEN], 16),
                 "16x32": ([SIXTEEN], 32)})
RECORDED_STEPS = 32  # tokens per lane a `record --lanes` run samples: twice what a read does, to compare longer lanes


def record(out: str, bench_args: list[str], lanes: int | None = None) -> None:
    from klevict_cli import engine
    from klevict_cli.cli import app

    if lanes is not None:  # that many lanes, each sampled RECORDED_STEPS tokens whatever the read's length
        engine.DRIFT_LANES, engine.DRIFT_STEPS = lanes, RECORDED_STEPS

    Path(f"{out}.tokens.jsonl").unlink(missing_ok=True)
    token_kl, measure = engine.ReferenceDistributions.kl_of_change, engine.Engine.measure_drift
    last = {}

    def recorded_kl(reference, change):
        last["kl"] = token_kl(reference, change)
        return last["kl"]

    def measured(self, stream, drafted):  # the KL taken inside it, not the bench's own of the real continuation
        last.clear()
        drift = measure(self, stream, drafted)
        with open(f"{out}.tokens.jsonl", "a") as f:
            f.write(json.dumps({"kl": drift["kl"], "sampled_kl": drift["sampled_kl"], "lanes": drafted.lanes,
                                "per_token": last["kl"].tolist()}) + "\n")
        return drift

    engine.ReferenceDistributions.kl_of_change, engine.Engine.measure_drift = recorded_kl, measured
    sys.argv = ["klevict", "bench", *bench_args, "--out", f"{out}.json"]
    app()


def pairs(out: str, truth: str = "kl") -> list[tuple[float, list[list[float]]]]:
    """(measured KL, per-token KL as steps x lanes) per window and budget of a recorded run; `truth`: the bench's
    number the KL was measured as (kl: on the real next page; kl_sampled: on the model's own continuations)."""
    result = json.loads(Path(f"{out}.json").read_text())
    dumps = [json.loads(line) for line in Path(f"{out}.tokens.jsonl").read_text().splitlines()]
    found = []
    for rows in result["fidelity"]["results"].values():
        for row in rows.values():
            window = row["per_window"]
            for estimate, measured in zip(window.get("estimated_kl", []), window[truth]):
                if estimate is None or measured <= 0:
                    continue
                # the estimate as recorded (runs before the calibration by length: 0.5 times the sampled KL)
                dump = next(d for d in dumps if abs(d.get("kl", 0.5 * d["sampled_kl"]) - estimate) <= 1e-9 * estimate)
                lanes = dump["lanes"]
                tokens = dump["per_token"]
                found.append((measured, [tokens[s : s + lanes] for s in range(0, len(tokens), lanes)]))
    return found


def describe(found: list[tuple[float, float]]) -> tuple[float, float, float, float, float]:
    """Spearman, the calibration that centres the ratios, their 10-90 % once calibrated, the share within 1.5x."""
    ratios = sorted(e / m for e, m in found)
    calibration = 1 / statistics.median(ratios)
    q = statistics.quantiles(ratios, n=10, method="inclusive")
    within = within_factor([r * calibration for r in ratios]) / len(ratios)
    return (spearman([e for e, _ in found], [m for _, m in found]), calibration, q[0] * calibration,
            q[-1] * calibration, within)


def compare(outs: list[str], truth: str = "kl") -> None:
    found = [p for out in outs for p in pairs(out, truth)]
    print(f"{len(found)} window x budget pairs\n")
    print("| lanes x tokens | Spearman | calibration | 10-90 % calibrated | within 1.5x |\n|---|---|---|---|---|")
    for name, (groups, steps) in VARIANTS.items():
        lanes = max(max(group) for group in groups) + 1
        if any(len(grid) < steps or len(grid[0]) < lanes for _, grid in found):  # not recorded this long or wide
            continue
        stats = [describe([(statistics.fmean(grid[s][lane] for s in range(steps) for lane in group), measured)
                           for measured, grid in found]) for group in groups]
        mean = [statistics.fmean(s[i] for s in stats) for i in range(5)]
        print(f"| {name} | {mean[0]:.3f} | {mean[1]:.3f} | {mean[2]:.2f}–{mean[3]:.2f} | {100 * mean[4]:.0f} % |")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "record":
        wide = sys.argv[3:5] if sys.argv[3:4] == ["--lanes"] else []
        record(sys.argv[2], [a for a in sys.argv[3 + len(wide):] if a != "--"], int(wide[1]) if wide else None)
    elif len(sys.argv) >= 3 and sys.argv[1] == "compare":
        given = sys.argv[2:]
        truth = given[given.index("--truth") + 1] if "--truth" in given else "page"
        compare([a for a in given if a not in ("--truth", truth)], TRUTHS[truth])
    else:
        sys.exit(__doc__)
