"""The product's operations, independent of the command line: read a document into a compressed stream, answer from
a stream, and move a stream to and from a `.kvc` file.

The CLI and the bench both call these; the engine below them knows nothing about documents, prompts or files.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import PreTrainedModel

from klevict_cli import __version__, calibrations
from klevict_cli.adapter_check import adapter_for
from klevict_cli.adapters import ModelAdapter
from klevict_cli.cache import KVCache
from klevict_cli.documents import Document
from klevict_cli.engine import WORKING_FACTOR, Engine, Plan, Stream, drift_steps, measures_drift, plan_positions
from klevict_cli.errors import CacheFileError, ResourceError
from klevict_cli.kvc import QUANTIZED_BITS, KvcFile, LayerSpec, PackedLayer, kv_bytes, load_kvc, save_kvc
from klevict_cli.models import LoadedModel, probe_copy
from klevict_cli.options import Budget, ByteLimit, format_size, resolve_probe_dtype
from klevict_cli.policies import POLICIES, make_policy
from klevict_cli.probes import Reconstruction
from klevict_cli.prompts import encode_text, frame_for, stop_ids
from klevict_cli.quantized import (
    EXACT, GROUP, STORAGE_CHOICES, entry_bytes, head_bytes, layer_cache, packed_layers, stored_cache,
)

QUESTION_ROOM = 256  # tokens kept free for a question when planning positions


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timings on a GPU would otherwise end before it does)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# What `estimate_peak_bytes` adds for what its terms do not count: the Python/torch runtime, what the allocator keeps
# between chunks, the entries set aside for the drift, and the probes' logits over the vocabulary (the drift's
# reference in float64, the look-ahead drafts'). Fitted to the peak resident size of a 2,270-token `compress` by
# SmolLM2-135M (1.92 GiB) and Gemma-3-270M (3.51 GiB) on CPU (docs/research-log.md, "a user's pass, round five").
RUNTIME_BYTES = 680 * 2**20
RUNTIME_LOGIT_ROWS = 1200


def creation_time() -> str:
    """When a cache is made: now, or the time SOURCE_DATE_EPOCH gives (the reproducible-builds convention), so that
    the same read gives the same bytes."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    when = datetime.fromtimestamp(int(epoch), timezone.utc) if epoch.isdigit() else datetime.now(timezone.utc)
    return when.isoformat(timespec="seconds")


@dataclass
class ReadSettings:
    budget: Budget | None  # None: keep everything
    method: str = "kl"
    chunk_size: int = 512
    probe_window: int = 32
    position_mode: str = "auto"
    seed: int = 0
    max_new_tokens: int = 256  # planned answer length (room reserved in the positions)
    max_memory: int | None = None  # bytes; refuse up front what would not fit
    working: float | Budget | None = None  # working limit: × the budget, or a count (None: engine.WORKING_FACTOR)
    reconstruct: bool = False  # judge entries by reconstruction probes too (kl; kvzip always does)
    # measure the last eviction (Engine.measure_drift): the cache's estimated KL; None: where the read is long enough
    # for that to be cheap (engine.drift_steps)
    measure_drift: bool | None = False
    max_kl: float | None = None  # keep the smallest cache (within `budget`, if any) whose estimated KL is at most this
    cache_dtype: str | None = None  # what the cache will be stored as (its drift is measured so); None: as it is
    # keys and values within this many bytes: of float16, int8 and int4 (or `cache_dtype`), each at the budget that
    # fits, the one whose stored cache drifts least (Engine.storage)
    max_bytes: ByteLimit | None = None
    probe_dtype: str = "auto"  # the probing forwards' precision (options.PROBE_DTYPE_CHOICES; Session.probe_model)


@dataclass
class GenerateSettings:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    repetition_penalty: float = 1.1
    no_repeat: int = 8  # no run of this many answer tokens written twice (0: off)


