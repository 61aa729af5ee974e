"""How a document and a question become tokens.

The document and question are untrusted: their text never becomes control tokens (`encode_text`). The document
must sit inside the model's chat format (user turn) but be read — and compressed — before any
question is known. So the chat template is rendered once around a placeholder and split: `prefix` (system prompt and
the start of the user turn) is read first, then the document, and `suffix(question)` (the question, the end of the
user turn and the assistant header) is appended at question time. Models without a chat template get a plain
"Question: … Answer:" frame.

A chat model ends its answer with an end-of-turn token (`stop_ids`). A plain frame has none: there the model goes on
to invent the frame's next turn ("Question: …") and answer it too, so its answer ends where that turn begins
(`PromptFrame.settled`).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SUMMARY_PROMPT = "Summarize the text above in a few sentences."
_PLACEHOLDER = "\u2063KLEVICT_DOCUMENT\u2063"
QUESTION, ANSWER = "Question:", "Answer:"  # the plain frame's turns


@dataclass(frozen=True)
class PromptFrame:
    prefix: str
    separator: str  # between the document and the question, inside the user turn
    closing: str  # after the question: end of turn + assistant header
    bos: list[int]
    stops: tuple[str, ...] = ()  # texts that end the answer: the start of the frame's next turn (plain frames only)

    def settled(self, text: str) -> tuple[int, bool]:
        """How much of `text`, an answer still being written, is final: up to the first stop text (True: the answer
        ends there, without it), else all but a tail that could still grow into one (False), so that streaming never
        shows part of a stop text."""
        cuts = [at for at in map(text.find, self.stops) if at >= 0]
        if cuts:
            return min(cuts), True
        return len(text) - max((_partial(text, stop) for stop in self.stops), default=0), False

    def prefix_ids(self, tokenizer) -> list[int]:
        return self.bos + _encode(tokenizer, self.prefix)

    def suffix_ids(self, tokenizer, question: str) -> list[int]:
        return _encode(tokenizer, self.separator) + encode_text(tokenizer, question.strip()) + _encode(
            tokenizer, self.closing)


def _partial(text: str, stop: str) -> int:
    """The length of the longest end of `text` that `stop` begins with (and is not all of it)."""
    return next((n for n in range(len(stop) - 1, 0, -1) if text.endswith(stop[:n])), 0)


def _encode(tokenizer, text: str) -> list[int]:
    """klevict's own frame: its special tokens ("<|im_start|>") become the control tokens they stand for."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def encode_text(tokenizer, text: str) -> list[int]:
    """Untrusted text (a document, a question) as plain text: a "<|im_start|>system" inside it is spelled out in
    ordinary tokens, never turned into the control token, so a document cannot close the user's turn and open its
    own. Only `_encode`d frame text makes control tokens."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] if text else []


def frame_for(tokenizer) -> PromptFrame:
    bos = bos_ids(tokenizer)
    if getattr(tokenizer, "chat_template", None):
        question = "\u2063QUESTION\u2063"
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": _PLACEHOLDER + "\n\n" + question}], tokenize=False, add_generation_prompt=True
        )
        prefix, rest = rendered.split(_PLACEHOLDER, 1)
        separator, closing = rest.split(question, 1)
        if tokenizer.bos_token and prefix.startswith(tokenizer.bos_token):
            prefix, bos = prefix[len(tokenizer.bos_token) :], [tokenizer.bos_token_id]
        return PromptFrame(prefix, separator, closing, bos)
    return PromptFrame("", f"\n\n{QUESTION} ", f"\n{ANSWER}", bos, stops=(f"\n{QUESTION}",))


def bos_ids(tokenizer) -> list[int]:
    """Keep the BOS token the tokenizer would add on its own (Llama-style models expect it)."""
    ids = tokenizer("a")["input_ids"]
    if tokenizer.bos_token_id is not None and ids and ids[0] == tokenizer.bos_token_id:
        return [tokenizer.bos_token_id]
    return []


def stop_ids(tokenizer) -> set[int]:
    """End-of-sequence and end-of-turn tokens."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    for token in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return ids
