"""The KL estimator's math (DESIGN §3), vectorised over heads, probes and cache entries.

Removing cached entry j from head h's softmax changes that head's output at probe t by exactly
    Δo_thj = a/(1-a) · (o_th - v_j)                                   (a = a_thj, the attention weight)
The next-token distribution at t then moves by KL ≈ ½ Δoᵀ G_t Δo for a metric G_t on the head outputs. Both
propagations factor G_t = Σ_r e_tr e_trᵀ with a few "readout" vectors e_tr per probe and query head:
  * direct: e = rows of √F_t·U_k·J_norm(x_t) mapped through W_O (final-norm Jacobian + unembedding, top-k tokens);
  * fisher: e = ∂ log p_t(y)/∂o for sampled labels y (a backward pass through all later layers), divided by √S.
So the score of j (summed over probes, query heads of its KV group folded *before* squaring) is
    score_j = ½ Σ_t Σ_r ( Σ_{h∈g} a/(1-a) · e_trh·(o_th - v_j) )²
which needs e·o (cheap) and e·v_j — one batched matmul per layer, never a (probes × entries × dim) tensor.
When one readout reaches several probes' logits (the Fisher path with live probes: a gradient at o_t carries the
effect on every later probe), removing j moves all probes' outputs at once and the probes are summed inside the
square instead: score_j = ½ Σ_r ( Σ_t Σ_{h∈g} a/(1-a) · e_trh·(o_th - v_j) )².
"""

from __future__ import annotations

import torch


class ReferenceDistributions:
    """Next-token distributions (M, V) that others are measured against, prepared once: the drift of every cache
    a `--max-kl` search tries is measured against the same ones. KL(p ‖ q) = log Σ_v p_v e^(d_v) − Σ_v p_v d_v with
    d = z_q − z_p, the change of the logits: both terms are formed from that change, which is small where the
    distributions are close, so float32 passes hold the KL to about 1e-6 nats (the reference's log-probabilities
    are normalised in float64 first) where subtracting two log-softmaxes needed float64 — 4x faster over 64 rows of
    a 262,144-token vocabulary on a CPU."""

    def __init__(self, logits: torch.Tensor, log_probs: torch.Tensor | None = None):
        """`log_probs`: the rows' float32 log-probabilities where the caller has normalised them already
        (SupportedReference), else normalised here in float64."""
        self.logits = logits.float()
        self.log_probs = logits.double().log_softmax(dim=-1).float() if log_probs is None else log_probs
        self.top = self.log_probs.argmax(dim=-1, keepdim=True)  # each row's likeliest token
        self.probs = self.log_probs.exp()  # within an ulp or two of float64's: only the normalisation needs it
        # what the float32 log-probabilities' own sum misses of 1 (the change's sum is taken the same way): a
        # distribution measured against itself is 0 exactly
        self.log_total = _logsumexp_(self.log_probs.clone())

    def kl(self, logits: torch.Tensor) -> torch.Tensor:
        """Per row, KL(p_reference ‖ p) in nats of the distributions `logits` (M, V) give (float64 numbers, good to
        about 1e-6 nats: below ~1e-5 a row's KL is mostly rounding)."""
        return self.kl_of_change(logits.float() - self.logits)

    def kl_of_change(self, change: torch.Tensor) -> torch.Tensor:
        """The same, from the logits' change alone (M, V): where only the change is computed (Engine.measure_drift)."""
        # measured from the likeliest token's change: a shift of every logit moves no probability, and left in it
        # would cost float32 digits
        change = change.float()
        change = change - change.gather(-1, self.top)
        mean_change = torch.linalg.vecdot(self.probs, change)
        moved = _logsumexp_(change.add_(self.log_probs)) - self.log_total - mean_change
        return moved.double().clamp(min=0)


