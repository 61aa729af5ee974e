"""Gradients of the probes' log-probabilities with respect to every layer's head outputs (the Fisher path).

The probes are re-run against the cache as it stands, the entries read before them held constant. For S labels
sampled from each probe's own distribution, g = ∂ Σ_t log p_t(y_t)/∂o gives the Fisher metric E_y[g gᵀ] of the
probes' next-token distributions on a layer's head outputs. Two ways to treat the probes' own keys and values:
  * frozen — served from the cache as computed: each probe's gradient flows only through its own residual stream
    (every later layer's MLP and attention queries);
  * live — recomputed in the re-run: a change to an early probe's residual also reaches the later probes through
    its keys and values at every later layer. That is how an eviction reaches the tokens that come after it (each
    future token's changed state is cached and read by the next ones), and on SmolLM2 it is most of the effect of
    early and middle layers: the float64 leave-one-out KL with the probes re-run is 2-7× the frozen one at layers
    2 and 15, about 1× at layer 28.
"""

from __future__ import annotations

import torch

from klevict_cli.adapters import run_with_cache
from klevict_cli.attention import ForwardContext, forward_context
from klevict_cli.cache import KVCache


class FrozenCache:
    """Serves the cached keys/values as constants and appends nothing. With `live` > 0, the last `live` columns
    (the tokens being re-run, appended last) are replaced by the keys/values the re-run computes."""

    is_compileable = False

    def __init__(self, cache: KVCache, live: int = 0):
        self.layers = cache.layers
        self.live = live

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        held = layer.capacity - self.live
        # clone(): tensors made under inference_mode cannot enter an autograd graph.
        keys, values = layer.keys[None, :, :held].clone(), layer.values[None, :, :held].clone()
        if not self.live:
            return keys, values
        return torch.cat((keys, key_states), dim=2), torch.cat((values, value_states), dim=2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].capacity

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def is_sliding(self) -> list[bool]:
        return [layer.window is not None for layer in self.layers]


def head_output_gradients(
    model, cache: KVCache, probe_ids: list[int], probe_rope: torch.Tensor, samples: int, generator: torch.Generator,
    live: bool = False,
) -> dict[int, torch.Tensor]:
    """Per layer, (W, S, Hq, Dv) gradients of Σ_t' log p_t'(y_t's) w.r.t. the head outputs o_t, y_t's ~ p_t'.
    Frozen, only t' = t contributes; live (`live`: the probes are the cache's last columns), every t' >= t."""
    device = probe_rope.device
    with torch.inference_mode(False), torch.enable_grad():
        ids = torch.tensor([probe_ids], device=device)
        embeds = model.get_input_embeddings()(ids).detach().clone().requires_grad_(True)
        ctx = ForwardContext(FrozenCache(cache, len(probe_ids) if live else 0), probe_rope.clone(), captured={})
        with forward_context(ctx):
            logits = run_with_cache(
                model, ctx.cache, inputs_embeds=embeds, position_ids=probe_rope.clone()[None],
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


def attention_output_gradient_norms(model, attentions, final_norm, cache: KVCache, probe_ids: list[int],
                                    probe_rope: torch.Tensor) -> dict[int, torch.Tensor]:
    """KVgrad's sensitivity: per layer, (W,) ‖∂Φ/∂a_t‖ where a_t is the attention block's output (after the output
    projection) at probe t and Φ = Σ_t ‖h_t‖², h the final residual stream (the final norm's input). The probes are
    re-run live (their own keys and values recomputed, as the cache's last columns); the rest of the cache is held
    constant."""
    outputs: dict[int, torch.Tensor] = {}
    final: dict[str, torch.Tensor] = {}
    hooks = [attn.register_forward_hook(lambda m, args, out, i=i: outputs.__setitem__(i, out[0]))
             for i, attn in enumerate(attentions)]
    hooks.append(final_norm.register_forward_pre_hook(lambda m, args: final.__setitem__("h", args[0])))
    device = probe_rope.device
    try:
        with torch.inference_mode(False), torch.enable_grad():
            ids = torch.tensor([probe_ids], device=device)
            embeds = model.get_input_embeddings()(ids).detach().clone().requires_grad_(True)
            ctx = ForwardContext(FrozenCache(cache, len(probe_ids)), probe_rope.clone())
            with forward_context(ctx):
                run_with_cache(model, ctx.cache, inputs_embeds=embeds, position_ids=probe_rope.clone()[None],
                               logits_to_keep=1)
            objective = final["h"].float().square().sum()
            layer_ids = sorted(outputs)
            grads = torch.autograd.grad(objective, [outputs[i] for i in layer_ids], allow_unused=True)
    finally:
        for hook in hooks:
            hook.remove()
    return {i: (g[0].float().norm(dim=-1) if g is not None else torch.zeros(len(probe_ids), device=device)).detach()
            for i, g in zip(layer_ids, grads)}
