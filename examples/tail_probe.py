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
import sys
from pathlib import Path

import torch

from held_out_reads import add_arguments, reads, session_for, windows
from klevict_kernels.kl import token_kl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from drift_check import spearman  # noqa: E402


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, budgets="20%,10%,5%", seed=0)
    parser.add_argument("--tails", default="32,64", help="tail lengths, comma-separated")
    parser.add_argument("--warmups", default="0,16,32,64", help="warm-up lengths, comma-separated")
    args = parser.parse_args()
    session = session_for(args)
    tails, warmups = [int(t) for t in args.tails.split(",")], [int(w) for w in args.warmups.split(",")]
    rows = []
    for window in windows(session, args):
        full_tail = {t: tail_rows(window.full.engine, window.full.stream, t) for t in tails}
        for read in reads(session, window, args):
            engine, stream = read.result.engine, read.result.stream
            probes = {f"tail{t}_w{w}": float(token_kl(full_tail[t], tail_rows(engine, stream, t, w)).mean())
                      for t in tails for w in warmups}
            rows.append({**read.row(args, window), "sampled": stream.drift["sampled_kl"],
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
