"""A reference for the engine's exactness tests: plain eager softmax attention over an explicit per-layer,
per-cached-head visibility mask, and the procedure that checks "eviction == masking the evicted entries".

The reference sees the keys and values the model hands to its attention function — per KV head for GQA/MHA, already
expanded per query head for MLA — and a mask per *cached* head (one for MLA: an entry is a token shared by every
head), broadcast over the query heads that read it."""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from klevict_cli.adapter_check import adapter_for

REFERENCE_NAME = "klevict_test_reference"
_REFERENCE_MASKS: dict[int, torch.Tensor] = {}


def _masked_reference(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    visible = _REFERENCE_MASKS[module.layer_idx]  # (H_cached, T, T)
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1).double()
    v = value.repeat_interleave(groups, dim=1).double()
    if visible.shape[0] > 1:
        visible = visible.repeat_interleave(query.shape[1] // visible.shape[0], dim=0)
    scores = (query.double() @ k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~visible[None], float("-inf"))
    out = scores.softmax(-1) @ v
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(REFERENCE_NAME, _masked_reference)


def reference_logits(model, ids: list[int], masks: dict[int, torch.Tensor]) -> torch.Tensor:
    """The last token's logits of one plain forward of `ids` in which layer l's queries see `masks[l]`."""
    _REFERENCE_MASKS.clear()
    _REFERENCE_MASKS.update(masks)
    previous = model.config._attn_implementation
    model.set_attn_implementation(REFERENCE_NAME)
    try:
        with torch.no_grad():
            return model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
    finally:
        model.set_attn_implementation(previous)


def causal_masks(model, n: int) -> dict[int, torch.Tensor]:
    """Per layer, (H_cached, n, n) causal masks, banded to the window on sliding-window layers."""
    shapes = adapter_for(model).layer_shapes()
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    masks = {}
    for i, s in enumerate(shapes):
        allowed = k <= q
        if s.window is not None:
            allowed &= k > q - s.window
        masks[i] = allowed.expand(s.kv_heads, n, n).clone()
    return masks


def eviction_vs_masking(model, engine, ids: list[int], chunk_size: int, next_token: int = 5):
    """Feed `ids` chunk by chunk through `engine` (evicting), then one more token; return (engine logits, reference
    logits) where the reference lets every token see exactly the entries that were kept when it was read."""
    stream = engine.new_stream()
    n = len(ids) + 1
    masks = causal_masks(model, n)
    for start in range(0, len(ids), chunk_size):
        if start:  # queries of this chunk see only what survived the previous eviction
            for layer_idx, layer in enumerate(stream.cache.layers):
                for h in range(layer.keys.shape[0]):
                    row = torch.zeros(n, dtype=torch.bool)
                    row[layer.positions[h][layer.valid[h]]] = True
                    masks[layer_idx][h, start:, :start] &= row[:start]
        engine.feed(stream, ids[start : start + chunk_size])
    for layer_idx, layer in enumerate(stream.cache.layers):  # the next token sees the final cache
        for h in range(layer.keys.shape[0]):
            row = torch.zeros(n, dtype=torch.bool)
            row[layer.positions[h][layer.valid[h]]] = True
            row[-1] = True
            masks[layer_idx][h, -1] &= row
    got = engine.feed(stream, [next_token], evict=False)
    return got, reference_logits(model, ids + [next_token], masks), stream
