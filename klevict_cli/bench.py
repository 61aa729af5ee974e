"""`klevict bench`: every eviction method side by side on one document (DESIGN §6).

Fidelity: draw `windows` windows of `context + continuation` tokens from the document (seeded). For each window the
full-cache reference reads the context (inside the chat frame's opening, as `compress` and `summarize` read a
document), then teacher-forces the continuation; every method × budget reads the same
context chunk by chunk with eviction, then teacher-forces the same continuation at the original positions. Per
token: KL(p_full ‖ p_compressed), top-1 agreement and the true next token's NLL. Cost: wall time of the compressed
read relative to the full-cache read of the same window (same chunking), and the bytes of cache kept.

Needle: `needles` facts ("The secret code of the red fox is 4821.") inserted at random sentence boundaries of a
haystack of about `context` tokens, read inside the chat frame with eviction; each fact is then asked (the question
unseen while compressing) and answered greedily in up to `answer_tokens` tokens (the default model restates the
question first); exact match = the number appears in the answer.

Recall: facts the text itself states once. In a window of about `context` tokens of the real document, `needles`
sentences are picked that contain a name or a number appearing nowhere else in the window; after compression the
model is asked to continue the sentence from its first words, and succeeds if the name or number appears in its
answer. It asks what questions about a document ask — to find a detail read once — without planted text.

Budgets resolve against `context` tokens for both tasks. Everything is seeded: the same seed gives the same numbers,
timings aside. `run_bench` returns one JSON-ready dict; `render` prints it as rich tables.
"""

from __future__ import annotations

import bisect
import math
import os
import platform
import random
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING

import torch
from rich.console import Console
from rich.table import Table

from klevict_kernels.kl import ReferenceDistributions, token_kl
from klevict_cli import __version__
from klevict_cli.errors import ResourceError, UsageError
from klevict_cli.options import Budget, parse_budget, parse_byte_limit
from klevict_cli.attention import Lanes
from klevict_cli.display import counted, shown
from klevict_cli.prompts import encode_text
from klevict_cli.results import TOLERANCE_PREFIX, summary, windows_count, within_factor
from klevict_cli.sampling import seeded

if TYPE_CHECKING:
    from klevict_cli.session import ReadSettings

TASKS = ("fidelity", "needle", "recall", "both", "all")  # both: fidelity + needle; all: the three
ADJECTIVES = ("red", "blue", "green", "golden", "silver", "purple", "orange", "spotted", "striped", "sleepy",
              "angry", "clever", "tiny", "giant", "quiet", "brave")
ANIMALS = ("fox", "owl", "tiger", "whale", "rabbit", "eagle", "wolf", "turtle", "otter", "falcon", "badger", "lynx",
           "heron", "moose", "panda", "koala")

Progress = Callable[[int, int, str], None]  # (done, total, what is running)
SAMPLED_SEED = 7_919  # the bench's own continuations (`--sampled`): never a read's drafts or drift samples


@dataclass
class BenchSettings:
    methods: list[str]
    budgets: list[str]  # as given: "20%", "512", ...
    windows: int = 8
    context: int = 2048
    continuation: int = 256
    seed: int = 0
    chunk_size: int = 512
    probe_window: int = 32
    probe_dtype: str = "auto"  # the probing forwards' precision (Session.probe_model), as the commands read
    task: str = "fidelity"
    needles: int = 4
    answer_tokens: int = 32  # room for the model to restate the question before the number
    working: float | None = None  # working limit, × the budget (None: the engine's default)
    reconstruct: bool = False  # kl: reconstruction probes too, as `compress` uses
    max_kl: list[float] = field(default_factory=list)  # tolerances (`--max-kl`), each measured beside the budgets
    estimate: bool = False  # every read measures its drift (`estimated_kl`; tolerances always do), at its cost
    # fidelity: each read's cache measured as `compress --cache-dtype` stores it and `ask` loads it, in each of these
    # dtypes (rows "<method> <dtype>"; cache_bytes are then the stored keys and values)
    cache_dtypes: list[str] = field(default_factory=list)
    # byte limits (`compress --max-bytes`: "40M", "5%"), each measured beside the budgets as it stores the cache
    max_bytes: list[str] = field(default_factory=list)
    # fidelity: each cache also measured on this many continuations the full cache's model writes itself (`kl_sampled`)
    sampled: int = 0


@dataclass
class Fact:
    adjective: str
    animal: str
    number: str
    depth: float = 0.0  # where the fact sits in the haystack text (0 = start, 1 = end)
    sentence: str = field(init=False)
    question: str = field(init=False)

    start: str = field(init=False, default="")  # how the answer begins (given, not generated)

    def __post_init__(self) -> None:
        self.sentence = f"The secret code of the {self.adjective} {self.animal} is {self.number}."
        self.question = f"What is the secret code of the {self.adjective} {self.animal}? Answer with the number only."

    @property
    def expected(self) -> str:
        return self.number


@dataclass
class Recall:
    """A detail the text states once: `expected` (a name or number) in `sentence`. The model is asked to quote the
    sentence and its answer starts with the words before the detail (the last 20): it must find the rest in the
    cache. (Asked to "continue this sentence", the default model mostly restated the instruction.)"""

    sentence: str
    expected: str
    depth: float
    question: str = field(init=False, default="Quote, word for word, the sentence of the text above that this answer"
                                               " starts.")
    start: str = field(init=False)

    def __post_init__(self) -> None:
        self.start = '"' + " ".join(self.sentence[: self.sentence.index(self.expected)].split()[-20:])


