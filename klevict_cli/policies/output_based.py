"""Policies that weigh what an entry adds to the attention output: `value` (attention × ‖W_O v‖) and `caote`.

Both are computed per query head and folded over a GQA group by SUM: an entry serves every query head of its group,
so its total effect is what matters.
"""

from __future__ import annotations

import torch

from klevict_kernels.attention_scores import group_sum
from klevict_kernels.output_rules import output_change, value_weighted_attention
from klevict_cli.policies.base import EvictionStep, Policy


class ValueNorm(Policy):
    """`value` (CriticalKV-style): probe attention times the norm of the value after the output projection."""

    name = "value"
    needs_probes = True

    def score(self, step: EvictionStep, layer_idx: int) -> torch.Tensor:
        layer = step.cache.layers[layer_idx]
        o_weight = step.adapter.output_projection(layer_idx).weight
        per_head = value_weighted_attention(step.probes[layer_idx].weights, layer.values, o_weight)
        return group_sum(per_head, layer.keys.shape[0])


class CAOTE(Policy):
    """`caote` (CAOTE): a/(1−a)·‖o − v_j‖, the exact head-output change of removing entry j."""

    name = "caote"
    needs_probes = True

    def score(self, step: EvictionStep, layer_idx: int) -> torch.Tensor:
        layer = step.cache.layers[layer_idx]
        probe = step.probes[layer_idx]
        return group_sum(output_change(probe.weights, probe.output, layer.values), layer.keys.shape[0])
