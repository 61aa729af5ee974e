"""How much could better look-ahead probes give? `kl`'s last choice judged by its drafts, against the same choice
judged by the text that really follows (its first 128 tokens, or all 256 that are then scored — which cheats).

    python examples/probe_headroom.py ../shared/data/moby-dick.txt --windows 1 --seed 2

If even the true continuation barely lowers the KL, the probes are not what limits `kl`: the choice made from them
is. Prints, per window and budget, the KL of the next 256 tokens and of their two halves.
"""

from __future__ import annotations

import argparse
import random

import torch

from klevict_cli import probes
from klevict_cli.attention import ATTENTION_NAME
from klevict_cli.bench import continuation_logits, draw_offsets, token_metrics
from klevict_cli.documents import load_document
from klevict_cli.models import load_model
from klevict_cli.prompts import bos_ids, encode_text
from klevict_cli.session import ReadSettings, Session


def read(engine, context: list[int]) -> dict:
    """The stream and last logits of `engine` reading `context` (no chat frame: the text alone after BOS)."""
    stream = engine.new_stream()
    return {"stream": stream, "logits": engine.feed(stream, context)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("--windows", type=int, default=1)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--budgets", default="10%,5%")
    parser.add_argument("--refit", default="final", help="kl's refit of the kept values: never, final, always")
    args = parser.parse_args()

    session = Session(load_model(None, attn_implementation=ATTENTION_NAME, quiet=True))
    ids = encode_text(session.lm.tokenizer, load_document(args.file).text)
    bos = bos_ids(session.lm.tokenizer)
    body = args.context - len(bos)
    read = ReadSettings(budget=None, chunk_size=512, probe_window=32, seed=args.seed)
    reference = session.engine("none", None, read, "original")
    true_text: list[int] | None = None
    drafted = probes.Drafts.requests

    def requests(self, tokens, read_logits, room, generator):  # the drafts, or the true continuation in their place
        if true_text is None:
            yield from drafted(self, tokens, read_logits, room, generator)
            return
        yield probes.ProbeRequest(true_text, rows=len(true_text), logits_rows=len(true_text))

    probes.Drafts.requests = requests
    print("| window | budget | probes | KL (256) | first 128 | last 128 |\n|---|---|---|---|---|---|")
    for w, offset in enumerate(draw_offsets(len(ids), body + 256, args.windows, random.Random(args.seed))):
        context, following = bos + ids[offset : offset + body], ids[offset + body : offset + body + 256]
        targets = torch.tensor(following)
        full = read(reference, context)
        expected = continuation_logits(reference, full["stream"], full["logits"], following)
        for budget in args.budgets.split(","):
            tokens = round(float(budget.rstrip("%")) / 100 * args.context)
            for label, true_text in (("drafts", None), ("true 128", following[:128]), ("true 256", following)):
                engine = session.engine("kl", tokens, read, "original")
                engine.policy.refit = args.refit
                engine.generator.manual_seed(args.seed)
                got = read(engine, context)
                logits = continuation_logits(engine, got["stream"], got["logits"], following)
                kl = [token_metrics(expected[s], logits[s], targets[s])["kl"]
                      for s in (slice(None), slice(0, 128), slice(128, None))]
                print(f"| {w + 1} | {budget} | {label} | {kl[0]:.4f} | {kl[1]:.4f} | {kl[2]:.4f} |", flush=True)


if __name__ == "__main__":
    main()
