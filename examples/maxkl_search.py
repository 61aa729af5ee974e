"""How many measurements `--max-kl`'s budget search takes: measured drift curves, and searches replayed on them.

    python examples/maxkl_search.py record MOBY_DICK.txt HAMLET.md --context 512 --windows 2 --method kl \
        --out benchmarks/results/tuning/maxkl-search/curves-kl-512.json
    python examples/maxkl_search.py replay benchmarks/results/tuning/maxkl-search/curves-*.json --recorded-with 0.5

`record` reads windows of each text as `--max-kl` reads them and, at the last eviction, measures the sampled drift
of every budget from the floor to the whole read (every one up to 128 entries per head, every second one above), as
the search's trials measure it (an eviction of a copy of the stream with its refit, then the sampled continuation
over it), beside the free guide the search uses: the budget-free scores of the entries each budget evicts, summed.
One 512-token window takes about 3-5 minutes of one CPU core. `replay` runs the search (klevict_cli/tolerance.py)
and the bisection it replaced on those curves at tolerances from 0.002 to 0.3, each carried back through the model's
drift calibration as the engine does (`--model`), and prints the budgets found and the measurements each took.
Curves recorded before the search compared sampled KLs hold the estimate of the time, the sampled KL times a single
factor: `--recorded-with` divides it out (0.5 for the default model's curves, 0.73 for Gemma-3-270M's).
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from pathlib import Path

TOLERANCES = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.3)


def record(args) -> None:
    from klevict_cli import engine as engine_module
    from klevict_cli.attention import ATTENTION_NAME
    from klevict_cli.documents import load_document
    from klevict_cli.models import load_model
    from klevict_cli.session import ReadSettings, Session

    curves = []

    def measure_every_budget(self, stream, step, scores, recent, keep, targets, drafted):
        most = self.budget if self.budget is not None else stream.next_position
        least = min(most, engine_module.sink_count(most) + recent + 1)
        drifts, predicted, _, _, _ = self._tolerance_trials(stream, step, scores, recent, keep, targets, drafted)
        curve = [[budget, drifts(budget), predicted(budget),  # and whether that budget's cache is refit
                  bool(self._at_budget(stream, step, scores, recent, budget, targets)[1])]
                 for budget in sorted({*range(least, min(most, 128) + 1), *range(128, most + 1, 2), most})]
        curves.append({"least": least, "most": most, "curve": curve})
        return most, None, None

    engine_module.Engine._budget_within = measure_every_budget
    lm = load_model(args.model, device="cpu", dtype="float32", attn_implementation=ATTENTION_NAME, quiet=True)
    session = Session(lm)
    for path in args.texts:
        ids = lm.tokenizer(load_document(path).text, add_special_tokens=False)["input_ids"]
        for k in range(args.windows):
            start = (2 * k + 1) * len(ids) // (2 * args.windows + 1) + 333  # spread over the text, seed-free
            session.read_tokens(ids[start : start + args.context],
                                ReadSettings(budget=None, method=args.method, max_kl=0.03, seed=k,
                                             reconstruct=args.method == "kl-reconstruct"))
            curves[-1].update(text=Path(path).name, start=start, context=args.context, method=args.method,
                              model=args.model, drift="sampled")
            print(f"{Path(path).name} window {k}: {len(curves[-1]['curve'])} budgets measured", flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(curves))


def drift_calibration(model: str | None):
    """The drift calibration a read of `model` uses: its shipped one, else the default model's (None: the default
    model; a name klevict ships no calibration file for is refused, not read with another model's)."""
    from klevict_cli import calibrations
    from klevict_cli.calibrations import DRIFT_CALIBRATION

    if model is None:
        return DRIFT_CALIBRATION
    for path in sorted(calibrations.FOLDER.glob("*.json")):
        data = json.loads(path.read_text())
        if data.get("model") == model:
            return calibrations.drift_calibration(data) or DRIFT_CALIBRATION
    raise SystemExit(f"no calibration file for {model} under {calibrations.FOLDER}")


def replay(args) -> None:
    from klevict_cli.tolerance import smallest_within

    curves = [c for f in args.files for c in json.loads(Path(f).read_text())]
    if any(c.get("model", args.model) != args.model for c in curves):
        raise SystemExit("the curves were recorded with another model than --model")
    if args.recorded_with != 1.0 and any(c.get("drift") == "sampled" for c in curves):
        raise SystemExit("--recorded-with is for curves recorded as estimates; these hold the sampled drift")
    calibration = drift_calibration(args.model)
    counts = {"bisection": [], "guided": []}
    sizes = []  # the guided search's budget over bisection's
    for c in curves:
        budgets = [row[0] for row in c["curve"]]
        drift = {row[0]: row[1] / args.recorded_with for row in c["curve"]}  # the sampled KL
        evicted = {row[0]: row[2] for row in c["curve"]}

        def on_curve(b: int) -> int:  # a budget between the recorded ones: the next recorded
            return budgets[min(bisect.bisect_left(budgets, b), len(budgets) - 1)]

        cells = []
        for tolerance in TOLERANCES:
            sampled = calibration.sampled_within(tolerance, c["context"])  # as Engine._sampled_tolerance
            # bisection (no guide), and the whole read's drift (0) not measured by either
            old = smallest_within(lambda b: drift[on_curve(b)], None, c["least"], c["most"], sampled, known=0.0)
            new = smallest_within(lambda b: drift[on_curve(b)], lambda b: evicted[on_curve(b)], c["least"], c["most"],
                                  sampled, known=0.0)
            counts["bisection"].append(old[1])
            counts["guided"].append(new[1])
            sizes.append(new[0] / old[0])
            cells.append(f"{tolerance:g}: {old[0]}/{old[1]} {new[0]}/{new[1]}")
        print(f"{c['text']} {c['method']} @{c['start']}: " + " | ".join(cells))
        ratios = [drift[b] / s for b, _, s, _ in c["curve"] if drift[b] > 0 and s > 0]
        deciles = statistics.quantiles(ratios, n=10)
        print(f"  sampled drift / summed scores: median {statistics.median(ratios):.2f}, 10-90 % {deciles[0]:.2f}-{deciles[-1]:.2f}")
    for name, n in counts.items():
        print(f"{name}: {statistics.mean(n):.2f} measurements on average, at most {max(n)} ({len(n)} searches)")
    print(f"budget found, guided over bisection: geometric mean {statistics.geometric_mean(sizes):.3f}, "
          f"{min(sizes):.2f}-{max(sizes):.2f}; larger in {sum(r > 1.05 for r in sizes)}, smaller in "
          f"{sum(r < 1 / 1.05 for r in sizes)} of {len(sizes)} by more than 5 %")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record")
    rec.add_argument("texts", nargs="+")
    rec.add_argument("--model", default=None)
    rec.add_argument("--context", type=int, default=512)
    rec.add_argument("--windows", type=int, default=2)
    rec.add_argument("--method", default="kl")
    rec.add_argument("--out", required=True)
    rep = commands.add_parser("replay")
    rep.add_argument("files", nargs="+")
    rep.add_argument("--model", default=None, help="whose drift calibration carries the tolerances back")
    rep.add_argument("--recorded-with", type=float, default=1.0,
                     help="the factor the curves' drift was recorded with (1: recorded as sampled)")
    args = parser.parse_args()
    record(args) if args.command == "record" else replay(args)


if __name__ == "__main__":
    main()