@dataclass
class ReadResult:
    stream: Stream
    plan: Plan
    document_tokens: int
    prefix_tokens: int
    seconds: float
    settings: ReadSettings
    document: Document | None
    notes: list[str] = field(default_factory=list)
    engine: Engine | None = None  # the engine that read it (to read on: a continuation, as the bench does)
    logits: torch.Tensor | None = None  # the read's last next-token logits
    peak_cache_bytes: int = 0  # the most the cache held while reading (a chunk's forward: what was kept + the chunk)

    @property
    def budget(self) -> str | None:
        """The budget as asked (`10%`), None where none was or the method keeps everything."""
        asked = self.settings.budget is not None and self.settings.method != "none"
        return str(self.settings.budget) if asked else None

    @property
    def kept_budget(self) -> int | None:
        """Entries per KV head the cache was evicted to: the budget, or what `max_kl` / `max_bytes` chose within it;
        None where everything read was kept."""
        return self.stream.kept_budget if self.stream.kept_budget is not None else self.plan.budget

    def summary(self) -> dict:
        """What the read did, as `compress` and `summarize --json` report it (a batch's lines and manifest too)."""
        kept = sum(sum(c) for c in self.stream.cache.kept_counts())
        return {
            "document": {"name": self.document.name, "sha256": self.document.sha256, "tokens": self.document_tokens},
            "prefix_tokens": self.prefix_tokens,  # the chat frame's, before the document: the budget counts them too
            "method": self.settings.method,
            "budget": self.budget,  # as asked; null where none was (--max-kl, --max-bytes) or nothing is evicted
            "max_kl": self.settings.max_kl,
            "budget_tokens": self.plan.budget,  # the budget (or cap) in entries per KV head
            "kept_budget": self.kept_budget,  # what the last eviction kept per KV head: --max-kl / --max-bytes choose
            "position_mode": self.plan.mode,
            "kept_entries": kept,
            "cache_bytes": self.stream.cache.nbytes(),
            # the read's last eviction, measured on its drafts (mean KL per token, nats; None where nothing drafted)
            "estimated_kl": self.stream.drift,
            "read_seconds": round(self.seconds, 3),
            "tokens_per_second": round((self.document_tokens + self.prefix_tokens) / max(self.seconds, 1e-9), 1),
        }


def working_entries(working: float | Budget | None, budget: int | None) -> int | None:
    """The working limit in entries per head: a multiple of the budget, or a count (None: the engine's default)."""
    if working is None or budget is None:
        return None
    return working.tokens if isinstance(working, Budget) else int(working * budget)


def no_room(question: int, next_rope: int, positions: int, mode: str) -> str:
    """Say what is too long: the question itself, or the question after this cache (and what would shrink that)."""
    if question >= positions:
        return (f"the question is {question} tokens with the chat frame, more than the model's {positions} positions"
                " on its own; shorten it")
    shrink = "recompress with --position-mode compact" if mode == "original" else "recompress with a smaller --budget"
    return (f"the question ({question} tokens with the chat frame) does not fit after the cache, which ends at position"
            f" {next_rope} of the model's {positions}; shorten it to fewer than {positions - next_rope} tokens, or"
            f" {shrink}")


