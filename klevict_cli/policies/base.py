"""The one policy interface, and the selection every policy shares.

A policy scores each cached entry of a layer (higher = more worth keeping); `select_keep` turns scores into a
keep-set within the budget. Policies never touch the cache or the model: the engine owns both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from klevict_cli.adapters import ModelAdapter
from klevict_cli.attention import LayerProbe
from klevict_cli.cache import KVCache, LayerCache, LayerStack
from klevict_cli.probes import SINKS


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
    final: bool = False  # the last eviction of a read: what remains is what questions will see
    judged: tuple[int, int] | None = None  # only entries at positions [lo, hi) are judged (reconstruction probes)
    # the reconstruction probes attended to the sinks, the span and themselves alone: their weights are KVzip's
    # restricted softmax already (and were recorded over the span only)
    restricted: bool = False
    read_end: int | None = None  # the tokens read: entries from this position on are appended probes (drafts, a re-reading)
    kept_fraction: float | None = None  # the budget over the tokens read so far (how much of the document survives)
    budget: int | None = None  # entries per head (on average) the eviction keeps
    # The engine keeps, whatever the scores, the first `sinks` entries and those at the `recent` positions (the last
    # tokens read): part of the budget the policy's choice does not decide (Engine._keep_best)
    sinks: int = 0
    recent: range = range(0)
    # the precision of the scoring's large products: the probe copy's dtype where the probes run on one
    # (`--probe-dtype`), float32 otherwise, whatever the model's own dtype
    score_dtype: torch.dtype = torch.float32
    # (S samples, live probes[, the last R probes only]) -> per layer (W or R, S, Hq, Dv) gradients (fisher.py)
    backward: Callable[..., dict[int, torch.Tensor]] | None = None
    # () -> per layer (W,) ‖∂Φ/∂a‖, KVgrad's sensitivity of the probes' final residuals (klevict_cli/fisher.py)
    output_gradient_norms: Callable[[], dict[int, torch.Tensor]] | None = None

    def kept_anyway(self, layer: LayerCache) -> torch.Tensor:
        """(H, C) bool: the valid entries of `layer` the engine keeps whatever the scores (the sinks, the recent
        window)."""
        return layer.valid & in_floor(layer.positions, self.sinks, self.recent)

    @property
    def chosen_per_head(self) -> int | None:
        """Entries per head (on average) the policy's scores choose: the budget less what is kept anyway."""
        return None if self.budget is None else max(0, self.budget - self.sinks - len(self.recent))

    def last_probes(self, rows: int) -> EvictionStep:
        """This step judged by its last `rows` probes only (all of them if it has no more): a cheaper sample of the
        same probes, for what needs a sample and not every probe (kl's calibration)."""
        if rows >= len(self.probe_positions):
            return self
        backward = self.backward
        return replace(self._probe_rows(slice(-rows, None)),
                       backward=lambda samples, live: backward(samples, live, rows))

    def split_probes(self, rows: int) -> tuple[EvictionStep | None, EvictionStep]:
        """(the step judged by all but its last `rows` probes, or None if there are no others; `last_probes(rows)`).
        A score summed over probes is the sum of the two halves' scores, so a sample of the last probes can be
        scored once and serve both the whole and what needs the sample."""
        if rows >= len(self.probe_positions):
            return None, self
        return replace(self._probe_rows(slice(None, -rows)), backward=None), self.last_probes(rows)

    def _probe_rows(self, rows: slice) -> EvictionStep:
        probes = {i: replace(p, query=p.query[:, rows], weights=p.weights[:, rows], output=p.output[:, rows])
                  for i, p in self.probes.items()}
        return replace(self, probes=probes, probe_positions=self.probe_positions[rows],
                       residuals=None if self.residuals is None else self.residuals[rows],
                       logits=None if self.logits is None else self.logits[rows], output_gradient_norms=None)


