"""The reads the drift probes share (examples/tail_probe.py, examples/kl_noise.py): the bench's fidelity windows of
each text, tokenised as the bench reads a document, each read in full and then by `kl` (or `compress`'s reading,
`kl-reconstruct`) at each budget with its drift measured, with the per-token KL of the real continuation after it.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from klevict_cli.bench import continuation_logits, fidelity_windows
from klevict_cli.documents import load_document
from klevict_cli.models import load_model
from klevict_cli.options import Budget
from klevict_cli.prompts import encode_text
from klevict_cli.session import ReadResult, ReadSettings, Session
from klevict_kernels.kl import token_kl


def add_arguments(parser: argparse.ArgumentParser, budgets: str, seed: int) -> None:
    """The texts and what is read of them, with these defaults for `--budgets` and `--seed`."""
    parser.add_argument("texts", nargs="*", type=Path)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--continuation", type=int, default=256)
    parser.add_argument("--budgets", default=budgets)
    parser.add_argument("--methods", default="kl", help="kl and/or kl-reconstruct")
    parser.add_argument("--model", default=None)
    parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--out", type=Path)


@dataclass
class Window:
    text: str
    offset: int
    tokens: list[int]
    follow: list[int]  # the real continuation
    full: ReadResult  # read in full
    reference: torch.Tensor  # the full read's logits for `follow`


@dataclass
class Read:
    method: str
    budget: str
    result: ReadResult
    per_token: torch.Tensor  # KL of the real continuation after `result` against the full read, per token

    def row(self, args, window: Window) -> dict:
        """What every probe records of a read."""
        return {"text": window.text, "context": args.context, "model": args.model or "smollm2",
                "method": self.method, "offset": window.offset, "budget": self.budget,
                "measured": float(self.per_token.mean()), "estimated": self.result.stream.drift["kl"]}


def session_for(args) -> Session:
    return Session(load_model(args.model, "cpu", "float32"))


def windows(session: Session, args) -> Iterator[Window]:
    for text in args.texts:
        ids = encode_text(session.lm.tokenizer, load_document(str(text)).text)  # as the bench reads it
        for offset, tokens, follow in fidelity_windows(session, ids, args.context, args.continuation, args.windows,
                                                       args.seed):
            full = session.read_tokens(tokens, ReadSettings(budget=None, method="none"), reserve=len(follow))
            reference = continuation_logits(full.engine, full.stream.clone(), full.logits, follow)
            yield Window(text.name, offset, tokens, follow, full, reference)


def reads(session: Session, window: Window, args) -> Iterator[Read]:
    for method in args.methods.split(","):
        for budget in args.budgets.split(","):
            settings = ReadSettings(budget=Budget(fraction=float(budget.rstrip("%")) / 100), method="kl",
                                    reconstruct=method == "kl-reconstruct", measure_drift=True, seed=args.seed)
            result = session.read_tokens(window.tokens, settings, reserve=len(window.follow))
            logits = continuation_logits(result.engine, result.stream.clone(), result.logits, window.follow)
            yield Read(method, budget, result, token_kl(window.reference, logits))
