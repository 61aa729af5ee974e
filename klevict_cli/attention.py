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
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from klevict_cli.cache import KVCache, mask_columns
from klevict_cli.errors import ModelError

ATTENTION_NAME = "klevict"


@dataclass
class LayerProbe:
    """One layer's statistics at the probe positions (the last W tokens of a forward)."""

    query: torch.Tensor  # (Hq, W, Dk) post-RoPE
    weights: torch.Tensor  # (Hq, W, C) float32 attention over the layer's cache (padding has weight 0)
    output: torch.Tensor  # (Hq, W, Dv) head outputs before the output projection
    # When only some entries were asked for (ForwardContext.probe_entries): `weights` is (Hq, W, n) over the columns
    # (H_kv, n) of the cache, true where `present` (padding has weight 0); still normalised over the whole cache.
    columns: torch.Tensor | None = None
    present: torch.Tensor | None = None

    def entries(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """(columns, present) of the entries `weights` covers: given ones, or every column of `layer`."""
        if self.columns is not None:
            return self.columns, self.present
        h, c = layer.valid.shape
        return torch.arange(c, device=layer.valid.device).expand(h, c), layer.valid


@dataclass(frozen=True)
class Lanes:
    """Independent continuations side by side at a stream's end (Engine.drafts_for_drift): the entries from true
    position `start` on, and the tokens of the forward, belong to lane (position - start) % `count` and see only
    their own lane's entries besides everything before `start`. Their rotary positions advance by one per step of
    `count` tokens (Engine.forward), so each lane sits where a single continuation would."""

    start: int
    start_rope: int
    count: int

    def rope(self, positions: torch.Tensor) -> torch.Tensor:
        return self.start_rope + torch.div(positions - self.start, self.count, rounding_mode="floor")

    def lane(self, positions: torch.Tensor) -> torch.Tensor:
        """Each position's lane; -1 before `start`."""
        return torch.where(positions >= self.start, (positions - self.start) % self.count, -1)


@dataclass
class ForwardContext:
    cache: KVCache
    query_positions: torch.Tensor  # (T,) rotary positions of the tokens in this forward
    probe_rows: int = 0
    probes: dict[int, LayerProbe] = field(default_factory=dict)
    residuals: torch.Tensor | None = None  # (W, d_model) final residual stream at the probes
    captured: dict[int, torch.Tensor] | None = None  # head outputs kept in the autograd graph (Fisher re-runs)
    # (layer_idx, layer, query (Hq, T, D), key (H_kv, C, D), query_positions, scaling, lse (Hq, T)): policies that
    # see every query
    observer: Callable | None = None
    # layer -> (H_kv, C) bool: record the probes' attention to these entries only (where the attention kernel gives
    # each row's log-sum-exp, so the full (W × C) map need not be computed); None: every entry
    probe_entries: Callable | None = None
    # layer -> (H_kv, C) bool: the cached entries this forward's tokens may attend to, besides each other (the rest
    # of the cache is hidden from them); None: every valid entry
    attend_entries: Callable | None = None
    # (T,) true positions of the tokens in this forward, the largest in the stream: with `attend_entries`, how its
    # own tokens are told apart from the cache (Engine.forward sets both)
    positions: torch.Tensor | None = None
    lanes: Lanes | None = None  # the forward's tokens continue independent lanes (true positions in `positions`)
    # the first `sampled_rows` of the logits rows asked for (all but the last) only feed sampling: the model's output
    # head computes the last row alone, and their inputs are kept here for the probe copy's head (Engine.forward)
    sampled_rows: int = 0
    sampled_inputs: torch.Tensor | None = None  # (sampled_rows, d) the output head's inputs at those rows

    def allowed(self, layer, query_positions: torch.Tensor, visible: torch.Tensor,
                columns: torch.Tensor | None = None) -> torch.Tensor:
        """`attention_mask` of the forward's last len(`query_positions`) tokens as the forward attends: the `visible`
        entries (`visible(layer)`), causal by rotary position (and window), and within each token's lane if there
        are lanes."""
        allowed = attention_mask(layer, query_positions, visible, columns)
        if self.lanes is not None:
            entries = layer.positions if columns is None else layer.positions.gather(1, columns)
            entry_lane = self.lanes.lane(entries)[:, None, :]
            own = self.lanes.lane(self.positions[-query_positions.shape[0]:])[None, :, None]
            allowed &= (entry_lane < 0) | (entry_lane == own)
        return allowed

    def visible(self, layer) -> torch.Tensor:
        """(H_kv, C) bool: the entries of `layer` this forward attends to (causality and windows apart): the
        `attend_entries`, and this forward's own (its tokens come last in the stream, wherever their rotary positions
        are: Engine.place)."""
        if self.attend_entries is None:
            return layer.valid
        return layer.valid & (self.attend_entries(layer) | (layer.positions >= self.positions[0]))


_current: ContextVar[ForwardContext | None] = ContextVar("klevict_forward", default=None)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext):
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def attention_mask(cache_layer, query_positions: torch.Tensor, visible: torch.Tensor | None = None,
                   columns: torch.Tensor | None = None) -> torch.Tensor:
    """(H_kv, T, C) bool: which cached entries each query may attend to (of the `visible` ones, default valid);
    with `columns` (H_kv, n), over those columns only: (H_kv, T, n)."""
    kpos, seen = cache_layer.rope_positions, cache_layer.valid if visible is None else visible
    if columns is not None:
        kpos, seen = kpos.gather(1, columns), seen.gather(1, columns)
    kpos = kpos[:, None, :]
    qpos = query_positions[None, :, None]
    allowed = seen[:, None, :] & (kpos <= qpos)
    if cache_layer.window is not None:
        allowed &= kpos > qpos - cache_layer.window
    return allowed


