"""Probe sources: what an eviction is judged by.

The engine reads and evicts; a policy scores entries from the statistics of some probe tokens; a probe source decides
which tokens those are. Three kinds exist:
  * the last tokens read — recorded by the chunk's own forward (`Engine.feed`), nothing to append;
  * `Drafts` — tokens sampled past the end of the read (what the text that follows will ask of the cache);
  * `Reconstruction` — the model re-reading the document after a repeat instruction (what questions about the
    document will ask of it: to say what it said, the model must find it in the cache).
The last two never touch the engine: each is a generator of `ProbeRequest`s — tokens to append at the stream's end
— that is sent back each request's logits. The engine runs them (`Engine.probe_sets`), lets the policy read the
statistics, and forgets the tokens again: the cache, tokens and positions are then exactly what they were.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from klevict_cli.attention import ForwardContext
from klevict_cli.sampling import sample, sample_rows

SINKS = 4  # the first entries, which every query attends to (attention sinks)
REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_LATER = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclass
class ProbeRequest:
    """One forward a probe source asks for: `ids` appended at the stream's end (at its next rotary positions, or
    earlier where those run out and the request sees only some entries: Engine.place), recording the statistics of
    the last `rows` of them — their attention over the entries `entries(layer)` marks (None: all) — and returning
    the logits of the last `logits_rows`. With `attends`, the tokens attend only to the cached entries it marks
    (and to each other). `scored`: the policy judges the cache by these rows (False: a draft's intermediate round,
    whose logits only the source reads)."""

    ids: list[int]
    rows: int = 0
    logits_rows: int = 1
    entries: Callable | None = None
    attends: Callable | None = None
    judged: tuple[int, int] | None = None  # the positions [lo, hi) whose entries the rows judge; None: all
    scored: bool = True


Requests = Generator[ProbeRequest, "torch.Tensor | None", None]  # sent each request's logits


@dataclass
class ProbeSet:
    """Tokens appended to a stream to probe its cache: the policy reads `ctx`/`logits` of the last `rows` of them."""

    ctx: ForwardContext
    logits: torch.Tensor | None  # (rows, vocab); None where the policy does not read them
    appended: int  # tokens appended (forgotten once the set is scored)
    rows: int  # probe rows: the last `rows` appended tokens
    judged: tuple[int, int] | None = None  # the positions [lo, hi) whose entries this set judges; None: all
    restricted: bool = False  # a re-reading that attended to the sinks, its span and itself alone (Reconstruction)


class Drafts:
    """Look-ahead probes: `count` tokens sampled past the end of the read.

    Sampling them one at a time would cost `count` forwards. Instead every position is sampled at once and refined
    (Jacobi iterations): start from one sampled token followed by a guess at the rest, then `rounds` times re-sample
    every position from the model's distribution given the draft before it. The guess is the last tokens read; with
    `from_read`, the first round is instead taken from the read itself — each of its last tokens' predicted next
    token, sampled — which costs no forward (the read computed those logits) where a round over the guess costs one.
    Probes need queries like those of the text to come, not exact text (docs/research-log.md: with 32 drafts, the
    rounds' caches were within 8 % of one-at-a-time sampling's in KL for a third of the cost; greedy drafts did worse
    than sampled ones; the read's first round kept the KL within noise, 0.96-1.06x, for one forward fewer)."""

    def __init__(self, count: int = 64, rounds: int = 2, from_read: bool = True):
        self.count, self.rounds, self.from_read = count, rounds, from_read

    def read_rows(self, read: int) -> int:
        """Rows of the read's last logits the drafts start from, when its last forward read `read` tokens: with
        `from_read` and that many tokens, the read's own predictions of them stand in for the first round (one forward
        fewer); otherwise only the last token's."""
        return self.count if self.from_read and self.rounds > 0 and read >= self.count else 1

    def requests(self, tokens: list[int], read_logits: torch.Tensor, room: int, generator: torch.Generator
                 ) -> Requests:
        """The drafts past the end of `tokens` (the read), from the read's last logits; at most `room` of them (the
        model's positions left)."""
        count = min(self.count, room)
        if count <= 0:
            return
        read_logits = read_logits.view(-1, read_logits.shape[-1])
        first = sample(read_logits[-1], 1.0, 1.0, generator)
        rounds = self.rounds
        if self.from_read and rounds > 0 and read_logits.shape[0] >= count:
            draft = [first] + sample_rows(read_logits[read_logits.shape[0] - count : -1], generator)
            rounds -= 1
        else:
            draft = [first] + tokens[max(0, len(tokens) - count + 1) :]
        for _ in range(rounds):
            logits = yield ProbeRequest(draft, logits_rows=len(draft), scored=False)
            draft = [first] + sample_rows(logits[:-1], generator)
        yield ProbeRequest(draft, rows=len(draft), logits_rows=len(draft))


class Reconstruction:
    """Reconstruction probes: after a repeat instruction, the model re-reads the document span by span (each span
    once, as soon as it has been read), and each span's tokens probe the entries of that span — the ones it must
    copy from. This is KVzip's context reconstruction (Kim et al., 2025, arXiv:2505.23416) as a probe source: any
    policy can score its rows (kvzip by their attention, kl by the KL of their next-token distributions).

    `first` is the instruction before the first span; later spans get `later` followed by the last `overlap` tokens
    of the span before, so that the model knows where to resume; `suffix` opens the answer (the chat frame's
    assistant header). `sees`: "all" — the re-reading attends to the whole cache (KVzip); "span" — only to the
    attention sinks and the span being re-read (and itself), which costs a span's attention instead of the cache's
    and judges the span's entries by what copying the span needs of them alone. Its attention is then KVzip's
    restricted softmax as the forward computed it, so only the span's entries are recorded (the sinks and the
    re-reading's own tokens, about half the columns, are needed only to normalise the softmax of a re-reading that
    sees everything)."""

    def __init__(self, first: list[int], later: list[int], suffix: list[int], span: int = 128, overlap: int = 8,
                 sees: str = "all"):
        if span < 1:
            raise ValueError("a reconstruction span needs at least one token")
        if sees not in ("all", "span"):
            raise ValueError(f"a re-reading sees 'all' the cache or its 'span', not {sees!r}")
        self.first, self.later, self.suffix = first, later, suffix
        self.span, self.overlap, self.sees = span, overlap, sees

    @classmethod
    def for_tokenizer(cls, tokenizer, suffix: list[int], **kwargs) -> Reconstruction:
        def encode(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        return cls(encode(REPEAT_FIRST), encode(REPEAT_LATER), suffix, **kwargs)

    def spans(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """[lo, hi) cut evenly into spans of about `span` tokens (3/4 to 3/2 of it, unless [lo, hi) is shorter): a
        short last span would cost a forward of its own, and small forwards run far below a long one's speed per
        token."""
        count = max(1, round((hi - lo) / self.span))
        bounds = [lo + (hi - lo) * k // count for k in range(count + 1)]
        return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]

    def requests(self, tokens: list[int], start: int, limit: int | None = None, stop: int | None = None
                 ) -> Requests:
        """Re-read `tokens` (the document read so far) from position `start` to `stop` (default: its end), one span
        per request (the engine stops at the first that fits nowhere in the model's positions: Engine.place). A span
        re-read against itself alone must sit after itself and before `limit` (the model's positions, in the tokens'
        own numbering); near it, spans are cut shorter so that each does, and the document's last tokens are re-read
        too."""
        end, alone = len(tokens), self.sees == "span"  # alone: KVzip's restricted softmax is the forward's own
        for lo, hi in self.spans(max(start, 1), end if stop is None else stop):  # position 0 (BOS or the first token) is never re-read
            while lo < hi:
                prompt = (self.first if lo <= 1 else self.later + tokens[max(1, lo - self.overlap) : lo]) + self.suffix
                cut = hi
                if limit is not None and alone:  # placed at limit - n >= cut, n = len(prompt) + cut - lo
                    cut = min(hi, (limit - len(prompt) + lo) // 2)
                    if cut <= lo:
                        return
                yield ProbeRequest(prompt + tokens[lo:cut], rows=cut - lo, judged=(lo, cut),
                                   entries=functools.partial(_span_entries, lo, cut, sinks=0 if alone else SINKS,
                                                             end=None if alone else end),
                                   attends=functools.partial(_span_entries, lo, cut, sinks=SINKS) if alone else None)
                lo = cut


def _span_entries(lo: int, hi: int, layer, sinks: int = 0, end: int | None = None) -> torch.Tensor:
    """The valid entries of the span [lo, hi), with the attention sinks (the first `sinks` positions, when given)
    and with the re-reading itself (positions from `end`, where the read stopped, when given)."""
    p = layer.positions
    marked = (p >= lo) & (p < hi)
    if sinks:
        marked |= p < sinks
    if end is not None:
        marked |= p >= end
    return layer.valid & marked
