"""How precisely can any estimate match the KL the bench measures? The measured KL is the mean over one real
continuation of 256 tokens, and a few tokens (a name copied from far back, a speaker tag) can carry most of it: the
same window with another 256 tokens of the same text would measure differently. This records, per window and budget,
the per-token KL of the real continuation and the read's drift estimate, then prints how far the continuation's two
halves disagree — a floor under how often even an exact estimate of the window's expected KL could land within a
factor of 1.5 of one 256-token measurement.

    python examples/kl_noise.py ../shared/data/moby-dick.txt HAMLET.md --context 512 --windows 4 --seed 1 \\
        [--model gemma3-270m] --out kl-noise.json
    python examples/kl_noise.py --report kl-noise*.json

With `--report`, reads recorded files instead. If the log-ratio of the halves has standard deviation s, a 256-token
mean has about s / 2 around the window's expectation (each half has half the tokens; the two halves' logs differ
by the sum of two such errors), so an exact estimate is within 1.5x about P(|N(0, s/2)| < log 1.5) of the time;
of one half, P(|N(0, s/sqrt 2)| < log 1.5) — with `--continuation 512`, the floor for 256-token measurements
without assuming how the noise shrinks with length. Without assuming normal errors: if the halves' errors are
independent and alike, the whole's error (their mean) is distributed as half their difference, so an exact
estimate is within 1.5x of the whole as often as the halves are within 1.5^2 = 2.25x of each other.
A research probe (docs/research-log.md), not used by klevict.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from held_out_reads import add_arguments, reads, session_for, windows


def record(args) -> list[dict]:
    session = session_for(args)
    rows = []
    for window in windows(session, args):
        for read in reads(session, window, args):
            rows.append({**read.row(args, window), "per_token": read.per_token.tolist()})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_token"}), flush=True)
    return rows


def report(rows: list[dict]) -> None:
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["context"]), []).append(row)
    groups[("all", "all")] = rows
    print("| model | context | pairs | halves within 1.5x | s = sd log(first / second half) | exact estimate within"
          " 1.5x of a half / the whole (expected) | halves within 2.25x | the drift estimate within 1.5x |\n"
          "|---|---|---|---|---|---|---|---|")
    for (model, context), found in groups.items():
        logs, within_halves, within_squared = [], 0, 0
        for row in found:
            half = len(row["per_token"]) // 2
            first, second = statistics.fmean(row["per_token"][:half]), statistics.fmean(row["per_token"][half:])
            if first > 0 and second > 0:
                logs.append(math.log(first / second))
                within_halves += abs(logs[-1]) <= math.log(1.5)
                within_squared += abs(logs[-1]) <= 2 * math.log(1.5)
        s = statistics.pstdev(logs)
        def exact(sd: float) -> float:  # P(|N(0, sd)| < log 1.5)
            return math.erf(math.log(1.5) / sd / math.sqrt(2)) if sd > 0 else 1.0

        estimate = sum(abs(math.log(r["estimated"] / r["measured"])) <= math.log(1.5) for r in found
                       if r["estimated"] and r["measured"] > 0) / len(found)
        print(f"| {model} | {context} | {len(found)} | {100 * within_halves / len(logs):.0f} % | {s:.2f} |"
              f" {100 * exact(s / math.sqrt(2)):.0f} % / {100 * exact(s / 2):.0f} % |"
              f" {100 * within_squared / len(logs):.0f} % | {100 * estimate:.0f} % |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, budgets="50%,20%,10%,5%", seed=1)
    parser.add_argument("--report", nargs="+", type=Path, help="recorded files to report on instead")
    args = parser.parse_args()
    if args.report:
        rows = [row for path in args.report for row in json.loads(path.read_text())["rows"]]
    else:
        rows = record(args)
        if args.out:
            args.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
                                + "\n")
    report(rows)


if __name__ == "__main__":
    main()
