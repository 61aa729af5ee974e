"""`random`: a floor for every other policy."""

from __future__ import annotations

import torch

from klevict_cli.policies.base import EvictionStep, Policy


class RandomChoice(Policy):
    """`random`: keep a uniformly random subset (seeded by the engine's generator, so runs repeat)."""

    name = "random"

    def score(self, step: EvictionStep, layer_idx: int) -> torch.Tensor:
        layer = step.cache.layers[layer_idx]
        generator = step.generator if step.generator is not None else torch.Generator().manual_seed(0)
        return torch.rand(layer.valid.shape, generator=generator, device=generator.device).to(layer.valid.device)
