"""Policies that rank entries by the attention queries pay them: `pyramidkv`, `h2o`, `tova`, `observed_attention`.

Per-query-head attention is folded over a GQA group by SUM: an entry serves every query head of its group, so its
total use is what matters. The most recent tokens (the probe window) are always kept by the engine, which gives
H2O and TOVA their "recent" part.
"""

from __future__ import annotations

import torch

from klevict_kernels.attention_rules import attention_column_sums, last_query_attention, pyramid_budgets, window_attention
from klevict_cli.attention import attention_mask
from klevict_cli.policies.base import EvictionStep, Policy
from klevict_cli.policies.snapkv import SnapKV


class PyramidKV(SnapKV):
    """`pyramidkv` (PyramidKV): SnapKV scores with budgets decreasing linearly from lower to upper layers."""

    name = "pyramidkv"

    def __init__(self, kernel: int = 7, beta: float = 20.0):
        super().__init__(kernel)
        self.beta = beta

    def layer_budgets(self, budget: int, num_layers: int, floor: int) -> list[int]:
        return pyramid_budgets(budget, num_layers, floor, self.beta)

    def params(self) -> dict[str, str]:
        return {**super().params(), "beta": str(self.beta)}


class H2O(Policy):
    """`h2o` (Heavy-Hitter Oracle): the probes' attention accumulated over every eviction so far."""

    name = "h2o"
    needs_probes = True
    EXTRA = "h2o_attention"

    def score(self, step: EvictionStep, layer_idx: int) -> torch.Tensor:
        layer = step.cache.layers[layer_idx]
        total = layer.extra(self.EXTRA) + window_attention(step.probes[layer_idx].weights, layer.keys.shape[0])
        layer.extras[self.EXTRA] = total  # scored once per eviction; the running sum travels with its entries
        return total


class TOVA(Policy):
    """`tova` (TOVA): the attention of the most recent query only."""

    name = "tova"
    needs_probes = True

    def score(self, step: EvictionStep, layer_idx: int) -> torch.Tensor:
        layer = step.cache.layers[layer_idx]
        return last_query_attention(step.probes[layer_idx].weights, layer.keys.shape[0])


class ObservedAttention(Policy):
    """`observed_attention` (H2O's accumulated attention, Zhang et al., 2023, arXiv:2306.14048, as kvpress's
    ObservedAttentionPress computes it): the attention each entry received from every query read after it, divided
    by how many queries that was. Unlike `h2o` (the probe rows at each eviction), it sees every query of the read."""

    name = "observed_attention"
    observes = True
    EXTRA = "observed_attention"

    def observe(self, adapter, layer_idx, layer, query, key, query_positions, scaling, lse) -> None:
        allowed = attention_mask(layer, query_positions)
        if key.shape[0] != layer.keys.shape[0]:  # MLA: keys expanded per query head over one cached latent
            sums = attention_column_sums(query, key, allowed.expand(key.shape[0], -1, -1), scaling)
            sums = sums.sum(dim=0, keepdim=True)
        else:
            sums = attention_column_sums(query, key, allowed, scaling)
        layer.extras[self.EXTRA] = layer.extra(self.EXTRA) + sums

    def score(self, step: EvictionStep, layer_idx: int) -> torch.Tensor:
        layer = step.cache.layers[layer_idx]
        queries_after = (int(step.probe_positions[-1]) + 1 - layer.positions).clamp_min(1)
        return layer.extra(self.EXTRA) / queries_after