# ---- parsing ---------------------------------------------------------------------------------------------------
def parse_methods(text: str, registry) -> list[str]:
    """`all` = every registered method except `none` (the reference, always measured) and variants of another
    method (kl-fisher, kl-layer: name them); else a comma list."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    if names == ["all"]:
        return [name for name, cls in registry.items() if name != "none" and not cls.variant]
    if not names:
        raise UsageError("invalid --methods ''; give a comma-separated list of methods, or all")
    for name in names:
        if name == "none":
            raise UsageError("invalid --methods: 'none' is the full-cache reference and is always measured")
        if name not in registry:
            raise UsageError(f"invalid --methods: unknown method '{name}'; choose from: all, "
                             + ", ".join(n for n in registry if n != "none"))
    if len(set(names)) != len(names):
        raise UsageError(f"invalid --methods '{text}': a method is listed twice")
    return names


def parse_budgets(text: str) -> list[Budget]:
    parts = [b.strip() for b in text.split(",") if b.strip()]
    if not parts:
        raise UsageError("invalid --budgets ''; give a comma-separated list such as 20%,10%,5%")
    try:
        budgets = [parse_budget(p) for p in parts]
    except UsageError as exc:  # said of bench's own flag, not of --budget, which bench does not take
        raise UsageError(str(exc).replace("invalid --budget ", "invalid --budgets ", 1)) from None
    if len({str(b) for b in budgets}) != len(budgets):
        raise UsageError(f"invalid --budgets '{text}': a budget is listed twice")
    return budgets


# ---- statistics ------------------------------------------------------------------------------------------------
def token_metrics(full_logits: torch.Tensor, comp_logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Mean per-token KL(p_full ‖ p_comp) in nats (to about 1e-6, kernels/kl.py), top-1 agreement and the NLL of the
    true tokens (float64).
    logits: (M, V) predicting `targets` (M,)."""
    lp_comp = comp_logits.double().log_softmax(dim=-1)
    kl = token_kl(full_logits, comp_logits)
    agree = (full_logits.argmax(dim=-1) == comp_logits.argmax(dim=-1)).double()
    nll = -lp_comp.gather(1, targets[:, None].to(lp_comp.device))[:, 0]
    return {"kl": float(kl.mean()), "top1": float(agree.mean()), "nll": float(nll.mean()),
            "perplexity": math.exp(float(nll.mean()))}


# ---- windows and haystacks -------------------------------------------------------------------------------------
def overlaps(offset: int, others: list[int], span: int) -> bool:
    """Whether the window of `span` tokens at `offset` shares a token with one at any of `others`."""
    return any(abs(offset - other) < span for other in others)


def draw_offsets(n_tokens: int, span: int, count: int, rng: random.Random) -> list[int]:
    """`count` offsets drawn uniformly so that [offset, offset + span) fits in `n_tokens`. A window that would
    overlap one drawn before it is drawn again, uniformly from the places clear of them all (kept where it fell if
    the text has no such place): overlapping windows measure much the same text twice, while the intervals over
    windows count them as independent. Windows are drawn in order from one generator, so the first N of N + k are
    the same, and a window that overlapped nothing is where it always was."""
    if span > n_tokens:
        raise UsageError(f"the document has {n_tokens} tokens; a window needs {span}"
                         " (lower --context / --continuation)")
    offsets: list[int] = []
    for _ in range(count):
        offset = rng.randint(0, n_tokens - span)
        if overlaps(offset, offsets, span):
            clear = clear_offsets(n_tokens - span, span, offsets)
            room = sum(high - low + 1 for low, high in clear)
            if room:
                pick = rng.randrange(room)
                for low, high in clear:
                    if pick <= high - low:
                        offset = low + pick
                        break
                    pick -= high - low + 1
        offsets.append(offset)
    return offsets


def clear_offsets(last: int, span: int, taken: list[int]) -> list[tuple[int, int]]:
    """The runs [low, high] of offsets in [0, last] whose windows of `span` tokens overlap none of `taken`'s."""
    runs, low = [], 0
    for other in sorted(taken):
        if other - span >= low:
            runs.append((low, min(other - span, last)))
        low = max(low, other + span)
    if low <= last:
        runs.append((low, last))
    return [(a, b) for a, b in runs if a <= b]


def fidelity_windows(session, doc_ids: list[int], context: int, continuation: int, count: int, seed: int
                     ) -> list[tuple[int, list[int], list[int]]]:
    """The fidelity task's windows: per window (its offset in `doc_ids`, the tokens read after the chat frame's
    opening — `context` tokens with it — and the `continuation` tokens that follow), drawn with `seed`; the one
    place that draws them, so that a script reads the windows `klevict bench --seed` reads."""
    body = context - len(session.frame.prefix_ids(session.lm.tokenizer))
    offsets = draw_offsets(len(doc_ids), body + continuation, count, random.Random(seed))
    return [(o, doc_ids[o : o + body], doc_ids[o + body : o + body + continuation]) for o in offsets]


def crowded(offsets: list[int], n_tokens: int, span: int) -> list[str]:
    """Windows drawn over one another because the text has no room for them apart (draw_offsets): said before they are
    measured, as the intervals over windows count them as independent and come out too narrow."""
    overlapping = sum(overlaps(offset, offsets[:i], span) for i, offset in enumerate(offsets))
    if not overlapping:
        return []
    return [f"{overlapping} of the {len(offsets)} windows {'overlaps' if overlapping == 1 else 'overlap'} an earlier"
            f" one: the document's {n_tokens:,} tokens hold {n_tokens // span} apart ({span:,} tokens each), and the"
            " intervals over windows count them as independent, so they are too narrow (lower --windows or"
            " --context, or give a longer document)"]


