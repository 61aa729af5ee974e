"""Interleaved cost of a compressing read against the full-cache read of the same tokens.

    python examples/cost.py ../shared/data/moby-dick.txt                       # 2,048 tokens, 20 % and 10 %
    python examples/cost.py ../shared/data/moby-dick.txt --tokens 4096 --reps 2
    python examples/cost.py ../shared/data/moby-dick.txt --device cuda --methods kl,snapkv --tokens 2048,8192
    python examples/cost.py ../shared/data/moby-dick.txt --model SHAPE_FOLDER --random-weights --dtype bfloat16
    python examples/cost.py ../shared/data/moby-dick.txt --tokens 300 --budgets 96 --probe-dtype float32,bfloat16

A busy or throttled machine changes speed from minute to minute, so each compressing read is timed right after a
full read of the same tokens and the table reports the median (and spread) of those paired ratios. The time is
`Engine.feed` alone: chunked prefill, scoring, eviction and, for `kl`, its look-ahead drafts and calibration (the probe
copy of `--probe-dtype` is made in the warm-up, as a session makes it once).

`--random-weights` builds the model from `--model`'s config.json (and its tokenizer) with random weights, so the cost
of a model too large to carry can be timed; its outputs are noise, so only its times mean anything. `--profile FILE`
then profiles one read per method (first window, first budget) and writes where the time went: wall time inside
evictions, inside their model passes (drafts, re-reading, calibration backward) and outside evictions, the kernels
launched and the host syncs (synchronisations and copies back to the host), and the top operators by self time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from klevict_cli.attention import ATTENTION_NAME
from klevict_cli.documents import load_document
from klevict_cli.models import LoadedModel, load_model
from klevict_cli.options import parse_budget, resolve_device, resolve_dtype
from klevict_cli.session import ReadSettings, Session
from op_count import MODEL_PASS, counted

# The host waits for the GPU at an explicit synchronisation and at every copy to the host (a value read back).
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "Memcpy DtoH")
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def timed_feed(session: Session, ids: list[int], method: str, budget: int | None, device: torch.device,
               scoped: bool = False, estimate: bool = False, probe_dtype: str = "auto") -> float:
    """One read of `ids` as the CLI reads (its engine, chunking and working limit; `kl-reconstruct` as `compress`).

    `scoped` marks evictions and their model passes for the profiler (op_count's scopes); `estimate`: the read
    measures its drift (as `compress` does by default from 1,024 tokens); `probe_dtype`: as `--probe-dtype`."""
    engine = session.engine(method, budget, ReadSettings(budget=None, measure_drift=estimate, probe_dtype=probe_dtype),
                            "original")
    if scoped:
        engine.__class__ = counted(type(engine))
    stream = engine.new_stream()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    engine.feed(stream, ids)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def random_model(folder: str, device: str, dtype: str) -> LoadedModel:
    """`folder`'s architecture and tokenizer with random weights made on the device (for timing only)."""
    torch_device = resolve_device(device)
    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    with torch.device(torch_device):
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype, torch_device),
                                                 attn_implementation=ATTENTION_NAME)
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=AutoTokenizer.from_pretrained(folder), model_id=folder, source=folder,
                       config_sha256="random", tokenizer_sha256="random", weights_sha256="random")


