"""Interleaved cost of a compressing read against the full-cache read of the same tokens.

    python examples/cost.py ../shared/data/moby-dick.txt                       # 2,048 tokens, 20 % and 10 %
    python examples/cost.py ../shared/data/moby-dick.txt --tokens 4096 --reps 2
    python examples/cost.py ../shared/data/moby-dick.txt --device cuda --methods kl,snapkv

A busy or throttled machine changes speed from minute to minute, so each compressing read is timed right after a
full read of the same tokens and the table reports the median (and spread) of those paired ratios. The time is
`Engine.feed` alone: chunked prefill, scoring, eviction and, for `kl`, its look-ahead drafts and calibration.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from klevict_cli.attention import ATTENTION_NAME
from klevict_cli.documents import load_document
from klevict_cli.models import load_model
from klevict_cli.options import parse_budget
from klevict_cli.session import ReadSettings, Session


def timed_feed(session: Session, ids: list[int], method: str, budget: int | None, device: torch.device) -> float:
    """One read of `ids` as the CLI reads (its engine, chunking and working limit; `kl-reconstruct` as `compress`)."""
    engine = session.engine(method, budget, ReadSettings(budget=None), "original")
    stream = engine.new_stream()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    engine.feed(stream, ids)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens read per window")
    parser.add_argument("--budgets", default="20%,10%", help="fractions of --tokens, or token counts")
    parser.add_argument("--methods", default="kl")
    parser.add_argument("--places", type=int, default=4, help="windows spread over the document")
    parser.add_argument("--reps", type=int, default=3, help="timed pairs per window, method and budget")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    session = Session(load_model(args.model, device=args.device, dtype=args.dtype,
                                 attn_implementation=ATTENTION_NAME, quiet=True))
    device = next(session.lm.model.parameters()).device
    ids = session.lm.tokenizer(load_document(args.file).text, add_special_tokens=False)["input_ids"]
    if len(ids) < args.tokens:
        parser.error(f"the document has {len(ids)} tokens, fewer than --tokens {args.tokens}")
    step = (len(ids) - args.tokens) // args.places
    windows = [ids[i * step : i * step + args.tokens] for i in range(args.places)]
    budgets = [parse_budget(b).resolve(args.tokens) for b in args.budgets.split(",")]
    methods = args.methods.split(",")
    timed_feed(session, windows[0][:600], "none", None, device)  # warm-up: first-call costs off the timings
    for method in methods:
        timed_feed(session, windows[0][:600], method, 64, device)

    ratios: dict[tuple[str, int], list[float]] = {(m, b): [] for m in methods for b in budgets}
    full_times: list[float] = []
    for window in windows:
        for _ in range(args.reps):
            for method in methods:
                for budget in budgets:
                    full = timed_feed(session, window, "none", None, device)
                    compressed = timed_feed(session, window, method, budget, device)
                    full_times.append(full)
                    ratios[(method, budget)].append(compressed / full)

    print(f"\n{args.tokens} tokens, {device} {args.dtype}, torch threads {torch.get_num_threads()}; "
          f"full read median {statistics.median(full_times):.3f} s "
          f"(range {min(full_times):.3f}-{max(full_times):.3f} s)")
    print("\n| method | budget | cost vs full read (median) | mean | range | pairs |")
    print("|---|---|---|---|---|---|")
    report = {"tokens": args.tokens, "device": str(device), "dtype": args.dtype, "full_seconds": full_times,
              "ratios": {}}
    for (method, budget), r in ratios.items():
        report["ratios"][f"{method}@{budget}"] = r
        print(f"| {method} | {budget} ({budget / args.tokens:.0%}) | {statistics.median(r):.2f}× | "
              f"{statistics.mean(r):.2f}× | {min(r):.2f}-{max(r):.2f}× | {len(r)} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
