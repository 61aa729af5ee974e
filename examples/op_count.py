"""Operators launched and host syncs per eviction and per decoded token, counted with torch.profiler on the CPU.

    python examples/op_count.py                         # random Llama-shaped models with 2, 4 and 8 layers
    python examples/op_count.py --layers 4,16 --method kl --json benchmarks/results/op-count.json

On a GPU every operator is at least one kernel launch and every host sync stalls the launch queue, so a step that
launches operators per layer, or reads tensor values back (`.item()`, `.tolist()`, a tensor in an `if`, a
data-dependent shape such as `nonzero`), is slow however little arithmetic it does. Both can be counted on the CPU:
the count is the same, only the cost differs. This script reads the same tokens with models that differ only in
their number of layers and counts, inside each eviction and each decoded token, the top-level aten operators and
the value reads (`aten::_local_scalar_dense`, which `.item()` and truth tests go through, and `aten::nonzero`), and
counts the host reads the profiler cannot see on a CPU (`.tolist()`, `.cpu()`, `.item()`, truth tests: HostReads).
An eviction's model passes (the look-ahead drafts, the re-reading, the calibration's backward pass) are counted
apart: like any forward they launch operators per layer, and what batching across layers can remove is the rest —
scoring, calibration, selection and the cache's update.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import LlamaConfig, LlamaForCausalLM

from klevict_cli.adapter_check import adapter_for
from klevict_cli.attention import ATTENTION_NAME
from klevict_cli.engine import Engine
from klevict_cli.policies import make_policy

SYNCS = ("aten::_local_scalar_dense", "aten::nonzero")
SCOPES = ("eviction", "decode")
MODEL_PASS = "model pass"  # a forward (or forward + backward) of the model inside an eviction
# Tensor methods that hand values to Python or to the host: each is a device-to-host copy on a GPU. On a CPU
# `.tolist()` and `.cpu()` dispatch no operator, so the profiler cannot see them; HostReads counts the calls.
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
_scopes: list[str] = []  # the engine scopes being run, innermost last


class HostReads:
    """Counts, while active, the calls of HOST_READS made inside each innermost scope ("eviction", "model pass"
    inside an eviction, "decode")."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def __enter__(self):
        for name, original in self.originals.items():
            setattr(torch.Tensor, name, self._counting(original))
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(torch.Tensor, name, original)

    def _counting(self, original):
        def read(tensor, *args, **kwargs):
            if _scopes:
                scope = _scopes[-1] if _scopes[-1] != MODEL_PASS or "eviction" in _scopes else None
                if scope is not None:
                    self.counts[scope] += 1
            return original(tensor, *args, **kwargs)

        return read


class scope:
    """A profiler scope that HostReads sees too."""

    def __init__(self, name: str):
        self.name, self.inner = name, record_function(name)

    def __enter__(self):
        _scopes.append(self.name)
        return self.inner.__enter__()

    def __exit__(self, *exc):
        _scopes.pop()
        return self.inner.__exit__(*exc)


