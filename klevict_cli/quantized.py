"""int8 / int4 caches: kept keys and values as per-group integer codes, in the file and in memory.

Keys are grouped along the entries of a head (one step and minimum per channel for every GROUP consecutive kept
entries) and values along the channels of an entry, as KIVI found best and as measured here (docs/research-log.md,
"int8 and int4 caches"); each head's first kept entry, the attention sink, is stored as it is. The file stores the
codes packed like float keys and values (kvc.py, format version 2); a loaded cache keeps them so
(`QuantizedLayerCache`) and the attention dequantizes one layer's keys and values when it reads them. Entries
appended later (a question, an answer) are kept in the model's dtype.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from klevict_cli.cache import KVCache, LayerCache
from klevict_cli.errors import UsageError
from klevict_cli.kvc import (
    QUANTIZED_BITS, PackedLayer, Quantized, nbytes, packed_from_padded, pad_rows, padded_from_packed, padding_mask,
)
from klevict_kernels.quantize import SCALE_DTYPE, dequantize, quantize

GROUP = 32  # entries per key group, channels per value group
STORAGE_CHOICES = ("float16", "int8", "int4")  # what `--max-bytes` chooses from, most bits first
EXACT = 1  # each head's first kept entries (the attention sink), kept in float16 and out of their key group's range


def quantize_keys(keys: torch.Tensor, valid: torch.Tensor, bits: int, group: int = GROUP,
                  exact: int = EXACT) -> Quantized:
    """(H, C, Dk) keys, each head's valid entries first: one step per channel for each `group` entries; the first
    `exact` entries of each head are kept as they are and left out of their group's range."""
    coded = valid.clone()
    coded[:, :exact] = False
    return Quantized(*quantize(keys, bits, group, dim=-2, valid=coded), _exact(keys, valid, exact), bits, group)


def quantize_values(values: torch.Tensor, valid: torch.Tensor, bits: int, group: int = GROUP,
                    exact: int = EXACT) -> Quantized:
    """(H, C, Dv) values, each head's valid entries first: one step per entry for each `group` channels; the
    first `exact` entries of each head kept as they are."""
    return Quantized(*quantize(values, bits, group, dim=-1), _exact(values, valid, exact), bits, group)


def _exact(x: torch.Tensor, valid: torch.Tensor, exact: int) -> torch.Tensor:
    rows = x[:, :exact].masked_fill(~valid[:, :exact, None], 0)
    return torch.cat((rows, rows.new_zeros(x.shape[0], exact - rows.shape[1], x.shape[2])), dim=1).to(SCALE_DTYPE)


