"""Policies that need only the cached keys: `keydiff`, `knorm` (no probes, so the cheapest to run)."""

from __future__ import annotations

import torch

from klevict_kernels.key_rules import key_mean_similarity, key_norm
from klevict_cli.policies.base import EvictionStep, Policy


class KeyDiff(Policy):
    """`keydiff` (KeyDiff): keep the keys least similar (cosine) to their head's mean key."""

    name = "keydiff"

    def score(self, step: EvictionStep, layer_idx: int) -> torch.Tensor:
        layer = step.cache.layers[layer_idx]
        return -key_mean_similarity(layer.keys, layer.valid)


class KNorm(Policy):
    """`knorm` (K-norm): keep the keys with the lowest L2 norm (they tend to draw the most attention)."""

    name = "knorm"

    def score(self, step: EvictionStep, layer_idx: int) -> torch.Tensor:
        return -key_norm(step.cache.layers[layer_idx].keys)
