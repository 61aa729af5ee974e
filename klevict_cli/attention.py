"""klevict's attention function: attends over ragged caches and records the probe rows' statistics.

transformers builds its causal mask from one layer's cache length, which is wrong once layers and heads keep
different entries. So klevict registers its own function with `AttentionInterface`: the mask comes from each
entry's `valid` flag and rotary position (causal = key position <= query position; sliding window likewise), and
for the last `probe_rows` queries it records what eviction policies need — post-RoPE queries, attention weights
over the whole cache and the per-head outputs before the output projection — without materialising the full
attention map of the chunk.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from klevict_cli.cache import KVCache
from klevict_cli.errors import ModelError

ATTENTION_NAME = "klevict"


@dataclass
class LayerProbe:
    """One layer's statistics at the probe positions (the last W tokens of a forward)."""

    query: torch.Tensor  # (Hq, W, Dk) post-RoPE
    weights: torch.Tensor  # (Hq, W, C) float32 attention over the layer's cache (padding has weight 0)
    output: torch.Tensor  # (Hq, W, Dv) head outputs before the output projection


@dataclass
class ForwardContext:
    cache: KVCache
    query_positions: torch.Tensor  # (T,) rotary positions of the tokens in this forward
    probe_rows: int = 0
    probes: dict[int, LayerProbe] = field(default_factory=dict)
    residuals: torch.Tensor | None = None  # (W, d_model) final residual stream at the probes
    captured: dict[int, torch.Tensor] | None = None  # head outputs kept in the autograd graph (Fisher re-runs)


_current: ContextVar[ForwardContext | None] = ContextVar("klevict_forward", default=None)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext):
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def attention_mask(cache_layer, query_positions: torch.Tensor) -> torch.Tensor:
    """(H_kv, T, C) bool: which cached entries each query may attend to."""
    kpos = cache_layer.rope_positions[:, None, :]
    qpos = query_positions[None, :, None]
    allowed = cache_layer.valid[:, None, :] & (kpos <= qpos)
    if cache_layer.window is not None:
        allowed &= kpos > qpos - cache_layer.window
    return allowed


def klevict_attention(module, query, key, value, attention_mask_unused, scaling, dropout=0.0, **kwargs):
    ctx = _current.get()
    if ctx is None:  # a plain forward of the same model (e.g. a reference in a test): behave like sdpa
        window = kwargs.get("sliding_window")
        if attention_mask_unused is None and window is not None:
            # transformers builds no mask for an attention function it does not know: apply the window here.
            kpos = torch.arange(key.shape[2], device=query.device)
            qpos = kpos[key.shape[2] - query.shape[2] :, None]
            attention_mask_unused = ((kpos <= qpos) & (kpos > qpos - window))[None, None]
        return sdpa_attention_forward(module, query, key, value, attention_mask_unused, scaling=scaling, **kwargs)
    layer_idx = module.layer_idx
    layer = ctx.cache.layers[layer_idx]
    if kwargs.get("softcap") is not None:
        raise ModelError("this model soft-caps attention logits, which klevict's attention does not support")
    if kwargs.get("sliding_window") not in (None, layer.window):
        raise ModelError(f"layer {layer_idx} attends over a window of {kwargs['sliding_window']} tokens but its cache"
                         f" was set up for {layer.window}")
    groups = query.shape[1] // key.shape[1]
    # One mask row per cached head. MLA caches a single "head" (the latent) and hands over keys and values already
    # expanded per query head: groups == 1 and that one mask broadcasts over every head.
    allowed = attention_mask(layer, ctx.query_positions).repeat_interleave(groups, dim=0)[None]
    k = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    v = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=allowed, scale=scaling)  # (1, Hq, T, Dv)
    if ctx.captured is not None:
        ctx.captured[layer_idx] = out
    if ctx.probe_rows:
        w = min(ctx.probe_rows, query.shape[2])
        q = query[0, :, -w:]
        logits = torch.matmul(q.float(), k[0].float().transpose(1, 2)) * scaling
        logits = logits.masked_fill(~allowed[0, :, -w:], float("-inf"))
        ctx.probes[layer_idx] = LayerProbe(query=q, weights=logits.softmax(dim=-1), output=out[0, :, -w:])
    return out.transpose(1, 2).contiguous(), None


def _capture_residual(module, args):
    ctx = _current.get()
    if ctx is not None and ctx.probe_rows:
        ctx.residuals = args[0][0, -ctx.probe_rows :].detach()


def install_residual_hook(final_norm) -> None:
    """Record the final residual stream (the final norm's input) at the probe rows; installed once per model."""
    if not getattr(final_norm, "_klevict_hooked", False):
        final_norm.register_forward_pre_hook(_capture_residual)
        final_norm._klevict_hooked = True


AttentionInterface.register(ATTENTION_NAME, klevict_attention)
