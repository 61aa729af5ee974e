"""`kvzip` (KVzip: Kim et al., 2025, "Query-agnostic KV cache compression with context reconstruction",
arXiv:2505.23416): an entry is worth what the model needs it for when asked to repeat the document.

Every span is re-read once after a repeat instruction (probes.Reconstruction, run by the engine as soon as the span
has been read, so it works while streaming as well as in one shot), and each entry of the span scores the largest
attention any reconstruction query of its KV group pays it, renormalised over the attention sinks, the span and the
reconstruction itself (as the paper does). Scores are comparable across layers and heads (attention
probabilities): one global top-k. The first tokens (attention sinks) are always kept.
"""

from __future__ import annotations

import torch

from kernels.attention_rules import restricted_max_attention
from klevict_cli.policies.base import EvictionStep, Policy, judged_mask

SINKS = 4


class KVzip(Policy):
    name = "kvzip"
    reconstruction = "required"
    allocation = "global"
    EXTRA = "kvzip"

    def absorb_reconstruction(self, step: EvictionStep, layer_ids: list[int]) -> None:
        for i in layer_ids:
            layer = step.cache.layers[i]
            judged = judged_mask(layer, step.judged)
            inside = layer.valid & ((layer.positions < SINKS) | judged | (layer.positions >= step.read_end))
            scores = restricted_max_attention(step.probes[i].weights, inside, judged)
            layer.extras[self.EXTRA] = torch.maximum(layer.extra(self.EXTRA), scores)

    def score(self, step: EvictionStep, layer_idx: int) -> torch.Tensor:
        layer = step.cache.layers[layer_idx]
        return layer.extra(self.EXTRA).masked_fill(layer.valid & (layer.positions < SINKS), float("inf"))
