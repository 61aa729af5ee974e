"""Would `--max-kl`'s tries measure alike on the bfloat16 copy? For every measure_drift call of a `--max-kl` read (its
tries and the final one; default model unless MODEL, 512-token windows at two offsets of each text, tolerances 0.01 /
0.03 / 0.1), the sampled drift as klevict measures it (model reference, model after) and on the copy alone (the copy's
sampled logits as reference, the copy after), and the copy's forward time.

    OMP_NUM_THREADS=2 python benchmarks/results/tuning/probe-precision/maxkl/copy_tries.py [MODEL|-] OUT.json
"""
import json, statistics, sys, time
import torch
from klevict_cli.models import load_model
from klevict_cli.session import ReadSettings, Session
from klevict_cli.engine import Engine, DRIFT_LANES
from klevict_cli.attention import Lanes
from klevict_cli.options import Budget
from klevict_kernels.kl import token_kl
from klevict_cli.prompts import encode_text
from klevict_cli.documents import load_document

model_name = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "-" else None
lm = load_model(model_name, quiet=True)
s = Session(lm)
orig_forward, orig_drafts, orig_measure = Engine.forward, Engine.drafts_for_drift, Engine.measure_drift
state = {"recording": False, "rows": []}
def forward(self, stream, ids, *a, **k):
    out = orig_forward(self, stream, ids, *a, **k)
    if state["recording"] and k.get("lanes") is not None and not k.get("measuring"):
        state["rows"].append(out[0])
    return out
def drafts(self, stream, read_logits):
    state["recording"], state["rows"] = True, []
    try:
        c = orig_drafts(self, stream, read_logits)
    finally:
        state["recording"] = False
    if c is not None:
        c.copy_logits = torch.cat(state["rows"])
    return c
pairs = []
def measure(self, stream, drafted):
    res = orig_measure(self, stream, drafted)
    lanes = Lanes(stream.next_position, stream.next_rope, drafted.lanes)
    t = time.perf_counter()
    after, _ = orig_forward(self, stream, drafted.tokens, logits_rows=len(drafted.tokens), probing=True, lanes=lanes)
    tc = time.perf_counter() - t
    self.forget_drafts(stream, len(drafted.tokens))
    copy_kl = float(token_kl(drafted.copy_logits, after).mean())
    pairs.append((res["sampled_kl"], copy_kl, tc))
    return res
Engine.forward, Engine.drafts_for_drift, Engine.measure_drift = forward, drafts, measure
texts = {"moby": "../shared/data/moby-dick.txt"}
import subprocess
texts["hamlet"] = subprocess.check_output([".venv/bin/python", "examples/play.py", "hamlet"]).decode().strip()
out = {}
for name, path in texts.items():
    ids = encode_text(lm.tokenizer, load_document(path).text)
    for w, off in enumerate((20000, 60000)):
        window = ids[off: off + 512]
        for tol in (0.01, 0.03, 0.1):
            pairs.clear()
            st = ReadSettings(budget=None, max_kl=tol, method="kl", probe_dtype="bfloat16")
            s.read_tokens(window, st)
            out[f"{name}-{w}-{tol}"] = list(pairs)
            print(name, w, tol, [(round(a, 5), round(b, 5)) for a, b, _ in pairs], flush=True)
json.dump(out, open(sys.argv[2], "w"), indent=1)
allp = [p for v in out.values() for p in v]
ratios = [b / a for a, b, _ in allp if a > 0]
from klevict_cli.oracle import spearman
print("n", len(allp), "copy/model median", round(statistics.median(ratios), 3), "10-90%",
      round(sorted(ratios)[len(ratios)//10], 3), round(sorted(ratios)[9*len(ratios)//10], 3),
      "spearman", round(float(spearman(torch.tensor([a for a, _, _ in allp]), torch.tensor([b for _, b, _ in allp]))), 3))
