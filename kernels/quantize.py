"""Per-group integer quantization of cached keys and values (int8, int4).

A group is `group` consecutive elements along one axis; each group stores its minimum and its step, and an element
is `minimum + code * step` with `code` in [0, 2^bits - 1] (asymmetric: a group of keys rarely straddles zero
evenly). Which axis is grouped is the caller's choice: KIVI groups keys along the tokens (one scale per channel, so
that a channel with large magnitudes, which keys have, does not coarsen every other channel of a token) and values
along the channels (one scale per token). Padding entries, which the cache keeps as zeros, are excluded from a
group's range through `valid`, so a half-full group is quantized as finely as a full one.

Steps and minima are stored in float16 (4 bytes a group); int4 codes are packed two to a byte along the last axis.
"""

from __future__ import annotations

import torch

SCALE_DTYPE = torch.float16


def quantize(x: torch.Tensor, bits: int, group: int, dim: int, valid: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (uint8, x's shape; int4: the last axis halved, packed) and each group's step and minimum (float16,
    x's shape with `dim` divided into ceil(size / group) groups). `valid` (x's shape without a trailing feature
    axis, or x's shape) marks the real elements; the others take any code and do not widen their group's range."""
    levels = (1 << bits) - 1
    dim = dim % x.dim()
    size = x.shape[dim]
    groups = -(-size // group)
    xf = x.float()
    real = torch.ones_like(xf, dtype=torch.bool) if valid is None else _broadcast(valid, xf)
    grouped = _split(_pad(xf, dim, groups * group, 0.0), dim, group)
    real = _split(_pad(real, dim, groups * group, False), dim, group)
    low = grouped.masked_fill(~real, float("inf")).amin(dim=dim + 1)
    high = grouped.masked_fill(~real, float("-inf")).amax(dim=dim + 1)
    empty = ~real.any(dim=dim + 1)
    low, high = low.masked_fill(empty, 0.0), high.masked_fill(empty, 0.0)
    # Round the minimum and step to what float16 stores first, so the codes are chosen against the stored values.
    low = low.to(SCALE_DTYPE).float()
    step = ((high - low) / levels).clamp_min(torch.finfo(SCALE_DTYPE).tiny).to(SCALE_DTYPE).float()
    step = step.clamp_min(torch.finfo(SCALE_DTYPE).tiny)  # a subnormal that rounded to zero
    codes = ((grouped - low.unsqueeze(dim + 1)) / step.unsqueeze(dim + 1)).round_().clamp_(0, levels)
    codes = _merge(codes, dim).narrow(dim, 0, size).to(torch.uint8)
    if bits == 4:
        codes = pack_int4(codes)
    return codes, step.to(SCALE_DTYPE), low.to(SCALE_DTYPE)


def dequantize(codes: torch.Tensor, steps: torch.Tensor, minima: torch.Tensor, bits: int, group: int, dim: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values `quantize` encoded, in `dtype` (padding elements come back as some value in their group's range).
    Computed in float32 (at least) and rounded once: bfloat16 steps would double int8's error."""
    if bits == 4:
        codes = unpack_int4(codes)
    dim = dim % codes.dim()
    size = codes.shape[dim]
    work = torch.promote_types(dtype, torch.float32)
    # each group's step and minimum broadcast over its members (nothing the size of `codes` but the result)
    grouped = _split(_pad(codes, dim, steps.shape[dim] * group, 0), dim, group)
    out = torch.addcmul(minima.to(work).unsqueeze(dim + 1), grouped.to(work), steps.to(work).unsqueeze(dim + 1))
    return _merge(out, dim).narrow(dim, 0, size).to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last axis (which must be even): element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def _broadcast(valid: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    valid = valid.to(torch.bool)
    return (valid if valid.dim() == like.dim() else valid[..., None]).expand_as(like)


def _pad(x: torch.Tensor, dim: int, size: int, fill) -> torch.Tensor:
    if x.shape[dim] == size:
        return x
    shape = list(x.shape)
    shape[dim] = size - x.shape[dim]
    return torch.cat((x, x.new_full(shape, fill)), dim=dim)


def _split(x: torch.Tensor, dim: int, group: int) -> torch.Tensor:
    return x.unflatten(dim, (x.shape[dim] // group, group))


def _merge(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.flatten(dim, dim + 1)