def make_facts(rng: random.Random, count: int) -> list[Fact]:
    pairs = rng.sample([(a, b) for a in ADJECTIVES for b in ANIMALS], count)
    numbers = rng.sample(range(1000, 10000), count)
    return [Fact(a, b, str(n)) for (a, b), n in zip(pairs, numbers)]


def insert_facts(text: str, facts: list[Fact], rng: random.Random) -> str:
    """Insert each fact's sentence at a seeded random depth, snapped to the nearest sentence end (or the text's
    start or end); records each fact's final depth."""
    ends = sorted({0, len(text), *(m.end() for m in re.finditer(r"[.!?](?=\s)", text))})
    spots = []
    for _ in facts:
        target = rng.random() * len(text)
        i = bisect.bisect_left(ends, target)
        spots.append(min(ends[max(0, i - 1) : i + 1], key=lambda e: abs(e - target)))
    for spot, fact in sorted(zip(spots, facts), key=lambda p: p[0], reverse=True):
        text = fact.sentence + " " + text if spot == 0 else text[:spot] + " " + fact.sentence + text[spot:]
    for fact in facts:
        fact.depth = text.index(fact.sentence) / max(1, len(text))
    return text


_WORD = re.compile(r"[A-Za-z][a-z]{2,}|\d[\d,]*\d|\d")


def pick_recalls(text: str, rng: random.Random, count: int) -> list[Recall]:
    """`count` sentences of `text` (seeded), each with a detail — a capitalised word that does not start the sentence,
    or a number — that occurs only once in `text`, with at least 4 words before it in its sentence."""
    counts: dict[str, int] = {}
    for m in _WORD.finditer(text):
        counts[m.group()] = counts.get(m.group(), 0) + 1
    candidates = []
    for m in re.finditer(r"[^.!?]+[.!?]", text):
        sentence = " ".join(m.group().split())
        words = sentence.split()
        for i, raw in enumerate(words[4:], start=4):
            word = raw.strip(".,;:!?\"'()[]_-")
            if (word[:1].isupper() or word[:1].isdigit()) and _WORD.fullmatch(word) and counts.get(word) == 1:
                candidates.append((m.start(), sentence, word))
                break
    chosen = rng.sample(candidates, min(count, len(candidates)))
    return [Recall(sentence, word, start / max(1, len(text))) for start, sentence, word in sorted(chosen)]


# ---- measuring -------------------------------------------------------------------------------------------------
def timed_read(session, doc_ids: list[int], settings: ReadSettings, reserve: int) -> dict:
    """Read a window's tokens as the commands read a document (`Session.read_tokens`: the chat frame, the plan,
    the engine); wall time, the last logits, kept and peak cache bytes (and on a GPU, peak device bytes)."""
    cuda = session.lm.model.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(session.lm.model.device)
        base = torch.cuda.memory_allocated(session.lm.model.device)
    result = session.read_tokens(doc_ids, settings, reserve=reserve)
    stream = result.stream
    return {
        "stream": stream, "engine": result.engine, "logits": result.logits, "seconds": result.seconds,
        "cache_bytes": stream.cache.nbytes(), "peak_cache_bytes": result.peak_cache_bytes,
        "kept_entries": sum(sum(c) for c in stream.cache.kept_counts()),
        "estimated_kl": None if stream.drift is None else stream.drift["kl"],
        "peak_device_bytes": torch.cuda.max_memory_allocated(session.lm.model.device) - base if cuda else None,
    }


def continuation_logits(engine, stream, last_logits: torch.Tensor, continuation: list[int]) -> torch.Tensor:
    """Teacher-force `continuation` (no eviction, original positions): (M, V) logits predicting each of its tokens,
    the first from the context's last logits."""
    rows, _ = engine.forward(stream, continuation, logits_rows=len(continuation))
    return torch.cat((last_logits[None].float(), rows[:-1].float()), dim=0)


def sampled_continuations(engine, stream, last_logits: torch.Tensor, lanes: int, length: int,
                          generator: torch.Generator) -> list[int]:
    """`lanes` continuations of `length` tokens that the model writes itself over `stream`'s cache (temperature 1),
    side by side (attention.Lanes) on a copy of the stream, their tokens step by step (a step's tokens, one per lane).
    The mean KL over them is a Monte-Carlo estimate of the per-token KL between what the full and the compressed cache
    would write: the sequence-level divergence, whose chain rule sums the next-token KLs along the model's own text."""
    work = stream.clone()
    return engine.sample_lanes(work, last_logits, Lanes(work.next_position, work.next_rope, lanes), length,
                               generator)[0]


def lane_logits(engine, stream, last_logits: torch.Tensor, tokens: list[int], lanes: int) -> torch.Tensor:
    """Teacher-force `tokens` (`sampled_continuations`' lanes) over a copy of `stream` in one forward: the logits
    predicting each token, in the tokens' order, the first step's from the context's last logits."""
    first = last_logits.reshape(1, -1).float().expand(lanes, -1)
    if len(tokens) == lanes:
        return first
    work = stream.clone()
    rows, _ = engine.forward(work, tokens[:-lanes], logits_rows=len(tokens) - lanes,
                             lanes=Lanes(work.next_position, work.next_rope, lanes))
    return torch.cat((first, rows.float()))


class _Counter:
    def __init__(self, total: int, progress: Progress | None):
        self.done, self.total, self.progress = 0, total, progress

    def __call__(self, label: str, steps: int = 1) -> None:
        self.done += steps
        if self.progress is not None:
            self.progress(self.done, self.total, label)


def stored_row(method: str, cache_dtype: str | None) -> str:
    return method if cache_dtype is None else f"{method} {cache_dtype}"


def byte_label(limit: str) -> str:
    return f"max-bytes {limit}"


