"""`kl`: evict the entries whose removal changes the next-token distribution least (DESIGN §3).

Scores are estimated KL divergences in nats (kernels/kl.py), so they are comparable across layers and heads and the
budget is allocated globally by one top-k. Two propagations from a layer's head outputs to the logits:
  * `direct` — the final-norm Jacobian and the unembedding of the probe's top-k tokens, as if the residual change
    passed straight to the last layer. Cheap (no backward); ranks well inside a layer, but its magnitudes drift
    across layers because it ignores what later layers do. So it is calibrated: at the first eviction two
    Fisher samples give, per KV head of every layer, the typical ratio of the full-path to the direct-path KL, and
    every direct score of that head is multiplied by it.
  * `fisher` — gradients of sampled labels' log-probabilities through all later layers (klevict_cli/fisher.py):
    the most faithful, and the most expensive (one batched backward pass of the probes per eviction). By default
    the re-run recomputes the probes' own keys and values (`probes="live"`), so an early probe's change reaches the
    later probes as an eviction reaches the tokens after it; the probes are then summed inside the square.
The default scores with `direct` throughout (`kl-fisher`: Fisher throughout).

Without a re-reading (`summarize`), part of the budget goes to the entries a re-reading of the document would need
most, estimated from the read's own queries (`observe`, kernels/attention_rules.py `copy_attention`): what a
question about the document asks of the cache, and on the benchmark's texts also most of what the text that follows
asks of it. With a re-reading (`compress`) the re-reading itself decides that share.

The last eviction's probes are not the last tokens read but `lookahead` tokens the engine samples past the end of
the read (probes.Drafts) and forgets afterwards: the cache must serve the text that follows, and the model's own
sample of it asks for what that text will ask for. With those probes the direct and Fisher paths keep equally good
caches, so the default pays for no backward pass where the model's calibration is shipped, one per document where
it is not.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import torch

from klevict_kernels.attention_rules import copy_attention, restricted_max_attention
from klevict_kernels.kl import direct_readout, kl_scores, to_head_space, work_bytes
from klevict_cli.cache import LayerStack, Stacked, pad_stack
from klevict_cli.policies.base import EvictionStep, Policy, reconstruction_columns, spread

STACKED_WORK_BYTES = {False: 32 << 20, True: 1 << 30}  # KL.stacked_entry_scores' work tensor, on a CPU / a GPU
BLOCK_BYTES = {False: 2 << 20, True: None}  # kl_scores' blocks of entries, on a CPU / a GPU (kernels/kl.py)


def block_bytes(t: torch.Tensor) -> int | None:
    """kl_scores' block size for tensors on `t`'s device."""
    return BLOCK_BYTES[t.device.type == "cuda"]


class KL(Policy):
    name = "kl"
    needs_probes = True
    reconstruction = "optional"
    # Each span is re-read against the sinks and itself only: this cost a fraction of re-reading against the whole
    # cache and was as good or better at 50/20/5 % kept, 1.2x worse at 10 %, on the tuning windows
    # (docs/research-log.md, "a cheap re-reading")
    reconstruction_sees = "span"
    # Spans of 256 rather than 128: fewer repeat instructions to read (about 4,300 tokens re-read for a 4,096-token
    # document instead of 4,950) in larger forwards; with 64 drafts they cut `compress`'s cost
    # by about 0.3-0.5x a read at the same KL on the tuning windows (docs/research-log.md)
    reconstruction_span = 256
    # Per entry, the most attention a copying query pays it (what the shares of the budget are decided by):
    QUESTION_EXTRA = "kl_question"  # the re-reading's (KVzip's score), where the document is re-read
    COPY_EXTRA = "kl_copy"  # a re-reading's as the read's own queries estimate it (`observe`), where it is not

    # Constants, each set by a measurement on the tuning windows (docs/research-log.md); a subclass may change them.
    # Where the document is re-read too, drafts probe the read's last choice where it keeps at most this part of the
    # document, and above it where they cost little (`cheap_drafts`).
    reread_drafts_up_to = 0.15
    # Drafting costs little where the read is at least this many times the tokens its forwards read: what decides
    # the drafts' second round without a re-reading, and drafts above `reread_drafts_up_to` with one (a re-read
    # document drafts in two rounds: 2,048 tokens for 64 drafts).
    cheap_drafts = 16
    # Without a re-reading, refit only where the read's last choice keeps at most this part of the document: the
    # refit's Gram products grow with the kept entries and cost about 0.1x a read at 20-50 % kept, for 3-4 % less
    # KL there (5-12 % at 10/5 %); with a re-reading it is worth 1.6-1.7x at 20-50 % and always runs.
    refit_up_to = 0.15
    # Where the re-reading relies on more entries than the question share holds (it paid each at least this much
    # attention), the share takes those the KL ranking values most (`reserve_for_questions`). A model's own, shipped
    # where measured (`adopt`): Gemma-3-270M's copy heads pay nearly every token almost all their attention, and with
    # 0.5 its `compress` reading had 0.87-0.98x `kl`'s KL instead of 1.10-1.91x at 20 / 5 % of 4,096-token tuning
    # windows; SmolLM2's re-reading ranks what it relies on usefully (at 10 % of 320-token notes 7 / 40 facts kept
    # with it, 16 / 40 without), so by default it is off (docs/research-log.md, "what Gemma's re-reading relies on").
    relied_on: float | None = None
    # The calibration's backward pass runs over the last this-many probes only: a per-head ratio needs a sample of
    # probes, not every draft (a read kept whole until its last eviction calibrates on drafts).
    calibration_rows = 32
    # The copy estimate moves the read's queries this many positions on (at most half the model's positions), where
    # a re-reading of a document would ask them: not moving them was 2x worse than the look-ahead alone at 50 %;
    # moving them by the read's own length instead was within noise at 512 tokens (0.99x).
    copy_distance = 4096
    # Research switches: direct scores calibrated by the Fisher path (per-layer factors change nothing inside a
    # layer, so only global allocation needs them); the Fisher re-run recomputing the probes' own keys and values
    # (klevict_cli/fisher.py) so that an early probe's change reaches the later ones, as an eviction reaches the
    # tokens after it.
    calibrates = True
    live_probes = True

    def __init__(self, propagation: str = "direct", allocation: str = "global", top_k: int = 64, rank: int = 4,
                 samples: int = 2, lookahead: int = 64, refit: str = "final", question_share: float = 0.6,
                 copy_share: float = 0.3):
        self.propagation = propagation
        self.allocation = allocation
        self.top_k, self.rank, self.samples = top_k, rank, samples
        # 64 drafts: they kept the same KL as 128 on the tuning windows (1.06x / 0.96x / 0.99x / 0.89x at 50 / 20 /
        # 10 / 5 % kept) for half the drafting (docs/research-log.md); fewer for short reads (32 at 512 tokens) were
        # 1.4-1.9x worse on Hamlet
        self.lookahead = lookahead
        if refit not in ("never", "final", "always"):
            raise ValueError(f"refit must be 'never', 'final' or 'always', not {refit!r}")
        self.refit = refit
        # Of what the floor leaves of the budget, kept for the entries a re-reading needs most, by the re-reading
        # where there is one (`compress`): on the tuning haystacks 0.6 kept 7/40 needles at 10 % where 0.3 kept
        # 0-1/40 (and 1.0 1-3/40), with the continuation's KL 1.1x / 0.88x / 1.0x 0.3's at 20/10/5 %; and by the
        # read's own estimate of it where not (`summarize`, `observe`): 0.3 made the KL of the text that follows
        # 0.12x / 0.25x / 0.40x / 0.63x the look-ahead's alone at 50 / 20 / 10 / 5 % kept (15 % and 60 % as well or
        # a little worse) — with SmolLM2; with Gemma-3-270M the share made it worse (0.68-0.95x without it), so a
        # model may ship its own (`adopt`, klevict_cli/calibrations.py). Why a share and not a weight in the KL sum:
        # docs/method.md, "one objective".
        self.question_share, self.copy_share = question_share, copy_share
        self.observes = copy_share > 0
        self.calibration: dict[int, torch.Tensor] | None = None  # per layer, (H_kv,) fisher/direct ratio
        self.adopted: dict[int, torch.Tensor] | None = None  # the model's calibration, where adopted (`adopt`)
        # per layer: (the next position, the query and lse of the last token read), for the next forward's first entry
        self._last_query: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}

    def observe(self, adapter, layer_idx, layer, query, key, query_positions, scaling, lse) -> None:
        """Estimate, for the entries this forward appends, the attention a re-reading of the document would pay them
        (kernels/attention_rules.py, `copy_attention`), from the forward's own queries moved `copy_distance`
        positions on — where a re-reading would ask them. Nothing is re-read: it costs a dot product per query."""
        t = query.shape[1]
        moved = adapter.move_queries(query, min(self.copy_distance, adapter.max_positions // 2), layer_idx)
        last = self._last_query.get(layer_idx)
        before = last[1:] if last is not None and last[0] == int(query_positions[0]) else None
        scores = copy_attention(moved, key[:, -t:], lse, scaling, before)
        self._last_query[layer_idx] = (int(query_positions[-1]) + 1, moved[:, -1], lse[:, -1])
        if scores.shape[0] != layer.keys.shape[0]:  # MLA: one cached latent for every query head
            scores = scores.amax(dim=0, keepdim=True)
        layer.extra(self.COPY_EXTRA)[:, -t:] = scores

    def observes_read(self, reread: bool) -> bool:
        """The copy estimate stands in for a re-reading: with a re-reading that counts, it would be computed and
        never used."""
        return self.observes and not (reread and self.question_share > 0)

    def reset(self) -> None:
        self._last_query = {}
        # calibrated on each document's first eviction, unless the model's calibration was adopted
        self.calibration = None if self.adopted is None else dict(self.adopted)

    def adopt(self, state: dict[str, str], kv_heads: list[int]) -> None:
        """Use the model's shipped calibration instead of a backward pass on each document: on the tuning windows
        it kept the same KL for `summarize` and `compress` alike (0.98-1.01x at 512 tokens, 4,096 in
        docs/research-log.md), and the backward pass is a fixed cost that weighs most on short documents. And the
        model's own copy share and `relied_on`, where it ships them (their worth is the model's: `copy_share`)."""
        self.restore(state, kv_heads)
        self.adopted = self.calibration
        if "copy_share" in state:
            share = float(state["copy_share"])
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"the model's copy share must be within [0, 1], not {share}")
            self.copy_share, self.observes = share, share > 0
        if "relied_on" in state:
            relied_on = float(state["relied_on"])
            if not 0.0 < relied_on <= 1.0:
                raise ValueError(f"the model's relied_on must be within (0, 1], not {relied_on}")
            self.relied_on = relied_on

    def state(self) -> dict[str, str]:
        if self.calibration is None:
            return {}
        return {"calibration": json.dumps({str(i): r.tolist() for i, r in self.calibration.items()})}

    def restore(self, state: dict[str, str], kv_heads: list[int]) -> None:
        if "calibration" not in state:
            return
        ratios = json.loads(state["calibration"])
        if not isinstance(ratios, dict) or not all(
            k.isdigit() and int(k) < len(kv_heads) and isinstance(v, list) and len(v) == kv_heads[int(k)]
            and all(isinstance(x, (int, float)) and x >= 0 for x in v)
            for k, v in ratios.items()
        ):
            raise ValueError("the kl calibration does not fit this model (one non-negative ratio per KV head)")
        self.calibration = {int(k): torch.tensor(v, dtype=torch.float32) for k, v in ratios.items()}

    def params(self) -> dict[str, str]:
        return {"propagation": self.propagation, "allocation": self.allocation, "top_k": str(self.top_k),
                "rank": str(self.rank), "samples": str(self.samples), "lookahead": str(self.lookahead),
                "refit": self.refit, "question_share": str(self.question_share), "copy_share": str(self.copy_share),
                "calibrates": str(self.calibrates).lower(), "live_probes": str(self.live_probes).lower(),
                "reread_drafts_up_to": str(self.reread_drafts_up_to), "cheap_drafts": str(self.cheap_drafts),
                "refit_up_to": str(self.refit_up_to),
                "calibration_rows": str(self.calibration_rows), "copy_distance": str(self.copy_distance),
                "refit_ridge": str(self.refit_ridge), "relied_on": str(self.relied_on)}

    def draft_rounds(self, reread: bool, read: int, count: int) -> int:
        """One round for a short read that is not re-read: the drafts are then the read's own predictions of its
        last tokens, sampled and placed past its end, and cost one forward instead of two — on the 512-token tuning
        windows 0.90-1.02x the KL of two rounds for 1.4x a read instead of 1.7x, but at 4,096 tokens 1.05-1.24x (8
        of 8 worse), where the second round's forward is 2 % of the read. So the second round runs once it costs at
        most a sixteenth of the read (`read` >= 16 x `count`), and always where the document is re-read
        (`compress`): there the refit fits every kept value to the drafts, and to drafts that repeat the read it
        overfit one tuning window (KL 0.15 -> 0.56 at 32 entries per head; docs/research-log.md)."""
        return 2 if reread or read >= self.cheap_drafts * count else 1

    def draft_count(self, reread: bool, kept_fraction: float, read: int) -> int:
        """Drafts for every read not re-read; for a re-read one where the choice keeps little of it, or where they
        cost little (`cheap_drafts`). Above 15 % kept the re-reading and the refit to the last tokens read choose
        well without them, but not as well: with them 0.4-0.9x the KL at 20 / 50 % on the tuning windows of 512 to
        4,096 tokens (12 of 12 lower), for 1.1x a read more on a 324-token note, 0.4x at 1,024 tokens and 0.0-0.2x at
        4,096 (docs/research-log.md)."""
        drafting = self.draft_rounds(reread, read, self.lookahead) * self.lookahead
        if not reread or kept_fraction <= self.reread_drafts_up_to or read >= self.cheap_drafts * drafting:
            return self.lookahead
        return 0

    def refits(self, final: bool, kept_fraction: float | None, reread: bool) -> bool:
        fraction = 0.0 if kept_fraction is None else kept_fraction
        return super().refits(final, kept_fraction, reread) and (reread or fraction <= self.refit_up_to)

    def score(self, step: EvictionStep, layer_idx: int) -> torch.Tensor:
        return self.score_layers(step, [layer_idx])[layer_idx]

    def score_layers(self, step: EvictionStep, layer_ids: list[int]) -> dict[int, torch.Tensor]:
        """Estimated KL of removing each entry for these probes; with a budget, a share of it lifted above every
        score for the entries a re-reading needs most (`reserve_for_questions`): by the re-reading itself where
        there was one (`question_share`), by the read's own estimate of it where not (`copy_share`)."""
        return self.at_budget(step, self.probe_scores(step, layer_ids))

    def at_budget(self, step: EvictionStep, scores: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The shares lifted above the scores (`reserve_for_questions`), where there is a budget."""
        if step.budget is None:
            return scores
        layer_ids = list(scores)
        needed, share = self.stored(step, layer_ids, self.QUESTION_EXTRA), self.question_share
        if not needed:
            needed, share = self.stored(step, layer_ids, self.COPY_EXTRA), self.copy_share
        if not needed or share <= 0:
            return scores
        return self.reserve_for_questions(step, dict(scores), needed, share)

    @staticmethod
    def stored(step: EvictionStep, layer_ids: list[int], name: str) -> dict[int, torch.Tensor]:
        """What the read or its re-reading stored under `name`, per layer that has it."""
        return {i: step.cache.layers[i].extras[name] for i in layer_ids if name in step.cache.layers[i].extras}

    def reserve_for_questions(self, step: EvictionStep, scores: dict[int, torch.Tensor],
                              stored: dict[int, torch.Tensor], share: float) -> dict[int, torch.Tensor]:
        """Lift the entries a re-reading needs most (`stored`: what the re-reading found, or the copy estimate where
        there was none) — `share` of what the engine's floor leaves of the budget, by one top-k over every layer and
        head — above every other score,
        so that they are kept whatever the look-ahead says: what a question about the document needs is what
        re-reading it needs, and at tight budgets a weighted sum lets the next text's needs crowd it out."""
        layers = {i: step.cache.layers[i] for i in stored}
        candidates = {i: _seen(layer) & ~step.kept_anyway(layer) for i, layer in layers.items()}
        heads = sum(layer.valid.shape[0] for layer in layers.values())
        # a share of what the floor (sinks, recent window) leaves: the KL ranking always chooses the rest of it
        count = min(int(share * step.chosen_per_head * heads), sum(s.numel() for s in stored.values()))
        if count <= 0:
            return scores
        chosen = _top(stored, candidates, count)
        if self.relied_on is not None:
            # Where the re-reading relies on more entries than the share holds (a copying query paid each at least
            # `relied_on` of its attention), their scores no longer say which it needs more — a copy needs each — so
            # the share takes those the text that follows needs most (their KL scores).
            relied = {i: candidates[i] & (s.float() >= self.relied_on) for i, s in stored.items()}
            if int(sum(r.sum() for r in relied.values())) > count:  # one host sync
                chosen = _top(scores, relied, count)
        lift = torch.stack([s.float().max() for s in scores.values()]).max() + 1.0  # no value read back
        for i in stored:
            scores[i] = scores[i] + lift.to(scores[i]) * chosen[i].to(scores[i])
        return scores

    def absorb_reconstruction(self, step: EvictionStep, layer_ids: list[int]) -> None:
        """Store, per judged entry, the most attention the re-reading of its span paid it (KVzip's score): what the
        question share is decided by."""
        for i in layer_ids:
            layer = step.cache.layers[i]
            columns, inside, judged = reconstruction_columns(step, i)
            attention = spread(layer, columns, restricted_max_attention(step.probes[i].weights, inside, judged))
            layer.extras[self.QUESTION_EXTRA] = torch.maximum(layer.extra(self.QUESTION_EXTRA), attention)

    def probe_scores(self, step: EvictionStep, layer_ids: list[int]) -> dict[int, torch.Tensor]:
        if self.propagation == "fisher":
            return self.fisher_scores(step, layer_ids)
        if self.calibrates and self.allocation == "global" and self.calibration is None:
            # the sample's direct scores are part of the whole's: scored once, apart from the other probes
            others, sample = step.split_probes(self.calibration_rows)
            direct = self.direct_scores(sample, layer_ids)
            scores = direct if others is None else add_scores(self.direct_scores(others, layer_ids), direct)
            self.calibration = calibration_ratios(direct, self.fisher_scores(sample, layer_ids), step, per_head=True)
        else:
            scores = self.direct_scores(step, layer_ids)
        return apply_calibration(scores, self.calibration) if self.calibration is not None else scores

    def direct_scores(self, step: EvictionStep, layer_ids: list[int]) -> Mapping[int, torch.Tensor]:
        adapter = step.adapter
        factors = direct_readout(step.residuals, step.logits, adapter.final_norm, adapter.unembedding.weight,
                                 self.top_k, self.rank,
                                 jacobian_scale=adapter.logit_jacobian_scale(step.logits))
        dtype = step.score_dtype
        if stackable(step, layer_ids) and all(adapter.post_attention_norm(i) is None for i in layer_ids):
            readout = to_head_space(factors.to(dtype), adapter.output_projections(layer_ids, dtype),
                                    step.probes[layer_ids[0]].output.shape[0])  # (W, R, L·Hq, Dv): every layer's at once
            return self.stacked_entry_scores(step, layer_ids, readout)
        out = {}
        for i in layer_ids:
            readout = to_head_space(adapter.to_attention_output(i, factors, step.probes[i].output).to(dtype),
                                    adapter.output_projection(i).weight, step.probes[i].output.shape[0])
            out[i] = self.entry_scores(step, i, readout)
        return out

    def stacked_entry_scores(self, step: EvictionStep, layer_ids: list[int], readout: torch.Tensor,
                             fold_probes: bool = False) -> Stacked:
        """`entry_scores` of many layers per kl_scores call (`stackable` layers): layers are stacked as extra heads,
        padded to the widest cache (padding has weight 0, so it scores 0). readout (W, R, L·Hq, Dv). As many layers
        go into one call as keep its work tensor within `STACKED_WORK_BYTES`: on a GPU that is every layer at
        usual sizes (few launches), on a CPU a few (a work tensor that outgrows the caches is slower to stream than
        the launches it saves)."""
        probes, layers = [step.probes[i] for i in layer_ids], [step.cache.layers[i] for i in layer_ids]
        hq, w, _ = probes[0].weights.shape
        kv, width = layers[0].values.shape[0], max(layer.capacity for layer in layers)
        device = probes[0].weights.device
        per_layer = hq * w * readout.shape[1] * width * work_bytes(readout.dtype)
        size = max(1, STACKED_WORK_BYTES[device.type == "cuda"] // per_layer)
        scores = torch.zeros(len(layer_ids), kv, width, dtype=torch.promote_types(readout.dtype, torch.float32),
                             device=device)
        for lo in range(0, len(layer_ids), size):
            group = range(lo, min(lo + size, len(layer_ids)))
            n = len(group)
            weights = pad_stack([probes[g].weights for g in group], dim=2)  # (n, Hq, W, C)
            values = pad_stack([layers[g].values for g in group])  # (n, H_kv, C, Dv)
            outputs = torch.stack([probes[g].output for g in group])  # (n, Hq, W, Dv)
            c = weights.shape[-1]
            scores[lo : lo + n, :, :c] = kl_scores(
                weights.view(n * hq, w, c), outputs.view(n * hq, w, -1), values.view(n * kv, c, -1),
                readout[:, :, lo * hq : (lo + n) * hq], n * kv, fold_probes=fold_probes,
                block_bytes=block_bytes(weights)).view(n, kv, c)
        return Stacked(scores, layer_ids, [layer.capacity for layer in layers])

    def entry_scores(self, step: EvictionStep, i: int, readout: torch.Tensor, fold_probes: bool = False
                     ) -> torch.Tensor:
        """kl_scores of layer i's entries for these probes."""
        layer = step.cache.layers[i]
        return kl_scores(step.probes[i].weights, step.probes[i].output, layer.values, readout, layer.keys.shape[0],
                         fold_probes=fold_probes, block_bytes=block_bytes(layer.values))

    def fisher_scores(self, step: EvictionStep, layer_ids: list[int]) -> Mapping[int, torch.Tensor]:
        live = self.live_probes
        grads = step.backward(self.samples, live)
        scale = math.sqrt(self.samples)
        if stackable(step, layer_ids):
            readout = torch.cat([grads[i] for i in layer_ids], dim=2)  # (W, S, L·Hq, Dv)
            return self.stacked_entry_scores(step, layer_ids, (readout / scale).to(step.score_dtype), fold_probes=live)
        return {i: self.entry_scores(step, i, (grads[i] / scale).to(step.score_dtype), fold_probes=live)
                for i in layer_ids}


def _top(values: dict[int, torch.Tensor], allowed: dict[int, torch.Tensor], count: int) -> dict[int, torch.Tensor]:
    """Per layer, the allowed entries among the `count` highest `values`, by one top-k over every layer and head
    (every allowed entry where fewer are allowed; ties at the cut all count)."""
    flat = torch.cat([values[i].float().masked_fill(~allowed[i], float("-inf")).flatten() for i in allowed])
    threshold = flat.topk(count).values[-1]
    return {i: allowed[i] & (values[i].float() >= threshold) for i in allowed}


def _seen(layer) -> torch.Tensor:
    """(H, C) bool: the valid entries the layer's next queries can still see — all of them, or for a sliding layer
    scored like the others (every layer of the model slides), those within its window of the newest entry."""
    if layer.window is None:
        return layer.valid
    return layer.valid & (layer.rope_positions > layer.rope_positions.max() - layer.window)


def stackable(step: EvictionStep, layer_ids: list[int]) -> bool:
    """Whether these layers can be scored as one: every entry judged, attention recorded over whole caches, and
    one shape of heads and values (not MLA's values, which differ per query head)."""
    if step.judged is not None or not layer_ids:
        return False
    shapes = set()
    for i in layer_ids:
        probe, layer = step.probes[i], step.cache.layers[i]
        if probe.columns is not None or layer.values.shape[0] != layer.keys.shape[0]:
            return False
        shapes.add((probe.output.shape[0], *layer.values.shape[::2]))
    return len(shapes) == 1


def calibration_ratios(direct: Mapping[int, torch.Tensor], fisher: Mapping[int, torch.Tensor], step: EvictionStep,
                       per_head: bool = False) -> dict[int, torch.Tensor]:
    """Per KV head (or per layer), the median over evictable entries (not the probes) of fisher / direct score.

    The direct path's error is what the layers after l do to the residual change, and it differs between heads: on
    Moby Dick, a factor per head ranks entries better against the float64 oracle than one per layer (Spearman .923
    vs .907 at layer 2, .977 vs .973 at layer 28), with the same downstream KL. A median, because per-entry Fisher
    estimates from a few samples are noisy and the scores are heavy-tailed (a ratio of sums would be decided by a
    handful of entries). All layers at once (`LayerStack`)."""
    stack = LayerStack.of({i: step.cache.layers[i] for i in direct})
    d, f = stack.stack(direct), stack.stack(fisher)
    candidates = stack.valid & (stack.positions < step.probe_positions[0]) & (d > 0)
    ratio = torch.where(candidates, f / d.where(candidates, 1.0), float("nan"))
    heads = ratio.shape[1]
    ratio = ratio.nanmedian(dim=-1).values if per_head else ratio.flatten(1).nanmedian(dim=1).values[:, None]
    ratio = ratio.nan_to_num(1.0).expand(-1, heads).to(d.dtype)
    return {i: ratio[n] for n, i in enumerate(stack.layer_ids)}


def add_scores(a: Mapping[int, torch.Tensor], b: Mapping[int, torch.Tensor]) -> Mapping[int, torch.Tensor]:
    """Per-layer scores of two sets of probes, summed (one addition when both hold every layer at once)."""
    if isinstance(a, Stacked) and isinstance(b, Stacked) and a.layer_ids == b.layer_ids:
        return Stacked(a.tensor + b.tensor, a.layer_ids, a.widths)
    return {i: a[i] + b[i] for i in a}


def apply_calibration(scores: Mapping[int, torch.Tensor], ratios: dict[int, torch.Tensor]
                      ) -> Mapping[int, torch.Tensor]:
    """Every KV head's direct scores times its calibration ratio (from `calibration_ratios`)."""
    if isinstance(scores, Stacked):  # one product for every layer
        factor = torch.stack([ratios[i] for i in scores.layer_ids]).to(scores.tensor)
        return Stacked(scores.tensor * factor[..., None], scores.layer_ids, scores.widths)
    return {i: s * ratios[i].to(s)[:, None] for i, s in scores.items()}


class KLFisher(KL):
    """`kl-fisher`: `kl` with the Fisher propagation at every eviction (a backward pass each time; slower)."""

    name = "kl-fisher"
    variant = True

    def __init__(self):
        super().__init__(propagation="fisher", samples=4)  # each eviction's scores, not just a per-head ratio


class KLLayer(KL):
    """`kl-layer`: `kl` scores, but every layer and head keeps the same count (no global allocation)."""

    name = "kl-layer"
    variant = True

    def __init__(self):
        super().__init__(allocation="layer")


class KLReconstruct(KL):
    """`kl-reconstruct`: `kl` judged by reconstruction probes too, whatever `--reconstruct` says — what `compress`
    does by default; in `bench`, so that both ways of reading are measured in one run on the same windows."""

    name = "kl-reconstruct"
    variant = True
    reconstruction = "required"
