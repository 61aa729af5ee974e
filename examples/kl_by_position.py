"""Where in the continuation a compressed cache loses, and how recent what it kept is.

    python examples/kl_by_position.py ../shared/data/moby-dick.txt --methods kl,streaming --budgets 10%,5% \
        --model gemma3-270m --context 16384 --seed 0 --window 0

Reads one bench window (the same offsets `klevict bench --seed S` draws) in full and with each method × budget,
teacher-forces the next `--continuation` tokens, and prints per method the KL of the continuation by blocks of
`--block` tokens (does a cache fail the first tokens after the read, which the look-ahead drafts see, or the later
ones?), and, over the global (non-sliding) layers, the share of kept entries among the last 512 / 2,048 positions read
(how much of its budget a reading spends on recency). A diagnostic for the research log, not a benchmark.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from klevict_kernels.kl import token_kl
from klevict_cli.attention import ATTENTION_NAME
from klevict_cli.bench import continuation_logits, fidelity_windows, parse_budgets
from klevict_cli.documents import load_document
from klevict_cli.models import load_model
from klevict_cli.options import Budget
from klevict_cli.prompts import encode_text
from klevict_cli.session import ReadSettings, Session


def recency(stream, read_end: int, spans=(512, 2048)) -> dict[str, float]:
    """Share of the kept entries of global layers among the last `span` positions read (sinks included in the
    denominator)."""
    kept = {span: 0 for span in spans}
    total = 0
    for layer in stream.cache.layers:
        if layer.window is not None:
            continue
        positions = layer.positions[layer.valid]
        total += positions.numel()
        for span in spans:
            kept[span] += int((positions >= read_end - span).sum())
    return {f"last_{span}": kept[span] / max(total, 1) for span in spans}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("--methods", default="kl,streaming")
    parser.add_argument("--budgets", default="10%,5%")
    parser.add_argument("--model", default=None)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--continuation", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=0, help="which of the seed's windows (0: the first)")
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    session = Session(load_model(args.model, attn_implementation=ATTENTION_NAME, quiet=True))
    ids = encode_text(session.lm.tokenizer, load_document(args.file).text)
    offset, window, cont = fidelity_windows(session, ids, args.context, args.continuation, args.window + 1,
                                            args.seed)[args.window]
    full_read = session.read_tokens(window, ReadSettings(budget=None, method="none", position_mode="original",
                                                         seed=args.seed), reserve=len(cont))
    reference = continuation_logits(full_read.engine, full_read.stream, full_read.logits, cont)
    read_end = full_read.stream.next_position
    del full_read
    rows = []
    for budget in parse_budgets(args.budgets):
        for method in args.methods.split(","):
            settings = ReadSettings(budget=Budget(tokens=min(budget.resolve(args.context), args.context)),
                                    method=method, position_mode="original", seed=args.seed)
            got = session.read_tokens(window, settings, reserve=len(cont))
            logits = continuation_logits(got.engine, got.stream, got.logits, cont)
            kl = token_kl(reference, logits)
            blocks = [float(kl[i : i + args.block].mean()) for i in range(0, len(cont), args.block)]
            rows.append({"method": method, "budget": str(budget), "kl": float(kl.mean()), "blocks": blocks,
                         **recency(got.stream, read_end)})
            del got, logits
    print(f"window {args.window} of seed {args.seed} (offset {offset}), {args.context} tokens; KL by blocks of "
          f"{args.block} continuation tokens")
    for row in rows:
        cells = " ".join(f"{b:.4f}" for b in row["blocks"])
        print(f"{row['budget']:>6} {row['method']:<12} mean {row['kl']:.4f} | {cells} | kept in the last 512: "
              f"{row['last_512']:.2f}, 2,048: {row['last_2048']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "offset": offset, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