def tiny_model(layers: int, seed: int = 0) -> LlamaForCausalLM:
    """A random Llama-shaped model: only the number of layers varies between the models compared."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation(ATTENTION_NAME)
    return model


def counted(engine_cls):
    """Engine methods wrapped in profiler scopes: the evictions of a read and each decoded token."""
    class Counted(engine_cls):
        def forward(self, *args, **kwargs):
            with scope(MODEL_PASS):
                return super().forward(*args, **kwargs)

        def eviction_step(self, *args, **kwargs):
            step = super().eviction_step(*args, **kwargs)
            step.backward = _as_model_pass(step.backward)
            step.output_gradient_norms = _as_model_pass(step.output_gradient_norms)
            return step

        def evict(self, *args, **kwargs):
            with scope("eviction"):
                return super().evict(*args, **kwargs)

        def evict_with(self, *args, **kwargs):
            with scope("eviction"):
                return super().evict_with(*args, **kwargs)

        def reconstruct(self, *args, **kwargs):
            with scope("eviction"):
                return super().reconstruct(*args, **kwargs)

    return Counted


def _as_model_pass(fn):
    def wrapped(*args, **kwargs):
        with scope(MODEL_PASS):
            return fn(*args, **kwargs)

    return wrapped


def count(prof, scope: str, apart: bool = True) -> tuple[Counter, int, int, int]:
    """Inside `scope` (but outside its model passes, if `apart`): the top-level aten operators (not those another
    operator calls) and the value reads (at any depth: `.item()` reaches `_local_scalar_dense` through
    `aten::item`); the top-level operators of its model passes; and how many scopes ran."""
    ops: Counter = Counter()
    syncs = scopes = passes = 0
    for event in prof.events():
        if event.name == scope and _outer_scope(event) is None:
            scopes += 1
        if not event.name.startswith("aten::"):
            continue
        parent, inside, top, in_pass = event.cpu_parent, False, True, False
        while parent is not None:
            if parent.name.startswith("aten::"):
                top = False
            in_pass |= parent.name == MODEL_PASS
            if parent.name == scope:
                inside = True
                break
            parent = parent.cpu_parent
        if inside and in_pass and apart:
            passes += top
        elif inside:
            ops[event.name] += top
            syncs += event.name in SYNCS
    return ops, syncs, passes, scopes


def _outer_scope(event):
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in SCOPES:
            return parent
        parent = parent.cpu_parent
    return None


def measure(layers: int, method: str, tokens: int, budget: int, chunk: int, decode: int) -> dict:
    model = tiny_model(layers)
    policy = make_policy(method)
    engine = counted(Engine)(model, adapter_for(model), policy, budget, chunk_size=chunk, seed=0)
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.feed(engine.new_stream(), ids)  # warm-up: first-call costs (vmap tracing) off the count
    stream = engine.new_stream()
    with profile(activities=[ProfilerActivity.CPU]) as prof, HostReads() as reads:
        engine.feed(stream, ids)
        with scope("decode"):
            for _ in range(decode):
                engine.forward(stream, [1])
    evict_ops, evict_syncs, pass_ops, evictions = count(prof, "eviction")
    decode_ops, decode_syncs, _, _ = count(prof, "decode", apart=False)
    per = max(evictions, 1)
    return {
        "layers": layers, "evictions": evictions,
        "ops_per_eviction": sum(evict_ops.values()) / per,
        "syncs_per_eviction": evict_syncs / per,
        "model_pass_ops_per_eviction": pass_ops / per,
        "host_reads_per_eviction": reads.counts["eviction"] / per,
        "model_pass_host_reads_per_eviction": reads.counts[MODEL_PASS] / per,
        "host_reads_per_token": reads.counts["decode"] / max(decode, 1),
        "ops_per_token": sum(decode_ops.values()) / max(decode, 1),
        "syncs_per_token": decode_syncs / max(decode, 1),
        "top_ops_per_eviction": {k: v / per for k, v in evict_ops.most_common(8)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="2,4,8")
    parser.add_argument("--method", default="kl")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--decode", type=int, default=8, help="decoded tokens counted")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(int(n), args.method, args.tokens, args.budget, args.chunk_size, args.decode)
            for n in args.layers.split(",")]
    print(f"\n{args.method}, {args.tokens} tokens, budget {args.budget}, chunks of {args.chunk_size}; CPU, "
          f"torch {torch.__version__}")
    print("\n| layers | evictions | operators per eviction | value reads per eviction | host reads per eviction "
          "(in its model passes) | its model passes' operators | operators per decoded token | host reads per token |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layers']} | {r['evictions']} | {r['ops_per_eviction']:.0f} | {r['syncs_per_eviction']:.0f} | "
              f"{r['host_reads_per_eviction']:.0f} ({r['model_pass_host_reads_per_eviction']:.0f}) | "
              f"{r['model_pass_ops_per_eviction']:.0f} | {r['ops_per_token']:.0f} | {r['host_reads_per_token']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"method": args.method, "tokens": args.tokens, "budget": args.budget,
                                               "chunk_size": args.chunk_size, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
