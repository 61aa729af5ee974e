"""klevict bench, recording each cache's measured KL on the first and the second half of the teacher-forced
continuation (how much the bench's own truth moves within one window), to HALVES_OUT as JSON lines.

    HALVES_OUT=out.jsonl python halves.py bench TEXT ARGS...
"""
import json, os
import klevict_cli.bench as B
from klevict_kernels.kl import token_kl
out = open(os.environ["HALVES_OUT"], "a")
f = B.token_metrics
def g(full_logits, comp_logits, targets):
    kl = token_kl(full_logits, comp_logits)
    m = kl.shape[0] // 2
    out.write(json.dumps({"first": float(kl[:m].mean()), "second": float(kl[m:].mean()), "all": float(kl.mean())}) + "\n")
    out.flush()
    return f(full_logits, comp_logits, targets)
B.token_metrics = g
from klevict_cli.cli import app
app()
