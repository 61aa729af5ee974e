import sys, time, statistics
import torch
from klevict_cli.attention import ATTENTION_NAME, Lanes
from klevict_cli.documents import load_document
from klevict_cli.models import load_model
from klevict_cli.session import ReadSettings, Session
lm = load_model(None, device="cpu", dtype="float32", attn_implementation=ATTENTION_NAME, quiet=True)
session = Session(lm)
ids = lm.tokenizer(load_document(sys.argv[1]).text, add_special_tokens=False)["input_ids"]
eng = session.engine("kl-reconstruct", 96, ReadSettings(budget=None, measure_drift=True, probe_dtype="auto"), "original")
print("probe dtype", eng.probe_dtype, torch.get_num_threads())
s = eng.new_stream()
eng.feed(s, ids[20000:20300], evict=False)
for lanes_n in [1, 4, 8, 16, 32, 64]:
    for where in ["copy", "model"]:
        ts = []
        for r in range(5):
            lanes = Lanes(s.next_position, s.next_rope, lanes_n)
            t = time.perf_counter()
            eng.forward(s, ids[:lanes_n], logits_rows=lanes_n, probing=True, measuring=(where == "model"), lanes=lanes)
            ts.append(time.perf_counter() - t)
            eng.forget_drafts(s, lanes_n)
        print(lanes_n, where, f"{statistics.median(ts)*1000:.1f} ms")
