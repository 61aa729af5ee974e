"""Attention-based entry scores (SnapKV family)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def group_sum(per_query_head: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Fold (Hq, ...) query-head scores into (H_kv, ...) by summing each GQA group: an entry serves all of its
    group's query heads, so its importance is their total."""
    hq = per_query_head.shape[0]
    return per_query_head.reshape(kv_heads, hq // kv_heads, *per_query_head.shape[1:]).sum(dim=1)


def pooled_window_attention(weights: torch.Tensor, kv_heads: int, kernel: int = 7) -> torch.Tensor:
    """SnapKV: attention of the probe queries summed over the window, summed over the GQA group, then max-pooled
    along the cache so neighbours of an important entry survive with it. weights: (Hq, W, C) -> (H_kv, C)."""
    scores = group_sum(weights.sum(dim=1), kv_heads)
    if kernel > 1 and scores.shape[-1] > 1:
        scores = F.max_pool1d(scores[:, None], kernel_size=kernel, stride=1, padding=kernel // 2)[:, 0]
    return scores