def dequantize_keys(q: Quantized, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(H, C, Dk) keys where `valid` (H, C), each head's entries first, of packed codes and groups
    (`quantize_packed`); elsewhere some value in a group's range."""
    groups = group_mask(valid, q.group)
    steps, minima = pad_rows(q.steps, groups), pad_rows(q.minima, groups)
    keys = dequantize(pad_rows(q.codes, valid), steps, minima, q.bits, q.group, dim=-2, dtype=dtype)
    return _restore_exact(keys, q)


def group_mask(valid: torch.Tensor, group: int) -> torch.Tensor:
    """(H, ceil(C / group)): the key groups each head's valid entries (first in its row) fill, a partial one last."""
    lengths = valid.sum(dim=1)
    return padding_mask(-(-lengths // group), capacity=-(-valid.shape[1] // group))


def dequantize_values(q: Quantized, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(H, C, Dv) values where `valid` (H, C) of packed codes, zeros elsewhere."""
    values = dequantize(q.codes, q.steps, q.minima, q.bits, q.group, dim=-1, dtype=dtype)
    return _restore_exact(pad_rows(values, valid), q)


def _restore_exact(x: torch.Tensor, q: Quantized) -> torch.Tensor:
    n = min(q.exact.shape[1], x.shape[1])
    x[:, :n] = q.exact[:, :n].to(x.dtype)
    return x


class QuantizedLayerCache(LayerCache):
    """A layer whose first `width` columns (the loaded entries) are held as the file holds them — packed codes — and
    dequantized on every read of `keys` / `values` (once per layer and forward, by the attention), while appended
    entries are stored as floats. An eviction among the loaded entries (a long answer kept within the budget) turns
    the layer into floats first: a kept entry's key group may lose its other members."""

    def __init__(self, keys: Quantized, values: Quantized, positions, rope_positions, valid, window,
                 dtype: torch.dtype):
        """keys and values as `quantize_packed` makes them; positions, rope_positions and valid (H, C) padded, each
        head's entries first."""
        heads, width = valid.shape
        self.frozen: tuple[Quantized, Quantized] | None = None
        self.dtype, self.width = dtype, 0
        # keys / values storage holds the float columns after the quantized ones: none yet
        tail_k = torch.zeros(heads, 0, keys.width, dtype=dtype, device=valid.device)
        tail_v = torch.zeros(heads, 0, values.width, dtype=dtype, device=valid.device)
        super().__init__(tail_k, tail_v, positions, rope_positions, valid, window)
        self.frozen, self.width = (keys, values), width

    keys = property(lambda self: self._read("keys"), lambda self, value: self._set_field("keys", value))
    values = property(lambda self: self._read("values"), lambda self, value: self._set_field("values", value))

    def _read(self, name: str) -> torch.Tensor:
        tail = self._storage[name][:, : self._used - self.width]
        if self.frozen is None:
            return tail
        q = self.frozen[0 if name == "keys" else 1]
        decode = dequantize_keys if name == "keys" else dequantize_values
        loaded = decode(q, self._storage["valid"][:, : self.width], self.dtype)
        return torch.cat((loaded, tail), dim=1) if tail.shape[1] else loaded

    def _set_field(self, name: str, value: torch.Tensor) -> None:
        if name in ("keys", "values"):  # new keys or values for every entry (re-rotated keys): floats from now on
            self.materialize()
        super()._set_field(name, value)

    def _offset(self, name: str) -> int:
        return self.width if name in ("keys", "values") else 0

    def materialize(self) -> None:
        """Hold every entry as floats, editable in place (before an eviction refits or re-packs the columns)."""
        if self.frozen is not None:
            keys, values = self.keys, self.values
            self.frozen, self.width = None, 0
            self._storage["keys"], self._storage["values"] = keys, values

    def keep(self, mask: torch.Tensor, order: torch.Tensor | None = None, new_cap: int | None = None) -> None:
        self.materialize()
        super().keep(mask, order, new_cap)

    def truncate(self, capacity: int) -> None:
        if capacity < self.width:
            self.materialize()
        super().truncate(capacity)

    def clone(self) -> QuantizedLayerCache:
        copy = QuantizedLayerCache.__new__(QuantizedLayerCache)
        # the codes are never written in place: shared
        copy.frozen, copy.dtype, copy.width, copy.window = self.frozen, self.dtype, self.width, self.window
        copy._used = self._used
        copy._storage = {name: store[:, : self._used - self._offset(name)].clone()
                         for name, store in self._storage.items()}
        copy.extras = {name: extra.clone() for name, extra in self.extras.items()}
        return copy

    def nbytes(self) -> int:
        """Bytes of the codes, their steps and minima, and the float entries appended after them."""
        if self.frozen is None:
            return super().nbytes()
        tail_valid = int(self.valid[:, self.width :].sum())
        tail = tail_valid * (self._storage["keys"].shape[-1] + self._storage["values"].shape[-1]) \
            * self._storage["keys"].element_size()
        return sum(q.nbytes() for q in self.frozen) + tail


def quantize_packed(layer: PackedLayer, bits: int, group: int = GROUP) -> PackedLayer:
    """A float layer as the file stores it (kvc.py), quantized: each head's keys grouped over its entries in order;
    codes, and values' steps and minima, packed like the entries."""
    widths = {layer.keys.shape[-1], layer.values.shape[-1]}
    if bits == 4 and any(width % 2 for width in widths):
        raise UsageError(f"int4 packs two channels to a byte, and this model's heads have {max(widths)} / "
                         f"{min(widths)} channels: use --cache-dtype int8")
    valid = padding_mask(layer.lengths)
    keys = quantize_keys(pad_rows(layer.keys, valid), valid, bits, group)
    values = quantize_values(pad_rows(layer.values, valid), valid, bits, group)
    groups = group_mask(valid, group)
    return replace(layer, keys=replace(keys, codes=keys.codes[valid], steps=keys.steps[groups],
                                       minima=keys.minima[groups]),
                   values=replace(values, codes=values.codes[valid], steps=values.steps[valid],
                                  minima=values.minima[valid]))


def layer_cache(layer: PackedLayer, window: int | None, device, dtype: torch.dtype) -> LayerCache:
    """A layer as the file stores it, as the engine's cache in `dtype` on `device`: float keys and values padded
    and cast, codes kept as the file holds them (no copy on the CPU) in a `QuantizedLayerCache`."""
    if not isinstance(layer.keys, Quantized):
        keys, values, positions, rope_positions, valid = padded_from_packed(layer)
        return LayerCache(keys.to(device, dtype), values.to(device, dtype), positions.long().to(device),
                          rope_positions.long().to(device), valid.to(device), window)
    valid = padding_mask(layer.lengths).to(device)
    positions, rope_positions = (pad_rows(rows.to(device=device, dtype=torch.long), valid, -1)
                                 for rows in (layer.positions, layer.rope_positions))
    return QuantizedLayerCache(layer.keys.to(device), layer.values.to(device), positions, rope_positions, valid,
                               window, dtype)


def entry_bytes(cache_dtype: str, key_dim: int, value_dim: int) -> float:
    """Bytes one kept entry of one head takes in the file as `cache_dtype` stores it: with a quantized key's share of
    its group's step and minimum (`head_bytes`: what a head adds)."""
    bits = QUANTIZED_BITS.get(cache_dtype)
    if bits is None:
        return (key_dim + value_dim) * getattr(torch, cache_dtype).itemsize
    scales = 2 * SCALE_DTYPE.itemsize  # a step and a minimum
    return (key_dim + value_dim) * bits / 8 + scales * key_dim / GROUP + scales * math.ceil(value_dim / GROUP)


def head_bytes(cache_dtype: str, key_dim: int, value_dim: int) -> float:
    """The most a quantized head adds to `entry_bytes` of its entries: its exact entries and a partial key group."""
    if cache_dtype not in QUANTIZED_BITS:
        return 0.0
    return SCALE_DTYPE.itemsize * (EXACT * (key_dim + value_dim) + 2 * key_dim)


def packed_layers(cache: KVCache, cache_dtype: str | None = None) -> list[PackedLayer]:
    """The cache's kept entries as the file stores them, in `cache_dtype` (float32, float16, bfloat16, int8 or int4;
    default: as they are)."""
    bits = QUANTIZED_BITS.get(cache_dtype)
    float_dtype = getattr(torch, cache_dtype) if cache_dtype and bits is None else None
    layers = []
    for layer in cache.layers:
        keys, values = layer.keys, layer.values
        if float_dtype is not None:
            keys, values = keys.to(float_dtype), values.to(float_dtype)
        packed = packed_from_padded(keys, values, layer.positions, layer.rope_positions, layer.valid)
        layers.append(packed if bits is None else quantize_packed(packed, bits))  # on the cache's device
    return layers


def stored_cache(cache: KVCache, cache_dtype: str, device, dtype: torch.dtype) -> tuple[KVCache, int]:
    """`cache` as a file stores it in `cache_dtype` and a load reads it back (in `dtype` on `device`), and the bytes
    of its keys and values in the file."""
    layers = packed_layers(cache, cache_dtype)
    caches = [layer_cache(packed, old.window, device, dtype) for packed, old in zip(layers, cache.layers)]
    return KVCache(caches), sum(nbytes(packed.keys) + nbytes(packed.values) for packed in layers)
