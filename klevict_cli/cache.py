"""The ragged KV cache: only what is kept, per layer and per KV head.

Each layer holds `(kv_heads, capacity, dim)` keys and values, the original position of every entry, the position its
key is currently rotated at (they differ only in `compact` mode) and a `valid` mask. Heads and layers may keep
different counts; after every eviction a layer is re-packed to its largest head, so padding never outgrows one
chunk. transformers' attention modules call `update()` exactly as they would on a `DynamicCache`; klevict's attention
function (attention.py) reads `valid` and the positions to build the mask itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerShape:
    """What one layer caches per entry: KV heads (and the query heads that share them), key and value widths."""

    kv_heads: int
    query_heads: int
    key_dim: int
    value_dim: int
    window: int | None  # sliding-window size, or None for a global layer


_FIELDS = ("keys", "values", "positions", "rope_positions", "valid")


class _Column:
    """A per-entry field of a layer, stored with spare columns so that appending a decoded token is amortised O(1)
    instead of copying the whole cache."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, layer, owner=None):
        if layer is None:
            return self
        return layer._storage[self.name][:, : layer._used]

    def __set__(self, layer, value: torch.Tensor):
        layer._set_field(self.name, value)


class LayerCache:
    """One layer's kept entries: (H, C, ·) tensors padded to the fullest head, plus a `valid` mask."""

    keys = _Column()  # (H, C, Dk), post-RoPE
    values = _Column()  # (H, C, Dv)
    positions = _Column()  # (H, C) int64 original stream positions; -1 for padding
    rope_positions = _Column()  # (H, C) int64 positions the keys are rotated at
    valid = _Column()  # (H, C) bool

    def __init__(self, keys, values, positions, rope_positions, valid, window: int | None = None,
                 extras: dict[str, torch.Tensor] | None = None):
        self._storage: dict[str, torch.Tensor] = {}
        self._used = 0
        for name, value in zip(_FIELDS, (keys, values, positions, rope_positions, valid)):
            setattr(self, name, value)
        self.window = window  # a sliding layer keeps its window; scored only if every layer slides
        # Per-entry state a policy keeps across evictions (e.g. h2o's accumulated attention): name -> (H, C) tensor.
        # New entries start at zero; eviction, truncation and cloning carry it along with the entries.
        self.extras: dict[str, torch.Tensor] = dict(extras or {})

    @classmethod
    def empty(cls, shape: LayerShape, device, dtype) -> LayerCache:
        h = shape.kv_heads
        return cls(
            keys=torch.zeros(h, 0, shape.key_dim, device=device, dtype=dtype),
            values=torch.zeros(h, 0, shape.value_dim, device=device, dtype=dtype),
            positions=torch.zeros(h, 0, dtype=torch.long, device=device),
            rope_positions=torch.zeros(h, 0, dtype=torch.long, device=device),
            valid=torch.zeros(h, 0, dtype=torch.bool, device=device),
            window=shape.window,
        )

    def _set_field(self, name: str, value: torch.Tensor) -> None:
        self._storage[name] = value
        self._used = value.shape[1]

    def materialize(self) -> None:
        """Hold keys and values as tensors that can be edited in place (they are; a quantized layer's are decoded
        on every read: klevict_cli/quantized.py)."""

    def _offset(self, name: str) -> int:
        """The first column `name`'s storage holds (a quantized layer stores its loaded keys and values apart)."""
        return 0

    @property
    def capacity(self) -> int:
        return self._used

    def lengths(self) -> torch.Tensor:
        return self.valid.sum(dim=1)

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, rope_positions: torch.Tensor):
        """Append T new entries (same positions for every head) after the current capacity."""
        h, t = keys.shape[0], keys.shape[1]
        used, end = self._used, self._used + t
        new = {"keys": keys, "values": values, "positions": positions.expand(h, t),
               "rope_positions": rope_positions.expand(h, t), "valid": True}
        for name in _FIELDS:
            store, first = self._storage[name], self._offset(name)
            if store.shape[1] < end - first:  # grow by half again (at least what is needed): amortised appends
                grown = store.new_zeros((h, max(end, used + used // 2 + 16) - first, *store.shape[2:]))
                grown[:, : used - first] = store[:, : used - first]
                store = self._storage[name] = grown
            store[:, used - first : end - first] = new[name]
        self._used = end
        for name, extra in self.extras.items():
            self.extras[name] = torch.cat((extra, extra.new_zeros(h, t)), dim=1)

    def extra(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (H, C) per-entry tensor `name`, created as zeros on first use."""
        if name not in self.extras:
            self.extras[name] = torch.zeros(self.valid.shape, dtype=dtype, device=self.valid.device)
        return self.extras[name]

    def keep(self, mask: torch.Tensor, order: torch.Tensor | None = None, new_cap: int | None = None) -> None:
        """Keep only the entries where `mask` (H, C) is true, re-packed to the left in their original order.
        `order` and `new_cap` (`keep_orders`, computed for every layer at once) save the sort and the host sync."""
        mask = mask & self.valid
        counts = mask.sum(dim=1)
        if new_cap is None:
            new_cap = int(counts.max()) if counts.numel() else 0
        order = (kept_first(mask) if order is None else order)[:, :new_cap]  # the first new_cap: the new layout
        valid = torch.arange(new_cap, device=mask.device)[None, :] < counts[:, None]
        packed = {}
        for name in _FIELDS[:-1]:  # gather everything from the old layout before replacing any field
            old = getattr(self, name)
            index = order if old.dim() == 2 else order[..., None].expand(-1, -1, old.shape[-1])
            fill = -1 if name.endswith("positions") else 0
            packed[name] = old.gather(1, index).masked_fill(~(valid if old.dim() == 2 else valid[..., None]), fill)
        packed["valid"] = valid
        for name in _FIELDS:
            setattr(self, name, packed[name])
        self.extras = {name: extra.gather(1, order).masked_fill(~valid, 0) for name, extra in self.extras.items()}

    def truncate(self, capacity: int) -> None:
        """Drop everything appended after `capacity` columns (used to answer many questions from one cache)."""
        self._used = min(self._used, capacity)
        self.extras = {name: extra[:, :capacity] for name, extra in self.extras.items()}

    def clone(self) -> LayerCache:
        return LayerCache(
            self.keys.clone(), self.values.clone(), self.positions.clone(), self.rope_positions.clone(),
            self.valid.clone(), self.window, {name: extra.clone() for name, extra in self.extras.items()},
        )

    def nbytes(self) -> int:
        """Bytes of the kept keys and values (padding excluded)."""
        n = int(self.valid.sum())
        return n * (self.keys.shape[-1] + self.values.shape[-1]) * self.keys.element_size()

    def dropped(self, mask: torch.Tensor, dtype: torch.dtype) -> LayerCache:
        """The valid entries `mask` (H, C) does not keep, as a layer of their own (keys and values in `dtype`, no
        per-entry state): what an eviction sets aside (`Evicted`)."""
        part = LayerCache(self.keys, self.values, self.positions, self.rope_positions, self.valid, self.window)
        part.keep(~mask)  # new tensors: this layer is left as it is
        part.keys, part.values = part.keys.to(dtype), part.values.to(dtype)
        return part

    @classmethod
    def joined(cls, layers: list[LayerCache], dtype: torch.dtype) -> LayerCache:
        """One layer holding every entry of `layers` (of one layer's shape), side by side in columns: attention
        masks by position and `valid`, so the order of columns does not matter. Keys and values in `dtype`."""
        fields = [torch.cat([getattr(layer, name).to(dtype) if name in ("keys", "values") else getattr(layer, name)
                             for layer in layers], dim=1) for name in _FIELDS]
        return cls(*fields, window=layers[0].window)


def kept_first(mask: torch.Tensor) -> torch.Tensor:
    """Each row's column indices with the columns where `mask` is true first, in order (a stable sort), then the
    rest: the layout of kept entries after a re-pack."""
    return torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)


def mask_columns(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The columns where each head's `mask` (H, C) is true, left-aligned and padded to the fullest head:
    (H, n) column indices (padding repeats column 0) and (H, n) bool, true where real."""
    counts = mask.sum(dim=1)
    n = max(int(counts.max()) if counts.numel() else 0, 1)
    order = kept_first(mask)[:, :n]
    present = torch.arange(n, device=mask.device)[None, :] < counts[:, None]
    return order.masked_fill(~present, 0), present


def pad_stack(tensors: list[torch.Tensor], dim: int = 1, fill: float | bool = 0) -> torch.Tensor:
    """Per-layer tensors that differ only in their size along `dim` (their cache columns) as one (L, ...) tensor,
    padded with `fill`: so that what is done to every layer is one batched operation instead of one per layer."""
    shape = list(tensors[0].shape)
    shape[dim] = max(t.shape[dim] for t in tensors)
    out = tensors[0].new_full((len(tensors), *shape), fill)
    for n, t in enumerate(tensors):
        out[n].narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


class Stacked(Mapping):
    """Per-layer (H, C_l) tensors held as one (L, H, C) tensor padded beyond each layer's `widths` (e.g. scores of
    every scored layer): read per layer like a dict, or all at once through `.tensor`."""

    def __init__(self, tensor: torch.Tensor, layer_ids: list[int], widths: list[int]):
        self.tensor, self.layer_ids, self.widths = tensor, list(layer_ids), list(widths)

    def __getitem__(self, layer_idx: int) -> torch.Tensor:
        n = self.layer_ids.index(layer_idx)
        return self.tensor[n, :, : self.widths[n]]

    def __iter__(self) -> Iterator[int]:
        return iter(self.layer_ids)

    def __len__(self) -> int:
        return len(self.layer_ids)


@dataclass
class LayerStack:
    """Some layers' `valid` and `positions` stacked (L, H, C) and padded (invalid, position -1) to the widest."""

    layer_ids: list[int]
    widths: list[int]  # each layer's capacity
    valid: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def of(cls, layers: Mapping[int, LayerCache]) -> LayerStack:
        ids = list(layers)
        return cls(ids, [layers[i].capacity for i in ids], pad_stack([layers[i].valid for i in ids], fill=False),
                   pad_stack([layers[i].positions for i in ids], fill=-1))

    def stack(self, per_layer: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """(L, H, C) float from per-layer (H, ≥ C_l) tensors (their first C_l columns), without a copy when they are
        already `Stacked` over these layers. Beyond each layer's columns: 0 (invalid in `valid`)."""
        width = self.valid.shape[-1]
        if isinstance(per_layer, Stacked) and per_layer.layer_ids == self.layer_ids \
                and per_layer.tensor.shape[-1] >= width:
            return per_layer.tensor[..., :width].float()
        return pad_stack([per_layer[i][:, :w].float() for i, w in zip(self.layer_ids, self.widths)])

    def split(self, stacked: torch.Tensor) -> Stacked:
        return Stacked(stacked, self.layer_ids, self.widths)


def keep_orders(masks: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """For (L, H, C) keep masks: each head's kept columns first, in order (`LayerCache.keep`'s layout), and each
    layer's new capacity — one sort and one host sync for every layer."""
    return kept_first(masks), masks.sum(dim=-1).amax(dim=-1).tolist()


class Evicted:
    """What a read's evictions dropped from its scored layers, set aside while the read measures its drift: the
    continuation that measures it is then sampled over these entries and the held ones together (`with_held`) — the
    cache of the whole read — so the estimate covers every eviction, not only the last (docs/method.md, "Estimated
    drift"). Keys and values are kept in float16 (half a float32 cache's bytes); past `max_bytes` everything set
    aside is let go and the estimate covers the last eviction only (`whole` false), as it does where kept keys are
    re-rotated (compact positions: the evicted ones could not sit among them)."""

    def __init__(self, keeps_entries: bool, max_bytes: int, dtype: torch.dtype = torch.float16):
        self.parts: dict[int, list[LayerCache]] | None = {} if keeps_entries else None
        self.max_bytes, self.dtype = max_bytes, dtype
        self.nbytes = 0
        self.evictions = 0

    @property
    def whole(self) -> bool:
        """Whether a cache made `with_held` holds every entry the read evicted (nothing evicted counts)."""
        return self.evictions == 0 or self.parts is not None

    def add(self, layers: Mapping[int, LayerCache], masks: torch.Tensor, widths: list[int]) -> None:
        """Set aside what keep masks (L, H, C) over `layers` (the scored ones, in order) drop."""
        self.evictions += 1
        if self.parts is None:
            return
        for n, (i, layer) in enumerate(layers.items()):
            part = layer.dropped(masks[n, :, : widths[n]], self.dtype)
            self.parts.setdefault(i, []).append(part)
            self.nbytes += part.nbytes()
        if self.nbytes > self.max_bytes:
            self.parts = None

    def with_held(self, cache: KVCache) -> KVCache:
        """`cache`'s layers joined with what was set aside from them (a new cache; `cache` is left as it is)."""
        parts = self.parts or {}
        dtype = cache.layers[0].keys.dtype if cache.layers else self.dtype
        return KVCache([LayerCache.joined([layer, *parts[i]], dtype) if parts.get(i) else layer.clone()
                        for i, layer in enumerate(cache.layers)])


class KVCache:
    """A transformers-compatible cache over `LayerCache`s.

    The engine announces each forward's token positions with `begin()`; attention modules then call `update()`.
    """

    is_compileable = False

    def __init__(self, layers: list[LayerCache]):
        self.layers = layers
        self._positions: torch.Tensor | None = None
        self._rope_positions: torch.Tensor | None = None
        self._read_as: torch.dtype | None = None

    @classmethod
    def empty(cls, shapes: list[LayerShape], device, dtype) -> KVCache:
        return cls([LayerCache.empty(s, device, dtype) for s in shapes])

    def begin(self, positions: torch.Tensor, rope_positions: torch.Tensor, read_as: torch.dtype | None = None
              ) -> None:
        """The next forward's token positions; `read_as`: the dtype it reads the cache at (else as stored)."""
        self._positions = positions
        self._rope_positions = rope_positions
        self._read_as = read_as

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        layer.append(key_states[0], value_states[0], self._positions[None], self._rope_positions[None])
        if self._read_as is None:
            return layer.keys[None], layer.values[None]
        return layer.keys[None].to(self._read_as), layer.values[None].to(self._read_as)

    # transformers asks these of any cache; positions are always passed explicitly, so they are informational.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.layers[layer_idx].lengths().max()) if self.layers[layer_idx].capacity else 0

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def is_sliding(self) -> list[bool]:
        return [layer.window is not None for layer in self.layers]

    def clone(self) -> KVCache:
        return KVCache([layer.clone() for layer in self.layers])

    def capacities(self) -> list[int]:
        return [layer.capacity for layer in self.layers]

    def truncate(self, capacities: list[int]) -> None:
        for layer, cap in zip(self.layers, capacities):
            layer.truncate(cap)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def kept_counts(self) -> list[list[int]]:
        return [layer.lengths().tolist() for layer in self.layers]
