# As run for cost-1024.txt (KL.cheap_drafts toggled); cost-4096.txt and cost-324.txt toggled KL.reread_drafts_up_to (0.15 / 1.0) in the same loop.
"""compress at 20%/50% of 4096 tokens: drafts judging the last choice (reread_drafts_up_to=1) vs not; interleaved with full reads."""
import sys, time, statistics, torch
sys.path.insert(0, "examples")
from cost import timed_feed
from klevict_cli.models import load_model
from klevict_cli.session import Session
from klevict_cli.documents import load_document
from klevict_cli.attention import ATTENTION_NAME
from klevict_cli.policies.kl import KL
n = int(sys.argv[1]); budgets = [float(b) for b in sys.argv[2].split(",")]; reps = int(sys.argv[3])
lm = load_model(None, device="cpu", dtype="float32", attn_implementation=ATTENTION_NAME, quiet=True)
s = Session(lm); dev = torch.device("cpu")
all_ids = lm.tokenizer(load_document("../shared/data/moby-dick.txt").text, add_special_tokens=False)["input_ids"]
res = {}
PLACES = [int(p) for p in sys.argv[4].split(",")] if len(sys.argv) > 4 else [20000, 120000]
for place in PLACES:
    ids = all_ids[place:place + n]
    for b in budgets:
        for r in range(reps):
            for up in (10**9, 16):
                KL.cheap_drafts = up
                full = timed_feed(s, ids, "none", int(b * n), dev)
                t = timed_feed(s, ids, "kl-reconstruct", int(b * n), dev)
                res.setdefault((b, up), []).append(t / full)
                print(place, b, up, f"full {full:.2f}s ratio {t/full:.2f}", flush=True)
for k, v in sorted(res.items()): print(k, f"median {statistics.median(v):.2f}", [round(x, 2) for x in v])