def tolerance_label(max_kl: float) -> str:
    return f"{TOLERANCE_PREFIX}{max_kl:g}"


def _reads(settings: BenchSettings, budgets: dict[str, int | None]):
    """How the full-cache reference and each method × budget (or tolerance) read: the settings
    `Session.read_tokens` takes."""
    from klevict_cli.session import ReadSettings

    full = ReadSettings(budget=None, method="none", chunk_size=settings.chunk_size,
                        probe_window=settings.probe_window, position_mode="original", seed=settings.seed,
                        working=settings.working, reconstruct=settings.reconstruct,
                        measure_drift=settings.estimate, probe_dtype=settings.probe_dtype)
    sizes = {tolerance_label(t): {"max_kl": t} for t in settings.max_kl}
    sizes.update({byte_label(b): {"max_bytes": parse_byte_limit(b)} for b in settings.max_bytes})
    return full, {(m, label): replace(full, method=m, **(sizes[label] if label in sizes
                                                         else {"budget": Budget(tokens=tokens)}))
                  for m in settings.methods for label, tokens in budgets.items()}


def warm_up(session, settings: BenchSettings, methods: list[str], ids: list[int]) -> None:
    """First-call costs (allocations, kernel selection, the first backward pass, vmap's tracing) must not land on a
    method's first timing: the reference reads one chunk, and each method reads two small chunks with a budget
    small enough that every path it has (eviction, drafts, calibration, reconstruction) runs once."""
    from klevict_cli.session import ReadSettings

    chunk = max(2, min(settings.chunk_size, settings.context) // 4)
    read = ReadSettings(budget=None, chunk_size=chunk, probe_window=settings.probe_window, seed=settings.seed,
                        working=1.0, reconstruct=settings.reconstruct, probe_dtype=settings.probe_dtype)
    reference = session.engine("none", None, read, "original")
    reference.feed(reference.new_stream(), ids[: min(settings.chunk_size, settings.context)])
    for method in methods:
        engine = session.engine(method, max(1, chunk // 2), read, "original")
        engine.feed(engine.new_stream(), ids[: 2 * chunk])


def carry_over(previous: dict | None, full: dict, results: dict, planned: list, key: str) -> int:
    """Resume a stopped run: copy the windows `previous` (a saved block of the same task) finished into `full` and
    `results`, and return how many. Windows are drawn in sequence from the seed, so a longer run's first windows are
    a shorter one's; anything else means the saved run measured something else."""
    if not previous:
        return 0
    done = previous["windows_done"]
    if done > len(planned):  # a stopped run of more windows than asked now: its offsets agree as far as they go
        raise UsageError(f"--resume: the saved run has measured {done} windows, more than --windows {len(planned)};"
                         f" give --windows {done} or more")
    if previous[key][:done] != planned[:done]:
        raise UsageError(f"--resume: the saved run's windows are not this run's first {done} ({key} differ)")
    for name, lists in previous["full"]["per_window"].items():
        full[name][:] = lists[:done]
    for method, per in results.items():
        for label, row in per.items():
            saved = previous["results"].get(method, {}).get(label, {}).get("per_window")
            if saved is None:
                raise UsageError(f"--resume: the saved run has no {method} @ {label}")
            for name in row:
                row[name][:] = saved.get(name, [None] * done)[:done]  # None: a number older runs did not record
    return done


def run_fidelity(session, doc_ids: list[int], settings: BenchSettings, reference, reads: dict, tick,
                 publish: Callable[[dict], None] = lambda block: None, previous: dict | None = None,
                 note: Callable[[str], None] = lambda line: None) -> dict:
    prefix = session.frame.prefix_ids(session.lm.tokenizer)  # the chat frame's opening, read before each window
    windows = fidelity_windows(session, doc_ids, settings.context, settings.continuation, settings.windows,
                               settings.seed)
    offsets = [offset for offset, _, _ in windows]
    for line in crowded(offsets, len(doc_ids), len(windows[0][1]) + settings.continuation):
        note(line)
    stored_as = settings.cache_dtypes or [None]  # None: the cache as read (or as a byte limit chose to store it)
    labels = list(dict.fromkeys(label for _, label in reads))
    warm_up(session, settings, list(dict.fromkeys(m for m, _ in reads)), prefix + doc_ids)
    full = {"perplexity": [], "nll": [], "seconds": [], "cache_bytes": [], "peak_cache_bytes": []}
    sampled = ("kl_sampled",) if settings.sampled else ()  # --sampled: summarised over windows
    per_lane = ("kl_sampled_lanes",) if settings.sampled else ()  # each continuation's own: per window only
    results = {stored_row(m, dtype): {label: {k: [] for k in (
        "kl", "top1", "nll", "perplexity", "seconds", "time_ratio", "cache_bytes", "cache_fraction", "peak_cache_bytes",
        "peak_device_bytes", "kept_entries", "estimated_kl", "cache_dtype") + sampled + per_lane} for label in labels}
        for m in settings.methods for dtype in stored_as}
    stats = ("kl", "top1", "perplexity", "time_ratio", "cache_bytes", "cache_fraction", "peak_cache_bytes") + sampled
    done = carry_over(previous, full, results, offsets, "offsets")

    def block(done: int) -> dict:
        return {
            "offsets": offsets,
            "windows_done": done,
            "context_tokens": settings.context,
            "continuation_tokens": settings.continuation,
            "full": {"perplexity": summary(full["perplexity"]), "seconds": summary(full["seconds"]),
                     "cache_bytes": summary(full["cache_bytes"]), "per_window": full},
            "results": {m: {label: {**{k: summary(row[k]) for k in stats}, "per_window": row}
                            for label, row in per.items()} for m, per in results.items()},
        }

    for w, (_, window, cont) in enumerate(windows):
        if w < done:
            tick(f"window {w + 1}/{len(offsets)}: measured before", 1 + len(reads))
            continue
        targets = torch.tensor(cont)
        ref = timed_read(session, window, reference, len(cont))
        own = own_text = None  # the model's own continuations, and the full cache's distributions along them
        if settings.sampled:
            generator = seeded(settings.seed * 1_000_003, w + SAMPLED_SEED)
            own_text = sampled_continuations(ref["engine"], ref["stream"], ref["logits"], settings.sampled,
                                             settings.continuation, generator)
            own = ReferenceDistributions(lane_logits(ref["engine"], ref["stream"], ref["logits"], own_text,
                                                     settings.sampled))
        ref_logits = continuation_logits(ref["engine"], ref["stream"], ref["logits"], cont)
        base = token_metrics(ref_logits, ref_logits, targets)
        full["perplexity"].append(base["perplexity"])
        full["nll"].append(base["nll"])
        for key in ("seconds", "cache_bytes", "peak_cache_bytes"):
            full[key].append(ref[key])
        del ref
        tick(f"window {w + 1}/{len(offsets)}: full cache")
        for (method, label), read in reads.items():
            got = timed_read(session, window, read, len(cont))  # a fresh engine: the same seeded state each window
            for dtype in stored_as:
                chosen = dtype or got["stream"].stored_as
                stream, nbytes = (got["stream"].clone(), got["cache_bytes"]) if chosen is None \
                    else session.as_stored(got["stream"], chosen)
                row = results[stored_row(method, dtype)][label]
                if own is not None:  # the mean, and each continuation's own (how far they agree)
                    kl = own.kl(lane_logits(got["engine"], stream, got["logits"], own_text, settings.sampled))
                    row["kl_sampled"].append(float(kl.mean()))
                    row["kl_sampled_lanes"].append(kl.view(-1, settings.sampled).mean(dim=0).tolist())
                logits = continuation_logits(got["engine"], stream, got["logits"], cont)
                row["cache_dtype"].append(chosen)
                for key, value in token_metrics(ref_logits, logits, targets).items():
                    row[key].append(value)
                for key in ("seconds", "peak_cache_bytes", "peak_device_bytes", "kept_entries", "estimated_kl"):
                    row[key].append(got[key])
                row["cache_bytes"].append(nbytes)
                row["time_ratio"].append(got["seconds"] / max(full["seconds"][-1], 1e-12))
                row["cache_fraction"].append(nbytes / max(full["cache_bytes"][-1], 1))
                del stream, logits
            del got
            tick(f"window {w + 1}/{len(offsets)}: {method} @ {label}")
        publish(block(w + 1))
    return block(len(offsets))


def build_haystack(session, doc_ids: list[int], settings: BenchSettings, rng: random.Random) -> dict:
    tok = session.lm.tokenizer
    prefix = session.frame.prefix_ids(tok)
    facts = make_facts(rng, settings.needles)
    fact_tokens = sum(len(encode_text(tok, " " + f.sentence)) for f in facts)
    body = max(1, settings.context - len(prefix) - fact_tokens)
    offset = draw_offsets(len(doc_ids), body, 1, rng)[0]
    text = insert_facts(tok.decode(doc_ids[offset : offset + body]), facts, rng)
    ids = encode_text(tok, text)
    return {"offset": offset, "ids": ids, "tokens": len(prefix) + len(ids), "facts": facts}


def build_recall(session, doc_ids: list[int], settings: BenchSettings, rng: random.Random) -> dict:
    tok = session.lm.tokenizer
    prefix = session.frame.prefix_ids(tok)
    offset = draw_offsets(len(doc_ids), settings.context - len(prefix), 1, rng)[0]
    ids = doc_ids[offset : offset + settings.context - len(prefix)]
    return {"offset": offset, "ids": ids, "tokens": len(prefix) + len(ids),
            "facts": pick_recalls(tok.decode(ids), rng, settings.needles)}


def answer(session, engine, stream, question: str, max_new: int, start: str = "") -> str:
    """Greedy answer through the chat frame, as `Session.answer` does, on a copy of `stream`, ending where it does
    (a plain frame's next turn: `Session.settled_tokens`); the answer begins with `start` (given, not generated, and
    not returned)."""
    work = stream.clone()
    suffix = session.frame.suffix_ids(session.lm.tokenizer, question) + encode_text(session.lm.tokenizer, start)
    tokens = list(engine.generate(work, suffix, max_new, session.stop_ids))
    _, ended = session.settled_tokens(tokens)
    return (ended if ended is not None else session.lm.tokenizer.decode(tokens, skip_special_tokens=True)).strip()


def share(correct: list[bool]) -> float | None:
    """A window's accuracy; None where it asked nothing (a recall window that states no detail once), which the
    mean over windows leaves out: 0 of 0 was counted as 0 %, for the full cache too."""
    return sum(correct) / len(correct) if correct else None


def build_haystacks(session, doc_ids: list[int], settings: BenchSettings, task: str) -> list[dict]:
    """The windows of a retrieval task, each with its questions: planted facts (`needle`) or details the text states
    once (`recall`), drawn from the seed. Refused where no window has a question, before any window is measured."""
    rng = random.Random(f"{task}:{settings.seed}")
    build = build_haystack if task == "needle" else build_recall
    haystacks = [build(session, doc_ids, settings, rng) for _ in range(settings.windows)]
    if not any(h["facts"] for h in haystacks):  # recall: short windows may state no detail once
        raise UsageError(f"--task {task}: no window of --context {settings.context} tokens states a detail only once"
                         " (a capitalised word or a number), so there is nothing to ask; give a larger --context")
    return haystacks


def run_needle(session, haystacks: list[dict], settings: BenchSettings, reference, reads: dict, tick,
               task: str = "needle", publish: Callable[[dict], None] = lambda block: None,
               previous: dict | None = None) -> dict:
    """Retrieval after compression on `haystacks` (`build_haystacks`)."""
    labels = list(dict.fromkeys(label for _, label in reads))
    room = settings.answer_tokens + max(
        (len(session.frame.suffix_ids(session.lm.tokenizer, f.question) + encode_text(session.lm.tokenizer, f.start))
         for h in haystacks for f in h["facts"]), default=0)
    longest = max(h["tokens"] for h in haystacks) + room
    if longest > session.adapter.max_positions:
        raise ResourceError(f"a needle haystack plus its question needs {longest} positions; the model has "
                         f"{session.adapter.max_positions} (lower --context)")

    answerer = session.engine("none", None, reference, "original")  # answers as `Session.answer` does

    def score(read, hay) -> tuple[list[str], list[bool]]:
        stream = session.read_tokens(hay["ids"], read, reserve=room).stream
        texts = [answer(session, answerer, stream, f.question, settings.answer_tokens, f.start) for f in hay["facts"]]
        return texts, [f.expected in t for f, t in zip(hay["facts"], texts)]

    full = {"accuracy": [], "answers": [], "correct": []}
    results = {m: {label: {"accuracy": [], "answers": [], "correct": []} for label in labels}
               for m in settings.methods}

    def block(done: int) -> dict:
        return {
            "haystacks": [{"offset": h["offset"], "tokens": h["tokens"],
                           "facts": [{"sentence": f.sentence, "question": f.question, "expected": f.expected,
                                      "depth": round(f.depth, 4)} for f in h["facts"]]} for h in haystacks],
            "windows_done": done,
            "full": {"accuracy": summary(full["accuracy"]), "per_window": full},
            "results": {m: {label: {"accuracy": summary(row["accuracy"]), "per_window": row}
                            for label, row in per.items()} for m, per in results.items()},
        }

    done = carry_over(previous, full, results, block(0)["haystacks"], "haystacks")
    for w, hay in enumerate(haystacks):
        if w < done:
            tick(f"{task} {w + 1}/{len(haystacks)}: measured before", 1 + len(reads))
            continue
        texts, ok = score(reference, hay)
        full["answers"].append(texts)
        full["correct"].append(ok)
        full["accuracy"].append(share(ok))
        tick(f"{task} {w + 1}/{len(haystacks)}: full cache")
        for (method, label), read in reads.items():
            texts, ok = score(read, hay)
            row = results[method][label]
            row["answers"].append(texts)
            row["correct"].append(ok)
            row["accuracy"].append(share(ok))
            tick(f"{task} {w + 1}/{len(haystacks)}: {method} @ {label}")
        publish(block(w + 1))
    return block(len(haystacks))


def run_bench(session, document, settings: BenchSettings, progress: Progress | None = None,
              checkpoint: Callable[[dict], None] | None = None, resume: dict | None = None,
              note: Callable[[str], None] = lambda line: None) -> dict:
    """Run the benchmark on a loaded `Session` and a `Document`; returns every raw number and the settings.
    `checkpoint`, when given, receives the result so far after every window ("complete": false until the end), so a
    long run that is stopped keeps what it measured; `resume` is such a saved result, whose windows are kept and not
    measured again (its settings must be this run's, but for the number of windows). `note` receives what the user
    should know before the windows are measured (windows that overlap)."""
    if settings.task not in TASKS:
        raise UsageError(f"invalid --task '{settings.task}'; choose from: {', '.join(TASKS)}")
    budgets: dict[str, int | None] = {str(b): min(b.resolve(settings.context), settings.context)
                                      for b in map(parse_budget, settings.budgets)}
    budgets.update({tolerance_label(t): None for t in settings.max_kl})  # the tolerance decides the size
    budgets.update({byte_label(b): None for b in settings.max_bytes})  # the dtype chosen decides it
    if settings.context + settings.continuation > session.adapter.max_positions:
        raise ResourceError(f"--context {settings.context} + --continuation {settings.continuation} exceed the model's "
                         f"{session.adapter.max_positions} positions")
    frame = len(session.frame.prefix_ids(session.lm.tokenizer))
    if settings.context <= frame:  # a window would read the chat frame's opening and no document at all
        raise UsageError(f"invalid --context {settings.context}; the chat frame's opening takes {frame} tokens of it:"
                         f" give more than {frame}")
    doc_ids = encode_text(session.lm.tokenizer, document.text)
    tasks = {"both": ["fidelity", "needle"], "all": ["fidelity", "needle", "recall"]}.get(settings.task, [settings.task])
    per_task = settings.windows * (1 + len(settings.methods) * len(budgets))
    tick = _Counter(per_task * len(tasks), progress)
    out = {
        "settings": {
            **asdict(settings),
            "budget_tokens": budgets,
            "model": session.lm.model_id,
            "model_config_sha256": session.lm.config_sha256,
            "model_weights_sha256": session.lm.weights_sha256,
            "device": str(next(session.lm.model.parameters()).device),
            "dtype": str(next(session.lm.model.parameters()).dtype).removeprefix("torch."),
            "probe_precision": session.probe_precision(settings.probe_dtype),  # what --probe-dtype is on this machine
            "document": {"name": document.name, "sha256": document.sha256, "tokens": len(doc_ids)},
            "interval": "mean ± 1.96·sd/√n over windows",
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": _machine(session),
            "method_params": {m: session.policy(m).params() for m in settings.methods},
            "versions": {"klevict": __version__, "torch": torch.__version__, "transformers": _transformers_version(),
                         "python": platform.python_version()},
        },
    }
    out["complete"] = False
    if resume is not None:
        check_resumable(resume, out["settings"])
        if resume.get("complete") and all(resume.get(task, {}).get("windows_done", 0) >= settings.windows
                                          for task in tasks):
            return resume  # nothing left to measure: the saved run as it is (not re-dated, not marked resumed)
        out["settings"]["resumed_from"] = resume["settings"].get("resumed_from", []) + [
            {"created": resume["settings"]["created"], "machine": resume["settings"]["machine"],
             **{task: resume[task]["windows_done"] for task in TASKS if task in resume}}]

    def publisher(task: str) -> Callable[[dict], None]:
        def publish(block: dict) -> None:
            out[task] = block
            if checkpoint is not None:
                checkpoint(out)
        return publish

    reference, reads = _reads(settings, budgets)
    haystacks = {task: build_haystacks(session, doc_ids, settings, task) for task in ("needle", "recall")
                 if task in tasks}
    if "fidelity" in tasks:
        out["fidelity"] = run_fidelity(session, doc_ids, settings, reference, reads, tick, publisher("fidelity"),
                                       (resume or {}).get("fidelity"), note)
    for task in ("needle", "recall"):
        if task in tasks:
            out[task] = run_needle(session, haystacks[task], settings, reference, reads, tick, task, publisher(task),
                                   (resume or {}).get(task))
    out["complete"] = True
    return out


# settings a resumed run may change: when and where it runs, and how many windows it plans
# --probe-dtype may be spelt differently (auto, or the dtype it means): the precision it runs at must agree
RESUMABLE_CHANGES = ("windows", "created", "machine", "versions", "resumed_from", "merged_from", "probe_dtype")


def check_resumable(saved: dict, settings: dict) -> None:
    """A saved run can be resumed only by a run measuring the same thing."""
    if not isinstance(saved, dict) or not isinstance(saved.get("settings"), dict):
        raise UsageError("--resume: not a klevict bench result")
    # earlier runs: the model's precision for the probes, no --sampled
    theirs = {"probe_precision": saved["settings"].get("dtype"), "sampled": 0, **saved["settings"]}
    same_text = {**theirs.get("document", {}), "name": None} == {**settings["document"], "name": None}
    differ = sorted(k for k in set(theirs) | set(settings)
                    if k not in RESUMABLE_CHANGES + ("document",) and theirs.get(k) != settings.get(k))
    differ = [k for k in differ if not set(FOLLOWS.get(k, ())) & set(differ)]  # said once, by what it follows from
    said = [resume_change(k, theirs.get(k), settings.get(k)) for k in differ] + ([] if same_text else ["the document"])
    if said:
        raise UsageError(f"--resume: the saved run was measured with other settings: {'; '.join(said)}")


# settings a bench result derives from others: a change to those changes them too
FOLLOWS = {"budget_tokens": ("budgets", "context"), "method_params": ("methods",)}
# settings a bench result names otherwise than by their option
SETTING_WORDS = {"probe_precision": "--probe-dtype", "model_config_sha256": "the model's config",
                 "model_weights_sha256": "the model's weights", "method_params": "the methods' parameters (another "
                 "klevict version)", "budget_tokens": "the budgets in tokens (another chat frame)"}


def resume_change(key: str, saved: object, now: object) -> str:
    """One setting a resumed run would change, as the user knows it: `--budgets 50%,20% (now 10%)`."""
    words = SETTING_WORDS.get(key, "--" + key.replace("_", "-"))
    if words.startswith("--") and all(isinstance(v, str | int | float | bool | list | None) for v in (saved, now)):
        return f"{words} {_as_typed(saved)} (now {_as_typed(now)})"
    return words


def _as_typed(value: object) -> str:
    """A setting's value as an option takes it: a list comma-separated, a switch in lower case."""
    if value is None:
        return "not given"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def _machine(session) -> str:
    """What the timings were measured on: CPU, core count and, when used, the GPU."""
    device = next(session.lm.model.parameters()).device
    cpu = platform.processor() or platform.machine()
    try:  # Linux names the CPU model here; platform.processor() is often empty
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo", encoding="utf-8")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads{gpu}"


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


# ---- rendering -------------------------------------------------------------------------------------------------
def _best(result: dict, metric: str, lower: bool) -> dict[str, float]:
    best: dict[str, float] = {}
    for per in result["results"].values():
        for label, row in per.items():
            value = row[metric]["mean"]
            if value is not None and (label not in best or (value < best[label] if lower else value > best[label])):
                best[label] = value
    return best


def _cell(text: str, bold: bool) -> str:
    return f"[bold green]{text}[/]" if bold else text


def _method_table(console: Console, block: dict, labels: list[str], cell, title: str, caption: str = "",
                  metric: str | None = None, lower: bool = False, headers: list[str] | None = None) -> None:
    """One table: a row per method, a column per budget; `cell(row, label)` formats a budget's numbers and, given a
    `metric`, the best mean per column is marked."""
    table = Table(title=title, caption=caption or None)
    table.add_column("method", no_wrap=True)
    for header in headers or labels:
        table.add_column(header, justify="right")
    best = _best(block, metric, lower) if metric else {}
    for method, per in block["results"].items():
        table.add_row(method, *[_cell(cell(per[b], b), metric is not None and _is(per[b][metric]["mean"], best.get(b)))
                                for b in labels])
    console.print(table)


def render(result: dict, console: Console) -> None:
    settings = result["settings"]
    labels = list(settings["budget_tokens"])
    head = (f"{shown(settings['model'])} · {shown(settings['document']['name'])} · "
            f"{windows_count(settings['windows'])} · seed {settings['seed']} · chunk {settings['chunk_size']}")
    fid = result.get("fidelity")
    if fid is not None:
        full = fid["full"]
        _method_table(console, fid, labels, lambda row, _: _pm(row["kl"], ".4f"),
                      f"KL(full ‖ compressed), nats/token, mean ± 95% — {head}",
                      f"context {settings['context']} + continuation {fid['continuation_tokens']} tokens; full-cache "
                      f"perplexity {_pm(full['perplexity'], '.2f')}; best per column in bold", metric="kl", lower=True,
                      headers=[label if settings["budget_tokens"][label] is None
                               else f"{label} ({settings['budget_tokens'][label]})" for label in labels])
        if settings.get("sampled"):
            _method_table(console, fid, labels, lambda row, _: _pm(row["kl_sampled"], ".4f"),
                          f"KL(full ‖ compressed) on the model's own text: {settings['sampled']} continuations of "
                          f"{fid['continuation_tokens']} tokens the full cache samples, nats/token, mean ± 95%",
                          metric="kl_sampled", lower=True)
        _method_table(console, fid, labels,
                      lambda row, _: f"{100 * row['top1']['mean']:.1f}% · {row['perplexity']['mean']:.2f}",
                      "top-1 agreement with the full cache · perplexity", metric="top1")
        _method_table(console, fid, labels,
                      lambda row, _: f"{row['time_ratio']['mean']:.2f}× · {row['cache_bytes']['mean'] / 1e6:.2f} MB"
                                  f" (peak {row['peak_cache_bytes']['mean'] / 1e6:.2f})",
                      "cost: read time vs the full cache (same chunks) · cache kept",
                      f"full cache: {full['seconds']['mean']:.3f} s per window, "
                      f"{full['cache_bytes']['mean'] / 1e6:.2f} MB")
        estimated = [label for label in labels if any(_estimate_pairs(per[label]) for per in fid["results"].values())]
        if estimated:
            _method_table(console, fid, estimated, lambda row, _: _estimate_cell(row),
                          "estimated drift (what --estimate and --max-kl report) against the measured KL: mean "
                          "estimate · median estimated / measured over windows (range) · windows within 1.5×")
        tolerances = [label for label in labels if label.startswith(TOLERANCE_PREFIX)]
        if tolerances:
            _method_table(console, fid, tolerances, _tolerance_cell,
                          "--max-kl: cache kept · measured KL / tolerance, median over windows (range) · windows "
                          "within 1.5× of it")
        limits = [label for label in labels if label.startswith(byte_label("").strip())]
        if limits:
            _method_table(console, fid, limits, _bytes_cell,
                          "--max-bytes: bytes kept (of the full cache's) · dtypes chosen (windows)")
    for task, what in (("needle", "needle retrieval (planted facts)"), ("recall", "recall (details stated once)")):
        block = result.get(task)
        if block is None:
            continue
        asked = [len(h["facts"]) for h in block["haystacks"][: block["windows_done"]]]
        # the mean of each window's accuracy: recall's windows may ask different numbers of questions, so 58.3 %
        # of "5 questions" (1/2 and 2/3) is no share of 5; said so
        n, windows = counted(sum(asked), "question", "questions"), counted(sum(map(bool, asked)), "window", "windows")
        _method_table(console, block, labels, lambda row, _: f"{100 * row['accuracy']['mean']:.1f}%",
                      f"{what}: exact-match accuracy, mean over {windows} ({n})",
                      f"full cache: {100 * block['full']['accuracy']['mean']:.1f}%; best per column in bold",
                      metric="accuracy")


def _tolerance_cell(row: dict, label: str) -> str:
    tolerance = float(label.removeprefix(TOLERANCE_PREFIX))
    ratios = sorted(kl / tolerance for kl in row["per_window"]["kl"])
    return (f"{100 * row['cache_fraction']['mean']:.1f} % · {statistics.median(ratios):.2f}× "
            f"({ratios[0]:.2f}–{ratios[-1]:.2f}) · {within_factor(ratios)}/{len(ratios)}")


def _estimate_pairs(row: dict) -> list[tuple[float, float]]:
    """(estimated, measured) KL of each window whose read estimated its drift."""
    per = row["per_window"]
    return [(e, m) for e, m in zip(per.get("estimated_kl") or [], per["kl"]) if e is not None and m is not None]


def _estimate_cell(row: dict) -> str:
    pairs = _estimate_pairs(row)
    if not pairs:
        return "–"
    ratios = sorted(e / m if m > 0 else math.inf for e, m in pairs)
    return (f"{statistics.fmean(e for e, _ in pairs):.4f} · {statistics.median(ratios):.2f}× "
            f"({ratios[0]:.2f}–{ratios[-1]:.2f}) · {within_factor(ratios)}/{len(ratios)}")


def _bytes_cell(row: dict, label: str) -> str:
    chosen = Counter(row["per_window"]["cache_dtype"])
    return (f"{100 * row['cache_fraction']['mean']:.1f} % · "
            + ", ".join(f"{dtype} ({n})" for dtype, n in chosen.most_common()))


def _is(value, best) -> bool:
    return value is not None and best is not None and abs(value - best) <= 1e-12


def _pm(s: dict, fmt: str) -> str:
    if s["mean"] is None:
        return "–"
    if s.get("n", 2) < 2:  # one window: no interval to give
        return f"{format(s['mean'], fmt)} (n = 1)"
    return f"{format(s['mean'], fmt)} ± {format(s['ci95'], fmt)}"
