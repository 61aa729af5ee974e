"""Attention-based entry scores beyond SnapKV (TOVA, H2O) and PyramidKV's per-layer budgets."""

from __future__ import annotations

import torch

from klevict_kernels.attention_scores import group_sum


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


def attention_column_sums(query: torch.Tensor, key: torch.Tensor, allowed: torch.Tensor, scaling: float,
                          block: int = 128) -> torch.Tensor:
    """The attention every cached entry receives, summed over all queries and the query heads of its group (H2O's
    "observed attention"), computed `block` query rows at a time so the (Hq, T, C) map never exists whole.
    query (Hq, T, D); key (H_kv, C, D); allowed (H_kv, T, C) -> (H_kv, C)."""
    h_kv = key.shape[0]
    groups = query.shape[0] // h_kv
    total = torch.zeros(h_kv, key.shape[1], device=key.device)
    for start in range(0, query.shape[1], block):
        q = query[:, start : start + block].float()
        rows = q.reshape(h_kv, groups * q.shape[1], -1)  # a group's heads as rows of its KV head
        logits = torch.bmm(rows, key.float().transpose(1, 2)).view(h_kv, groups, q.shape[1], -1) * scaling
        logits = logits.masked_fill(~allowed[:, None, start : start + block], float("-inf"))
        total += logits.softmax(dim=-1).nan_to_num(0.0).sum(dim=(1, 2))
    return total


def _restricted(weights: torch.Tensor, inside: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weights (Hq, W, C) as (H_kv, groups × W, C) rows of their KV head, and each row's attention summed over the
    entries `inside` (H_kv, C): (H_kv, groups × W, 1), never 0. One product instead of a masked copy of the rows."""
    h_kv = inside.shape[0]
    rows = weights.float().view(h_kv, -1, weights.shape[-1])
    return rows, torch.bmm(rows, inside.to(rows.dtype)[..., None]).clamp_min(1e-30)


def restricted_attention(weights: torch.Tensor, inside: torch.Tensor | None) -> torch.Tensor:
    """Each probe row's attention renormalised over the entries `inside` (H_kv, C) — for KVzip and KVgrad, the
    attention sinks, the span being reconstructed and the reconstruction itself; None: the rows attended to those
    alone, so the weights are that already. weights (Hq, W, C) -> same."""
    if inside is None:
        return weights.float()
    rows, total = _restricted(weights, inside)
    return (rows * inside[:, None, :] / total).view(weights.shape)


def restricted_max_attention(weights: torch.Tensor, inside: torch.Tensor | None, judged: torch.Tensor
                             ) -> torch.Tensor:
    """KVzip's score: the largest restricted attention (above) any probe row and query head of a group pays each
    `judged` (H_kv, C) entry inside (0 elsewhere). weights (Hq, W, C) -> (H_kv, C)."""
    h_kv = judged.shape[0]
    if inside is None:
        return weights.float().view(h_kv, -1, weights.shape[-1]).amax(dim=1) * judged
    rows, total = _restricted(weights, inside)
    return (rows / total).amax(dim=1) * (judged & inside)


def input_times_gradient(weights: torch.Tensor, inside: torch.Tensor | None, judged: torch.Tensor,
                         gradient_norms: torch.Tensor, value_norms: torch.Tensor) -> torch.Tensor:
    """KVgrad's score: max over probe rows p and the query heads h of a group of A_hpc · ‖W_O^h v_c‖ · ‖∂Φ/∂a_p‖,
    A the restricted attention (above) — what entry c writes into the residual stream at p, times how much the
    objective depends on that stream. weights (Hq, W, C); gradient_norms (W,); value_norms (Hq, C) -> (H_kv, C)."""
    w = restricted_attention(weights, inside)
    per_head = (w * gradient_norms.float()[None, :, None]).amax(dim=1) * value_norms.float()  # (Hq, C)
    return per_head.view(judged.shape[0], -1, per_head.shape[-1]).amax(dim=1) * judged


def copy_attention(query: torch.Tensor, key: torch.Tensor, lse: torch.Tensor, scaling: float,
                   before: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """What a re-reading's copying queries would pay each of T consecutive entries, estimated from the queries that
    read them: re-reading token j, the model looks for its earlier occurrence (entry j) and for what followed it
    (entry j + 1, an induction head's target). Each of those logits is set against everything the query attended
    to when it was read — exp(s) / (exp(s) + exp(lse)), the attention it would pay the entry if that were added —
    and an entry keeps the larger of the two, over the query heads of its group.
    query (Hq, T, D) the tokens' queries, moved to where a re-reading would ask them; key (H_kv, T, D) their keys;
    lse (Hq, T); `before`: the query (Hq, D) and lse (Hq,) of the token before the first, when known.
    Returns (H_kv, T)."""
    h_kv, t = key.shape[:2]
    q = query.float().view(h_kv, -1, t, query.shape[-1])  # (H_kv, groups, T, D)
    k, lse = key.float()[:, None], lse.float().view(q.shape[:3])
    own = torch.sigmoid((q * k).sum(-1) * scaling - lse)
    following = torch.zeros_like(own)
    following[..., 1:] = torch.sigmoid((q[:, :, :-1] * k[:, :, 1:]).sum(-1) * scaling - lse[..., :-1])
    if before is not None:
        prev_q, prev_lse = before[0].float().view(q.shape[:2] + q.shape[3:]), before[1].float().view(q.shape[:2])
        following[..., 0] = torch.sigmoid((prev_q * k[:, :, 0]).sum(-1) * scaling - prev_lse)
    return torch.maximum(own, following).amax(dim=1)
