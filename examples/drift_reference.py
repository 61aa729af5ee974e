"""Is the cache a drift estimate is measured against (the whole read's: held entries and what earlier evictions set
aside) close to a full read's? And how far is the estimate from the KL of the real next page?

    python examples/drift_reference.py ../shared/data/moby-dick.txt --context 4096 --seed 1 --window 1

Reads one bench window (the offsets `klevict bench --seed S` draws) in full and with `kl` at each budget, measuring
drift; the sampled tokens the estimate used are then read over a full read as well. Prints, per budget, the KL of
the sampled tokens' distributions: whole read's cache against the compressed one (what the estimate measures, before
its calibration), full read against the compressed one, full read against the whole read's cache (what the reference
lacks: earlier evictions' effect on the entries read after them); and the estimate against the KL measured on the
real continuation. A diagnostic for the research log, not a benchmark.
"""

from __future__ import annotations

import argparse

import torch

from klevict_kernels.kl import token_kl
from klevict_cli.attention import ATTENTION_NAME, Lanes
from klevict_cli.bench import continuation_logits, fidelity_windows, parse_budgets
from klevict_cli.documents import load_document
from klevict_cli.engine import Engine
from klevict_cli.models import load_model
from klevict_cli.options import Budget
from klevict_cli.prompts import encode_text
from klevict_cli.session import ReadSettings, Session


def mean_kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float(token_kl(p, q).mean())


def lanes_logits(read, sample) -> torch.Tensor:
    """The sampled lanes read side by side over a copy of `read`'s cache, as the estimate reads them."""
    stream = read.stream.clone()
    lanes = Lanes(stream.next_position, stream.next_rope, sample.lanes)
    logits, _ = read.engine.forward(stream, sample.tokens, logits_rows=len(sample.tokens), probing=True, lanes=lanes)
    return logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("--budgets", default="20%,10%,5%")
    parser.add_argument("--model", default=None)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--continuation", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--window", type=int, default=0, help="which of the seed's windows (0: the first)")
    args = parser.parse_args()

    session = Session(load_model(args.model, attn_implementation=ATTENTION_NAME, quiet=True))
    ids = encode_text(session.lm.tokenizer, load_document(args.file).text)
    offset, window, cont = fidelity_windows(session, ids, args.context, args.continuation, args.window + 1,
                                            args.seed)[args.window]
    room = args.continuation + 64
    full = session.read_tokens(window, ReadSettings(budget=None, method="none", position_mode="original",
                                                    seed=args.seed), reserve=room)
    real_full = continuation_logits(full.engine, full.stream.clone(), full.logits, cont)
    drafted = []
    measure = Engine.measure_drift
    Engine.measure_drift = lambda self, stream, d: drafted.append(d) or measure(self, stream, d)
    print(f"window {args.window} of seed {args.seed} (offset {offset}), {args.context} tokens")
    for budget in parse_budgets(args.budgets):
        settings = ReadSettings(budget=Budget(tokens=min(budget.resolve(args.context), args.context)), method="kl",
                                position_mode="original", seed=args.seed, measure_drift=True)
        got = session.read_tokens(window, settings, reserve=room)
        sample = drafted[-1]
        real = continuation_logits(got.engine, got.stream.clone(), got.logits, cont)
        after, true = (lanes_logits(read, sample) for read in (got, full))
        print(f"{str(budget):>6}: sampled tokens — whole read vs compressed {mean_kl(sample.logits, after):.4f}, "
              f"full vs compressed {mean_kl(true, after):.4f}, full vs whole read {mean_kl(true, sample.logits):.4f}"
              f" | estimate {got.stream.drift['kl']:.4f} ({got.stream.drift['covers']}), real next page "
              f"{mean_kl(real_full, real):.4f}", flush=True)


if __name__ == "__main__":
    main()
