"""The true leave-one-out KL, for tests and research only (never on the product's path).

Removes one cached entry, re-runs the probe tokens through the whole model and measures
Σ_t KL(p_t ‖ p_t without the entry). Leave-one-out KLs are 1e-9–1e-7 nats on real models, below float32 noise,
so the oracle runs a float64 copy of the model and cache.
"""

from __future__ import annotations

import copy

import torch

from klevict_cli.adapter_check import adapter_for
from klevict_cli.cache import KVCache, LayerCache
from klevict_cli.engine import Engine, Stream
from klevict_cli.policies import make_policy


def float64_copy(model):
    model64 = copy.deepcopy(model).double()
    if model64._can_set_experts_implementation():  # MoE: the default grouped_mm kernel has no float64 version
        model64.set_experts_implementation("eager")
    return model64


def _without_probes(stream: Stream, probes: int) -> Stream:
    """The stream as it was before the last `probes` tokens (which were appended last to every layer)."""
    layers = []
    for layer in stream.cache.layers:
        keep = layer.capacity - probes
        layers.append(LayerCache(layer.keys[:, :keep].double(), layer.values[:, :keep].double(),
                                 layer.positions[:, :keep].clone(), layer.rope_positions[:, :keep].clone(),
                                 layer.valid[:, :keep].clone(), layer.window))
    return Stream(KVCache(layers), list(stream.tokens[:-probes]), stream.next_rope - probes)


def leave_one_out_kl(model64, stream: Stream, probes: int, entries: list[tuple[int, int, int]]) -> torch.Tensor:
    """KL summed over the last `probes` tokens for removing each (layer, kv_head, column) entry of `stream`'s
    cache (columns index the cache as it stands, probes included). Returns (len(entries),) float64."""
    engine = Engine(model64, adapter_for(model64), make_policy("none"), None, chunk_size=probes)
    ids = stream.tokens[-probes:]
    base = _without_probes(stream, probes)

    def run(s: Stream) -> torch.Tensor:
        logits, _ = engine.forward(s, ids, logits_rows=probes)
        return logits.double().log_softmax(dim=-1)

    reference = run(base.clone())
    out = []
    for layer_idx, head, column in entries:
        trial = base.clone()
        trial.cache.layers[layer_idx].valid[head, column] = False
        logp = run(trial)
        out.append((reference.exp() * (reference - logp)).sum())
    return torch.stack(out)


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Rank correlation of an estimate with the oracle (no ties expected in continuous scores)."""
    ra, rb = a.double().argsort().argsort().double(), b.double().argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))
