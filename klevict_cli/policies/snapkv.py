"""`snapkv` (SnapKV): pooled attention of the last W probe queries, summed over a KV group."""

from __future__ import annotations

import torch

from klevict_kernels.attention_scores import pooled_window_attention
from klevict_cli.policies.base import EvictionStep, Policy


class SnapKV(Policy):
    name = "snapkv"
    needs_probes = True

    def __init__(self, kernel: int = 7):
        self.kernel = kernel

    def score(self, step: EvictionStep, layer_idx: int) -> torch.Tensor:
        layer = step.cache.layers[layer_idx]
        return pooled_window_attention(step.probes[layer_idx].weights, layer.keys.shape[0], self.kernel)

    def params(self) -> dict[str, str]:
        return {"kernel": str(self.kernel)}
