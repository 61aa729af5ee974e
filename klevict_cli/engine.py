"""The chunked engine: stream tokens through the model with a bounded cache, evict between chunks, decode.

Positions are explicit. In `original` mode every kept entry keeps the position it was read at and new tokens continue
at the document's true next position. In `compact` mode (documents longer than the model's context) kept keys are
re-rotated after every eviction so that they sit at consecutive positions ending just before the next token.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch
from transformers import PreTrainedModel

from klevict_cli import attention
from klevict_cli.adapters import ModelAdapter, run_with_cache
from klevict_cli.attention import ForwardContext, Lanes, forward_context
from klevict_cli.cache import Evicted, KVCache, LayerStack, keep_orders, mask_columns, pad_stack
from klevict_cli.calibrations import DRIFT_CALIBRATION, DriftCalibration
from klevict_cli.errors import ModelError, ResourceError
from klevict_cli.fisher import FrozenCache, attention_output_gradient_norms, head_output_gradients
from klevict_cli.policies import EvictionStep, Policy, in_floor, select_global, select_keep
from klevict_cli.probes import SINKS, Drafts, ProbeRequest, ProbeSet, Reconstruction, Requests
from klevict_cli.quantized import stored_cache
from klevict_cli.sampling import SpanBan, penalise_repeats, sample, sample_rows, seeded
from klevict_cli.tolerance import smallest_within
from klevict_kernels.kl import ReferenceDistributions, SupportedReference
from klevict_kernels.refit import refit_values

POSITION_MODES = ("auto", "original", "compact")
WORKING_FACTOR = 4  # default working limit: this many times the budget (docs/method.md, "Lazy eviction")
# Compact positions: what a read keeps free past each chunk, for the probes of the eviction after it (kl's look-ahead
# drafts, 64 tokens; the drift's continuation, DRIFT_STEPS)
PROBE_ROOM = 64


def sink_count(budget: int | None) -> int:
    """How many of the first entries every eviction keeps, whatever the policy scores: the attention sinks, which
    every query attends to (StreamingLLM; position 0 is the chat frame's opening token). Losing them leaves a cache
    the model cannot use (a 300-token note at 10 % kept answered garbage), so they are a floor of the budget, as
    the recent window is; a budget under 16 entries per head gives them a quarter of itself."""
    return SINKS if budget is None else min(SINKS, budget // 4)


@dataclass
class Stream:
    """A cache plus where the stream stands: what was read, and the next token's true and rotary positions."""

    cache: KVCache
    tokens: list[int] = field(default_factory=list)
    next_rope: int = 0
    policy_state: dict[str, str] = field(default_factory=dict)  # what the policy learnt reading it (kl: calibration)
    reconstructed: int = 0  # positions before this were judged by reconstruction probes (Engine.reconstruct)
    drift: dict[str, float] | None = None  # the read's last eviction, measured on its drafts (Engine.measure_drift)
    stored_as: str | None = None  # the dtype the cache is to be stored in (Engine's `storage`), when one is set
    # entries per KV head the read's last eviction kept: the budget, or what `max_kl` / a storage choice settled on
    kept_budget: int | None = None
    # what the read's evictions dropped, set aside until its last eviction's drift is measured (not cloned)
    evicted: Evicted | None = None

    @property
    def next_position(self) -> int:
        return len(self.tokens)

    def clone(self) -> Stream:
        return Stream(self.cache.clone(), list(self.tokens), self.next_rope, dict(self.policy_state),
                      self.reconstructed, None if self.drift is None else dict(self.drift), self.stored_as,
                      self.kept_budget)


@dataclass
class Plan:
    """How a document of `n_tokens` will be read: the resolved position mode and per-head budget."""

    mode: str
    budget: int | None  # kept entries per KV head; None keeps everything
    notes: list[str] = field(default_factory=list)
    head_cap: int | None = None  # compact mode: most entries any one head may keep (they must fit the positions)


def plan_positions(
    n_tokens: int, budget: int | None, chunk_size: int, reserve: int, max_positions: int, mode: str = "auto"
) -> Plan:
    """Choose the position mode and cap the budget so that cache + chunk (while reading) and cache + question +
    answer (afterwards) fit the model's positions. `reserve` is the room kept for the question and answer."""
    notes: list[str] = []
    fits = n_tokens + reserve <= max_positions
    if mode == "auto":
        mode = "original" if fits else "compact"
    if mode == "original" and not fits:
        raise ResourceError(
            f"{n_tokens} tokens + {reserve} for the question and answer exceed the model's {max_positions} positions;"
            " use --position-mode compact (or auto)"
        )
    if mode == "compact":
        if budget is None:
            raise ResourceError(
                f"the document ({n_tokens} tokens) is longer than the model's {max_positions} positions;"
                " the full cache cannot hold it — pass a --budget"
                if not fits
                else "compact positions need eviction: pass a --budget (and a method other than none)"
                " or use --position-mode original"
            )
        room = max_positions - max(chunk_size + PROBE_ROOM, reserve)
        if room < 1:
            raise ResourceError(
                f"--chunk-size {chunk_size} / reserve {reserve} leave no room in the model's {max_positions} positions"
            )
        if budget > room:
            notes.append(
                f"budget capped from {budget} to {room} tokens to fit the model's {max_positions} positions"
                f" with the next chunk / question and answer"
            )
            budget = room
    if budget is not None and budget >= n_tokens:
        budget = None if mode == "original" else budget
    head_cap = max_positions - max(chunk_size + PROBE_ROOM, reserve) if mode == "compact" else None
    return Plan(mode, budget, notes, head_cap)


# The read's drift is measured on DRIFT_LANES continuations of DRIFT_STEPS tokens sampled side by side
# (`Engine.drafts_for_drift`, attention.Lanes): one continuation's KL depends on the sample, and the model's own
# continuations vary from one another more than a few lanes show (Gemma-3-270M's about 2.3x as much as SmolLM2's).
# On held-out windows, against the real next page, 16 lanes of 16 tokens ranked caches better than the 4 of 16 read
# before on both packaged models (Spearman 0.91 against 0.83 pooled over 96 caches; Gemma-3-270M at 512 tokens 0.95
# against 0.56) and about as well as 16 of 32 (docs/research-log.md, "sixteen lanes"). A read measures it by
# default only where it is cheap beside the read: from DRIFT_CHEAP tokens (`drift_steps`).
DRIFT_STEPS = 16
DRIFT_LANES = 16
DRIFT_CHEAP = 1024
# Where the drift is measured from the change of the output head's inputs (a linear head, a narrower probe copy:
# `Engine.measure_drift`), the head and the KL run over the union of each row's DRIFT_SUPPORT likeliest tokens, the
# rest of each row's mass one bucket at its exact mean change (kernels/kl.py, SupportedReference)
DRIFT_SUPPORT = 2048
DRIFT_SEED = 104_729  # their samples' seed is the read's plus this: never the drafts that judge the choice
DRIFT_TEMPERATURE = 1.0  # the model's own distribution: 0.7 ranked caches worse (docs/research-log.md)
# The most bytes a read sets aside of what it evicted, to measure its drift against the whole read (cache.Evicted):
# a SmolLM2-135M read of its 8,192 positions sets aside at most 189 MB
EVICTED_BYTES = 1 << 30


def measures_drift(asked: bool, max_kl: float | None, chooses_storage: bool) -> bool:
    """Whether a read measures its drift: where asked, and always where a tolerance or a choice of storage is judged
    by it (the engine's rule; `Session.uses_probe_copy` asks it before any engine exists, with the storage choice as
    the settings foretell it)."""
    return asked or max_kl is not None or chooses_storage


def drift_steps(tokens: int, asked: bool = True) -> int:
    """Tokens per lane that the drift estimate of a read of `tokens` samples: DRIFT_STEPS where it is `asked` for or
    the read is at least DRIFT_CHEAP tokens, none otherwise."""
    return DRIFT_STEPS if asked or tokens >= DRIFT_CHEAP else 0


@dataclass(eq=False)
class Continuation:
    """Tokens sampled past the end of a read to measure an eviction (`Engine.drafts_for_drift`), and the logits that
    followed each over the cache before the choice."""

    tokens: list[int]  # step-major: lane = index % lanes
    logits: torch.Tensor  # (len(tokens), vocab)
    lanes: int = 1
    whole: bool = True  # sampled over every entry the read produced, not only those held at its last eviction
    evicted_before: bool = False  # entries evicted before the last eviction are in it: keeping all held still drifts
    # (len(tokens) - 1, d): the output head's inputs for all rows but the last, where the model's head is linear and a
    # probe copy holds it at a narrower dtype (`Engine.measure_drift` computes the logits' change from them)
    head_inputs: torch.Tensor | None = None
    supported: SupportedReference | None = field(default=None, repr=False)  # `over_support`'s, once prepared

    @functools.cached_property
    def before(self) -> ReferenceDistributions:
        """Its distributions prepared once, for every cache measured against them (`Engine.measure_drift`)."""
        return ReferenceDistributions(self.logits)

    @functools.cached_property
    def last(self) -> ReferenceDistributions:
        """The last row's distribution alone: where the others are measured from the head's inputs, its logits
        after a choice still come whole from the model."""
        return ReferenceDistributions(self.logits[-1:])

    def over_support(self, weight: torch.Tensor) -> SupportedReference:
        """The distributions of every row but the last over the union of each one's DRIFT_SUPPORT likeliest tokens,
        for a linear head whose rows are `weight` (kernels/kl.py, SupportedReference); prepared once."""
        if self.supported is None:
            self.supported = SupportedReference(self.logits[:-1], DRIFT_SUPPORT, weight)
        return self.supported


class Engine:
    """Reads tokens into a `Stream` and evicts with `policy` so that it ends with `budget` entries per KV head,
    holding at most `working` entries per head (default: WORKING_FACTOR × budget, never less than budget + one
    chunk) while reading. `reconstruction` (probes.Reconstruction) judges every span once it is read, for the
    policies that use it."""

    def __init__(
        self,
        model,
        adapter: ModelAdapter,
        policy: Policy,
        budget: int | None,
        chunk_size: int = 512,
        probe_window: int = 32,
        mode: str = "original",
        seed: int = 0,
        head_cap: int | None = None,
        working: int | None = None,
        reconstruction: Reconstruction | None = None,
        measure_drift: bool = False,
        max_kl: float | None = None,
        storage: dict[str, int | None] | None = None,
        evicted_bytes: int = EVICTED_BYTES,
        drift_calibration: DriftCalibration | None = None,
        probe_model: Callable[[], PreTrainedModel | None] | None = None,
        score_dtype: torch.dtype = torch.float32,
    ):
        self.model = model
        # the probing forwards (drafts, a re-reading, the drift's samples) run on the copy this gives, at a cheaper
        # precision, where it gives one (Session.probe_model; asked when a probing forward first runs)
        self.probe_source = probe_model
        self.score_dtype = score_dtype  # the scoring's large products' precision (EvictionStep.score_dtype)
        self.adapter = adapter
        self.policy = policy
        self.budget = budget if policy.evicts else None
        self.chunk_size = chunk_size
        self.probe_window = probe_window
        self.mode = mode
        self.head_cap = head_cap
        if self.budget is not None:
            working = WORKING_FACTOR * self.budget if working is None else working
            if head_cap is not None:  # compact positions: what is held while reading must fit them too
                working = min(working, head_cap)
            self.working = max(working, self.budget + chunk_size)
        if policy.reconstruction == "required" and reconstruction is None:
            raise ValueError(f"{policy.name} judges entries by reconstruction probes: pass a reconstruction source")
        self.reconstruction = reconstruction if policy.reconstruction != "never" else None
        if mode == "compact":
            adapter.require_rerotation()  # absolute position embeddings cannot be moved
        self.generator = torch.Generator().manual_seed(seed)
        # the read's last eviction measured on drafts (`measure_drift`), sampled apart so that nothing else changes
        # With `max_kl`, the last eviction keeps the smallest cache (within `budget`, if any) whose measured drift
        # is at most that many nats per token (`_budget_within`); nothing is evicted before it unless `budget` says
        self.max_kl = max_kl if policy.evicts else None
        # `storage`: the dtype the cache will be stored in (the drift is measured on the cache as stored), or a choice
        # of dtypes, each with the budget a byte limit gives it: the read's last eviction keeps the one whose stored
        # cache drifts least (`_storage_within`)
        self.storage = dict(storage or {})
        self.chooses_storage = len(self.storage) > 1 and policy.evicts
        measuring = measures_drift(measure_drift, max_kl, self.chooses_storage)
        self.drift_generator = seeded(seed, DRIFT_SEED) if measuring else None
        self.drift_calibration = drift_calibration or DRIFT_CALIBRATION  # the model's own, where it has one
        self.evicted_bytes = evicted_bytes  # the most of what it evicts a read sets aside to measure its drift
        observes = policy.observes_read(self.reconstruction is not None)
        self.observer = functools.partial(policy.observe, adapter) if observes else None
        self.shapes = adapter.layer_shapes()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.ready(model, adapter.final_norm)

    @staticmethod
    def ready(model: PreTrainedModel, final_norm: torch.nn.Module) -> None:
        """Make `model` attend with klevict's attention, record its final residuals at the probes, and leave the
        rows only sampled from to the probe copy's head."""
        if model.config._attn_implementation != attention.ATTENTION_NAME:
            model.set_attn_implementation(attention.ATTENTION_NAME)
        attention.install_residual_hook(final_norm)
        attention.install_head_hook(model.get_output_embeddings())

    @functools.cached_property
    def probe_model(self) -> PreTrainedModel | None:
        """The copy the probing forwards run on (`forward`), or None: the model itself."""
        copy = self.probe_source() if self.probe_source is not None else None
        if copy is not None:
            norm = next(name for name, module in self.model.named_modules() if module is self.adapter.final_norm)
            self.ready(copy, copy.get_submodule(norm))
        return copy

    @property
    def probe_dtype(self) -> torch.dtype:
        return next(self.probe_model.parameters()).dtype if self.probe_model is not None else self.dtype

    def new_stream(self) -> Stream:
        """An empty stream; the policy forgets what it learnt on the previous one (e.g. kl's calibration)."""
        self.policy.reset()
        # stored as the storage says; where it offers a choice, the first (most bits) unless the last eviction
        # chooses another
        evicted = Evicted(self.mode == "original", self.evicted_bytes) if self.drift_generator is not None else None
        return Stream(KVCache.empty(self.shapes, self.device, self.dtype), stored_as=next(iter(self.storage), None),
                      evicted=evicted)

    # ---- one forward ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self, stream: Stream, ids: list[int], probe_rows: int = 0, logits_rows: int | None = None,
        probe_entries: Callable | None = None, attend_entries: Callable | None = None, probing: bool = False,
        rope_start: int | None = None, lanes: Lanes | None = None, measuring: bool = False, sampled: bool = False,
        head_inputs: bool = False,
    ) -> tuple[torch.Tensor, ForwardContext]:
        """Run `ids` at the stream's next positions, recording probe statistics for the last `probe_rows` tokens
        (their attention to the entries `probe_entries(layer)` marks, when given). With `attend_entries`, the tokens
        see only the cached entries it marks (and each other). `probing`: the tokens are probes that will be
        forgotten (drafts, a re-reading), which policies that observe every forward do not see. `rope_start`: the
        tokens' first rotary position, if not the stream's next (`place`). `lanes`: the tokens continue independent
        lanes (attention.Lanes) begun at or before this forward. Probing forwards run on the probe copy, if any, unless
        `measuring`: their logits are a measurement (the drift's), taken on the model itself. Returns the logits of
        the last `logits_rows` tokens (default: max(1, probe_rows)); `sampled`: all but the last of them only feed
        sampling (the drafts'), and where there is a probe copy they come from its output head (at 300 tokens the
        model's float32 head over 63 rows was 6 % of the read); `head_inputs`: of all but the last, only the output
        head's inputs are wanted (`ctx.sampled_inputs`), and the logits returned are the last row's."""
        t = len(ids)
        positions = torch.arange(stream.next_position, stream.next_position + t, device=self.device)
        start = stream.next_rope if rope_start is None else rope_start
        rope = torch.arange(start, start + t, device=self.device) if lanes is None else lanes.rope(positions)
        model = self.model if not probing or measuring else self.probe_model or self.model
        # a copy at another dtype attends over the cache as stored, but a module that computes on what it reads
        # from the cache (MLA) reads it at the copy's dtype
        read_as = self.probe_dtype if model is not self.model and self.adapter.computes_on_cache else None
        stream.cache.begin(positions, rope, read_as)
        rows = logits_rows or max(1, probe_rows)
        cheap_head = sampled and self.probe_model is not None
        ctx = ForwardContext(stream.cache, rope, probe_rows=probe_rows, observer=None if probing else self.observer,
                             probe_entries=probe_entries, attend_entries=attend_entries, positions=positions,
                             lanes=lanes, sampled_rows=min(rows, t) - 1 if cheap_head or head_inputs else 0)
        with forward_context(ctx):
            out = run_with_cache(
                model, stream.cache, input_ids=torch.tensor([ids], device=self.device), position_ids=rope[None],
                logits_to_keep=rows,
            )
        stream.tokens.extend(ids)
        stream.next_rope += t
        logits = out.logits[0]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if cheap_head and ctx.sampled_inputs is not None:
            logits = torch.cat((self.head_logits(self.probe_model, ctx.sampled_inputs).to(logits.dtype), logits))
        return logits, ctx

    # ---- reading with eviction -----------------------------------------------------------------------------
    def feed(
        self, stream: Stream, ids: list[int], evict: bool = True, progress: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Read `ids` chunk by chunk. The cache grows up to the working limit before anything is evicted; when the
        next chunk would overflow it, the cache is evicted down to the budget, judged by the last tokens read. After
        the last chunk the final choice is made from everything held, with the best probes (look-ahead drafts when
        the policy asks for them). Returns the last token's logits."""
        logits = None
        starts = list(range(0, len(ids), self.chunk_size))
        for n, start in enumerate(starts):
            chunk = ids[start : start + self.chunk_size]
            final = n == len(starts) - 1
            upcoming = 0 if final else min(self.chunk_size, len(ids) - starts[n + 1])
            must_evict = evict and self._must_evict(stream, len(chunk), upcoming)
            recent = self.recent_window(len(chunk))
            read = stream.next_position + len(chunk)
            count = self.draft_count(read) if final and must_evict else 0
            drafts = Drafts(count, self.policy.draft_rounds(self.reconstruction is not None, read, count),
                            self.policy.drafts_from_read) if count else None
            rows = recent if must_evict and self.policy.needs_probes and not drafts else 0
            logits, ctx = self.forward(stream, chunk, probe_rows=rows,
                                       logits_rows=drafts.read_rows(len(chunk)) if drafts else None,
                                       sampled=drafts is not None)  # the rows before the last: the drafts' only
            self.check_finite(logits)
            if must_evict:
                if self.reconstruction is not None:  # the recent window is kept unless drafts judge it
                    self.reconstruct(stream, kept=0 if drafts else recent)
                drafted = self.drafts_for_drift(stream, logits) if final else None
                stream.drift = None
                if drafts:
                    requests = drafts.requests(stream.tokens, logits, self.room(stream), self.generator)
                    self.evict_with(stream, self.probe_sets(stream, requests), recent, final=True, drafted=drafted)
                else:
                    self.evict(stream, ctx, logits, recent, final=final, drafted=drafted)
                if drafted is not None and stream.drift is None:  # a tolerance or storage choice measured it
                    stream.drift = self.measure_drift(self.as_stored(stream), drafted)
            elif evict:
                self.trim_windows(stream)
            if progress is not None:
                progress(len(chunk))
        if logits is None:
            raise ValueError("nothing to read")
        if evict:  # read: nothing more to measure (decoding's evictions set nothing aside)
            stream.evicted = None
        stream.policy_state = self.policy.state()
        return logits[-1]

    def check_finite(self, logits: torch.Tensor) -> None:
        """Refuse a read or an answer whose outputs overflowed (float16's range is too small for some models, Gemma's
        among them): every choice and token after it would be noise, or a crash in sampling. One host sync per chunk
        read or token decoded."""
        if not bool(torch.isfinite(logits).all()):
            name = str(self.dtype).removeprefix("torch.")
            hint = ": float16's range is too small for this model; use --dtype bfloat16 or float32" \
                if self.dtype == torch.float16 else ""
            raise ModelError(f"the model's outputs are not finite numbers in {name}{hint}")

    def draft_count(self, read: int) -> int:
        """How many look-ahead drafts probe the read's last eviction, once `read` tokens are read (the policy's
        choice, from whether the document is re-read and what part of it the budget keeps)."""
        if not self.policy.needs_probes or (self.budget is None and self.max_kl is None and not self.chooses_storage):
            return 0
        return self.policy.draft_count(self.reconstruction is not None, self.kept_fraction(read) or 1.0, read)

    def recent_window(self, chunk_len: int, budget: int | None = None) -> int:
        """The last tokens read: they are the probes and are always kept (at most half of what the sinks leave of
        the budget, so that the policy's ranking always chooses part of it)."""
        budget = self.budget if budget is None else budget
        limit = (budget - sink_count(budget)) // 2 if budget is not None else chunk_len
        return max(1, min(self.probe_window, chunk_len, limit))

    def _scored_layers(self, stream: Stream) -> dict:
        """The global layers; if every layer slides (Mistral-style `sliding_window` without `layer_types`), all of
        them: the window is then only an upper bound on what a layer holds, and the budget must still apply."""
        layers = dict(enumerate(stream.cache.layers))
        return {i: layer for i, layer in layers.items() if layer.window is None} or layers

    def held_per_head(self, stream: Stream) -> float:
        """Entries held per KV head, on average over the scored layers (`_scored_layers`)."""
        layers = self._scored_layers(stream).values()
        heads = sum(layer.valid.shape[0] for layer in layers)
        return int(sum(layer.valid.sum() for layer in layers)) / max(heads, 1)  # one host sync

    def _must_evict(self, stream: Stream, incoming: int, upcoming: int) -> bool:
        """Evict after a chunk of `incoming` tokens if the scored layers would then hold more than the budget (the
        read's last chunk, `upcoming` == 0) or could not take the next chunk of `upcoming` tokens within the
        working limit — or, in compact positions, within the model's positions with PROBE_ROOM to spare.
        Sliding-window layers are trimmed after every chunk regardless, without scoring."""
        if (self.max_kl is not None or self.chooses_storage) and not upcoming:
            return True  # the last eviction chooses by the tolerance, or the storage, whatever is held
        if self.budget is None:
            return False
        if self.mode == "compact" and stream.next_rope + incoming + upcoming + PROBE_ROOM > self.adapter.max_positions:
            return True  # positions run with the head that keeps most, not the mean the working limit counts
        held = self.held_per_head(stream) + incoming
        return held > self.budget if not upcoming else held + upcoming > self.working

    def trim_windows(self, stream: Stream) -> None:
        """Drop what sliding-window layers can no longer see (nothing to score: the window decides)."""
        for layer in stream.cache.layers:
            if layer.window is not None and layer.capacity > layer.window:
                layer.keep(layer.rope_positions > stream.next_rope - layer.window)

    def eviction_step(self, stream: Stream, ctx: ForwardContext, logits: torch.Tensor | None, w: int,
                      final: bool = False, judged: tuple[int, int] | None = None, budget: int | None = None,
                      appended: int = 0, recent: int = 0, restricted: bool = False) -> EvictionStep:
        """What policies may read about the last `w` tokens (the probes) of the forward that produced `ctx`; the
        eviction keeps the `recent` last tokens read (not counting the `appended` probe tokens) whatever the
        scores."""
        budget = self.budget if budget is None else budget
        read_end = stream.next_position - appended
        return EvictionStep(
            cache=self.adapter.scoring_view(stream.cache),
            adapter=self.adapter,
            probes=ctx.probes,
            probe_positions=torch.arange(stream.next_position - w, stream.next_position, device=self.device),
            residuals=ctx.residuals,
            logits=logits[-w:] if ctx.probe_rows and logits is not None else None,
            generator=self.generator,
            final=final,
            judged=judged,
            restricted=restricted,
            read_end=read_end,
            kept_fraction=self.kept_fraction(read_end, budget),
            budget=budget,
            score_dtype=self.score_dtype,
            sinks=sink_count(budget) if budget is not None else 0,
            recent=range(read_end - min(recent, read_end), read_end),
            backward=lambda samples, live, rows=w: head_output_gradients(
                self.model, stream.cache, stream.tokens[-rows:],
                torch.arange(stream.next_rope - rows, stream.next_rope, device=self.device), samples, self.generator,
                live,
            ),
            output_gradient_norms=lambda: attention_output_gradient_norms(
                self.model, self.adapter.attentions, self.adapter.final_norm, stream.cache, stream.tokens[-w:],
                torch.arange(stream.next_rope - w, stream.next_rope, device=self.device),
            ),
        )

    @torch.inference_mode()
    def evict(
        self, stream: Stream, ctx: ForwardContext, logits: torch.Tensor, recent: int, budget: int | None = None,
        final: bool = False, keep: range = range(0), drafted: Continuation | None = None,
    ) -> None:
        """Bring the cache back within `budget` (default: the engine's): sliding layers to their window, the others
        by policy score, judged by the probes of the forward that produced `ctx` (its last tokens); the `recent`
        last tokens and the positions in `keep` are always kept."""
        w = min(recent, stream.next_position)
        scored = self._scored_layers(stream)
        step = self.within_tolerance(self.eviction_step(stream, ctx, logits, w, final, budget=budget, recent=w))
        scores = self.policy.score_layers(step, list(scored))
        self._choose(stream, step, scores, recent, budget, keep, self.refit_targets(stream, ctx, step), None, drafted)

    def kept_fraction(self, read: int, budget: int | None = None) -> float | None:
        """What part of `read` tokens (read, not probe tokens appended) an eviction to `budget` (default: the
        engine's) keeps."""
        budget = self.budget if budget is None else budget
        return None if budget is None else min(1.0, budget / max(1, read))

    @torch.inference_mode()
    def evict_with(self, stream: Stream, probe_sets: Iterator[ProbeSet], recent: int, budget: int | None = None,
                   final: bool = False, drafted: Continuation | None = None) -> None:
        """`evict`, judged by probe sets appended to the stream (drafts, ...) instead of the last tokens read: each
        set is scored and forgotten in turn, and the entries' scores add up over the sets. The last tokens read are
        not the probes here, so the probes judge them too: of the `recent` window only the last token read stays
        protected (the one the next token attends to first). On 512-token reads that made `kl`'s KL 0.66-0.92x and
        `compress`'s 0.69-0.86x what protecting the whole window gave (docs/research-log.md)."""
        scored = self._scored_layers(stream)
        held = LayerStack.of(scored)  # before any probe is appended: the entries judged
        kept_recent = 1  # of the last tokens read, the probes judge all but the last
        total = None
        targets: list[dict] = []
        for probe_set in probe_sets:
            step = self.within_tolerance(self.eviction_step(stream, probe_set.ctx, probe_set.logits, probe_set.rows,
                                                            final, budget=budget, appended=probe_set.appended,
                                                            recent=kept_recent))
            scores = held.stack(self.policy.score_layers(step, list(scored)))  # the probes' own columns cut off
            total = scores if total is None else total + scores
            targets.append(self.refit_targets(stream, probe_set.ctx, step, dict(zip(held.layer_ids, held.widths))))
        if total is None:  # no room for probes past the end: judge by the last tokens read instead
            logits, ctx = self.probe_again(stream, recent if self.policy.needs_probes else 1)
            return self.evict(stream, ctx, logits, recent, budget, final, drafted=drafted)
        self._choose(stream, step, held.split(total), kept_recent, budget, range(0), _stack_rows(targets), held,
                     drafted)

    def within_tolerance(self, step: EvictionStep) -> EvictionStep:
        """The read's last eviction under `max_kl` or a storage choice is scored for no budget: the budget is what
        the tolerance then allows (`_budget_within`) or the storage chosen gets (`_storage_within`), and what a
        policy keeps at a budget beyond its scores (`Policy.at_budget`) is added for each one tried."""
        choosing = self.max_kl is not None or self.chooses_storage
        return replace(step, budget=None, kept_fraction=None) if step.final and choosing else step

    def _choose(self, stream: Stream, step: EvictionStep, scores: Mapping[int, torch.Tensor], recent: int,
                budget: int | None, keep: range, targets: dict | None, stack: LayerStack | None,
                drafted: Continuation | None) -> None:
        """`_keep_best`, at the budget the tolerance allows where the read's last eviction is under `max_kl`."""
        if step.final and self.max_kl is not None and drafted is not None:
            budget, stream.drift, evicted = self._budget_within(stream, step, scores, recent, keep, targets, drafted)
            if evicted is not None:  # the search measured a copy evicted to that budget: evicting again redoes it
                stream.cache, stream.next_rope, stream.kept_budget = evicted.cache, evicted.next_rope, budget
                return
            scores, targets = self._at_budget(stream, step, scores, recent, budget, targets)
        elif step.final and self.chooses_storage:
            if drafted is not None:
                stream.stored_as, budget, stream.drift = self._storage_within(stream, step, scores, recent, keep,
                                                                              targets, drafted)
            else:  # no room past the read to sample a continuation: the storage with the most bits
                budget = self.storage[stream.stored_as]
            scores, targets = self._at_budget(stream, step, scores, recent, budget, targets)
        self._keep_best(stream, scores, recent, budget, keep, targets, stack)
        if step.final:
            stream.kept_budget = budget

    def _at_budget(self, stream: Stream, step: EvictionStep, scores: Mapping[int, torch.Tensor], recent: int,
                   budget: int, targets: dict | None) -> tuple[Mapping[int, torch.Tensor], dict | None]:
        """Budget-free scores and refit targets as an eviction to `budget` uses them."""
        read = step.read_end or stream.next_position
        at = replace(step, budget=budget, kept_fraction=self.kept_fraction(read, budget), sinks=sink_count(budget),
                     recent=range(read - min(recent, read), read))
        refit = targets and self.policy.refits(True, at.kept_fraction, reread=self.reconstruction is not None)
        return self.policy.at_budget(at, dict(scores)), targets if refit else None

    def _budget_within(self, stream: Stream, step: EvictionStep, scores: Mapping[int, torch.Tensor], recent: int,
                       keep: range, targets: dict | None, drafted: Continuation
                       ) -> tuple[int, dict | None, Stream | None]:
        """The smallest budget (entries per head, within the engine's budget if it has one) whose cache drifts at
        most `max_kl` on the sampled continuation, to 10 % of it (tolerance.smallest_within): each budget measured is
        an eviction of a copy of the stream and one forward of the continuation; the next one is placed by the
        summed scores of what each budget would evict, which cost no forward. The largest, where even it drifts
        further. Returns it, its drift as measured (what the stream's eviction to it would measure again; None
        where it was not measured) and the copy evicted to it (None where it was not measured)."""
        most = self.budget if self.budget is not None else stream.next_position
        least = min(most, sink_count(most) + recent + 1)
        drifts, predicted, kept, measured, within = self._tolerance_trials(stream, step, scores, recent, keep, targets,
                                                                           drafted)
        # a cache that keeps every entry held (its values as they are: a refit over the whole softmax changes
        # nothing), stored as it is, drifts 0: nothing to measure
        unchanged = bool(kept(most).eq(LayerStack.of(self._scored_layers(stream)).valid).all()) \
            and stream.stored_as is None and not drafted.evicted_before
        budget, _ = smallest_within(drifts, predicted, least, most, self._sampled_tolerance(stream),
                                    known=0.0 if unchanged else None)
        return budget, measured.get(budget), within.get(budget)

    def _sampled_tolerance(self, stream: Stream) -> float:
        """`max_kl` as a sampled KL (`DriftCalibration.sampled_within`): the search compares sampled KLs, which move
        about in proportion to the summed scores that guide it (tolerance.py), where the estimate is a power of
        them."""
        return self.drift_calibration.sampled_within(self.max_kl, stream.next_position)

    def _tolerance_trials(self, stream: Stream, step: EvictionStep, scores: Mapping[int, torch.Tensor], recent: int,
                          keep: range, targets: dict | None, drafted: Continuation):
        """What `_budget_within` asks of a budget (examples/maxkl_search.py records them for every budget):
        `drifts(budget)`, the sampled drift of the cache an eviction to it keeps, measured (a copy of the stream
        evicted with its refit, then the sampled continuation over it; each measurement kept in `measured`, and the
        copy of the smallest budget whose sampled drift is within `max_kl` carried back (`_sampled_tolerance`) in
        `within`, which the search returns if it ends there);
        `predicted(budget)`, the budget-free scores of the entries it evicts, summed (a selection alone, no forward);
        `kept(budget)`, that selection's (L, H, C) masks."""
        held = LayerStack.of(self._scored_layers(stream))
        budget_free = held.stack(scores).nan_to_num(0.0, 0.0, 0.0).clamp(min=0).masked_fill(~held.valid, 0)
        masks: dict[int, torch.Tensor] = {}
        evicted: dict[int, float] = {}
        measured: dict[int, dict] = {}
        within: dict[int, Stream] = {}  # at most one copy held besides the stream
        tolerance = None if self.max_kl is None else self._sampled_tolerance(stream)

        def kept(budget: int) -> torch.Tensor:
            if budget not in masks:
                at_budget, _ = self._at_budget(stream, step, scores, recent, budget, None)
                masks[budget] = self._keep_masks(stream, at_budget, recent, budget, keep, held)
            return masks[budget]

        def predicted(budget: int) -> float:
            if budget not in evicted:
                evicted[budget] = float(budget_free.masked_fill(kept(budget), 0).sum())
            return evicted[budget]

        def drifts(budget: int) -> float:
            trial = stream.clone()
            at_budget, fit = self._at_budget(stream, step, scores, recent, budget, targets)
            self._keep_best(trial, at_budget, recent, budget, keep, fit)
            measured[budget] = self.measure_drift(self.as_stored(trial), drafted)
            sampled = measured[budget]["sampled_kl"]
            if tolerance is not None and sampled <= tolerance and all(budget < b for b in within):
                within.clear()
                within[budget] = trial
            return sampled

        return drifts, predicted, kept, measured, within

    def _storage_within(self, stream: Stream, step: EvictionStep, scores: Mapping[int, torch.Tensor], recent: int,
                        keep: range, targets: dict | None, drafted: Continuation) -> tuple[str, int, dict]:
        """Of the storage dtypes and the budget each gets, the one whose cache, evicted to that budget and stored,
        drifts least on the sampled continuation (the first, with more bits, on a tie): fewer entries against
        coarser ones, judged by the KL the stored cache gives, quantization error included. A dtype with fewer bits
        is tried only where it buys more entries than every one before it (the storage is ordered most bits first):
        the same entries, coarser, can only win by the sample's chance (a `--budget` capping all of them). Returns it,
        its budget and its drift (what the stream's eviction to that budget, stored, would measure again)."""
        best, most = None, 0
        for dtype, budget in self.storage.items():
            if budget <= most:
                continue
            most = budget
            trial = stream.clone()
            at_budget, fit = self._at_budget(stream, step, scores, recent, budget, targets)
            self._keep_best(trial, at_budget, recent, budget, keep, fit)
            trial.stored_as = dtype
            trial.cache, _ = stored_cache(trial.cache, dtype, self.device, self.dtype)
            drift = self.measure_drift(trial, drafted)
            if best is None or drift["kl"] < best[2]["kl"]:
                best = (dtype, budget, drift)
        return best

    def as_stored(self, stream: Stream) -> Stream:
        """`stream` as its cache will be stored (`stored_as`) and read back; itself when it is stored as it is."""
        if stream.stored_as is None:
            return stream
        stored = stream.clone()
        stored.cache, _ = stored_cache(stream.cache, stream.stored_as, self.device, self.dtype)
        return stored

    def drafts_for_drift(self, stream: Stream, read_logits: torch.Tensor) -> Continuation | None:
        """A continuation sampled for measuring the read's drift (`measure_drift`): DRIFT_LANES independent
        ones side by side, token by token from the cache of the whole read — the one held before the last
        choice with what earlier evictions set aside (`Evicted`) — with that cache's logits for them (sampled
        on the probe copy where there is one, and then read again on the model, in one forward); none unless
        the engine measures drift. Never the look-ahead drafts: the choice (and the refit) is fitted to those,
        and their Jacobi rounds start from a repeat of the last tokens read, so they copy more than the text
        that follows does."""
        if self.drift_generator is None:
            return None
        evicted, stream.evicted = stream.evicted, None  # let go once used: the last eviction needs none of it
        whole = evicted is None or evicted.whole
        before = evicted is not None and evicted.evictions > 0 and whole
        # over every entry the read produced, where earlier evictions set them aside: the drift of the whole read
        reference = Stream(evicted.with_held(stream.cache), list(stream.tokens), stream.next_rope) if before else stream
        steps = min(drift_steps(stream.next_position), self.room(stream))
        lanes = Lanes(reference.next_position, reference.next_rope, DRIFT_LANES)
        tokens, rows = self.sample_lanes(reference, read_logits, lanes, steps, self.drift_generator, probing=True,
                                         temperature=DRIFT_TEMPERATURE)
        head_inputs = None
        if self.probe_model is not None and tokens:  # sampled on the probe copy: their logits from the model itself
            self.forget_drafts(reference, len(tokens))
            # the change through the copy's head where that head is linear and narrower than the model's
            narrower = torch.finfo(self.probe_dtype).bits < torch.finfo(self.dtype).bits
            last, ctx = self.forward(reference, tokens, logits_rows=len(tokens), probing=True, measuring=True,
                                     lanes=lanes, head_inputs=narrower and self.adapter.logit_softcap is None)
            head_inputs = ctx.sampled_inputs
            rows = [last] if head_inputs is None else [self.head_logits(self.model, head_inputs), last]
        if reference is stream:
            self.forget_drafts(stream, len(tokens))
        return Continuation(tokens, torch.cat(rows), DRIFT_LANES, whole, before, head_inputs) if tokens else None

    def sample_lanes(self, stream: Stream, last_logits: torch.Tensor, lanes: Lanes, steps: int,
                     generator: torch.Generator, probing: bool = False, temperature: float = 1.0
                     ) -> tuple[list[int], list[torch.Tensor]]:
        """`steps` tokens per lane of `lanes`, side by side past the end of `stream` (to which they are appended), each
        step's tokens (one per lane) drawn from the logits the step before gave, the first from `last_logits` (the
        read's last row): the tokens step-major, and each step's logits (lanes, vocab) after its tokens. `probing`:
        on the probe copy where there is one (attention.Lanes; Engine.forward)."""
        tokens, rows = [], []
        logits = last_logits.reshape(-1, last_logits.shape[-1])[-1:].expand(lanes.count, -1)
        for _ in range(steps):
            step = sample_rows(logits / temperature, generator)  # one token per lane
            logits, _ = self.forward(stream, step, logits_rows=lanes.count, probing=probing, lanes=lanes)
            tokens += step
            rows.append(logits)
        return tokens, rows

    @torch.inference_mode()
    def head_logits(self, model: PreTrainedModel, head_inputs: torch.Tensor) -> torch.Tensor:
        """`model`'s output head on `head_inputs` (rows, d), finished as the model finishes its logits, in float32."""
        head = model.get_output_embeddings()
        return self.adapter.finish_logits(head(head_inputs.to(head.weight.dtype)).float())

    def measure_drift(self, stream: Stream, drafted: Continuation) -> dict:
        """How far the read's evictions moved the model: a continuation sampled from the whole read's cache, read
        again over the cache after the last choice (its lanes in one forward), and the mean KL of its next-token
        distributions against those before (`sampled_kl`), with a 95 % interval over the lanes (a lane's tokens are
        not independent samples) — carried through the drift calibration at the read's length (`DriftCalibration`;
        its `calibration` scale and `slope`) to an estimate of the KL of the text that follows (`kl`, `ci95`), and
        where that KL lands for 80 % of caches (`range80`, where the calibration has measured it). `covers`: "read",
        or "last eviction" where what earlier evictions dropped could not be set aside (`Evicted`)."""
        lanes = Lanes(stream.next_position, stream.next_rope, drafted.lanes)
        cheap = drafted.head_inputs is not None
        after, ctx = self.forward(stream, drafted.tokens, logits_rows=len(drafted.tokens), probing=True,
                                  measuring=True, lanes=lanes, head_inputs=cheap)
        self.forget_drafts(stream, len(drafted.tokens))
        if cheap:  # the logits' change through the probe copy's head, over the likeliest tokens: its rounding scales
            # with the change
            weight = self.probe_model.get_output_embeddings().weight
            change = ctx.sampled_inputs.float() - drafted.head_inputs.float()
            kl = torch.cat((drafted.over_support(weight).kl_of_head_change(change), drafted.last.kl(after)))
        else:
            kl = drafted.before.kl(after)
        per_lane = kl.view(-1, drafted.lanes).mean(dim=0)
        spread = float(per_lane.std()) if per_lane.numel() > 1 else 0.0
        sampled, ci95 = float(kl.mean()), 1.96 * spread / math.sqrt(per_lane.numel())
        estimate, interval = self.drift_calibration.estimate(sampled, ci95, stream.next_position)
        drift = {"kl": estimate, "ci95": interval, "drafts": kl.numel(), "sampled_kl": sampled,
                 "calibration": self.drift_calibration.scale(stream.next_position),
                 "slope": self.drift_calibration.slope, "covers": "read" if drafted.whole else "last eviction"}
        likely = self.drift_calibration.likely(estimate, stream.next_position)
        if likely is not None and drafted.whole:  # the range was measured on whole reads' estimates
            drift["range80"] = list(likely)
        return drift

    def refit_targets(self, stream: Stream, ctx: ForwardContext, step: EvictionStep, held: dict[int, int] | None = None
                      ) -> dict:
        """What the kept values are refit to (kernels/refit.py), from the probes of `ctx`, when the policy asks for it
        at this eviction `step` (`Policy.refits`: e.g. at the read's last eviction):
        per scored layer, the probes' attention over the `held` first columns (default: all), their head outputs,
        and the part of those outputs from the columns beyond (the probes' own appended tokens, about to be
        forgotten). Empty when the probes saw only some entries, or the cache's values are not what heads attend
        over (MLA's latent)."""
        wanted = self.policy.refits(step.final, step.kept_fraction, reread=self.reconstruction is not None)
        if not wanted or self.adapter.scoring_view(stream.cache) is not stream.cache:
            return {}
        out = {}
        for i, layer in self._scored_layers(stream).items():
            probe = ctx.probes.get(i)
            if probe is None or probe.columns is not None:
                return {}
            c = layer.capacity if held is None else held[i]
            weights, output = probe.weights[..., :c].float(), probe.output.float()
            appended = None
            if c < layer.capacity:  # each KV head's query heads as rows: its values are read once, not copied
                kv, (hq, w, _) = layer.values.shape[0], weights.shape
                held_part = weights.reshape(kv, hq // kv * w, c) @ layer.values[:, :c].float()
                appended = output - held_part.view(hq, w, -1)
            out[i] = (weights, output, appended)
        return out

    def _keep_masks(self, stream: Stream, scores: Mapping[int, torch.Tensor], recent: int, budget: int,
                    keep: range, stack: LayerStack) -> torch.Tensor:
        """(L, H, C) masks over the scored layers' `stack`: the best-scoring entries within `budget`, with the `recent`
        last tokens, the attention sinks and the positions in `keep`."""
        scored = self._scored_layers(stream)
        w, sinks = min(recent, stream.next_position), sink_count(budget)
        p = stack.positions
        # a sliding layer (scored only when every layer slides) sees no sink beyond its window
        layer_sinks = torch.tensor([sinks if layer.window is None else 0 for layer in scored.values()],
                                   device=p.device)
        protect = (in_floor(p, layer_sinks[:, None, None], range(stream.next_position - w, stream.next_position))
                   | ((p >= keep.start) & (p < keep.stop)))
        if self.policy.allocation == "global":
            return select_global(stack, stack.stack(scores), budget, protect, min_per_head=w,
                                 max_per_head=self.head_cap)
        budgets = self.policy.layer_budgets(budget, self.adapter.num_layers, min(budget, sinks + w))
        return pad_stack([select_keep(layer, scores[i], budgets[i] if budgets else budget,
                                      protect[n, :, : layer.capacity])
                          for n, (i, layer) in enumerate(scored.items())], fill=False)

    def _keep_best(self, stream: Stream, scores: Mapping[int, torch.Tensor], recent: int, budget: int | None,
                   keep: range = range(0), targets: dict | None = None, stack: LayerStack | None = None) -> None:
        """Keep the best-scoring entries of the scored layers within `budget` (and the `recent` last tokens and the
        positions in `keep`: `_keep_masks`), refit the kept values to `targets` if any; all layers at once (`stack`:
        the scored layers' `LayerStack`, if the caller has it)."""
        budget = self.budget if budget is None else budget
        scored = self._scored_layers(stream)
        if budget is not None and scored:
            stack = LayerStack.of(scored) if stack is None else stack
            masks = self._keep_masks(stream, scores, recent, budget, keep, stack)
            if stream.evicted is not None:  # before the refit: what is set aside is what the read produced
                stream.evicted.add(scored, masks, stack.widths)
            if targets:
                for layer in scored.values():
                    layer.materialize()  # the refit writes into the values
                self._refit(scored, masks, targets)
            order, capacities = keep_orders(masks)
            for n, layer in enumerate(scored.values()):
                layer.keep(masks[n, :, : stack.widths[n]], order[n], capacities[n])
        self.trim_windows(stream)  # last: the Fisher re-run needs the probes as every layer's last columns
        if self.mode == "compact":
            self.compact(stream)

    def _refit(self, scored: dict, masks: torch.Tensor, targets: dict) -> None:
        """Refit each scored layer's kept values (keep masks (L, H, C)) to the probes' outputs (`refit_targets`)."""
        width = max(weights.shape[-1] for weights, _, _ in targets.values())
        columns, present = mask_columns(masks[..., :width].flatten(0, 1))  # one host sync for every layer
        columns, present = columns.view(*masks.shape[:2], -1), present.view(*masks.shape[:2], -1)
        for n, (i, layer) in enumerate(scored.items()):
            if i in targets:
                weights, outputs, appended = targets[i]
                c = weights.shape[-1]
                layer.values[:, :c] = refit_values(weights, outputs, layer.values[:, :c], columns[n], present[n],
                                                   appended, self.policy.refit_ridge, held=layer.valid[:, :c])

    @torch.inference_mode()
    def reconstruct(self, stream: Stream, kept: int = 0) -> None:
        """Judge the entries read since the last time by reconstruction probes (probes.Reconstruction): the policy
        keeps what it learns in per-entry state that travels with the entries (`Policy.absorb_reconstruction`). The
        last `kept` tokens read are kept by the eviction whatever their scores (its recent window): they are not
        re-read now, but by the next re-reading, if one comes."""
        scored = list(self._scored_layers(stream))
        # the tokens read since the last eviction sit at their position less this many rotary positions (compact mode)
        shift = stream.next_position - stream.next_rope
        stop = stream.next_position - kept
        requests = self.reconstruction.requests(stream.tokens, stream.reconstructed, self.adapter.max_positions + shift,
                                                stop)
        for probe_set in self.probe_sets(stream, requests):
            step = self.eviction_step(stream, probe_set.ctx, probe_set.logits, probe_set.rows,
                                      judged=probe_set.judged, appended=probe_set.appended,
                                      restricted=probe_set.restricted)
            self.policy.absorb_reconstruction(step, scored)
        stream.reconstructed = max(stream.reconstructed, stop)

    def room(self, stream: Stream) -> int:
        """Tokens that can still be appended to the stream within the model's positions."""
        return self.adapter.max_positions - stream.next_rope

    def place(self, stream: Stream, request: ProbeRequest) -> int | None:
        """The first rotary position of a probe request's tokens: the stream's next, where they fit within the model's
        positions; else, for a request that sees only some entries (a re-reading of one span), as late as the
        positions allow, provided that is after every entry it sees (so a document read close to the model's last
        position is still re-read). None: it fits nowhere."""
        latest = self.adapter.max_positions - len(request.ids)
        if stream.next_rope <= latest:
            return stream.next_rope
        if request.attends is None or latest < 0:
            return None
        seen = [layer.rope_positions.masked_fill(~(request.attends(layer) & layer.valid), -1).max()
                for layer in stream.cache.layers if layer.capacity]
        return latest if not seen or int(torch.stack(seen).max()) < latest else None  # one host sync

    def probe_sets(self, stream: Stream, requests: Requests) -> Iterator[ProbeSet]:
        """Run a probe source's requests at the stream's end (probes.py; where they fit: `place`), yielding each
        scored one's statistics while its tokens are in the stream, and forgetting every request's tokens once it
        has been used (the cache, tokens and positions are then what they were)."""
        logits = None
        while True:
            try:
                request = requests.send(logits)
            except StopIteration:
                return
            start = self.place(stream, request)
            if start is None:
                return
            logits, ctx = self.forward(stream, request.ids, probe_rows=request.rows, logits_rows=request.logits_rows,
                                       probe_entries=request.entries,
                                       attend_entries=request.attends, probing=True,
                                       rope_start=start)
            try:
                if request.scored:  # the rows' logits, where the source asked for them all
                    yield ProbeSet(ctx, logits if request.logits_rows >= request.rows else None, len(request.ids),
                                   request.rows, request.judged, restricted=request.attends is not None)
            finally:  # also when the caller stops early
                self.forget_drafts(stream, len(request.ids))

    def forget_drafts(self, stream: Stream, count: int) -> None:
        """Drop the last `count` tokens of the stream (sampled drafts): their cache entries, tokens and positions.
        Entries just appended are the last columns of every layer and are cut off (no re-packing, and the spare
        columns stay for the next forward); after an eviction has re-packed them they are masked out."""
        end = stream.next_position - count
        layers = stream.cache.layers
        # a head holds each position at most once, so if the last `count` columns are all drafts, they all are
        # (asked of every layer at once: one host sync)
        tails = [layer.capacity - count for layer in layers]
        cut = torch.stack([(layer.positions[:, max(tail, 0) :] >= end).all() & (tail >= 0)
                           for layer, tail in zip(layers, tails)]).tolist()
        for layer, tail, at_end in zip(layers, tails, cut):
            if at_end:
                layer.truncate(tail)
            else:
                layer.keep(layer.positions < end)
        del stream.tokens[end:]
        stream.next_rope -= count

    @torch.inference_mode()
    def probe_again(self, stream: Stream, w: int) -> tuple[torch.Tensor, ForwardContext]:
        """Re-run the last `w` tokens against the cache as it stands (their entries are already in it) to record
        probe statistics — used during decoding, where tokens arrive one at a time."""
        rope = torch.arange(stream.next_rope - w, stream.next_rope, device=self.device)
        ctx = ForwardContext(FrozenCache(stream.cache), rope, probe_rows=w)
        with forward_context(ctx):
            out = run_with_cache(
                self.model, ctx.cache, input_ids=torch.tensor([stream.tokens[-w:]], device=self.device),
                position_ids=rope[None], logits_to_keep=w,
            )
        return out.logits[0].float(), ctx

    def compact(self, stream: Stream) -> None:
        """Re-rotate every head's kept keys to consecutive positions ending just before the next token."""
        lengths = [layer.lengths() for layer in stream.cache.layers]
        target = max(int(n.max()) for n in lengths if n.numel())
        for idx, layer in enumerate(stream.cache.layers):
            rank = layer.valid.long().cumsum(dim=1) - 1
            new_rope = (target - lengths[idx][:, None] + rank).masked_fill(~layer.valid, -1)
            delta = (new_rope - layer.rope_positions).masked_fill(~layer.valid, 0)
            self.adapter.rerotate_layer(layer, delta, idx)
            layer.rope_positions = new_rope
        stream.next_rope = target

    # ---- decoding ------------------------------------------------------------------------------------------
    def generate(
        self,
        stream: Stream,
        prompt_ids: list[int],
        max_new_tokens: int,
        stop_ids: set[int],
        temperature: float = 0.0,
        top_p: float = 1.0,
        slack: int = 64,
        repetition_penalty: float = 1.0,
        no_repeat: int = 0,
    ) -> Iterator[int]:
        """Append the prompt (never evicted) and decode; greedy unless `temperature` > 0. With a budget, the cache
        is re-compressed whenever generation has grown it by `slack` entries per head beyond the budget (or beyond
        what the prompt left, if more), with the latest tokens as probes. No `no_repeat`-token run of the answer is
        written twice (sampling.SpanBan)."""
        logits = self.feed(stream, prompt_ids, evict=False)
        prompt = range(stream.next_position - len(prompt_ids), stream.next_position)
        limit = None if self.budget is None else max(self.budget, math.ceil(self.held_per_head(stream)))
        answer: list[int] = []
        ban = SpanBan(no_repeat)
        for i in range(max_new_tokens):
            allowed = ban.apply(penalise_repeats(logits, answer, repetition_penalty), answer)
            token = sample(allowed, temperature, top_p, self.generator)
            if token in stop_ids:
                return
            answer.append(token)
            ban.add(answer)
            yield token
            if i == max_new_tokens - 1:
                return  # nothing more to predict: don't pay for a forward of the last token
            logits = self.forward(stream, [token])[0][-1]
            self.check_finite(logits)
            if limit is not None and self.held_per_head(stream) > limit + slack:
                recent = self.recent_window(slack, limit)
                probe_logits, ctx = self.probe_again(stream, recent if self.policy.needs_probes else 1)
                self.evict(stream, ctx, probe_logits, recent, budget=limit, keep=prompt)


def _stack_rows(targets: list[dict]) -> dict:
    """Refit targets of several probe sets as one (`Engine.refit_targets`): their rows side by side; empty if any
    set has none. Sets appended to the stream always carry their appended part."""
    if not targets or not all(targets):
        return {}
    if len(targets) == 1:
        return targets[0]
    return {i: tuple(torch.cat([t[i][k] for t in targets], dim=1) for k in range(3)) for i in targets[0]}
