"""Drawing tokens: greedy or top-p decoding, the repetition penalty, and the drafts' batched sampling."""

from __future__ import annotations

import torch


def seeded(seed: int, offset: int = 0) -> torch.Generator:
    """A CPU generator for `seed` moved by `offset` (a stream of samples kept apart from the others), wrapped into
    the 64 bits torch's generators take: `--seed` goes up to 2**64 - 1, and the sum past it was a traceback."""
    return torch.Generator().manual_seed((seed + offset) % 2**64)


def penalise_repeats(logits: torch.Tensor, previous: list[int], penalty: float, window: int = 64) -> torch.Tensor:
    """Make the answer's last `window` tokens less likely again (positive logits divided by `penalty`, negative
    ones multiplied): small models decoding greedily from a heavily compressed cache otherwise fall into loops."""
    if penalty == 1.0 or not previous:
        return logits
    index = torch.tensor(sorted(set(previous[-window:])), device=logits.device)
    seen = logits[index]
    return logits.index_copy(0, index, torch.where(seen > 0, seen / penalty, seen * penalty))


class SpanBan:
    """Rules out every token that would end a `span`-token run of the answer equal to an earlier one: a small model
    decoding greedily from a compressed cache falls into loops of whole sentences that a penalty on single tokens
    only delays (over the quick start's plays, every summary ended in one). Each run's first span - 1 tokens map to
    the tokens that followed them, so a step costs one lookup however long the answer. span 0: off."""

    def __init__(self, span: int):
        self.span = span
        self.followers: dict[tuple[int, ...], set[int]] = {}

    def add(self, answer: list[int]) -> None:
        """Record the run that the answer's newest token ends."""
        if self.span and len(answer) >= self.span:
            self.followers.setdefault(tuple(answer[len(answer) - self.span : -1]), set()).add(answer[-1])

    def apply(self, logits: torch.Tensor, answer: list[int]) -> torch.Tensor:
        """`logits` with the banned tokens at -inf; as they are where that would leave no token at all."""
        if not self.span or len(answer) < self.span - 1:
            return logits
        banned = self.followers.get(tuple(answer[len(answer) - self.span + 1 :]))
        if not banned or len(banned) >= logits.shape[-1]:
            return logits
        return logits.index_fill(0, torch.tensor(sorted(banned), device=logits.device), float("-inf"))


def sample_rows(logits: torch.Tensor, generator: torch.Generator) -> list[int]:
    """One token from each row's distribution (temperature 1), by inverting each row's cumulative distribution at
    one uniform draw: two passes over the logits and one random number per row. `torch.multinomial` took 79 ms on
    the CPU for the drafts' 64 rows over a 49k vocabulary, Gumbel-max (a random number per logit) 15 ms, this 2-4 ms.
    In float64, so that no token is lost in the sum: in float32 the tail of a 262k vocabulary (probabilities below
    ~3e-8) added nothing to it and could never be drawn."""
    # on the generator's device (a CPU one, which also has float64 where MPS has not)
    cdf = logits.to(generator.device).softmax(dim=-1, dtype=torch.float64).cumsum_(dim=-1)
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=generator.device, dtype=torch.float64)
    # the first token whose cumulative probability exceeds u: never one of probability 0
    drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]
    return drawn.clamp_max_(cdf.shape[-1] - 1).tolist()


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    probs = (logits.float().cpu() / temperature).softmax(dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        outside = sorted_p.cumsum(dim=-1) - sorted_p > top_p
        sorted_p[outside] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))
