"""Wall time of a compress-like read at 300 tokens split by Engine method (inclusive times)."""
import sys, time, statistics, functools
import torch
from klevict_cli.attention import ATTENTION_NAME
from klevict_cli.documents import load_document
from klevict_cli.models import load_model
from klevict_cli.session import ReadSettings, Session
from klevict_cli import engine as E
from klevict_cli import probes as P

times = {}
def wrap(cls, name):
    f = getattr(cls, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            times[name] = times.get(name, 0.0) + time.perf_counter() - t
    setattr(cls, name, g)
for n in ["drafts_for_drift", "measure_drift", "evict", "evict_with", "reconstruct", "probe_sets", "_keep_best",
          "refit_targets", "_refit", "eviction_step", "probe_again"]:
    wrap(E.Engine, n)

lm = load_model(None, device="cpu", dtype="float32", attn_implementation=ATTENTION_NAME, quiet=True)
session = Session(lm)
ids = lm.tokenizer(load_document(sys.argv[1]).text, add_special_tokens=False)["input_ids"]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 300
def read(method, budget, est, window):
    engine = session.engine(method, budget, ReadSettings(budget=None, measure_drift=est, probe_dtype="auto"), "original")
    s = engine.new_stream()
    t = time.perf_counter(); engine.feed(s, window); return time.perf_counter() - t
w0 = ids[5000:5000+N]
read("none", None, False, w0); read("kl-reconstruct", 96, True, w0)
res = {}
for rep in range(3):
    for k, start in enumerate([20000, 60000, 100000]):
        w = ids[start:start+N]
        for name, m, est in [("none", "none", False), ("noest", "kl-reconstruct", False), ("est", "kl-reconstruct", True)]:
            times.clear()
            t = read(m, 96 if m != "none" else None, est, w)
            res.setdefault(name, []).append((t, dict(times)))
for name, rows in res.items():
    med = statistics.median(r[0] for r in rows)
    keys = sorted({k for r in rows for k in r[1]})
    print(name, f"{med:.3f}s", {k: round(statistics.median(r[1].get(k, 0) for r in rows), 3) for k in keys})
