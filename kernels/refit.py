"""Refitting the kept values after an eviction, so that the probes' head outputs stay what the full cache gave.

Evicting entries from a head's softmax moves every probe's output o_t towards the kept values. Scoring chooses the
entries whose removal moves it least, but at tight budgets most of the mass is removed and the moves add up. The kept
keys decide where queries look; the kept values can be changed freely. So after the choice, the values V_S of the
kept set S are refit, by ridge least squares towards the probes' full-cache outputs:

    o'_t = (Σ_{j∈S} a_tj v'_j + d_t) / Z_t,   Z_t = Σ_{j∈S} a_tj + m_t
    minimise Σ_t ‖o'_t Z_t − o_t Z_t‖² + λ‖V'_S − V_S‖²

where a_tj is probe t's attention to held entry j, d_t and m_t the output and mass of entries outside the held ones
that stay (the probes' own appended tokens). The probes of a KV head's query heads are its rows. With R rows and
|S| unknowns per head, R ≪ |S| at generous budgets, so the solution is computed in row space:
    V'_S = V_S + A_Sᵀ (A_S A_Sᵀ + λI)⁻¹ (O − A_S V_S),   O_t = o_t Z_t − d_t
(one R × R solve per KV head, whatever the budget). Entries no probe attends to are left as they are.

The fit must never make the cache worse than no refit, whatever the budget. Three bounds see to it:
  * λ is `ridge` times the probes' mean Σ_j a_tj² over every *held* entry, not only the kept ones: where the kept
    entries hold little of the probes' attention, a ridge relative to their own Gram matrix would let a few values
    grow without bound to carry the whole output (at 37 entries per head of a 400-token note, values of |v| 304
    against the model's 13.9, and a cache that answered garbage); relative to what was held, the fit is damped there.
  * no refit value is larger in magnitude than the largest value the model produced in that head (over the held
    entries);
  * a head whose probe outputs the (bounded) refit would move further from the full cache's keeps its values.
"""

from __future__ import annotations

import torch


def refit_values(weights: torch.Tensor, outputs: torch.Tensor, values: torch.Tensor, columns: torch.Tensor,
                 present: torch.Tensor, appended: torch.Tensor | None = None, ridge: float = 0.1,
                 held: torch.Tensor | None = None) -> torch.Tensor:
    """Kept values refit to the probes' outputs.

    weights (Hq, W, C): the probes' attention over the C held entries (normalised over everything they saw, which
    may include `appended` entries beyond the C); outputs (Hq, W, Dv): their head outputs; values (H_kv, C, Dv);
    columns (H_kv, n): each head's kept columns, left-aligned and padded, real where `present` (H_kv, n) is true
    (klevict_cli.cache.mask_columns of the keep mask); appended (Hq, W, Dv): the part of `outputs` from the appended
    entries, Σ a v over them (None: nothing appended); held (H_kv, C): the columns that hold entries (None: all),
    whose values bound the refit ones. Returns (H_kv, C, Dv) values, changed only in the kept columns."""
    hq, w, c = weights.shape
    kv = values.shape[0]
    dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
    a = weights.to(dtype).reshape(kv, hq // kv * w, c)  # each KV head's rows: its query heads' probes
    o = outputs.to(dtype).reshape(kv, hq // kv * w, -1)
    outside = 0.0 if appended is None else appended.to(dtype).reshape(kv, hq // kv * w, -1)
    index = columns[..., None].expand(-1, -1, values.shape[-1])
    a_kept = a.gather(2, columns[:, None, :].expand(-1, a.shape[1], -1)) * present[:, None, :].to(dtype)
    v_kept = values.to(dtype).gather(1, index)
    z = a_kept.sum(dim=-1, keepdim=True) + (1.0 - a.sum(dim=-1, keepdim=True))  # appended mass stays
    residual = o * z - outside - a_kept @ v_kept  # (H_kv, R, Dv): what the kept values must add
    gram = a_kept @ a_kept.transpose(1, 2)  # (H_kv, R, R)
    scale = a.square().sum(dim=-1).mean(dim=-1).clamp_min(torch.finfo(dtype).tiny)  # what was held, not kept
    eye = torch.eye(gram.shape[-1], dtype=dtype, device=gram.device)
    # Symmetric positive definite: a Cholesky factor and two triangular solves, none of which checks for errors (a
    # check reads a value back from the device; the ridge keeps the system definite). MKL's batched LU solve failed
    # after some earlier work in a process on the 2-core CI machine ("Parameter 6 was incorrect on entry to SLASWP").
    factor = torch.linalg.cholesky_ex(gram + ridge * scale[:, None, None] * eye).L
    half = torch.linalg.solve_triangular(factor, residual, upper=False)
    delta = a_kept.transpose(1, 2) @ torch.linalg.solve_triangular(factor.transpose(1, 2), half, upper=True)
    mask = torch.ones(values.shape[:2], dtype=torch.bool, device=values.device) if held is None else held
    bound = values.to(dtype).abs().masked_fill(~mask[..., None], 0.0).amax(dim=(1, 2))[:, None, None]
    delta = (v_kept + delta).clamp(-bound, bound) - v_kept
    worse = (residual - a_kept @ delta).square().sum(dim=(1, 2)) > residual.square().sum(dim=(1, 2))
    delta = delta.masked_fill(worse[:, None, None], 0.0)
    # Added, not written: padding repeats column 0, which may also be kept (a write would race with its own); the
    # padding adds nothing.
    delta = delta.masked_fill(~present[..., None], 0.0)
    return values.to(dtype).scatter_add(1, index, delta).to(values.dtype)
