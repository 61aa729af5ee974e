"""Speed, memory-free cost and file-size benchmark for the README (issue "Fast and lean").

    python examples/perf.py ../shared/data/moby-dick.txt            # default model, CPU
    python examples/perf.py ../shared/data/moby-dick.txt --device cuda

Prints markdown tables:
  1. scoring overhead: chunked prefill time per method at --chunk-size 512 against the full cache;
  2. end to end: summarize-like read + generation at 10 % vs the full cache, for 2k/4k/8k-token documents;
  3. reuse: first-token latency of `ask` on a saved .kvc vs re-reading the document with the full cache;
  4. file size: .kvc bytes vs the formula, per --cache-dtype, with the KL change of half precision.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from klevict_cli.attention import ATTENTION_NAME
from klevict_cli.documents import Document, load_document
from klevict_cli.engine import Engine
from klevict_cli.models import load_model
from klevict_cli.options import parse_budget
from klevict_cli.policies import make_policy
from klevict_cli.session import GenerateSettings, ReadSettings, Session


def window(text_ids: list[int], n: int, tokenizer) -> Document:
    text = tokenizer.decode(text_ids[:n])
    return Document(text=text, name=f"first {n} tokens", sha256="-")


def timed_read(session: Session, doc: Document, method: str, budget: str | None, chunk: int) -> tuple[float, object]:
    settings = ReadSettings(budget=parse_budget(budget) if budget else None, method=method, chunk_size=chunk,
                            position_mode="original")
    start = time.perf_counter()
    result = session.read(doc, settings, reserve=256)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    session = Session(load_model(args.model, device=args.device, dtype=args.dtype,
                                 attn_implementation=ATTENTION_NAME, quiet=True))
    tok = session.lm.tokenizer
    ids = tok(load_document(args.file).text, add_special_tokens=False)["input_ids"]
    report: dict = {"device": args.device, "dtype": args.dtype, "torch_threads": torch.get_num_threads()}

    # 1. scoring overhead at chunk 512 on a 4k-token window, 10 % budget
    doc4k = window(ids, 4096, tok)
    timed_read(session, window(ids, 600, tok), "none", None, 512)  # warm-up
    base, _ = timed_read(session, doc4k, "none", None, 512)
    rows = [("none", base)]
    for method in ("streaming", "snapkv", "kl"):
        seconds, _ = timed_read(session, doc4k, method, "10%", 512)
        rows.append((method, seconds))
    report["overhead"] = {m: s for m, s in rows}
    print("\n| method (4096 tokens, chunk 512, budget 10 %) | read seconds | vs full cache |")
    print("|---|---|---|")
    for method, seconds in rows:
        print(f"| {method} | {seconds:.2f} | {seconds / base:.2f}× |")

    # 2. end to end: read + generate, 10 % kl vs full cache
    gen = GenerateSettings(max_new_tokens=args.max_new_tokens)
    prompt = "Summarize the text above in a few sentences."
    print(f"\n| document | full cache (s) | kl 10 % (s) | ratio |   (read + {args.max_new_tokens} new tokens)")
    print("|---|---|---|---|")
    report["end_to_end"] = {}
    for n in (2048, 4096, 7680):  # 7680 + chat frame + 256 reserved for the answer fit the 8192 positions
        doc = window(ids, n, tok)
        totals = {}
        for method, budget in (("none", None), ("kl", "10%")):
            start = time.perf_counter()
            _, result = timed_read(session, doc, method, budget, 512)
            session.answer(result.stream, prompt, gen, "original", method=method, budget=result.plan.budget)
            totals[method] = time.perf_counter() - start
        report["end_to_end"][n] = totals
        print(f"| {n} tokens | {totals['none']:.1f} | {totals['kl']:.1f} | {totals['kl'] / totals['none']:.2f} |")

    # 3. reuse: ask from a .kvc vs re-reading with the full cache
    doc = window(ids, 4096, tok)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "doc.kvc"
        _, result = timed_read(session, doc, "kl", "10%", 512)
        session.save(path, result)
        start = time.perf_counter()
        stream, meta = session.load(path)
        answer = session.answer(stream, "Who is the narrator?", GenerateSettings(1), meta["position_mode"])
        from_file = time.perf_counter() - start
        start = time.perf_counter()
        _, full = timed_read(session, doc, "none", None, 512)
        session.answer(full.stream, "Who is the narrator?", GenerateSettings(1), "original")
        reread = time.perf_counter() - start
        report["reuse"] = {"load_and_first_token": from_file, "reread_and_first_token": reread,
                           "first_token_only": answer["first_token_seconds"]}
        print("\n| first token of an answer (4096-token document) | seconds |")
        print("|---|---|")
        print(f"| `ask` on a saved .kvc (load + verify + prefill question) | {from_file:.3f} |")
        print(f"| re-read the document with the full cache | {reread:.2f} |")
        print(f"| speed-up | {reread / from_file:.0f}× |")

        # 4. file size per cache dtype, and the KL change of storing half precision
        print("\n| --cache-dtype | file bytes | formula bytes | next-token KL vs float32 file |")
        print("|---|---|---|---|")
        report["file_size"] = {}
        reference = None
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            path = Path(tmp) / f"doc-{dtype}.kvc"
            size = session.save(path, result, cache_dtype=dtype)
            kept = sum(int(layer.valid.sum()) for layer in result.stream.cache.layers)
            dims = result.stream.cache.layers[0].keys.shape[-1] + result.stream.cache.layers[0].values.shape[-1]
            formula = kept * dims * torch.finfo(dtype).bits // 8
            stream, _ = session.load(path)
            engine = Engine(session.lm.model, session.adapter, make_policy("none"), None)
            logits = engine.feed(stream, session.frame.suffix_ids(tok, "Who is the narrator?"), evict=False)
            logp = logits.double().log_softmax(-1)
            if reference is None:
                reference = logp
            kl = float((reference.exp() * (reference - logp)).sum())
            report["file_size"][str(dtype)] = {"bytes": size, "formula": formula, "kl": kl}
            print(f"| {str(dtype).removeprefix('torch.')} | {size:,} | {formula:,} | {kl:.2e} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
