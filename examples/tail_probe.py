"""Does the document's own text see what a sampled continuation misses? The drift estimate against a probe on real
text, both set against the KL measured on the real continuation.

    python examples/tail_probe.py ../shared/data/moby-dick.txt HAMLET.md --context 512 --windows 4 --seed 0 \
        [--model gemma3-270m] [--methods kl,kl-reconstruct] [--tails 32,64] [--warmups 0,16,32,64] --out OUT.json

For each window, method and budget: the reading with its drift measured (`estimated`, and `sampled`, before the
calibration); the tail probes — the read's last `tail` tokens read again over the compressed cache with the entries
of the last `tail + warmup` hidden (the `warmup` tokens read again first, so that the tail has its local context
back, as the text after a read has the kept recent window), against the same over the full cache (KL per token;
`tail{T}_w{W}`); and the KL the bench measures on the 256 tokens that follow. Prints, per estimate, the Spearman
correlation with the measured KL over windows x budgets and the median ratio to it; `--out` writes every number.
A research probe (docs/research-log.md), not used by klevict.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from klevict_cli.bench import continuation_logits, fidelity_windows, token_metrics
from klevict_cli.documents import load_document
from klevict_cli.models import load_model
from klevict_cli.options import Budget
from klevict_cli.prompts import encode_text
from klevict_cli.session import ReadSettings, Session
from klevict_kernels.kl import token_kl


def tail_rows(engine, stream, tail: int, warmup: int = 0) -> torch.Tensor:
    """Logits of the stream's last `tail` tokens read again (on a copy) over everything before the last
    `tail + warmup` only: the `warmup` tokens before the tail are read again too (their rows not returned), so that
    the tail has its local context back, as the text after a read has the kept recent window."""
    work = stream.clone()
    end = work.next_position
    span = tail + warmup
    ids = work.tokens[end - span:]
    rows, _ = engine.forward(work, ids, logits_rows=tail, probing=True, rope_start=work.next_rope - span,
                             attend_entries=lambda layer: layer.positions < end - span)
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
    parser.add_argument("--tails", default="32,64", help="tail lengths, comma-separated")
    parser.add_argument("--warmups", default="0,16,32,64", help="warm-up lengths, comma-separated")
    parser.add_argument("--model", default=None)
    parser.add_argument("--methods", default="kl", help="kl and/or kl-reconstruct")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    session = Session(load_model(args.model, "cpu", "float32"))
    tails, warmups = [int(t) for t in args.tails.split(",")], [int(w) for w in args.warmups.split(",")]
    rows = []
    for text in args.texts:
        ids = encode_text(session.lm.tokenizer, load_document(str(text)).text)  # as the bench reads it
        for offset, window, follow in fidelity_windows(session, ids, args.context, args.continuation, args.windows,
                                                  args.seed):
            full = session.read_tokens(window, ReadSettings(budget=None, method="none"), reserve=len(follow))
            reference = continuation_logits(full.engine, full.stream.clone(), full.logits, follow)
            full_tail = {t: tail_rows(full.engine, full.stream, t) for t in tails}
            for method, budget in ((m, b) for m in args.methods.split(",") for b in args.budgets.split(",")):
                settings = ReadSettings(budget=Budget(fraction=float(budget.rstrip("%")) / 100), method="kl",
                                        reconstruct=method == "kl-reconstruct", measure_drift=True, seed=args.seed)
                read = session.read_tokens(window, settings, reserve=len(follow))
                probes = {f"tail{t}_w{w}": float(token_kl(full_tail[t], tail_rows(read.engine, read.stream, t, w)
                                                          ).mean()) for t in tails for w in warmups}
                logits = continuation_logits(read.engine, read.stream.clone(), read.logits, follow)
                measured = token_metrics(reference, logits, torch.tensor(follow))["kl"]
                rows.append({"text": text.name, "context": args.context, "model": args.model or "smollm2",
                             "method": method, "offset": offset, "budget": budget, "measured": measured,
                             "estimated": read.stream.drift["kl"], "sampled": read.stream.drift["sampled_kl"],
                             "tail": probes[f"tail{tails[0]}_w{warmups[0]}"], **probes})
                print(json.dumps(rows[-1]), flush=True)
    measured = [r["measured"] for r in rows]
    for key in ("estimated", *(k for k in rows[0] if k.startswith("tail") and k != "tail")):
        values = [r[key] for r in rows]
        ratios = [v / m for v, m in zip(values, measured) if m > 0]
        print(f"{key:9s} Spearman {spearman(values, measured):.3f}  median ratio {statistics.median(ratios):.3f}"
              f"  10-90 % {sorted(ratios)[len(ratios) // 10]:.3f}-{sorted(ratios)[(9 * len(ratios)) // 10]:.3f}")
    if args.out:
        args.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
