"""`expected_attention` (Devoto et al., 2025; kvpress's ExpectedAttentionPress): keep the keys that the queries to
come are expected to attend to, times their value norm (kernels/expected_attention.py).

The query statistics are every pre-RoPE query read so far (the policy observes every forward, after the attention
sinks); the future is the next `future` positions after the eviction. Each layer and head keeps the same count (the
engine keeps the attention sinks, as for every policy).
"""

from __future__ import annotations

import torch

from klevict_kernels.expected_attention import QueryMoments, expected_attention
from klevict_cli.errors import ModelError
from klevict_cli.policies.base import EvictionStep, Policy
from klevict_cli.probes import SINKS


class ExpectedAttention(Policy):
    name = "expected_attention"
    observes = True

    def __init__(self, future: int = 512):
        self.future = future
        self.moments: dict[int, QueryMoments] = {}
        self.scaling = 1.0

    def reset(self) -> None:
        self.moments = {}

    def params(self) -> dict[str, str]:
        return {"future": str(self.future)}

    def observe(self, adapter, layer_idx, layer, query, key, query_positions, scaling, lse) -> None:
        if query.shape[-1] != layer.keys.shape[-1]:
            raise ModelError("expected_attention needs per-head keys; this model caches a compressed latent (MLA):"
                             " choose another --method")
        after_sinks = query_positions >= SINKS
        q = query[:, after_sinks]
        positions = query_positions[after_sinks].expand(q.shape[0], -1)
        moments = self.moments.get(layer_idx)
        if moments is None:
            moments = self.moments[layer_idx] = QueryMoments(q.shape[0], q.shape[-1], q.device)
        moments.add(_rotated(adapter, q, -positions, layer_idx))
        self.scaling = scaling

    def score(self, step: EvictionStep, layer_idx: int) -> torch.Tensor:
        layer = step.cache.layers[layer_idx]
        mean, cov = self.moments[layer_idx].mean_and_covariance()
        dim = layer.keys.shape[-1]
        start = int(step.probe_positions[-1]) + 1
        future = torch.arange(start, start + self.future, device=layer.keys.device)
        basis = torch.eye(dim, device=layer.keys.device)[None].expand(len(future), -1, -1)
        # rotating the rows of I by p gives R_pᵀ; averaged over the future positions
        rotation = _rotated(step.adapter, basis, future[:, None].expand(-1, dim), layer_idx).mean(dim=0).T
        return expected_attention(layer.keys, layer.values, layer.valid, mean, cov, rotation, self.scaling)


def _rotated(adapter, x: torch.Tensor, delta: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """`x` (N, T, D) moved by `delta` (N, T) rotary positions; unchanged for models without RoPE (absolute position
    embeddings: queries and keys are not rotated)."""
    return adapter.rerotate(x, delta, layer_idx) if adapter.can_rerotate else x.float()
