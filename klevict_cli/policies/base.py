"""The one policy interface, and the selection every policy shares.

A policy scores each cached entry of a layer (higher = more worth keeping); `select_keep` turns scores into a
keep-set within the budget. Policies never touch the cache or the model: the engine owns both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from klevict_cli.adapters import ModelAdapter
from klevict_cli.attention import LayerProbe
from klevict_cli.cache import KVCache, LayerCache


@dataclass
class EvictionStep:
    """What a policy may read at one eviction point."""

    cache: KVCache
    adapter: ModelAdapter
    probes: dict[int, LayerProbe]  # per layer, present when the policy asked for them
    probe_positions: torch.Tensor  # (W,) original positions of the probe tokens
    residuals: torch.Tensor | None = None  # (W, d_model) final residual stream at the probes
    logits: torch.Tensor | None = None  # (W, vocab) at the probes
    generator: torch.Generator | None = None


class Policy:
    name: str = "policy"
    needs_probes: bool = False  # record queries / attention / head outputs at the probe rows
    evicts: bool = True

    def score(self, step: EvictionStep, layer_idx: int) -> torch.Tensor:
        """(H_kv, C) float scores for one layer's entries; padding is ignored by the caller."""
        raise NotImplementedError

    def params(self) -> dict[str, str]:
        """Parameters worth recording in a `.kvc` file's metadata."""
        return {}


def select_keep(layer: LayerCache, scores: torch.Tensor, budget: int, protect: torch.Tensor) -> torch.Tensor:
    """Keep the `budget` best-scoring valid entries of every head, always including protected ones (the most
    recent probe tokens). Returns an (H, C) bool mask."""
    scores = scores.float().masked_fill(protect & layer.valid, float("inf"))
    scores = scores.masked_fill(~layer.valid, float("-inf"))
    k = min(budget, layer.capacity)
    top = scores.topk(k, dim=1).indices
    mask = torch.zeros_like(layer.valid)
    mask.scatter_(1, top, True)
    return mask & layer.valid