def profiled(session: Session, ids: list[int], method: str, budget: int | None, device: torch.device) -> str:
    """Where one read's time went (see the module docstring), as text."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        seconds = timed_feed(session, ids, method, budget, device, scoped=True)
    totals = {"eviction": 0.0, MODEL_PASS: 0.0}
    launches = syncs = 0
    for event in prof.events():
        if event.name == "eviction" and not _inside(event, "eviction"):
            totals["eviction"] += event.cpu_time_total / 1e6
        elif event.name == MODEL_PASS and _inside(event, "eviction") and not _inside(event, MODEL_PASS):
            totals[MODEL_PASS] += event.cpu_time_total / 1e6
        launches += event.name in LAUNCH_CALLS
        syncs += event.name.startswith(SYNC_CALLS)
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return (f"## {method} @ {budget}, {len(ids)} tokens: {seconds:.3f} s; evictions {totals['eviction']:.3f} s "
            f"(model passes in them {totals[MODEL_PASS]:.3f} s); outside evictions "
            f"{seconds - totals['eviction']:.3f} s; kernel launches {launches}; host syncs {syncs}\n\n"
            + prof.key_averages().table(sort_by=sort, row_limit=30) + "\n")


def _inside(event, name: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", default="2048", help="tokens read per window; several: 2048,8192")
    parser.add_argument("--budgets", default="20%,10%", help="fractions of --tokens, or token counts")
    parser.add_argument("--methods", default="kl")
    parser.add_argument("--places", type=int, default=4, help="windows spread over the document")
    parser.add_argument("--reps", type=int, default=3, help="timed pairs per window, method and budget")
    parser.add_argument("--json", default=None, help="raw results (one entry per --tokens)")
    parser.add_argument("--random-weights", action="store_true", help="--model's shape with random weights")
    parser.add_argument("--profile", default=None, help="write a profile of one read per method to this file")
    parser.add_argument("--estimate", action="store_true", help="the reads measure their drift (compress's default "
                        "from 1,024 tokens)")
    parser.add_argument("--probe-dtype", default="auto", help="as the commands' --probe-dtype; several (float32,"
                        "bfloat16): each timed against its own full reads, interleaved")
    args = parser.parse_args()

    if args.random_weights:
        lm = random_model(args.model, args.device, args.dtype)
    else:
        lm = load_model(args.model, device=args.device, dtype=args.dtype, attn_implementation=ATTENTION_NAME,
                        quiet=True)
    session = Session(lm)
    device = next(session.lm.model.parameters()).device
    ids = session.lm.tokenizer(load_document(args.file).text, add_special_tokens=False)["input_ids"]
    reports, profiles = [], []
    for tokens in (int(t) for t in args.tokens.split(",")):
        report, windows, budgets = measure(session, ids, tokens, args, device, parser)
        reports.append(report)
        if args.profile:
            profiles += [profiled(session, windows[0], method, budgets[0], device)
                         for method in ["none"] + args.methods.split(",")]
            Path(args.profile).write_text("\n".join(profiles))
        if args.json:  # after each read length, so a run stopped by a time limit keeps what it measured
            Path(args.json).write_text(json.dumps(reports if len(reports) > 1 else reports[0], indent=1))


def measure(session: Session, ids: list[int], tokens: int, args, device: torch.device, parser):
    """Paired timings at one read length: the report, the windows read and the budgets in tokens."""
    if len(ids) < tokens:
        parser.error(f"the document has {len(ids)} tokens, fewer than --tokens {tokens}")
    step = (len(ids) - tokens) // args.places
    windows = [ids[i * step : i * step + tokens] for i in range(args.places)]
    budgets = [parse_budget(b).resolve(tokens) for b in args.budgets.split(",")]
    probes = args.probe_dtype.split(",")
    methods = [(m, p) for m in args.methods.split(",") for p in probes]
    timed_feed(session, windows[0][:600], "none", None, device)  # warm-up: first-call costs off the timings
    for method, probe in methods:  # (and the probe copy made)
        timed_feed(session, windows[0][:600], method, 64, device, estimate=args.estimate, probe_dtype=probe)

    ratios: dict[tuple[str, int], list[float]] = {(m, b): [] for m in methods for b in budgets}
    full_times: list[float] = []
    for window in windows:
        for _ in range(args.reps):
            for method, probe in methods:
                for budget in budgets:
                    full = timed_feed(session, window, "none", None, device)
                    compressed = timed_feed(session, window, method, budget, device, estimate=args.estimate,
                                            probe_dtype=probe)
                    full_times.append(full)
                    ratios[((method, probe), budget)].append(compressed / full)

    print(f"\n{tokens} tokens, {device} {args.dtype}, torch threads {torch.get_num_threads()}; "
          f"full read median {statistics.median(full_times):.3f} s "
          f"(range {min(full_times):.3f}-{max(full_times):.3f} s)")
    print("\n| method | probes | budget | cost vs full read (median) | mean | range | pairs |")
    print("|---|---|---|---|---|---|---|")
    report = {"tokens": tokens, "device": str(device), "dtype": args.dtype, "full_seconds": full_times,
              "probe_dtype": {p: session.probe_precision(p) for p in probes}, "ratios": {}}
    for ((method, probe), budget), r in ratios.items():
        report["ratios"][f"{method}@{budget}" + (f"@{probe}" if len(probes) > 1 else "")] = r
        print(f"| {method} | {session.probe_precision(probe)} | {budget} ({budget / tokens:.0%}) | "
              f"{statistics.median(r):.2f}× | "
              f"{statistics.mean(r):.2f}× | {min(r):.2f}-{max(r):.2f}× | {len(r)} |")
    return report, windows, budgets


if __name__ == "__main__":
    main()