class SupportedReference:
    """Reference distributions (M, V) for logits that a linear output head makes from its inputs, whose change is
    computed on a shared support of tokens only — the union of each row's `keep` likeliest — with the rest of each
    row's mass taken as one bucket. With a linear head the change of the logits is d = W·Δh for a change Δh of the
    head's inputs, so over the support it is the head's rows there times Δh, and the bucket's mean change is exactly
    Δh·μ, μ the mean of its tokens' head rows weighted by their probability (`rest_direction`). Only how the change
    spreads inside the bucket is unknown: taking it all at its mean (Jensen) lowers log Σ p·e^d by about the
    bucket's mass times half the change's variance inside it, so the KL comes out a hair low where the support holds
    nearly all of each row's mass. Over a 262,144-token vocabulary each cache measured then costs the head and the
    KL over the support instead of every token (Engine.measure_drift)."""

    def __init__(self, logits: torch.Tensor, keep: int, weight: torch.Tensor):
        # float32 passes over the whole vocabulary, each normaliser summed in float64: (M, V) float64 copies, and
        # (M, S) ones, were most of the cost (Gemma-3-270M: 1.2-2.2 s for a drift's 255 rows, then 0.7-0.9 s)
        logits = logits.float()
        likeliest = logits.topk(min(keep, logits.shape[-1]), dim=-1)
        self.support = likeliest.indices.flatten().unique()  # sorted ids
        top = likeliest.values[:, :1]  # each row's largest logit
        scaled = (logits - top).exp_()  # the unnormalised probabilities, each row's likeliest at 1
        total = scaled.sum(dim=-1).double()  # float32's pairwise sums: good to about 1e-7
        self.weight = weight[self.support]  # (S, d): the head's rows over the support
        scaled[:, self.support] = 0  # now the rest alone: its mass summed, not 1 less the support's (0 where none)
        left = scaled.sum(dim=-1)
        rest = left.double() / total  # each row's mass outside the support
        self.rest = rest.float()
        # the support's log-probabilities and the rest as one more token's (log -inf where the support holds it
        # all), each within an ulp or two of the float64 value (z - top is exact to half an ulp), measured as
        # ReferenceDistributions measures every change
        log_probs = torch.cat((logits[:, self.support].sub_(top), rest.log().float()[:, None]), dim=-1)
        log_probs[:, :-1] -= total.log().float()[:, None]
        self.bucketed = ReferenceDistributions(log_probs, log_probs=log_probs)
        # the rest's head rows weighted by probability
        self.rest_direction = (scaled.to(weight.dtype) @ weight).float() / left.clamp(min=1e-30)[:, None]  # (M, d)

    def kl_of_head_change(self, change: torch.Tensor) -> torch.Tensor:
        """Per row, KL(p_reference ‖ p) for the logits the head makes from its inputs moved by `change` (M, d): the
        change over the support, and the rest's mean change as one more token's."""
        support_change = torch.nn.functional.linear(change.to(self.weight.dtype), self.weight).float()  # (M, S)
        rest_change = torch.linalg.vecdot(change.float(), self.rest_direction)
        return self.bucketed.kl_of_change(torch.cat((support_change, rest_change[:, None]), dim=-1))


def _logsumexp_(x: torch.Tensor) -> torch.Tensor:
    """log Σ exp over the last dimension, consuming `x` (its passes in place: over a large vocabulary the KL above
    is a few passes over memory, and each temporary is one more)."""
    top = x.amax(dim=-1, keepdim=True)
    return x.sub_(top).exp_().sum(dim=-1).log() + top[..., 0]


def token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per row, KL(p_reference ‖ p) in nats (to about 1e-6): how far `logits` (M, V) moved from `reference_logits`."""
    return ReferenceDistributions(reference_logits).kl(logits)


def removal_coefficients(weights: torch.Tensor, clamp: float = 1e-6) -> torch.Tensor:
    """a/(1-a): how strongly removing an entry moves the head output towards the others. (Hq, W, C)"""
    return weights / (1.0 - weights).clamp_min(clamp)


def kl_scores(
    weights: torch.Tensor, outputs: torch.Tensor, values: torch.Tensor, readout: torch.Tensor, kv_heads: int,
    clamp: float = 1e-6, fold_probes: bool = False, block_bytes: int | None = None,
) -> torch.Tensor:
    """Estimated KL (nats) of removing each cached entry, summed over probes.

    weights (Hq, W, C) attention of the probe rows; outputs (Hq, W, Dv) head outputs; values (H_kv, C, Dv), or
    already per query head (Hq, C, Dv) (MLA: one cached entry expands to a different value for every head);
    readout (W, R, Hq, Dv) metric factors in head-output space; `fold_probes`: sum the probes before squaring (see
    above). Returns (H_kv, C), in float32 or wider.
    The products run at readout's dtype and the rest in float32 at least: with bfloat16 readouts (the probes'
    precision, `--probe-dtype`) the scores of a 300-token read were within 0.3 % of float32's (median; Spearman
    0.999998), the product 3-6x faster on a CPU with bfloat16 arithmetic; the terms of entries holding most of a row's
    attention are formed in float32 all the same (sole_terms).
    One batched matmul gives e·(o - v_j) directly — e is extended by e·o and v_j by -1 — into a (Hq, W, R, C)
    work tensor that is then updated in place. With `block_bytes`, the entries are taken in blocks whose work
    tensor stays within that many bytes: on a CPU the work tensor is far larger than the caches, and streaming it
    through memory, not the arithmetic, is the cost (blocks of 1-2 MB halved the time on a 2-core EPYC for 128
    probes and 4,096 entries). None: one block (a GPU, where fewer launches matter more).
    """
    hq, w, c = weights.shape
    r = readout.shape[1]
    dtype = readout.dtype
    e = readout.permute(2, 0, 1, 3)  # (Hq, W, R, Dv)
    e_o = torch.einsum("hwrd,hwd->hwr", e, outputs.to(dtype))  # (Hq, W, R)
    # Grouped so that each KV head's values are used once (no repeat over the group).
    value_heads = values.shape[0]  # H_kv, or Hq when the values are already per query head
    e_ext = torch.cat((e, e_o[..., None]), dim=-1).reshape(value_heads, hq // value_heads * w * r, -1)
    v_ext = torch.cat((-values.to(dtype).transpose(1, 2), values.new_ones(value_heads, 1, c, dtype=dtype)), dim=1)
    block = c if block_bytes is None else max(1, block_bytes // (hq * w * r * work_bytes(dtype)))
    starts = range(0, c, block)
    sole = sole_terms(weights, e, outputs, values, starts) if dtype.itemsize < 4 else [None] * len(starts)
    blocks = [_block_scores(e_ext, v_ext[..., lo : lo + block], weights[..., lo : lo + block], kv_heads, clamp,
                            fold_probes, terms) for lo, terms in zip(starts, sole)]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-1)


def work_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of kl_scores' work tensor for products at `dtype`: the product's output and, below float32,
    the float32 copy the rest is computed on (both live at once)."""
    work = torch.promote_types(dtype, torch.float32)
    return work.itemsize + (dtype.itemsize if work != dtype else 0)


