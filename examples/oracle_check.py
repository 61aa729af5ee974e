"""How well does the KL estimator rank cache entries against the true leave-one-out KL (float64 oracle)?

For a few windows of a long text: read `--context` tokens with the full cache, then one more chunk whose last 32
tokens are the probes; score every entry with the direct path (with and without calibration) and the Fisher path
(probes frozen or live, klevict_cli/fisher.py), and compare against the oracle on sampled entries at a few layers
(Spearman rank correlation, and magnitude ratio).

    python examples/oracle_check.py ../shared/data/moby-dick.txt --windows 3 --layers 2,15,28
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from klevict_cli.attention import ATTENTION_NAME
from klevict_cli.results import summary as mean_ci
from klevict_cli.documents import load_document
from klevict_cli.engine import Engine
from klevict_cli.models import load_model
from klevict_cli.oracle import float64_copy, leave_one_out_kl, spearman
from klevict_cli.policies.kl import KL, apply_calibration, calibration_ratios
from klevict_cli.session import Session


def frozen(policy: KL) -> KL:
    """The policy's Fisher re-run with the probes' keys and values held fixed."""
    policy.live_probes = False
    return policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("--model", default=None)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--context", type=int, default=1536)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--layers", default="2,15,28")
    parser.add_argument("--entries", type=int, default=48, help="sampled entries per layer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    session = Session(load_model(args.model, attn_implementation=ATTENTION_NAME, quiet=True))
    model = session.lm.model
    model64 = float64_copy(model)
    ids = session.lm.tokenizer(load_document(args.file).text, add_special_tokens=False)["input_ids"]
    layers = [int(x) for x in args.layers.split(",")]
    w = 32
    rows = []
    for window in range(args.windows):
        start = rng.randrange(0, len(ids) - args.context - args.chunk)
        text = ids[start : start + args.context + args.chunk]
        engine = Engine(model, session.adapter, KL(), budget=None, chunk_size=args.chunk, probe_window=w)
        stream = engine.new_stream()
        engine.feed(stream, text[: args.context])
        with torch.inference_mode():
            logits, ctx = engine.forward(stream, text[args.context :], probe_rows=w)
            step = engine.eviction_step(stream, ctx, logits, w)
            direct = KL().direct_scores(step, layers)
            rank8 = KL(rank=8).direct_scores(step, layers)
            fisher16, fisher4 = (frozen(KL(propagation="fisher", samples=n)).fisher_scores(step, layers)
                                 for n in (16, 4))
            fisher4_live = KL(propagation="fisher", samples=4).fisher_scores(step, layers)
            fisher16_live = KL(propagation="fisher", samples=16).fisher_scores(step, layers)
            fisher2_live = KL(propagation="fisher", samples=2).fisher_scores(step, layers)
            estimates = {  # in the order of the printed table
                "direct": direct,
                "direct_rank8": rank8,
                "direct_calibrated": apply_calibration(direct, calibration_ratios(direct, fisher4, step)),
                "direct_head_calibrated": apply_calibration(
                    direct, calibration_ratios(direct, fisher4, step, per_head=True)),
                "direct_head_calibrated16": apply_calibration(
                    direct, calibration_ratios(direct, fisher16, step, per_head=True)),
                "direct_head_calibrated_live": apply_calibration(
                    direct, calibration_ratios(direct, fisher4_live, step, per_head=True)),
                "direct_head_calibrated_live2": apply_calibration(  # the default: 2 samples, live probes
                    direct, calibration_ratios(direct, fisher2_live, step, per_head=True)),
                "fisher4": fisher4, "fisher16": fisher16, "fisher4_live": fisher4_live, "fisher16_live": fisher16_live,
            }
        for layer in layers:
            cache_layer = stream.cache.layers[layer]
            candidates = [(h, c) for h in range(cache_layer.keys.shape[0])
                          for c in range(cache_layer.capacity - w) if cache_layer.valid[h, c]]
            entries = [(layer, h, c) for h, c in rng.sample(candidates, min(args.entries, len(candidates)))]
            truth = leave_one_out_kl(model64, stream, w, entries)
            row = {"window": window, "offset": start, "layer": layer}
            for name, scores in estimates.items():
                estimate = torch.stack([scores[layer][h, c] for _, h, c in entries])
                row[name] = {"spearman": spearman(estimate, truth), "ratio": float(estimate.sum() / truth.sum())}
            rows.append(row)
            print(json.dumps(row))
    names = list(estimates)
    table = {}
    for name in names:
        for layer in layers:
            of_layer = [r for r in rows if r["layer"] == layer]
            table[f"{name}@{layer}"] = {"spearman": mean_ci([r[name]["spearman"] for r in of_layer]),
                                        "spearman_min": min(r[name]["spearman"] for r in of_layer),
                                        "ratio": mean_ci([r[name]["ratio"] for r in of_layer])}
    print(f"\nSpearman vs the float64 oracle, mean ± 95 % over {args.windows} windows (magnitude ratio to the truth)")
    print("\n| estimator | " + " | ".join(f"layer {x}" for x in layers) + " |")
    print("|---|" + "---|" * len(layers))
    for name in names:
        cells = [f"{c['spearman']['mean']:.3f} ± {c['spearman']['ci95']:.3f} (×{c['ratio']['mean']:.2f})"
                 for c in (table[f"{name}@{x}"] for x in layers)]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "rows": rows, "summary": table}, f, indent=1)


if __name__ == "__main__":
    main()