class Session:
    """A loaded model plus what every operation on it needs (adapter, prompt frame, stop tokens)."""

    def __init__(self, lm: LoadedModel, shipped_calibration: bool = True):
        self.lm = lm
        # policies start from the state measured once for this model, where klevict ships one (calibrations.py)
        shipped = calibrations.shipped_file(lm.weights_sha256) if shipped_calibration else None
        self.model_state = None if shipped is None else calibrations.state_of(shipped)
        self.drift_calibration = calibrations.drift_calibration(shipped)  # None: the engine's (the default model's)
        self.adapter: ModelAdapter = adapter_for(lm.model)
        self.frame = frame_for(lm.tokenizer)
        self.stop_ids = stop_ids(lm.tokenizer)
        self.probe_copies: dict[torch.dtype, PreTrainedModel] = {}  # made once, when a read first asks for one

    def probe_copy_dtype(self, probe_dtype: str) -> torch.dtype | None:
        """The dtype of the copy `--probe-dtype` asks for on this machine, or None: the probes run on the model."""
        param = next(self.lm.model.parameters())
        return resolve_probe_dtype(probe_dtype, param.device, param.dtype)

    def probe_model(self, probe_dtype: str) -> PreTrainedModel | None:
        """The copy of the model that runs a read's probing forwards at `probe_dtype` (models.probe_copy), or None
        where they run on the model itself."""
        dtype = self.probe_copy_dtype(probe_dtype)
        if dtype is not None and dtype not in self.probe_copies:
            self.probe_copies[dtype] = probe_copy(self.lm.model, dtype)
        return self.probe_copies.get(dtype)

    def probe_precision(self, probe_dtype: str) -> str:
        """The dtype the probing forwards run at on this machine (`probe_model`), by name."""
        dtype = self.probe_copy_dtype(probe_dtype) or next(self.lm.model.parameters()).dtype
        return str(dtype).removeprefix("torch.")

    def policy(self, method: str):
        """`method`'s policy as this model reads with it: from the state klevict ships for the model, if any."""
        policy = make_policy(method)
        if self.model_state is not None:
            policy.adopt(self.model_state, self.kv_heads())
        return policy

    @staticmethod
    def rereads(policy, settings: ReadSettings) -> bool:
        """Whether `policy` reads with a re-reading of the document (its probes) under `settings`."""
        return policy.reconstruction == "required" or (policy.reconstruction == "optional" and settings.reconstruct)

    def uses_probe_copy(self, settings: ReadSettings) -> bool:
        """Whether a read with `settings` runs forwards on the probe copy (`probe_model`): look-ahead drafts, a
        re-reading or the drift's samples. A drift measured only where the read turns out long enough (`measure_drift`
        None) does not count: that read makes the copy itself, where its 0.1 s are little."""
        if settings.method == "none" or self.probe_copy_dtype(settings.probe_dtype) is None:
            return False
        policy = self.policy(settings.method)
        chooses_storage = settings.max_bytes is not None and settings.cache_dtype is None
        measures = measures_drift(settings.measure_drift is True, settings.max_kl, chooses_storage)
        return policy.lookahead > 0 or self.rereads(policy, settings) or measures

    def engine(self, method: str, budget: int | None, settings: ReadSettings, mode: str,
               head_cap: int | None = None, storage: dict[str, int | None] | None = None) -> Engine:
        if settings.measure_drift is None:
            raise ValueError("measure_drift None is resolved per read, by read_tokens")
        policy = self.policy(method)
        wanted = self.rereads(policy, settings)
        closing = self.lm.tokenizer(self.frame.closing, add_special_tokens=False)["input_ids"]
        engine = Engine(
            self.lm.model, self.adapter, policy, budget,
            chunk_size=settings.chunk_size, probe_window=settings.probe_window, mode=mode, seed=settings.seed,
            head_cap=head_cap, working=working_entries(settings.working, budget),
            reconstruction=Reconstruction.for_tokenizer(self.lm.tokenizer, closing, span=policy.reconstruction_span,
                                                        sees=policy.reconstruction_sees) if wanted else None,
            measure_drift=settings.measure_drift, max_kl=settings.max_kl, drift_calibration=self.drift_calibration,
            storage=storage if storage is not None else {settings.cache_dtype: None} if settings.cache_dtype else None,
            probe_model=functools.partial(self.probe_model, settings.probe_dtype),
            score_dtype=self.probe_copy_dtype(settings.probe_dtype) or torch.float32,  # the probes' precision
        )
        if settings.max_memory is not None and engine.budget is not None:  # what is evicted is set aside within it
            engine.evicted_bytes = max(0, settings.max_memory - self.estimate_peak_bytes(
                engine.working, settings.chunk_size, settings.probe_dtype))
        return engine

    # ---- reading -------------------------------------------------------------------------------------------
    def read(
        self, document: Document, settings: ReadSettings,
        progress: Callable[[int, int], None] | None = None, reserve: int | None = None,
    ) -> ReadResult:
        """Tokenise and stream `document` (inside the chat frame) with eviction; the cache ends within budget."""
        return self.read_tokens(encode_text(self.lm.tokenizer, document.text), settings, progress, reserve, document)

    def read_tokens(
        self, doc_ids: list[int], settings: ReadSettings, progress: Callable[[int, int], None] | None = None,
        reserve: int | None = None, document: Document | None = None,
    ) -> ReadResult:
        """Stream a document's tokens inside the chat frame with eviction, keeping `reserve` positions free after
        it (default: a question and its answer). `read` for text; the bench reads its windows' tokens here, so
        that it measures exactly what the commands do."""
        prefix = self.frame.prefix_ids(self.lm.tokenizer)
        ids = prefix + doc_ids
        budget = settings.budget.resolve(len(ids)) if settings.budget is not None else None
        storage = None
        if settings.max_bytes is not None and settings.method != "none":
            storage = self.storage_budgets(settings.max_bytes, len(ids), settings.cache_dtype, budget)
            budget = max(storage.values())
        if settings.method == "none":
            budget = None
        room = reserve if reserve is not None else QUESTION_ROOM + settings.max_new_tokens
        plan = plan_positions(len(ids), budget, settings.chunk_size, room, self.adapter.max_positions,
                              settings.position_mode)
        if storage is not None and plan.budget is not None:  # what the positions allow (compact mode) caps them all
            storage = {dtype: min(entries, plan.budget) for dtype, entries in storage.items()}
        # a count the user gave (before --max-memory sets one); a multiple such as 1x means "evict after every chunk"
        asked_working = settings.working.tokens if isinstance(settings.working, Budget) else None
        if settings.max_memory is not None:
            need = self.estimate_peak_bytes(plan.budget or len(ids), settings.chunk_size, settings.probe_dtype)
            if need > settings.max_memory:
                raise ResourceError(
                    f"reading needs about {need / 2**30:.2f} GiB (model + cache of {plan.budget or len(ids)} tokens +"
                    f" a {settings.chunk_size}-token chunk), over --max-memory {settings.max_memory / 2**30:.2f} GiB;"
                    " lower --budget or --chunk-size"
                )
            if plan.budget is not None and settings.working is None:  # the largest working limit that fits
                settings = replace(settings, working=Budget(tokens=self.working_within(
                    settings.max_memory, plan.budget, WORKING_FACTOR * plan.budget, settings.chunk_size,
                    settings.probe_dtype)))
        if settings.measure_drift is None:
            settings = replace(settings, measure_drift=drift_steps(len(ids), asked=False) > 0)
        engine = self.engine(settings.method, plan.budget, settings, plan.mode, plan.head_cap, storage)
        notes = list(plan.notes)
        if asked_working is not None and engine.budget is not None and engine.working > asked_working:
            notes.append(f"--working-limit {asked_working} is under the budget plus one chunk: the cache grows to"
                         f" {engine.working} entries per head ({engine.budget} + {settings.chunk_size}) while reading")
        stream = engine.new_stream()
        per_token = self.bytes_per_token()
        done = peak = held = 0

        def tick(n: int) -> None:  # after each chunk's eviction: its forward held what was kept before + the chunk
            nonlocal done, peak, held
            done += n
            peak, held = max(peak, held + n * per_token), stream.cache.nbytes()
            if progress is not None:
                progress(done, len(ids))

        synchronize(engine.device)
        start = time.perf_counter()
        logits = engine.feed(stream, ids, progress=tick)
        synchronize(engine.device)
        if engine.chooses_storage:  # the budget is the one the chosen storage got
            plan = replace(plan, budget=engine.storage[stream.stored_as])
        return ReadResult(stream, plan, len(doc_ids), len(prefix), time.perf_counter() - start, settings, document,
                          notes, engine, logits, peak)

    def storage_budgets(self, limit: ByteLimit, n_tokens: int, cache_dtype: str | None, cap: int | None
                        ) -> dict[str, int]:
        """Entries per KV head that float16, int8 and int4 (or `cache_dtype` alone) can keep of `n_tokens` within
        `limit` bytes of keys and values, at most `cap`: sliding-window layers hold their window whatever the budget,
        the others share the rest (kl spends it globally)."""
        size = limit.resolve(n_tokens * self.bytes_per_token())
        shapes = self.adapter.layer_shapes()
        scored = [s for s in shapes if s.window is None] or shapes
        budgets = {}
        for dtype in [cache_dtype] if cache_dtype else STORAGE_CHOICES:
            fixed = sum(s.kv_heads * (min(s.window or n_tokens, n_tokens) * entry_bytes(dtype, s.key_dim, s.value_dim)
                                      * (s not in scored) + head_bytes(dtype, s.key_dim, s.value_dim))
                        for s in shapes)
            per_entry = sum(s.kv_heads * entry_bytes(dtype, s.key_dim, s.value_dim) for s in scored)
            budgets[dtype] = min(int((size - fixed) // per_entry), n_tokens, cap or n_tokens)
        if max(budgets.values()) < 1:
            shown = f"{limit} ({format_size(size)})" if limit.share is not None else str(limit)  # a share: its size
            raise ResourceError(f"--max-bytes {shown} cannot hold one entry per head of this"
                                f" model, even as {list(budgets)[-1]}")
        return {dtype: budget for dtype, budget in budgets.items() if budget >= 1}

    def working_within(self, max_memory: int, budget: int, most: int, chunk: int, probe_dtype: str = "auto") -> int:
        """The largest working limit in [budget, most] entries per head whose reading fits `max_memory` bytes."""
        low, high = budget, most
        while low < high:
            mid = (low + high + 1) // 2
            fits = self.estimate_peak_bytes(mid, chunk, probe_dtype) <= max_memory
            low, high = (mid, high) if fits else (low, mid - 1)
        return low

    def estimate_peak_bytes(self, kept: int, chunk: int, probe_dtype: str = "auto") -> int:
        """Upper estimate of resident bytes while reading: weights (with the probe copy `probe_dtype` asks for), the
        cache at its largest (kept + chunk entries per head), the chunk's attention scores and activations. Used to
        fail up front, not after an hour."""
        model = self.lm.model
        copy = self.probe_copy_dtype(probe_dtype)
        weights = sum(p.numel() * (p.element_size() + (copy.itemsize if copy is not None else 0))
                      for p in model.parameters())
        shapes = self.adapter.layer_shapes()
        cache = (kept + chunk) * self.bytes_per_token()
        cfg = model.config
        scores = max(s.query_heads for s in shapes) * chunk * (kept + chunk) * 4 * 3  # mask, scores, weights
        hidden = chunk * max(cfg.hidden_size, getattr(cfg, "intermediate_size", 0) or 0) * 4 * 8
        logits = RUNTIME_LOGIT_ROWS * model.get_output_embeddings().weight.shape[0] * 4
        return int(weights + cache + scores + hidden + logits + RUNTIME_BYTES)

    def model_dtype(self) -> str:
        return str(next(self.lm.model.parameters()).dtype).removeprefix("torch.")

    def bytes_per_token(self) -> int:
        """Cache bytes per token read (every layer's keys and values, in the model's dtype)."""
        itemsize = next(self.lm.model.parameters()).element_size()
        return sum(s.kv_heads * (s.key_dim + s.value_dim) for s in self.adapter.layer_shapes()) * itemsize

    # ---- answering -----------------------------------------------------------------------------------------
    def answer(
        self, stream: Stream, question: str, gen: GenerateSettings, mode: str, seed: int = 0,
        method: str = "none", budget: int | None = None, on_token: Callable[[list[int]], None] | None = None,
    ) -> dict:
        """Answer one question from `stream` (left unchanged). With `method`/`budget`, long answers are kept within
        the budget by decode-phase eviction. A plain frame's answer ends where the model starts the frame's next
        turn (`settled_tokens`). `on_token` sees the answer's final tokens so far after each one (to print them as
        they come). Returns text, token counts and timings."""
        work = stream.clone()
        suffix = self.fitting_question(stream, question, mode)
        max_new = min(gen.max_new_tokens, self.adapter.max_positions - work.next_rope - len(suffix))
        # Compact mode: decode-phase eviction must leave every head short enough for the rest of the answer.
        head_cap = self.adapter.max_positions - max_new if mode == "compact" else None
        engine = Engine(self.lm.model, self.adapter, self.policy(method), budget, chunk_size=max(len(suffix), 1),
                        mode=mode, seed=seed, head_cap=head_cap)
        engine.policy.restore(work.policy_state, self.kv_heads())  # e.g. kl's calibration: not learnt again
        start = time.perf_counter()
        first_token_at = None
        tokens: list[int] = []
        ended = None
        for token in engine.generate(work, suffix, max_new, self.stop_ids, gen.temperature, gen.top_p,
                                     repetition_penalty=gen.repetition_penalty, no_repeat=gen.no_repeat):
            if first_token_at is None:
                first_token_at = time.perf_counter() - start
            tokens.append(token)
            shown, ended = self.settled_tokens(tokens)
            if on_token is not None:
                on_token(shown)
            if ended is not None:
                break
        total = time.perf_counter() - start
        if ended is None:  # cut by the limit, maybe inside a character: its first bytes alone decode to U+FFFD
            ended = self.lm.tokenizer.decode(tokens, skip_special_tokens=True)
            ended = ended.removesuffix("\ufffd") if len(tokens) >= max_new else ended
        else:  # the tokens that hold the answer: a token the stop text begins inside counts
            tokens = tokens[:len(shown) + (self.lm.tokenizer.decode(shown, skip_special_tokens=True) != ended)]
        return {
            "text": ended.strip(),
            "new_tokens": len(tokens),
            "first_token_seconds": first_token_at if first_token_at is not None else total,
            "seconds": total,
            "truncated_to_fit": max_new < gen.max_new_tokens,
            "token_room": max_new,  # the answer's limit: --max-new-tokens, or the model's positions left
        }

    def fitting_question(self, stream: Stream, question: str, mode: str) -> list[int]:
        """The question's tokens in the frame, refused where they leave no room for an answer after `stream` (to
        check every question before the first is answered)."""
        suffix = self.frame.suffix_ids(self.lm.tokenizer, question)
        if self.adapter.max_positions - stream.next_rope - len(suffix) < 1:
            raise ResourceError(no_room(len(suffix), stream.next_rope, self.adapter.max_positions, mode))
        return suffix

    def settled_tokens(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """The answer so far as far as it is final (`PromptFrame.settled`): the longest start of `tokens` whose text
        lies within the final part (whole tokens, what may stream out), and, where the answer ends at a stop text,
        its text up to there (which can end inside a token: "Bob" + ".\n" + "Question:" is "Bob."); else None."""
        if not self.frame.stops:  # a chat frame: its end-of-turn token ends the answer
            return tokens, None
        decode = functools.partial(self.lm.tokenizer.decode, skip_special_tokens=True)
        whole = text = decode(tokens)
        end, stopped = self.frame.settled(text)
        kept = len(tokens)
        while len(text) > end:
            kept -= 1
            text = decode(tokens[:kept])
        return tokens[:kept], whole[:end] if stopped else None

    # ---- files ---------------------------------------------------------------------------------------------
    def kv_heads(self) -> list[int]:
        return [s.kv_heads for s in self.adapter.layer_shapes()]

    def layer_specs(self) -> list[LayerSpec]:
        return [LayerSpec(s.kv_heads, s.key_dim, s.value_dim) for s in self.adapter.layer_shapes()]

    def identity(self) -> dict[str, str]:
        """Metadata that a `.kvc` file must share with the model loading it."""
        return {
            "model_config_sha256": self.lm.config_sha256,
            "tokenizer_sha256": self.lm.tokenizer_sha256,
            "model_weights_sha256": self.lm.weights_sha256,
        }

    def save(self, path: Path, result: ReadResult, cache_dtype: str | None = None) -> int:
        return save_kvc(path, self.cache_file(result, cache_dtype))

    def cache_file(self, result: ReadResult, cache_dtype: str | None = None) -> KvcFile:
        """What `save` writes, for writers other than a file (e.g. standard output). `cache_dtype`: float32,
        float16, bfloat16, int8 or int4 (klevict_cli/quantized.py); default what the read chose (`--max-bytes`),
        else the model's dtype."""
        stream, settings = result.stream, result.settings
        cache_dtype = cache_dtype or stream.stored_as
        layers = packed_layers(stream.cache, cache_dtype)
        bits = QUANTIZED_BITS.get(cache_dtype)
        dtype = cache_dtype if bits else str(layers[0].keys.dtype if layers else torch.float32).removeprefix("torch.")
        meta = {
            **self.identity(),
            "model_id": self.lm.model_id,
            "klevict_version": __version__,
            "cache_dtype": dtype,
            "model_dtype": self.model_dtype(),  # what the full cache would be in: inspect's "of ... full"
            **self.layer_windows(),
            **({"quant_group": str(GROUP), "quant_exact": str(EXACT)} if bits else {}),
            "position_mode": result.plan.mode,
            "next_position": str(stream.next_position),
            "next_rope": str(stream.next_rope),
            "budget": result.budget or "all",
            "budget_tokens": str(result.plan.budget) if result.plan.budget is not None else "all",
            "kept_budget": str(result.kept_budget) if result.kept_budget is not None else "all",
            "method": settings.method,
            "method_params": json.dumps(self.policy(settings.method).params(), sort_keys=True),
            "method_state": json.dumps(stream.policy_state, sort_keys=True),
            "chunk_size": str(settings.chunk_size),
            "probe_window": str(settings.probe_window),
            "working_limit": str(settings.working) if settings.working is not None else "default",
            "reconstruct": str(settings.reconstruct).lower(),
            "probe_dtype": self.probe_precision(settings.probe_dtype),
            **({"max_kl": repr(settings.max_kl)} if settings.max_kl is not None else {}),
            **({"max_bytes": str(settings.max_bytes)} if settings.max_bytes is not None else {}),
            **({"estimated_kl": json.dumps(stream.drift, sort_keys=True)} if stream.drift is not None else {}),
            "prefix_tokens": str(result.prefix_tokens),
            "document_tokens": str(result.document_tokens),
            "source_name": result.document.name,
            "source_sha256": result.document.sha256,
            "created": creation_time(),
        }
        tokens = torch.tensor(stream.tokens, dtype=torch.int32)
        return KvcFile(layers=layers, tokens=tokens, metadata=meta)

    def stored_summary(self, result: ReadResult, cache: KvcFile) -> dict:
        """`result.summary()` for the cache as stored: its model, dtype and bytes (a quantized cache's codes, not the
        read's floats). One document's `compress --json` and every line of a batch's carry it."""
        return {"model": self.lm.model_id, **result.summary(), "cache_bytes": kv_bytes(cache),
                "cache_dtype": cache.metadata["cache_dtype"], "max_bytes": cache.metadata.get("max_bytes")}

    def layer_windows(self) -> dict[str, str]:
        """`layer_windows` where some layers keep a sliding window whatever the budget (Gemma 3: 15 of 18), so that
        `inspect` can show what the budget chose apart from what the window holds; nothing for other models."""
        windows = [shape.window for shape in self.adapter.layer_shapes()]
        return {"layer_windows": json.dumps(windows)} if any(w is not None for w in windows) else {}

    def load(self, path: Path) -> tuple[Stream, dict[str, str]]:
        """Load and validate a `.kvc` file against this model; returns a stream ready for questions."""
        kvc = load_kvc(path, specs=self.layer_specs(), expect=self.identity(), vocab_size=len(self.lm.tokenizer),
                       using=self.lm.model_id)
        return self.stream_of(kvc, path), kvc.metadata

    def stream_of(self, kvc: KvcFile, path: Path | str) -> Stream:
        """The stream a checked `.kvc` file holds, on this model's device: quantized layers stay quantized."""
        meta = kvc.metadata
        try:
            next_rope = int(meta["next_rope"])
            mode = meta["position_mode"]
        except (KeyError, ValueError) as exc:
            raise CacheFileError(f"{path}: metadata lacks a valid {exc}") from None
        if mode not in ("original", "compact") or meta.get("next_position") != str(len(kvc.tokens)):
            raise CacheFileError(f"{path}: inconsistent position metadata")
        if meta.get("method") not in POLICIES or not (meta.get("budget_tokens") == "all"
                                                      or meta.get("budget_tokens", "").isdigit()):
            raise CacheFileError(f"{path}: unknown method or budget in the metadata")
        try:  # absent in files from before klevict kept it: the policy then learns it again
            state = json.loads(meta.get("method_state", "{}"))
            if not isinstance(state, dict) or not all(isinstance(v, str) for v in state.values()):
                raise ValueError("not an object of strings")
            make_policy(meta["method"]).restore(state, self.kv_heads())
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            raise CacheFileError(f"{path}: invalid method state in the metadata ({exc})") from None
        for packed in kvc.layers:
            if packed.rope_positions.numel() and int(packed.rope_positions.max()) >= next_rope:
                raise CacheFileError(f"{path}: a cached entry sits at or after the next position")
        return Stream(self.cache_of(kvc.layers), tokens=kvc.tokens.tolist(), next_rope=next_rope, policy_state=state)

    def cache_of(self, layers: list[PackedLayer]) -> KVCache:
        """Packed layers (a file's) as the engine's cache on this model's device; quantized ones stay quantized."""
        param = next(self.lm.model.parameters())
        return KVCache([layer_cache(packed, shape.window, param.device, param.dtype)
                        for packed, shape in zip(layers, self.adapter.layer_shapes())])

    def as_stored(self, stream: Stream, cache_dtype: str) -> tuple[Stream, int]:
        """`stream` as `compress --cache-dtype` writes it and `ask` loads it back, and the bytes its keys and values
        take in the file (what the bench measures)."""
        param = next(self.lm.model.parameters())
        stored = stream.clone()
        stored.cache, size = stored_cache(stream.cache, cache_dtype, param.device, param.dtype)
        return stored, size

