"""Scores from the cached keys alone (no queries needed): KeyDiff and K-norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def key_norm(keys: torch.Tensor) -> torch.Tensor:
    """L2 norm of every cached key. keys: (H, C, D) -> (H, C)."""
    return keys.float().norm(dim=-1)


def key_mean_similarity(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """KeyDiff: cosine similarity of every key to the mean of its head's valid keys. keys: (H, C, D), valid: (H, C)
    -> (H, C); keys most like the mean are the most redundant."""
    k = keys.float() * valid[..., None]
    mean = k.sum(dim=1, keepdim=True) / valid.sum(dim=1).clamp(min=1)[:, None, None]
    return F.cosine_similarity(keys.float(), mean.expand_as(k), dim=-1, eps=1e-8)