class Policy:
    name: str = "policy"
    needs_probes: bool = False  # record queries / attention / head outputs at the probe rows
    evicts: bool = True
    allocation: str = "uniform"  # "uniform": every head keeps `budget`; "global": one top-k over all layers/heads
    lookahead: int = 0  # probe the read's last eviction with this many tokens sampled past its end (probes.Drafts)
    drafts_from_read: bool = True  # the read's own predictions stand in for their first round (probes.Drafts)
    variant: bool = False  # a variant of another method (e.g. kl-fisher): benched only when named
    # Reconstruction probes (probes.Reconstruction): "never" used, "optional" (used when the caller asks, e.g.
    # `compress` with kl), or "required" (kvzip, kvgrad: the method is defined by them).
    reconstruction: str = "never"
    # How the re-reading runs: spans of this many tokens, each seeing the whole cache ("all", as KVzip re-reads) or
    # only the attention sinks and the span it copies ("span": cheaper, and judges the span's entries on their own)
    reconstruction_span: int = 128
    reconstruction_sees: str = "all"
    # Refit the kept values to the probes' full-cache head outputs (kernels/refit.py): "never", at the read's
    # "final" eviction, or at "always" every eviction; `refit_ridge` is the ridge's strength
    refit: str = "never"
    refit_ridge: float = 0.1
    # sees every query of every forward that reads (`observe`) — the document, a question, an answer — not only the
    # probe rows; never the probes appended and forgotten (drafts, a re-reading)
    observes: bool = False

    def observes_read(self, reread: bool) -> bool:
        """Whether to `observe` a read (`observes`), given that the document is also re-read (`reread`): a policy
        whose observation stands in for a re-reading need not pay for it when there is one."""
        return self.observes

    def draft_rounds(self, reread: bool, read: int, count: int) -> int:
        """The Jacobi rounds (probes.Drafts) of `count` drafts past a read of `read` tokens; `reread`: the document
        is re-read too."""
        return 2

    def draft_count(self, reread: bool, kept_fraction: float, read: int) -> int:
        """How many look-ahead drafts probe the read's last eviction, which keeps `kept_fraction` of the `read`
        tokens read; `reread`: the document is re-read too."""
        return self.lookahead

    def refits(self, final: bool, kept_fraction: float | None, reread: bool) -> bool:
        """Whether an eviction (the read's `final` one or not) that keeps `kept_fraction` of what was read refits
        the kept values (`refit`); `reread`: the document is re-read too."""
        return self.refit == "always" or (final and self.refit == "final")

    def layer_budgets(self, budget: int, num_layers: int, floor: int) -> list[int] | None:
        """Per-layer budgets for uniform allocation, none below `floor` (what the engine keeps anyway: the sinks and
        the recent window); None: `budget` everywhere. PyramidKV-style policies override."""
        return None

    def score(self, step: EvictionStep, layer_idx: int) -> torch.Tensor:
        """(H_kv, C) float scores for one layer's entries; padding is ignored by the caller."""
        raise NotImplementedError

    def score_layers(self, step: EvictionStep, layer_ids: list[int]) -> dict[int, torch.Tensor]:
        """Scores for several layers at once; override when layers share work (e.g. one backward pass)."""
        return {i: self.score(step, i) for i in layer_ids}

    def at_budget(self, step: EvictionStep, scores: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """`scores` (from `score_layers` for no budget) as an eviction to `step.budget` ranks them: what a policy
        keeps at a budget beyond its scores (kl: the shares) is added here, so that the engine can try several
        budgets on one scoring (`--max-kl`). Most policies add nothing."""
        return scores

    def absorb_reconstruction(self, step: EvictionStep, layer_ids: list[int]) -> None:
        """Learn from one reconstruction probe set (its rows re-read the entries at positions `step.judged`), into
        per-entry state (`LayerCache.extras`) that later `score` calls read."""
        raise NotImplementedError(f"{self.name} does not use reconstruction probes")

    def observe(self, adapter: ModelAdapter, layer_idx: int, layer: LayerCache, query: torch.Tensor,
                key: torch.Tensor, query_positions: torch.Tensor, scaling: float, lse: torch.Tensor) -> None:
        """Called by the attention function for every forward that reads when `observes`: query (Hq, T, D)
        post-RoPE, key (H_kv, C, D) the layer's whole cache including the T new entries (its last T columns),
        query_positions (T,) rotary, lse (Hq, T) each query's log-sum-exp over what it attended to."""

    def reset(self) -> None:
        """Forget per-document state before a new stream (the engine calls it); most policies have none."""

    def state(self) -> dict[str, str]:
        """Per-document state worth keeping with the cache (saved in a `.kvc`), so that evicting again later (while
        answering) continues where reading stopped instead of learning it again."""
        return {}

    def restore(self, state: dict[str, str], kv_heads: list[int]) -> None:
        """Take back what `state()` returned, for a model with `kv_heads[l]` KV heads in layer l; raises ValueError
        if it does not fit."""

    def adopt(self, state: dict[str, str], kv_heads: list[int]) -> None:
        """Start every document from `state` measured once for this model (klevict_cli/calibrations.py), instead of
        learning it on each. Most policies have no such state."""

    def params(self) -> dict[str, str]:
        """Parameters worth recording in a `.kvc` file's metadata."""
        return {}


def in_floor(positions: torch.Tensor, sinks: int | torch.Tensor, recent: range) -> torch.Tensor:
    """Whether entries at `positions` are in the floor every eviction keeps: one of the first `sinks` (an int, or a
    tensor that broadcasts against `positions`) or at a `recent` position."""
    return (positions < sinks) | ((positions >= recent.start) & (positions < recent.stop))


def judged_mask(layer: LayerCache, judged: tuple[int, int] | None) -> torch.Tensor:
    """(H, C) bool: the valid entries a probe set judges (all of them when `judged` is None)."""
    if judged is None:
        return layer.valid
    return layer.valid & (layer.positions >= judged[0]) & (layer.positions < judged[1])


def reconstruction_columns(step: EvictionStep, layer_idx: int
                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """For a reconstruction probe set (`step.judged` is the span re-read): the (H_kv, n) columns its attention was
    recorded over, which of them it attends to in KVzip's restricted softmax (the attention sinks, the span and the
    re-reading itself; None where the re-reading attended to those alone, so that its weights are that softmax
    already: `step.restricted`), and which of them it judges (the span)."""
    layer, probe = step.cache.layers[layer_idx], step.probes[layer_idx]
    columns, present = probe.entries(layer)
    positions = layer.positions.gather(1, columns)
    judged = present & (positions >= step.judged[0]) & (positions < step.judged[1])
    if step.restricted:
        return columns, None, judged
    inside = present & ((positions < SINKS) | judged | (positions >= step.read_end))
    return columns, inside, judged


def values_at(values: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """(H, n, Dv): the values at each KV head's `columns` (H_kv, n). MLA's values come one set per query head
    (H = Hq): each takes its KV group's columns."""
    index = columns.repeat_interleave(values.shape[0] // columns.shape[0], dim=0)
    return values.gather(1, index[..., None].expand(-1, -1, values.shape[-1]))


def spread(layer: LayerCache, columns: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """(H_kv, n) scores of the entries at `columns` as an (H_kv, C) tensor over the layer's columns (0 elsewhere)."""
    return torch.zeros(layer.valid.shape, dtype=scores.dtype, device=scores.device).scatter_add_(1, columns, scores)


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


def select_global(
    stack: LayerStack, scores: torch.Tensor, budget: int, protect: torch.Tensor, min_per_head: int,
    max_per_head: int | None = None,
) -> torch.Tensor:
    """Keep `budget` entries per head on average, chosen by one top-k over every layer and head of `stack` (scores
    (L, H, C), stacked like it): scores must be comparable across layers (the KL policy's are, in nats). Protected
    entries (L, H, C) and each head's `min_per_head` best entries are always kept, so no head is emptied; no head
    keeps more than `max_per_head` (in `compact` mode a head's entries must fit the model's positions). Returns
    (L, H, C) keep masks; every step is one operation over all layers."""
    valid = stack.valid
    s = scores.float().masked_fill(~valid, float("-inf")).masked_fill(protect & valid, float("inf"))
    rows = s.flatten(0, 1)  # (L·H, C): every head of every layer
    width = rows.shape[-1]
    if max_per_head is not None and width > max_per_head:  # padding is -inf, so it goes first
        rows = rows.scatter(1, rows.topk(width - max_per_head, dim=1, largest=False).indices, float("-inf"))
    k = min(min_per_head, width)
    if k:  # each head's best k entries are lifted above any score (not invalid ones: they stay -inf)
        floor = rows.topk(k, dim=1)
        lifted = torch.where(floor.values > float("-inf"), floor.values.clamp(min=torch.finfo(torch.float32).max),
                             floor.values)
        rows = rows.scatter(1, floor.indices, lifted)
    everything = rows.flatten()
    allowed = min(budget * rows.shape[0], everything.numel())
    wanted = (everything > float("-inf")).sum().clamp(max=allowed)
    # one top-k of the most that may be kept; only the first `wanted` count (no host sync to cut it to size)
    top = everything.topk(allowed)
    chosen = torch.arange(top.indices.numel(), device=rows.device) < wanted
    keep = torch.zeros_like(everything, dtype=torch.bool).index_put_((top.indices,), chosen)
    return keep.view(valid.shape) & valid