def _can_split(layer, query, value) -> bool:
    """Whether a chunk may be attended as "every kept past entry, then the chunk causally" (see below); the fused
    CPU kernel needs one head size for queries, keys and values (MLA's differ)."""
    return (layer.window is None and query.shape[2] > 1 and query.device.type == "cpu"
            and query.shape[-1] == value.shape[-1] and not torch.is_grad_enabled())


def _attend_past_then_chunk(query, k, v, past_valid, groups, scaling):
    """Attention of a chunk over a ragged cache without a (T × C) mask.

    Every kept past entry precedes every query of the chunk, so the past needs only a per-entry mask that broadcasts
    over the chunk's rows, and the chunk itself is plain causal attention. The two partial softmaxes are merged by
    their log-sum-exps. On a CPU this is about 1.5× faster than one masked call, whose cost is dominated by the
    (heads × T × C) mask. The fused CPU kernel is the one that returns the log-sum-exp. Returns the output and each
    row's log-sum-exp over everything it attends to, (1, Hq, T).
    """
    t = query.shape[2]
    past = k.shape[2] - t
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    chunk_out, chunk_lse = flash(query, k[:, :, past:], v[:, :, past:], is_causal=True, scale=scaling)[:2]
    if past == 0:
        return chunk_out, chunk_lse
    valid = past_valid.repeat_interleave(groups, dim=0)  # (Hq, P)
    bias = torch.zeros(valid.shape, dtype=query.dtype, device=query.device).masked_fill_(~valid, float("-inf"))
    past_out, past_lse = flash(query, k[:, :, :past], v[:, :, :past], attn_mask=bias[None, :, None], scale=scaling)[:2]
    # A head with no kept past gets output 0 and log-sum-exp 0 from the kernel: give it no weight instead.
    past_lse = past_lse.masked_fill(~valid.any(dim=1)[None, :, None], float("-inf"))
    total = torch.logaddexp(past_lse, chunk_lse)
    past_weight = torch.exp(past_lse - total)[..., None].to(query.dtype)
    return past_out * past_weight + chunk_out * (1 - past_weight), total


