"""What differs between model families, in one place.

The engine, the cache and the policies talk to a model only through `ModelAdapter`: where the decoder layers and
their attention modules are, how many KV heads each layer caches, which layers use a sliding window, how keys are
rotated (to re-rotate them in `compact` mode), and what the final norm and unembedding are (for the KL estimator).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from klevict_cli.errors import ModelError


@dataclass(frozen=True)
class LayerShape:
    kv_heads: int
    query_heads: int
    key_dim: int
    value_dim: int
    window: int | None  # sliding-window size, or None for a global layer


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ModelAdapter:
    """Default adapter: Llama-style decoders (Llama, SmolLM2, Qwen2/3, Mistral, Gemma 3)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config
        base = getattr(model, "model", None)
        if base is None or not hasattr(base, "layers"):
            raise ModelError(f"unsupported model architecture '{self.config.model_type}'")
        self.base = base
        self.layers = list(base.layers)
        self.attentions = [layer.self_attn for layer in self.layers]

    # ---- shapes -------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_shapes(self) -> list[LayerShape]:
        cfg = self.config
        q_heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or q_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // q_heads
        types = getattr(cfg, "layer_types", None) or ["full_attention"] * self.num_layers
        window = getattr(cfg, "sliding_window", None)
        return [
            LayerShape(kv_heads, q_heads, head_dim, head_dim, window if kind == "sliding_attention" else None)
            for kind in types[: self.num_layers]
        ]

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    # ---- positions ----------------------------------------------------------------------------------------
    def inv_freq(self, layer_idx: int) -> tuple[torch.Tensor, float]:
        """The rotary frequencies used by a layer's keys, and the magnitude factor the rotary module applies."""
        rotary = self.base.rotary_emb
        return rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0))

    def rerotate(self, keys: torch.Tensor, delta: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Move post-RoPE keys by `delta` positions (per entry). Exact for any RoPE whose variants only change the
        frequencies (plain, linear, llama3, YaRN): a rotation by p followed by one by delta is one by p + delta."""
        inv_freq, _ = self.inv_freq(layer_idx)
        # float32 is enough: after the first compaction, deltas are at most a chunk or two.
        angles = delta.to(torch.float32)[..., None] * inv_freq.to(device=keys.device, dtype=torch.float32)
        cos, sin = angles.cos(), angles.sin()
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        k = keys.to(torch.float32)
        return (k * cos + _rotate_half(k) * sin).to(keys.dtype)

    # ---- the read-out (used by the KL estimator) ------------------------------------------------------------
    @property
    def final_norm(self) -> nn.Module:
        return self.base.norm

    @property
    def unembedding(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def output_projection(self, layer_idx: int) -> nn.Linear:
        return self.attentions[layer_idx].o_proj


def adapter_for(model: nn.Module) -> ModelAdapter:
    return ModelAdapter(model)
