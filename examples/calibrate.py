"""Measure kl's calibration for a model once, over many windows, to ship it (klevict_cli/calibrations.py).

    python examples/calibrate.py PLAY1.md PLAY2.md ... --windows 2 --budgets 50%,10% \
        --out klevict_cli/model_calibrations/smollm2-135m.json

Reads `--windows` windows of `--tokens` tokens from each text (spread evenly) with `kl` at each budget, calibrating
on each read as a model without a shipped calibration does — at 50 % on the last look-ahead drafts, at 10 % on the
last tokens read at the first eviction — and writes each KV head's geometric mean ratio with the weights'
fingerprint and this command. Use texts outside the benchmark's (Moby Dick, Hamlet), so that the calibration is
not tuned on the windows it is reported on.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

import torch

from klevict_cli.attention import ATTENTION_NAME
from klevict_cli.documents import load_document
from klevict_cli.models import load_model
from klevict_cli.options import parse_budget
from klevict_cli.session import ReadSettings, Session


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("texts", nargs="+")
    parser.add_argument("--model", default=None)
    parser.add_argument("--windows", type=int, default=2, help="windows per text")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--budgets", default="50%,10%")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    lm = load_model(args.model, attn_implementation=ATTENTION_NAME, quiet=True)
    session = Session(lm, shipped_calibration=False)
    logs: dict[int, list[torch.Tensor]] = {}
    for text in args.texts:
        ids = lm.tokenizer(load_document(text).text, add_special_tokens=False)["input_ids"]
        if len(ids) < args.tokens:
            parser.error(f"{text} has {len(ids)} tokens, fewer than --tokens {args.tokens}")
        step = (len(ids) - args.tokens) // max(1, args.windows - 1) if args.windows > 1 else 0
        for w in range(args.windows):
            window = ids[w * step : w * step + args.tokens]
            for budget in args.budgets.split(","):
                engine = session.engine("kl", parse_budget(budget).resolve(args.tokens), ReadSettings(budget=None),
                                        "original")
                engine.feed(engine.new_stream(), window)
                for layer, ratios in engine.policy.calibration.items():
                    logs.setdefault(layer, []).append(ratios.clamp_min(1e-12).log())
                print(f"{Path(text).name} window {w} at {budget}", file=sys.stderr)
    ratios = {str(layer): [round(math.exp(x), 6) for x in torch.stack(found).mean(dim=0).tolist()]
              for layer, found in sorted(logs.items())}
    Path(args.out).write_text(json.dumps({
        "model": lm.model_id, "weights_sha256": lm.weights_sha256,
        "command": "python examples/calibrate.py " + shlex.join(sys.argv[1:]),
        "reads": len(next(iter(logs.values()))), "ratios": ratios}, indent=1) + "\n")


if __name__ == "__main__":
    main()
