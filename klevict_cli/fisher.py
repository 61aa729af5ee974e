"""Gradients of the probes' log-probabilities with respect to every layer's head outputs (the Fisher path).

The probes are re-run against the cache as it stands, with its keys and values held constant, so that each probe's
gradient flows only through its own residual stream — through every later layer's MLP and attention queries — and
not through other tokens. For S labels sampled from each probe's own distribution, g = ∂ log p(y)/∂o gives the
Fisher metric E_y[g gᵀ] of the next-token distribution on that layer's head outputs.
"""

from __future__ import annotations

import torch

from klevict_cli.attention import ForwardContext, forward_context
from klevict_cli.cache import KVCache


class FrozenCache:
    """Serves the cached keys/values as constants and appends nothing."""

    is_compileable = False

    def __init__(self, cache: KVCache):
        self.layers = cache.layers

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        # clone(): tensors made under inference_mode cannot enter an autograd graph.
        return layer.keys[None].clone(), layer.values[None].clone()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].capacity

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def is_sliding(self) -> list[bool]:
        return [layer.window is not None for layer in self.layers]


def head_output_gradients(
    model, cache: KVCache, probe_ids: list[int], probe_rope: torch.Tensor, samples: int, generator: torch.Generator
) -> dict[int, torch.Tensor]:
    """Per layer, (W, S, Hq, Dv) gradients of log p_t(y_ts) w.r.t. the head outputs o_t, y_ts ~ p_t."""
    device = probe_rope.device
    with torch.inference_mode(False), torch.enable_grad():
        ids = torch.tensor([probe_ids], device=device)
        embeds = model.get_input_embeddings()(ids).detach().clone().requires_grad_(True)
        ctx = ForwardContext(FrozenCache(cache), probe_rope.clone(), captured={})
        with forward_context(ctx):
            logits = model(
                inputs_embeds=embeds, position_ids=probe_rope.clone()[None], cache=ctx.cache, use_cache=True,
                logits_to_keep=len(probe_ids),
            ).logits[0].float()
        logp = logits.log_softmax(dim=-1)
        labels = torch.multinomial(logp.detach().exp().cpu(), samples, replacement=True, generator=generator)
        per_sample = logp.gather(1, labels.to(device)).sum(dim=0)  # (S,): sample s's log-probs over the probes
        # All S backward passes at once (vmapped over the rows of I_S): bigger matrix products than a loop of S.
        layer_ids = sorted(ctx.captured)
        grads = torch.autograd.grad(per_sample, [ctx.captured[i] for i in layer_ids],
                                    grad_outputs=torch.eye(samples, device=device), is_grads_batched=True)
    # each (S, 1, Hq, W, Dv) -> (W, S, Hq, Dv)
    return {idx: g[:, 0].permute(2, 0, 1, 3).detach() for idx, g in zip(layer_ids, grads)}
