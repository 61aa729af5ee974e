"""klevict's CLI with the drift's continuation drawn from each distribution's nucleus (the smallest set of tokens
holding P of its probability, renormalised) instead of the whole of it: the same generator, so the same uniforms —
a paired comparison in which the caches and the measured KL are the same and only the estimate differs.

    python variant.py 0.9 ARGS...   # drift tokens from the 90 % nucleus
    python variant.py 1 ARGS...     # as shipped
"""
import sys

import torch

import klevict_cli.engine as E

top_p = float(sys.argv.pop(1))
if top_p < 1:
    whole = E.sample_rows

    def nucleus(logits, generator):
        probs = logits.float().softmax(dim=-1)
        ordered, order = probs.sort(dim=-1, descending=True)
        outside = ordered.cumsum(dim=-1) - ordered > top_p  # past the nucleus (the first token always stays)
        cut = logits.float().scatter(-1, order, torch.where(outside, float("-inf"), 0.0)) + logits.float()
        return whole(cut, generator)

    E.sample_rows = nucleus
from klevict_cli.cli import app

app()
