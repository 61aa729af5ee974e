"""Expected attention (Devoto et al., 2025, "Expected Attention: KV cache compression by estimating attention from
future queries distribution"; NVIDIA kvpress's ExpectedAttentionPress): the attention that future queries are
expected to pay each cached key, from the statistics of the queries seen so far.

With pre-RoPE queries q ~ N(μ, Σ) and the rotation R that the next positions will apply (averaged over them), the
expected unnormalised attention to a post-RoPE key k is E[exp(qᵀRᵀk·s)] = exp(s·kᵀRμ + s²/2·kᵀRΣRᵀk), s the
attention scale. Scores are its softmax over the cache times ‖v‖.
"""

from __future__ import annotations

import torch


class QueryMoments:
    """Running count, sum and sum of outer products of one layer's pre-RoPE queries, per query head."""

    def __init__(self, heads: int, dim: int, device):
        self.count = 0
        self.sum = torch.zeros(heads, dim, dtype=torch.float64, device=device)
        self.outer = torch.zeros(heads, dim, dim, dtype=torch.float64, device=device)

    def add(self, queries: torch.Tensor) -> None:
        """queries (Hq, T, D)."""
        q = queries.double()
        self.count += q.shape[1]
        self.sum += q.sum(dim=1)
        self.outer += q.transpose(1, 2) @ q

    def mean_and_covariance(self) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.sum / max(self.count, 1)
        cov = self.outer / max(self.count, 1) - mean[:, :, None] * mean[:, None, :]
        return mean.float(), cov.float()


def expected_attention(keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, mean: torch.Tensor,
                       cov: torch.Tensor, rotation: torch.Tensor, scaling: float) -> torch.Tensor:
    """keys (H_kv, C, D) post-RoPE, values (H_kv, C, Dv), valid (H_kv, C); mean (Hq, D), cov (Hq, D, D) of the
    pre-RoPE queries; rotation (D, D) the average future RoPE rotation (q_rotated = rotation @ q). Returns (H_kv, C):
    the expected attention averaged over each group's query heads, times the value norm."""
    h_kv = keys.shape[0]
    groups = mean.shape[0] // h_kv
    mu = mean @ rotation.T  # (Hq, D)
    sigma = rotation @ cov @ rotation.T  # (Hq, D, D)
    k = keys.float().repeat_interleave(groups, dim=0)  # (Hq, C, D)
    logits = scaling * torch.einsum("hcd,hd->hc", k, mu)
    logits = logits + 0.5 * scaling**2 * torch.einsum("hcd,hde,hce->hc", k, sigma, k)
    logits = logits.masked_fill(~valid.repeat_interleave(groups, dim=0), float("-inf"))
    probs = logits.softmax(dim=-1).view(h_kv, groups, -1).mean(dim=1)
    return probs * values.float().norm(dim=-1)
