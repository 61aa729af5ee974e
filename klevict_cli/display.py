"""Text from files, paths and the model, made safe to print on a terminal; answers streamed, progress counted.

A `.kvc` header, a file name, a document or a generated answer may hold escape sequences (ESC[…m recolours,
ESC]0;… retitles the window, OSC 8 plants links) or rich markup (`[link=…]`). Printed raw they would drive the
user's terminal, so `visible` shows every control character as a Python-style escape (`\\x1b`), and such text
reaches rich only as `Text` objects, which are never parsed as markup.
"""

from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.progress import ProgressColumn
from rich.text import Text

# Progress, notes and errors: one console on standard error for every room that shows them.
err = Console(stderr=True, highlight=False)


def visible(text: str, keep: str = "") -> str:
    """`text` with each non-printable character except those in `keep` (e.g. "\\n") shown as an escape."""
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


def shown(name: str) -> str:
    """A file name inside rich markup (e.g. a progress description): control characters and markup shown."""
    return escape(visible(name))


def json_text(payload: object) -> str:
    """One line of JSON with non-ASCII text kept readable but every non-printable character escaped (json.dumps
    leaves DEL, the C1 controls such as the one-byte CSI, and bidi overrides raw)."""
    text = json.dumps(payload, ensure_ascii=False)
    return "".join(c if c.isprintable() else json.dumps(c)[1:-1] for c in text)


def counted(n: int | None, one: str, many: str) -> str:
    """'1 entry', '2 entries', 'all entries' (None: every one): a one-token document or a one-entry budget is not
    reported as '1 entries'."""
    return f"{'all' if n is None else n} {one if n == 1 else many}"


def chosen_layers(info: dict) -> str:
    """Where sliding layers are left out of `inspect`'s kept tokens (`report.describe`), which layers were counted."""
    chosen = len(info["kept_per_layer"]) - len(info["sliding_layers"])
    return f" of the {counted(chosen, 'layer', 'layers')} the budget chose for" if info["sliding_layers"] else ""


def sliding_summary(sliding: dict[str, int], layers: int) -> str:
    """What `inspect` says of the sliding-window layers (`report.describe`'s `sliding_layers`: layer -> window)."""
    return (f"{len(sliding)} of {layers} layers keep their last {min(sliding.values()):,} tokens whatever the budget;"
            " the shading and spans count the other layers")


def drift_words(drift: dict) -> str:
    """A cache's estimated drift (`Engine.measure_drift`) in words: the estimate, and where the KL of the text that
    follows lands for 80 % of caches (`range80`) or, from a file written without that range, the upper end of the
    samples' 95 % interval."""
    if "range80" in drift:
        low, high = drift["range80"]
        return f"{drift['kl']:.3g} nats/token (80 % range {low:.2g}–{high:.2g})"
    return f"{drift['kl']:.3g} nats/token (95 % up to {drift['kl'] + drift['ci95']:.3g})"


def drift_against(drift: dict) -> str:
    """What a drift estimate was measured against (`covers`): the whole read's cache or, where the evicted entries
    could not be set aside (compact positions, files written before), the cache before the last eviction, which
    leaves out what earlier evictions moved (research log: 0.17-0.28x the measured KL)."""
    return "the whole read's cache" if drift.get("covers") == "read" else "the cache before the last eviction"


def decode_spans(tokenizer, tokens: list[int], longest: int = 4) -> list[tuple[str, range]]:
    """The text of `tokens` piece by piece, each piece with the range of tokens it is the text of.

    A piece is one token, unless that token holds only part of a character (byte-level tokenizers split a character
    outside their vocabulary into one token per byte, and each alone decodes to U+FFFD): then the following tokens
    that complete it, up to `longest` in all (a UTF-8 character has at most 4 bytes), make one piece.
    """
    pieces: list[tuple[str, range]] = []
    i = 0
    while i < len(tokens):
        end, text = i + 1, tokenizer.decode(tokens[i:i + 1])
        if text.endswith("\ufffd"):
            for j in range(i + 2, min(i + longest, len(tokens)) + 1):
                longer = tokenizer.decode(tokens[i:j])
                if not longer.endswith("\ufffd"):
                    end, text = j, longer
                    break
        pieces.append((text, range(i, end)))
        i = end
    return pieces


class TextStream:
    """An answer's text, released piece by piece as its tokens arrive, so that it can be printed while it is written.

    What is released always adds up to the final, stripped answer: leading and trailing whitespace is held back, and
    so is a trailing U+FFFD (the first bytes of a character whose other bytes are still to come).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.shown = ""

    def update(self, tokens: list[int]) -> str:
        """The new text since the last call."""
        ready = self.tokenizer.decode(tokens, skip_special_tokens=True).strip().removesuffix("\ufffd").rstrip()
        if not ready.startswith(self.shown):  # the tokenizer re-spaced earlier text: wait for `finish`
            return ""
        new, self.shown = ready[len(self.shown):], ready
        return new

    def finish(self, text: str) -> str:
        """What is left of the final `text`; the whole of it again, on a new line, if the pieces went astray."""
        return text[len(self.shown):] if text.startswith(self.shown) else "\n" + text


class Count(ProgressColumn):
    """'1,200/4,096 tokens' once the total is known, '12 tokens' while it is not (never '0/?')."""

    def __init__(self, unit: str):
        super().__init__()
        self.unit = unit

    def render(self, task) -> Text:
        if task.total is not None:
            return Text(f"{int(task.completed):,}/{int(task.total):,} {self.unit}")
        return Text(f"{int(task.completed):,} {self.unit}" if task.completed else "")