def _gather_past(k, v, past_visible, t):
    """Keys and values (1, H_kv, ·, D) cut to each head's visible past entries (left-aligned, padded) followed by
    the chunk's own `t`, and which of the gathered past columns are real (H_kv, n). Gathered per KV head, before
    any copy per query head: a re-reading sees a few hundred of the cache's thousands of entries."""
    columns, present = mask_columns(past_visible)
    index = columns[None, :, :, None]
    past = k.shape[2] - t
    k = torch.cat([k[:, :, :past].gather(2, index.expand(-1, -1, -1, k.shape[-1])), k[:, :, past:]], dim=2)
    v = torch.cat([v[:, :, :past].gather(2, index.expand(-1, -1, -1, v.shape[-1])), v[:, :, past:]], dim=2)
    return k, v, present


def _attend_grouped(query, key, value, allowed, scaling):
    """Masked attention with each KV group's query heads stacked as extra rows of one head, so the cache is read
    as it is instead of being copied once per query head (decoding reads the whole cache for every token).
    query (1, Hq, T, D); key/value (1, H_kv, C, D); allowed (H_kv, T, C). Returns (1, Hq, T, Dv)."""
    _, hq, t, _ = query.shape
    h_kv, c = key.shape[1], key.shape[2]
    groups = hq // h_kv
    rows = query.reshape(1, h_kv, groups * t, -1)  # query head h = kv_head * groups + g: rows g-major
    mask = allowed[:, None].expand(h_kv, groups, t, c).reshape(1, h_kv, groups * t, c)
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(1, hq, t, -1)


def _log_sum_exp(query, key, allowed, scaling, block: int = 256) -> torch.Tensor:
    """(1, Hq, T): each query's log-sum-exp over the entries it may attend to, `allowed` (H_kv, T, C), for the
    attention paths whose kernel does not return it; `block` query rows at a time (never the whole (T × C) map)."""
    _, hq, t, _ = query.shape
    h_kv = key.shape[1]
    groups = hq // h_kv
    keys = key[0].float().transpose(1, 2)
    out = torch.empty(h_kv, groups, t, device=query.device)
    for lo in range(0, t, block):
        q = query[0, :, lo : lo + block].float().reshape(h_kv, groups * min(block, t - lo), -1)
        logits = torch.bmm(q * scaling, keys).view(h_kv, groups, -1, keys.shape[-1])
        out[:, :, lo : lo + block] = logits.masked_fill(~allowed[:, None, lo : lo + block], float("-inf")).logsumexp(-1)
    return out.view(1, hq, t)


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
    # a probe copy of the model at a cheaper precision (Engine.probe_model) attends over the cache as it is stored
    dtype, query = query.dtype, query.to(key.dtype)
    if kwargs.get("softcap") is not None:
        raise ModelError("this model soft-caps attention logits, which klevict's attention does not support")
    if kwargs.get("sliding_window") not in (None, layer.window):
        raise ModelError(f"layer {layer_idx} attends over a window of {kwargs['sliding_window']} tokens but its cache"
                         f" was set up for {layer.window}")
    groups = query.shape[1] // key.shape[1]
    # One mask row per cached head. MLA caches a single "head" (the latent) and hands over keys and values already
    # expanded per query head: groups == 1 and that one mask broadcasts over every head.
    lse = allowed = None
    visible = ctx.visible(layer)
    if _can_split(layer, query, value) and ctx.lanes is None:
        k, v, past_visible = key, value, visible[:, : key.shape[2] - query.shape[2]]
        if ctx.attend_entries is not None:  # attend to the few visible past entries only: gather them
            k, v, past_visible = _gather_past(k, v, past_visible, query.shape[2])
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out, lse = _attend_past_then_chunk(query, k, v, past_visible, groups, scaling)
    else:
        allowed = ctx.allowed(layer, ctx.query_positions, visible)
        out = _attend_grouped(query, key, value, allowed, scaling)
    if ctx.captured is not None:
        ctx.captured[layer_idx] = out
    if ctx.observer is not None:
        if lse is None:  # attended with one mask: the same one
            lse = _log_sum_exp(query, key, allowed, scaling)
        ctx.observer(layer_idx, layer, query[0], key[0], ctx.query_positions, scaling, lse[0])
    if ctx.probe_rows:
        ctx.probes[layer_idx] = _probe(ctx, layer, visible, query, key, out, lse, scaling)
    return out.transpose(1, 2).contiguous().to(dtype), None