def _block_scores(e_ext: torch.Tensor, v_ext: torch.Tensor, weights: torch.Tensor, kv_heads: int, clamp: float,
                  fold_probes: bool, sole: tuple | None = None) -> torch.Tensor:
    """kl_scores of the entries of `v_ext` (value heads, Dv + 1, n), whose attention weights are `weights`; `sole`
    (head, probe, entry within the block, terms), their near-sole terms (sole_terms), replace the product's."""
    hq, w, n = weights.shape
    work = torch.promote_types(e_ext.dtype, torch.float32)
    y = torch.bmm(e_ext, v_ext).view(hq, w, -1, n).to(work)  # e·(o - v_j): (Hq, W, R, n)
    if sole is not None:
        h, t, j, terms = sole
        y[h, t, :, j] = terms
    y.mul_(removal_coefficients(weights.to(work), clamp)[:, :, None, :])  # × a/(1-a)
    y = y.view(kv_heads, hq // kv_heads, w, -1, n).sum(dim=1) if hq > kv_heads else y  # fold the group first
    if fold_probes:
        return 0.5 * y.sum(dim=1).square_().sum(dim=1)
    return 0.5 * y.square_().sum(dim=(1, 2))


SOLE_ABOVE = 0.5  # an entry with more of a row's attention than this is "near-sole" (at most one per row)


def sole_terms(weights: torch.Tensor, e: torch.Tensor, outputs: torch.Tensor, values: torch.Tensor,
               starts: range) -> list[tuple]:
    """The terms e·(o - v_j), formed in float32, of the entries holding more than half a row's attention; per block
    of entries beginning at `starts`, as (head, probe, entry within the block, terms (k, R)). For such an entry o is
    close to v_j, so e·o - e·v_j is a small difference of two large products, and a/(1-a) (up to 1/clamp) then
    multiplies what is left of it: with products rounded to bfloat16 (2^-9 relative) a sink's score came out up to
    700x float32's on a 3,600-token read. Forming o - v_j first in float32 keeps the difference exact. At most one
    entry per row qualifies: one small product per row, found once per call rather than per block (one host sync
    for every block's bounds, none beyond `nonzero`'s for a single block)."""
    largest, entry = weights.max(dim=-1)  # (Hq, W): cheaper than finding them among every weight
    h, t = (largest > SOLE_ABOVE).nonzero(as_tuple=True)
    j, order = entry[h, t].sort()
    h, t = h[order], t[order]
    group = weights.shape[0] // values.shape[0]
    difference = outputs[h, t].float() - values[h // group, j].float()  # (k, Dv)
    terms = torch.einsum("krd,kd->kr", e[h, t].float(), difference)
    if len(starts) == 1:
        return [(h, t, j, terms)]
    bounds = torch.searchsorted(j, torch.tensor([*starts, starts.stop], device=j.device)).tolist()
    return [(h[a:b], t[a:b], j[a:b] - lo, terms[a:b]) for lo, a, b in zip(starts, bounds, bounds[1:])]


def direct_readout(
    residuals: torch.Tensor, logits: torch.Tensor, final_norm: torch.nn.Module, unembedding: torch.Tensor,
    top_k: int = 64, rank: int = 8, jacobian_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-probe factors of the direct-path metric on the final residual stream. Returns (W, rank, d).

    With p the probe's next-token distribution restricted to its top-k tokens, the second-order KL of a logit change
    δz is ½ Var_p(δz) = ½ ‖diag(√p)(I - 1pᵀ) δz‖²; δz = U_k J δr. With R = diag(√p)(I - 1pᵀ) U_k J (k × d), the
    metric is RᵀR; its top `rank` directions are u_iᵀR for the top eigenvectors u_i of the small k × k Gram matrix
    RRᵀ (cheaper and steadier than an SVD of R). The rest is negligible because p is concentrated.
    `jacobian_scale` (W, vocab): when the final logits are a function of the unembedding's output (Gemma's
    soft-capping cap·tanh(z/cap)), d(logit)/d(raw logit) per token (ModelAdapter.logit_jacobian_scale); it scales
    the unembedding rows. None: the logits are the unembedding's output.
    """
    p_full = logits.float().softmax(dim=-1)
    p, top = p_full.topk(min(top_k, p_full.shape[-1]), dim=-1)  # (W, k)
    u = unembedding.float()[top]  # (W, k, d)
    if jacobian_scale is not None:
        u = u * jacobian_scale.float().gather(1, top)[..., None]
    centred = u - torch.einsum("wk,wkd->wd", p, u)[:, None, :]  # (I - 1pᵀ) U_k
    r_mat = p.sqrt()[..., None] * through_norm(final_norm, residuals, centred)  # (W, k, d)
    gram = torch.bmm(r_mat, r_mat.transpose(1, 2)).double()  # (W, k, k)
    top_vectors = top_eigenvectors(gram, min(rank, gram.shape[-1])).to(r_mat)  # (W, k, rank)
    return torch.bmm(top_vectors.transpose(1, 2), r_mat)  # (W, rank, d): rows σ_i v_iᵀ


def top_eigenvectors(gram: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` leading eigenvectors of each symmetric matrix in `gram` (B, k, k), largest first: (B, k, count).

    On a GPU the solve runs on the CPU: cuSOLVER batches eigenproblems only up to 32 × 32 and solves larger ones
    one matrix at a time, dozens of small launches each (measured on an H200: 117 ms per eviction for 56 probes'
    64 × 64 matrices, more than the look-ahead drafts), where the CPU's LAPACK takes a few milliseconds. The copy
    back is one host sync per eviction, and the eigenvectors are the ones the CPU path computes."""
    solve_on = gram.device if gram.device.type == "cpu" else torch.device("cpu")
    _, vectors = torch.linalg.eigh(gram.to(solve_on))  # ascending eigenvalues
    return vectors[..., -count:].flip(-1).to(gram.device, non_blocking=True)


def to_head_space(factors: torch.Tensor, o_proj_weight: torch.Tensor, query_heads: int) -> torch.Tensor:
    """Map residual-space factors (W, R, d) through a layer's output projection W_O (d, Hq·Dv): (W, R, Hq, Dv).
    With the W_O of L layers stacked (L, d, Hq·Dv), one product for all of them: (W, R, L·Hq, Dv), the layers as
    extra heads."""
    w, r, _ = factors.shape
    e = factors.reshape(w * r, -1) @ o_proj_weight.to(factors.dtype)
    if o_proj_weight.dim() == 2:
        return e.view(w, r, query_heads, -1)
    layers = o_proj_weight.shape[0]
    return e.view(layers, w, r, query_heads, -1).permute(1, 2, 0, 3, 4).reshape(w, r, layers * query_heads, -1)


def through_norm(norm: torch.nn.Module, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """rows (W, k, d) times the Jacobian of the final norm at each probe's residual x (W, d): (W, k, d).

    One vector-Jacobian product per row (k of them) instead of the full d × d Jacobian (d forward-mode passes);
    works for whatever the module computes (RMSNorm, Gemma's (1+γ) RMSNorm, LayerNorm)."""
    dtype = next(norm.parameters()).dtype

    def f(row: torch.Tensor) -> torch.Tensor:
        return norm(row[None, None].to(dtype))[0, 0].float()

    def one_probe(x_w: torch.Tensor, rows_w: torch.Tensor) -> torch.Tensor:
        _, pull_back = torch.func.vjp(f, x_w)
        return torch.func.vmap(pull_back)(rows_w)[0]

    with torch.inference_mode(False):
        return torch.func.vmap(one_probe)(x.detach().float().clone(), rows.detach().clone()).detach()
