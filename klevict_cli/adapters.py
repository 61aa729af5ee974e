"""What differs between model families, in one place.

The engine, the cache and the policies talk to a model only through a `ModelAdapter`: where the decoder layers, their
attention modules and output projections are, how many KV "heads" each layer caches and how wide they are, which
layers use a sliding window, how positions enter the keys (to re-rotate them in `compact` mode, or to refuse that
mode), and what the final norm, the unembedding and any logit soft-capping are (for the KL estimator).

`ModelAdapter` itself is the Llama-style decoder (Llama, SmolLM2, Qwen2/3, Mistral, ...: GQA + RoPE); each other
family is a small subclass holding only what really differs, chosen by `config.model_type` in `adapter_for`:

| family | adapter | differs in |
|---|---|---|
| Gemma 3 | `Gemma3Adapter` | local/global RoPE bases per layer type; a norm on the attention output; soft-capping |
| GPT-2 | `GPT2Adapter` | layout (`transformer.h[i].attn.c_proj`, `ln_f`), Conv1D weights, absolute positions |
| OPT | `OPTAdapter` | layout (`model.decoder.layers[i].self_attn.out_proj`, `final_layer_norm`), absolute positions |
| GPT-NeoX | `GPTNeoXAdapter` | layout (`gpt_neox.layers[i].attention.dense`, `final_layer_norm`), partial rotary |
| DeepSeek-V2/V3 | `MLAAdapter` | the cache holds the compressed latent; interleaved RoPE (V2) |

Any other `model_type` gets the Llama-style adapter only after a self-check shows that it fits the model
(adapter_check.py, which reads through the engine and so sits above it).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from klevict_kernels.kl import through_norm
from klevict_cli.cache import LayerShape
from klevict_cli.errors import ModelError, ResourceError


@dataclass(frozen=True)
class Projection:
    """A layer's output projection as a (d_model, Hq·Dv) matrix, whatever module holds it."""

    weight: torch.Tensor


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the pairs of `x` by the angles whose cos/sin are given (one per pair). Pairs are (i, i + d/2) in the
    "half" layout (Llama's rotate_half) or adjacent (2i, 2i + 1) when `interleaved` (complex-number RoPE)."""
    if not interleaved:
        return x * torch.cat((cos, cos), dim=-1) + _rotate_half(x) * torch.cat((sin, sin), dim=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)


class ModelAdapter:
    """Llama-style decoders: `model.model.layers[i].self_attn.o_proj`, `model.model.norm`, `model.model.rotary_emb`,
    RoPE in the "half" layout over the whole key. Subclasses override only what their family changes."""

    can_rerotate = True  # keys carry their position as a rotation that can be moved (RoPE)
    rotary_slot = "keys"  # which cached tensor holds the rotated part ("values" for MLA's k_rot)
    interleaved_rope = False  # rotary pairs are adjacent dims (2i, 2i+1) instead of (i, i+d/2)
    # the attention module computes on what it reads from the cache (MLA expands its latent) before attending, so a
    # forward of a copy at another dtype (Engine.probe_model) must read the cache at that dtype
    computes_on_cache = False

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config
        self.base = self._base(model)
        self.layers = list(self._layers(self.base))
        self.attentions = [self._attention(layer) for layer in self.layers]
        self._stacked_projections: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}

    # ---- where things are ---------------------------------------------------------------------------------
    def _base(self, model: nn.Module) -> nn.Module:
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers"):
            raise ModelError(f"unsupported model architecture '{self.config.model_type}'")
        return base

    def _layers(self, base: nn.Module):
        return base.layers

    def _attention(self, layer: nn.Module) -> nn.Module:
        return layer.self_attn

    @property
    def rotary_embedding(self) -> nn.Module:
        return self.base.rotary_emb

    # ---- shapes -------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_types(self) -> list[str]:
        """"full_attention" or "sliding_attention" per layer. Without `layer_types`, a configured `sliding_window`
        applies to every layer (Mistral, Phi-3, Starcoder2)."""
        types = getattr(self.config, "layer_types", None)
        if types:
            return list(types[: self.num_layers])
        kind = "sliding_attention" if getattr(self.config, "sliding_window", None) else "full_attention"
        return [kind] * self.num_layers

    def layer_shapes(self) -> list[LayerShape]:
        cfg = self.config
        q_heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or q_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // q_heads
        window = getattr(cfg, "sliding_window", None)
        return [
            LayerShape(kv_heads, q_heads, head_dim, head_dim, window if kind == "sliding_attention" else None)
            for kind in self.layer_types()
        ]

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    # ---- positions ----------------------------------------------------------------------------------------
    def inv_freq(self, layer_idx: int) -> tuple[torch.Tensor, float]:
        """The rotary frequencies used by a layer's keys, and the magnitude factor the rotary module applies.
        The rotated dims are the first 2·len(inv_freq) of the rotary slot (partial rotary leaves the rest)."""
        self.require_rerotation()
        rotary = self.rotary_embedding
        return rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0))

    def rerotate(self, keys: torch.Tensor, delta: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Move post-RoPE keys (the rotary slot's tensor, (H, C, D)) by `delta` positions (per entry, or one for all:
        any shape that broadcasts to (H, C)). Exact for any RoPE whose variants only change the frequencies (plain,
        linear, llama3, YaRN): a rotation by p followed by one by delta is one by p + delta; the magnitude factor was
        applied once, at p, and is not applied again."""
        inv_freq, _ = self.inv_freq(layer_idx)
        # float32 is enough: after the first compaction, deltas are at most a chunk or two.
        angles = delta.to(torch.float32)[..., None] * inv_freq.to(device=keys.device, dtype=torch.float32)
        k = keys.to(torch.float32)
        n = 2 * inv_freq.shape[-1]
        moved = _rotate(k[..., :n], angles.cos(), angles.sin(), self.interleaved_rope)
        if n < k.shape[-1]:
            moved = torch.cat((moved, k[..., n:]), dim=-1)
        return moved.to(keys.dtype)

    def move_queries(self, query: torch.Tensor, delta: int, layer_idx: int) -> torch.Tensor:
        """Post-RoPE queries (Hq, T, D) as if asked `delta` positions later (float32); as they are for models
        without rotary positions."""
        if not self.can_rerotate:
            return query.float()
        # one distance for every query: one angle per frequency, broadcast (not one per query, head and frequency)
        return self.rerotate(query.float(), torch.tensor(float(delta), device=query.device), layer_idx)

    def rerotate_layer(self, layer, delta: torch.Tensor, layer_idx: int) -> None:
        """Re-rotate a `LayerCache`'s entries in place by `delta` (H, C) positions."""
        self.require_rerotation()
        setattr(layer, self.rotary_slot, self.rerotate(getattr(layer, self.rotary_slot), delta, layer_idx))

    def require_rerotation(self) -> None:
        """Raise a clear error if this model's positions cannot be moved (then `compact` mode is impossible)."""
        if not self.can_rerotate:
            raise ResourceError(
                f"{self.config.model_type} uses absolute position embeddings; a document longer than its"
                f" {self.max_positions} positions cannot be compacted (split the document, or use a model with rotary"
                " positions)"
            )

    # ---- the read-out (used by the KL estimator) ------------------------------------------------------------
    @property
    def final_norm(self) -> nn.Module:
        return self.base.norm

    @property
    def unembedding(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def output_projection(self, layer_idx: int) -> nn.Linear | Projection:
        """The module (or `Projection`) whose `.weight` is W_O as a (d_model, Hq·Dv) matrix."""
        return self.attentions[layer_idx].o_proj

    def output_projections(self, layer_ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """These layers' W_O stacked, (L, d_model, Hq·Dv) in `dtype`, built once per set of layers and dtype: the KL
        scoring maps its readout through every layer in one product."""
        key = (tuple(layer_ids), dtype)
        if key not in self._stacked_projections:
            self._stacked_projections[key] = torch.stack([self.output_projection(i).weight.to(dtype)
                                                          for i in layer_ids])
        return self._stacked_projections[key]

    @property
    def logit_softcap(self) -> float | None:
        """The cap of the final logits' soft-capping cap·tanh(z/cap) where the config asks for one (Gemma's)."""
        return getattr(self.config, "final_logit_softcapping", None) or None

    def finish_logits(self, raw: torch.Tensor) -> torch.Tensor:
        """The final logits from the output head's (soft-capped where the model caps them: `logit_softcap`)."""
        cap = self.logit_softcap
        return raw if cap is None else cap * torch.tanh(raw / cap)

    def logit_jacobian_scale(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Per token, d(final logit)/d(raw logit) at `logits` (the final logits, after any soft-capping); None when
        the logits are the unembedding's output unchanged."""
        cap = self.logit_softcap
        if cap is None:
            return None
        return 1.0 - (logits.double() / cap).clamp(-1.0, 1.0).square()  # 1 - tanh²(raw/cap)

    def post_attention_norm(self, layer_idx: int) -> nn.Module | None:
        """The norm a layer applies to its attention output before adding it to the residual stream (Gemma 2/3,
        OLMo 2), or None when the output is added as it is."""
        return None

    def to_attention_output(self, layer_idx: int, factors: torch.Tensor, head_outputs: torch.Tensor) -> torch.Tensor:
        """Residual-stream readout factors (W, R, d) as factors on layer `layer_idx`'s attention output y = W_O·o,
        given the probes' head outputs (Hq, W, Dv). A norm between y and the residual add moves the residual by
        J_norm(y)·Δy, whose 1/rms(y) differs per probe and whose γ differs per dimension: no per-head calibration
        can absorb that, so the factors are pulled back through the norm's Jacobian at each probe's y."""
        norm = self.post_attention_norm(layer_idx)
        if norm is None:
            return factors
        projection = self.output_projection(layer_idx)
        y = head_outputs.transpose(0, 1).flatten(1) @ projection.weight.T
        if getattr(projection, "bias", None) is not None:
            y = y + projection.bias
        return through_norm(norm, y, factors)

    # ---- what policies read -------------------------------------------------------------------------------
    def scoring_view(self, cache):
        """The cache as eviction policies should read it: per layer, `values` are the values each (query or KV)
        head attends over. For most families that is the cache itself."""
        return cache


class Gemma3Adapter(ModelAdapter):
    """Gemma 3 (text): MQA/GQA + RoPE like Llama; sliding layers (from `layer_types`) use the local RoPE base,
    global layers the global one; the (1+γ) RMSNorm and the embedding scale live inside the modules. The attention
    output is normalised (`post_attention_layernorm`) before the residual add. Its optional final logit soft-capping
    `cap·tanh(z/cap)` is the base class's (`finish_logits`)."""

    def inv_freq(self, layer_idx: int) -> tuple[torch.Tensor, float]:
        rotary, kind = self.rotary_embedding, self.layer_types()[layer_idx]
        return getattr(rotary, f"{kind}_inv_freq"), float(getattr(rotary, f"{kind}_attention_scaling", 1.0))

    def post_attention_norm(self, layer_idx: int) -> nn.Module:
        return self.layers[layer_idx].post_attention_layernorm


class GPT2Adapter(ModelAdapter):
    """GPT-2: MHA with learned absolute positions (nothing to re-rotate); Conv1D projections store (in, out)."""

    can_rerotate = False

    def _base(self, model: nn.Module) -> nn.Module:
        return model.transformer

    def _layers(self, base: nn.Module):
        return base.h

    def _attention(self, layer: nn.Module) -> nn.Module:
        return layer.attn

    def layer_shapes(self) -> list[LayerShape]:
        cfg = self.config
        head_dim = cfg.n_embd // cfg.n_head
        return [LayerShape(cfg.n_head, cfg.n_head, head_dim, head_dim, None) for _ in self.layers]

    @property
    def max_positions(self) -> int:
        return int(self.config.n_positions)

    @property
    def final_norm(self) -> nn.Module:
        return self.base.ln_f

    def output_projection(self, layer_idx: int) -> Projection:
        return Projection(self.attentions[layer_idx].c_proj.weight.T)  # Conv1D weight is (Hq·Dv, d_model)


class OPTAdapter(ModelAdapter):
    """OPT: MHA with learned absolute positions (offset inside the module); pre-LN variants with a final norm and no
    `project_out` (opt-125m, 1.3b, ...); opt-350m (post-LN, projected output) is not supported."""

    can_rerotate = False

    def _base(self, model: nn.Module) -> nn.Module:
        decoder = model.model.decoder
        if decoder.final_layer_norm is None or decoder.project_out is not None:
            raise ModelError("unsupported OPT variant: klevict needs a final layer norm and no project_out"
                             " (e.g. opt-125m or opt-1.3b, not opt-350m)")
        return decoder

    @property
    def final_norm(self) -> nn.Module:
        return self.base.final_layer_norm

    def output_projection(self, layer_idx: int) -> nn.Linear:
        return self.attentions[layer_idx].out_proj


class GPTNeoXAdapter(ModelAdapter):
    """GPT-NeoX (Pythia): MHA + RoPE over the first `rotary_pct` of each head's dims (`inv_freq` is that long)."""

    def _base(self, model: nn.Module) -> nn.Module:
        return model.gpt_neox

    def _attention(self, layer: nn.Module) -> nn.Module:
        return layer.attention

    @property
    def final_norm(self) -> nn.Module:
        return self.base.final_layer_norm

    def output_projection(self, layer_idx: int) -> nn.Linear:
        return self.attentions[layer_idx].dense


class MLAAdapter(ModelAdapter):
    """DeepSeek-V2/V3 multi-head latent attention. transformers caches the compressed latent, not per-head K/V: the
    `keys` slot of a layer's single cached "head" is the normalised latent kv_nope (width kv_lora_rank) and the
    `values` slot the shared rotary key k_rot (width qk_rope_head_dim); the attention module expands both into
    per-head keys and values after the cache. So an entry is a token shared by every query head (evicted per
    token), re-rotation moves the `values` slot, and policies read the expanded per-head values."""

    rotary_slot = "values"
    computes_on_cache = True

    def __init__(self, model: nn.Module):
        super().__init__(model)
        # V2 rotates adjacent pairs as complex numbers and keeps them interleaved; V3 (either rope_interleave
        # setting) writes the rotated key in the half layout.
        self.interleaved_rope = self.config.model_type == "deepseek_v2"

    def layer_shapes(self) -> list[LayerShape]:
        cfg = self.config
        return [LayerShape(1, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, None)
                for _ in self.layers]

    def move_queries(self, query: torch.Tensor, delta: int, layer_idx: int) -> torch.Tensor:
        rope = self.config.qk_rope_head_dim  # MLA's queries end with their rotary part
        moved = super().move_queries(query[..., -rope:], delta, layer_idx)
        return torch.cat((query[..., :-rope].float(), moved), dim=-1)

    def expanded_values(self, layer_idx: int, latent: torch.Tensor) -> torch.Tensor:
        """Per query head values (Hq, C, Dv) from the cached latent (1, C, kv_lora_rank), as `expand_kv` does."""
        attn = self.attentions[layer_idx]
        weight = attn.kv_b_proj.weight.view(attn.num_heads, attn.qk_nope_head_dim + attn.v_head_dim, -1)
        w_v = weight[:, attn.qk_nope_head_dim :]  # (Hq, Dv, r)
        return torch.einsum("cr,hvr->hcv", latent[0].to(w_v.dtype), w_v)

    def scoring_view(self, cache):
        from klevict_cli.cache import KVCache  # cache.py imports this module

        return KVCache([_ExpandedValues(layer, self, i) for i, layer in enumerate(cache.layers)])


class _ExpandedValues:
    """A `LayerCache` as policies see it under MLA: everything is the layer's own (so per-entry state a policy keeps
    in `extras` stays with the layer), except `values`, which are the per-query-head values (Hq, C, Dv)."""

    def __init__(self, layer, adapter: MLAAdapter, layer_idx: int):
        self._layer, self._adapter, self._idx = layer, adapter, layer_idx
        self._values: torch.Tensor | None = None

    def __getattr__(self, name):
        return getattr(self._layer, name)

    @property
    def values(self) -> torch.Tensor:
        if self._values is None:
            self._values = self._adapter.expanded_values(self._idx, self._layer.keys)
        return self._values


ADAPTERS: dict[str, type[ModelAdapter]] = {
    "llama": ModelAdapter,
    "mistral": ModelAdapter,
    "qwen2": ModelAdapter,
    "qwen3": ModelAdapter,
    "gemma3_text": Gemma3Adapter,
    "gpt2": GPT2Adapter,
    "gpt_neox": GPTNeoXAdapter,
    "opt": OPTAdapter,
    "deepseek_v2": MLAAdapter,
    "deepseek_v3": MLAAdapter,
}


def run_with_cache(model: nn.Module, cache, **inputs):
    """Run `model` reading and extending klevict's `cache`. transformers 5.24 renamed the forward's `past_key_values`
    argument to `cache` (the old name lives on there, deprecated): use the name this version's forward declares, so
    the same code runs on every transformers 5.x."""
    return model(**{_cache_keyword(type(model)): cache}, use_cache=True, **inputs)


@functools.cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def known_adapter(model: nn.Module) -> ModelAdapter | None:
    """The adapter of `model`'s family where klevict knows it (`ADAPTERS`); None otherwise (adapter_check.py then
    tries the Llama-style adapter, checked)."""
    family = ADAPTERS.get(model.config.model_type)
    return None if family is None else family(model)
