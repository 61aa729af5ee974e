"""Attention-based entry scores beyond SnapKV (TOVA, H2O) and PyramidKV's per-layer budgets."""

from __future__ import annotations

import torch

from kernels.attention_scores import group_sum


def last_query_attention(weights: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """TOVA: the attention the most recent query pays to each entry, summed over the GQA group.
    weights: (Hq, W, C) -> (H_kv, C)."""
    return group_sum(weights[:, -1].float(), kv_heads)


def window_attention(weights: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The attention each entry receives from all probe queries, summed over the window and the GQA group (H2O's
    per-eviction increment). weights: (Hq, W, C) -> (H_kv, C)."""
    return group_sum(weights.float().sum(dim=1), kv_heads)


def pyramid_budgets(budget: int, num_layers: int, floor: int, beta: float = 20.0) -> list[int]:
    """PyramidKV: per-layer budgets decreasing linearly from the lowest layer to the highest, summing to
    `budget * num_layers`. The top layer gets `budget / beta` (never less than `floor`, never more than `budget`),
    the bottom layer `2 * budget - top`; rounding leftovers go to the lowest layers so the sequence stays
    non-increasing."""
    if num_layers <= 1:
        return [budget] * num_layers
    floor = max(1, min(floor, budget))
    top = min(float(budget), max(float(floor), budget / beta))
    bottom = 2 * budget - top
    step = (bottom - top) / (num_layers - 1)
    exact = [bottom - step * i for i in range(num_layers)]
    budgets = [max(floor, int(x)) for x in exact]
    for i in range(budget * num_layers - sum(budgets)):  # fewer than num_layers: one each from the bottom up
        budgets[i] += 1
    return budgets
