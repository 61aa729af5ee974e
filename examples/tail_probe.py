"""Does the document's own text see what a sampled continuation misses? The drift estimate against a probe on real
text, both set against the KL measured on the real continuation.

    python examples/tail_probe.py ../shared/data/moby-dick.txt HAMLET.md --context 512 --windows 4 --seed 0

For each window and budget: `kl`'s reading with its drift measured (`estimated_kl`: 32 tokens sampled past the read);
the tail probe — the read's last `--tail` tokens read again over the compressed cache with their own entries hidden,
against the same re-reading over the full cache (KL per token); and the KL the bench measures on the 256 tokens that
follow. Prints, per estimate, the Spearman correlation with the measured KL over windows × budgets and the median
ratio to it; `--out` writes every number. A research probe (docs/research-log.md), not used by klevict.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from klevict_cli.bench import continuation_logits, fidelity_windows, token_metrics
from klevict_cli.models import load_model
from klevict_cli.options import Budget
from klevict_cli.session import ReadSettings, Session
from klevict_kernels.kl import token_kl


def tail_rows(engine, stream, tail: int) -> torch.Tensor:
    """Logits of the stream's last `tail` tokens read again (on a copy) over everything before them only."""
    work = stream.clone()
    end = work.next_position
    ids = work.tokens[end - tail:]
    rows, _ = engine.forward(work, ids, logits_rows=tail, probing=True, rope_start=work.next_rope - tail,
                             attend_entries=lambda layer: layer.positions < end - tail)
    return rows.float()


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for rank, i in enumerate(order):
            out[i] = rank
        return out
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("texts", nargs="+", type=Path)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--continuation", type=int, default=256)
    parser.add_argument("--budgets", default="20%,10%,5%")
    parser.add_argument("--tail", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    session = Session(load_model(None, "cpu", "float32"))
    rows = []
    for text in args.texts:
        ids = session.lm.tokenizer(text.read_text(encoding="utf-8"))["input_ids"]
        for offset, window, follow in fidelity_windows(session, ids, args.context, args.continuation, args.windows,
                                                  args.seed):
            full = session.read_tokens(window, ReadSettings(budget=None, method="none"), reserve=len(follow))
            reference = continuation_logits(full.engine, full.stream.clone(), full.logits, follow)
            full_tail = tail_rows(full.engine, full.stream, args.tail)
            for budget in args.budgets.split(","):
                settings = ReadSettings(budget=Budget(fraction=float(budget.rstrip("%")) / 100), method="kl",
                                        measure_drift=True, seed=args.seed)
                read = session.read_tokens(window, settings, reserve=len(follow))
                tail = float(token_kl(full_tail, tail_rows(read.engine, read.stream, args.tail)).mean())
                logits = continuation_logits(read.engine, read.stream.clone(), read.logits, follow)
                measured = token_metrics(reference, logits, torch.tensor(follow))["kl"]
                rows.append({"text": text.name, "offset": offset, "budget": budget, "measured": measured,
                             "estimated": read.stream.drift["kl"], "tail": tail})
                print(json.dumps(rows[-1]), flush=True)
    measured = [r["measured"] for r in rows]
    for key in ("estimated", "tail"):
        values = [r[key] for r in rows]
        ratios = [v / m for v, m in zip(values, measured) if m > 0]
        print(f"{key:9s} Spearman {spearman(values, measured):.3f}  median ratio {statistics.median(ratios):.3f}"
              f"  10-90 % {sorted(ratios)[len(ratios) // 10]:.3f}-{sorted(ratios)[(9 * len(ratios)) // 10]:.3f}")
    if args.out:
        args.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
