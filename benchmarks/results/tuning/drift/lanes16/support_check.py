"""How many tokens the drift's KL needs (engine.DRIFT_SUPPORT): a bench run whose every drift measurement also takes
the KL over the whole vocabulary (the model's head inputs' change through the probe copy's whole head), beside the
union of each row's K likeliest tokens for several K (kernels/kl.py, SupportedReference): the support's size, the
most mass a row leaves outside it, the mean KL over rows against the whole vocabulary's, and the seconds of each.

    OMP_NUM_THREADS=2 python benchmarks/results/tuning/drift/lanes16/support_check.py \\
        ../shared/data/moby-dick.txt --model gemma3-270m --methods kl --budgets 20%,5% --windows 1 --context 512 \\
        --seed 0 --estimate --max-kl 0.03 --threads 2
"""
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[5]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from klevict_cli import engine  # noqa: E402
from klevict_cli.cli import app  # noqa: E402
from klevict_kernels.kl import ReferenceDistributions, SupportedReference  # noqa: E402

KEEPS = (256, 512, 1024, 2048)
prepared = {}  # id(continuation) -> {K: SupportedReference}, and the whole vocabulary's reference


def checked(self, stream, drafted):
    if drafted.head_inputs is None:
        return measure(self, stream, drafted)
    lanes = engine.Lanes(stream.next_position, stream.next_rope, drafted.lanes)
    weight = self.probe_model.get_output_embeddings().weight
    _, ctx = self.forward(stream, drafted.tokens, logits_rows=len(drafted.tokens), probing=True, measuring=True,
                          lanes=lanes, head_inputs=True)
    self.forget_drafts(stream, len(drafted.tokens))
    change = ctx.sampled_inputs.float() - drafted.head_inputs.float()
    refs = prepared.setdefault(id(drafted), {})
    if "whole" not in refs:
        refs["whole"] = ReferenceDistributions(drafted.logits[:-1])
        refs.update({k: SupportedReference(drafted.logits[:-1], k, weight) for k in KEEPS})
    start = time.perf_counter()
    whole = refs["whole"].kl_of_change(torch.nn.functional.linear(change.to(weight.dtype), weight).float())
    seconds = time.perf_counter() - start
    line = [f"whole {float(whole.mean()):.5f} ({seconds:.3f} s)"]
    for k in KEEPS:
        start = time.perf_counter()
        part = refs[k].kl_of_head_change(change)
        seconds = time.perf_counter() - start
        line.append(f"K={k}: {len(refs[k].support)} tokens, rest ≤ {float(refs[k].rest.max()):.1e}, "
                    f"{float(part.mean()) / float(whole.mean()):.5f}x ({seconds:.3f} s)")
    print(" | ".join(line), file=sys.stderr, flush=True)
    return measure(self, stream, drafted)


measure = engine.Engine.measure_drift
engine.Engine.measure_drift = checked
sys.argv = ["klevict", "bench", *sys.argv[1:]]
app()