def _probe(ctx: ForwardContext, layer, visible, query, key, out, lse, scaling) -> LayerProbe:
    """The probe rows' statistics: their attention over the `visible` cache entries they may see
    (ForwardContext.allowed, as the forward attended; or over `ctx.probe_entries` only), queries and head outputs.
    Where the attention kernel gave each row's log-sum-exp, the weights are exp(logit - lse), normalised as the
    forward normalised them.

    Built in place on one (H_kv, groups, W, C) tensor — a KV group's query heads as rows of its KV head, scaled
    before the product, masked by broadcasting — because on a CPU the cost of this step is the passes over that
    tensor (each a fresh allocation of tens of MB for 128 drafts over 4,096 entries), not the arithmetic."""
    w = min(ctx.probe_rows, query.shape[2])
    q = query[0, :, -w:]
    h_kv, groups = key.shape[1], query.shape[1] // key.shape[1]
    keys = key[0].float()
    columns = present = None
    if ctx.probe_entries is not None and lse is not None:
        columns, present = mask_columns(ctx.probe_entries(layer))
        keys = keys.gather(1, columns[..., None].expand(-1, -1, keys.shape[-1]))
    rows_of_group = (q.float() * scaling).reshape(h_kv, groups * w, q.shape[-1])
    logits = torch.matmul(rows_of_group, keys.transpose(1, 2)).view(h_kv, groups, w, -1)
    allowed = ctx.allowed(layer, ctx.query_positions[-w:], visible, columns)  # (H_kv, W, n)
    if columns is not None:
        allowed &= present[:, None, :]
    logits.masked_fill_(~allowed[:, None], float("-inf"))
    if lse is None:
        weights = logits.softmax(dim=-1)
    else:
        weights = logits.sub_(lse[0, :, -w:].float().view(h_kv, groups, w, 1)).exp_()
    return LayerProbe(query=q, weights=weights.view(h_kv * groups, w, -1), output=out[0, :, -w:], columns=columns,
                      present=present)


def _capture_residual(module, args):
    ctx = _current.get()
    if ctx is not None and ctx.probe_rows:
        ctx.residuals = args[0][0, -ctx.probe_rows :].detach()


def _pre_hook_once(module, hook) -> None:
    """Register `hook` before `module`'s forward unless it already is (a probe copy made by deepcopy carries its
    model's hooks and their record)."""
    installed = module.__dict__.setdefault("_klevict_hooks", set())
    if hook.__name__ not in installed:
        module.register_forward_pre_hook(hook)
        installed.add(hook.__name__)


def install_residual_hook(final_norm) -> None:
    """Record the final residual stream (the final norm's input) at the probe rows; installed once per model."""
    _pre_hook_once(final_norm, _capture_residual)


def _divert_sampled_rows(module, args):
    ctx = _current.get()
    hidden = args[0]
    if ctx is not None and ctx.sampled_rows:
        ctx.sampled_inputs = hidden[0, -ctx.sampled_rows - 1 : -1].detach()
        hidden = hidden[:, -1:]
    if hidden.stride() == _plain_strides(hidden.shape):
        return None if hidden is args[0] else (hidden,) + args[1:]
    return (hidden.clone(memory_format=torch.contiguous_format),) + args[1:]


def _plain_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def install_head_hook(output_head) -> None:
    """Let the model's output head compute only the last of the logits rows asked for when the others only feed
    sampling (ForwardContext.sampled_rows), and keep those rows' inputs; installed once per model. Taken at the
    head's input, after whatever the family puts between the final norm and it. The rows reach the head laid out
    plainly: the last rows of a longer forward keep its batch stride, and on a CPU a bfloat16 matmul of such a
    single row copies the whole transposed head weight first (1.6 s for Gemma-3-270M's 262,144 × 640 on the probe
    copy, against 0.04 s for the same row laid out plainly)."""
    _pre_hook_once(output_head, _divert_sampled_rows)


AttentionInterface.register(ATTENTION_NAME, klevict_attention)
