"""`kvzip` (KVzip: Kim et al., 2025, "Query-agnostic KV cache compression with context reconstruction",
arXiv:2505.23416): an entry is worth what the model needs it for when asked to repeat the document.

Every span is re-read once after a repeat instruction (probes.Reconstruction, run by the engine as soon as the span
has been read, so it works while streaming as well as in one shot), and each entry of the span scores the largest
attention any reconstruction query of its KV group pays it, renormalised over the attention sinks, the span and the
reconstruction itself (as the paper does). Scores are comparable across layers and heads (attention
probabilities): one global top-k. The engine keeps the attention sinks, as for every policy.
"""

from __future__ import annotations

import torch

from klevict_kernels.attention_rules import input_times_gradient, restricted_max_attention
from klevict_kernels.output_rules import projected_value_norm
from klevict_cli.policies.base import EvictionStep, Policy, reconstruction_columns, spread, values_at


class KVzip(Policy):
    name = "kvzip"
    reconstruction = "required"
    allocation = "global"
    EXTRA = "kvzip"

    def absorb_reconstruction(self, step: EvictionStep, layer_ids: list[int]) -> None:
        for i in layer_ids:
            layer = step.cache.layers[i]
            columns, inside, judged = reconstruction_columns(step, i)
            scores = spread(layer, columns, self.span_scores(step, i, columns, inside, judged).float())
            layer.extras[self.EXTRA] = torch.maximum(layer.extra(self.EXTRA), scores)

    def span_scores(self, step: EvictionStep, layer_idx: int, columns: torch.Tensor, inside: torch.Tensor,
                    judged: torch.Tensor) -> torch.Tensor:
        """(H_kv, n) scores of the entries at `columns` (0 outside `judged`)."""
        return restricted_max_attention(step.probes[layer_idx].weights, inside, judged)

    def score(self, step: EvictionStep, layer_idx: int) -> torch.Tensor:
        return step.cache.layers[layer_idx].extra(self.EXTRA)


class KVgrad(KVzip):
    """`kvgrad` (KVgrad, OpenReview cg1wTCJjjk; kvpress's KVgradPress): KVzip's reconstruction, but each entry is
    worth the largest input × gradient attribution over the reconstruction's tokens: reconstruction attention ×
    ‖W_O v‖ (what the entry writes into the residual stream) × ‖∂Φ/∂a‖, the gradient of Φ = Σ‖h‖² (the final
    residual stream of the re-read span) with respect to that layer's attention output. One backward pass per span.
    Φ runs over the re-read span only; the instruction before it is held constant."""

    name = "kvgrad"
    EXTRA = "kvgrad"

    def absorb_reconstruction(self, step: EvictionStep, layer_ids: list[int]) -> None:
        self._gradient_norms = step.output_gradient_norms()
        super().absorb_reconstruction(step, layer_ids)

    def span_scores(self, step: EvictionStep, layer_idx: int, columns: torch.Tensor, inside: torch.Tensor,
                    judged: torch.Tensor) -> torch.Tensor:
        probe = step.probes[layer_idx]
        values = values_at(step.cache.layers[layer_idx].values, columns)
        weight = step.adapter.output_projection(layer_idx).weight
        values = projected_value_norm(values, weight, probe.weights.shape[0])
        return input_times_gradient(probe.weights, inside, judged, self._gradient_norms[layer_idx], values)
