"""Policies that need no model statistics."""

from __future__ import annotations

import torch

from klevict_cli.policies.base import EvictionStep, Policy


class FullCache(Policy):
    """`none`: keep everything (the reference every other policy is measured against)."""

    name = "none"
    evicts = False


class Streaming(Policy):
    """`streaming` (StreamingLLM): a few attention sinks at the start plus the most recent entries."""

    name = "streaming"

    def __init__(self, sinks: int = 4):
        self.sinks = sinks

    def score(self, step: EvictionStep, layer_idx: int) -> torch.Tensor:
        positions = step.cache.layers[layer_idx].positions.float()
        return positions.masked_fill(positions < self.sinks, float("inf"))

    def params(self) -> dict[str, str]:
        return {"sinks": str(self.sinks)}
