# Measured against commit 36328c1 (the judge it monkeypatches was dropped after this measurement; see docs/research-log.md).
"""For each window x budget: the judge's KL (last tokens read again) for the policy's own ranking and for the
alternative, and the bench's KL of the continuation for each (forced). Prints a table and writes json."""
import argparse, json, math, sys
import torch
from klevict_cli import engine as engine_module
from klevict_cli.attention import ATTENTION_NAME
from klevict_cli.bench import BenchSettings, run_bench
from klevict_cli.documents import load_document
from klevict_cli.models import load_model
from klevict_cli.session import Session
from klevict_kernels.kl import token_kl

p = argparse.ArgumentParser()
p.add_argument("file"); p.add_argument("--context", type=int); p.add_argument("--windows", type=int)
p.add_argument("--budgets", default="50%,20%,10%,5%,32,64"); p.add_argument("--seed", type=int, default=0)
p.add_argument("--model", default=None); p.add_argument("--out")
p.add_argument("--judge", type=int, default=32)
args = p.parse_args()
engine_module.JUDGE_TOKENS = args.judge
records = []
pick = {"mode": "own"}

def judge(self, stream, step, scores, recent, budget, keep, targets):
    w = min(engine_module.JUDGE_TOKENS, stream.next_position - 1)
    before = self._read_last_again(stream.clone(), w)
    out = []
    for alternative in (None, *self.policy.alternatives(step)):
        ranked, fit = self._at_budget(stream, step, scores, recent, budget, targets, alternative)
        trial = stream.clone()
        self._keep_best(trial, ranked, recent, budget, keep, fit, compact=False)
        kl = token_kl(before, self._read_last_again(trial, w))
        out.append((kl, ranked, fit))
    if pick["mode"] == "own":
        records.append({"budget": budget, "window": hash(tuple(stream.tokens[:64])),
                        "per_token": [o[0].tolist() for o in out]})
    chosen = out[0] if pick["mode"] == "own" else out[-1]
    return chosen[1], chosen[2]

engine_module.Engine._judge_alternatives = judge
session = Session(load_model(args.model, attn_implementation=ATTENTION_NAME, quiet=True))
document = load_document(args.file)
res = {}
for mode in ("own", "without"):
    pick["mode"] = mode
    settings = BenchSettings(methods=["kl"], budgets=args.budgets.split(","), windows=args.windows, context=args.context,
                             continuation=256, seed=args.seed, task="fidelity")
    res[mode] = run_bench(session, document, settings)["fidelity"]["results"]["kl"]
json.dump({"args": vars(args), "records": records, "results": res}, open(args.out, "w"))
