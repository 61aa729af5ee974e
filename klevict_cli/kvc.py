"""The `.kvc` file: a compressed KV cache stored as safetensors, checked byte by byte before use.

A cache only makes sense with the model and tokenizer that built it, and a corrupt one would quietly give wrong
answers instead of an error. So loading checks the layout, a checksum over metadata and tensors, the contents and
the model identity before it hands out a single tensor. The header is parsed here, not trusted to a library, so
that every failure becomes a one-line `CacheFileError` naming the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from klevict_cli.display import visible
from klevict_cli.errors import CacheFileError, OutputError
from klevict_cli.files import write_atomically

if TYPE_CHECKING:  # torch is imported where tensors are made: reading a header (a batch's skip check) needs none
    import torch

FORMAT = "klevict-kvc"
FORMAT_VERSION = "1"  # float keys and values
QUANTIZED_VERSION = "2"  # int8 / int4 codes (klevict_cli/quantized.py); float caches are still written as version 1
READABLE_VERSIONS = (FORMAT_VERSION, QUANTIZED_VERSION)
MAX_HEADER_BYTES = 16 * 1024 * 1024
# The largest magnitude a key or value may have: what float16 holds. A model's keys and values are far smaller (tens,
# a few thousand for the rare outlier); a forged 1e30 would pass every other check and make every answer blank.
MAX_MAGNITUDE = 65504.0
# method_params: a flat JSON object of short strings (or numbers); every number in it in [0, MAX_PARAM] (2^20: the
# longest context a count could mean; shares are at most 1).
MAX_PARAM = float(2**20)
MAX_PARAM_CHARS = 64
LAYER_FIELDS = ("keys", "values", "positions", "rope_positions", "lengths")
CODE_FIELDS = ("codes", "steps", "minima", "exact")  # of quantized keys and values: layers.{i}.keys.codes, ...
MAX_GROUP = 4096  # entries (keys) or channels (values) per quantization group
MAX_EXACT = 64  # each head's first entries kept in float16 beside the codes
QUANTIZED_BITS = {"int8": 8, "int4": 4}  # cache_dtype of a quantized cache: bits per code

# The only dtypes a .kvc file may hold, by their safetensors names.
_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "I32": "int32", "U8": "uint8"}  # torch's names
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "U8": 1}
_SAFETENSORS_NAMES = {f"torch.{dtype}": name for name, dtype in _DTYPES.items()}
_FLOATS = ("F32", "F16", "BF16")


@dataclass
class PackedLayer:
    """One layer's kept entries, packed head after head (no padding)."""

    keys: torch.Tensor | Quantized  # (N, key_dim)   N = lengths.sum(); quantized: see layer_tensors
    values: torch.Tensor | Quantized  # (N, value_dim)
    positions: torch.Tensor  # (N,) int32, original token positions in the stream (index into `tokens`)
    rope_positions: torch.Tensor  # (N,) int32, position the key is currently rotated at
    lengths: torch.Tensor  # (heads,) int32, entries per KV head


@dataclass
class Quantized:
    """Quantized keys or values (format version 2; klevict_cli/quantized.py makes and reads them): per-group codes,
    x ≈ minima + codes · steps (kernels/quantize.py), int4 codes two to a byte along the channels. As stored: keys'
    codes (N, ·) packed head after head and their steps and minima (groups, Dk), each head's groups of `group`
    entries after the previous head's; values' codes, steps and minima (N, ·), one step per `group` channels.
    (klevict_cli.quantized's `quantize_keys` / `quantize_values` give the padded (H, C, ·) form.)"""

    codes: torch.Tensor  # uint8
    steps: torch.Tensor  # float16
    minima: torch.Tensor  # float16
    exact: torch.Tensor  # (H, quant_exact, D) float16: each head's first entries as they are (codes unused)
    bits: int
    group: int

    @property
    def width(self) -> int:
        """Channels per entry."""
        return self.codes.shape[-1] * 8 // self.bits

    def nbytes(self) -> int:
        return sum(getattr(self, part).numel() * getattr(self, part).element_size() for part in CODE_FIELDS)

    def to(self, device) -> Quantized:
        return replace(self, **{part: getattr(self, part).to(device) for part in CODE_FIELDS})


@dataclass
class LayerSpec:
    """What the loading model expects of a layer."""

    heads: int
    key_dim: int
    value_dim: int


@dataclass
class KvcFile:
    layers: list[PackedLayer]
    tokens: torch.Tensor  # (T,) int32 token ids of everything streamed
    metadata: dict[str, str]


@dataclass
class _Entry:
    """A tensor as the header describes it; offsets are relative to the start of the data region."""

    dtype: str
    shape: tuple[int, ...]
    begin: int = 0
    end: int = 0


# --- packing --------------------------------------------------------------------------------------------------


def packed_from_padded(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    rope_positions: torch.Tensor,
    valid: torch.Tensor,
) -> PackedLayer:
    """Drop the padding of the engine's (heads, capacity, ...) cache; a row-major mask keeps each head's order."""
    import torch

    valid = valid.to(torch.bool)
    return PackedLayer(
        keys=keys[valid],
        values=values[valid],
        positions=positions[valid].to(torch.int32),
        rope_positions=rope_positions[valid].to(torch.int32),
        lengths=valid.sum(dim=1).to(torch.int32),
    )


def padded_from_packed(
    layer: PackedLayer, capacity: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rebuild the engine's padded layout of float keys and values: entries packed left, zeros and position -1
    where `valid` is False."""
    import torch

    valid = padding_mask(layer.lengths, capacity)
    keys, values = (pad_rows(rows, valid) for rows in (layer.keys, layer.values))
    positions, rope_positions = (pad_rows(rows.to(torch.int32), valid, -1)
                                 for rows in (layer.positions, layer.rope_positions))
    return keys, values, positions, rope_positions, valid


def padding_mask(lengths: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """(heads, capacity) bool, true at each head's first `lengths` columns (capacity: the longest by default)."""
    import torch

    lengths = lengths.to(torch.int64)
    longest = int(lengths.max()) if lengths.numel() else 0
    capacity = longest if capacity is None else capacity
    if capacity < longest:
        raise ValueError(f"a head holds {longest} entries, more than the capacity {capacity}")
    return torch.arange(capacity, device=lengths.device)[None, :] < lengths[:, None]


def pad_rows(rows: torch.Tensor, valid: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """(N, ...) rows packed head after head, laid out (heads, capacity, ...) where `valid`; `fill` elsewhere."""
    valid = valid.to(rows.device)
    out = rows.new_full((*valid.shape, *rows.shape[1:]), fill)
    out[valid] = rows
    return out


# --- saving ---------------------------------------------------------------------------------------------------


def save_kvc(path: Path, kvc: KvcFile) -> int:
    """Write `kvc` atomically and return its size; refuses to write a file that `load_kvc` would reject."""
    path = Path(path)
    blob = encode_kvc(kvc, path)
    _write_atomically(path, blob)
    return len(blob)


def encode_kvc(kvc: KvcFile, name: Path | str) -> bytes:
    """The bytes of the `.kvc` file for `kvc` (for a file or a stream), checked as `load_kvc` would check them;
    `name` is only for messages."""
    import safetensors.torch

    tensors = _tensors_of(kvc)
    metadata = dict(kvc.metadata)
    metadata.pop("payload_sha256", None)
    is_quantized = quantized(kvc)
    metadata.update(format=FORMAT, format_version=QUANTIZED_VERSION if is_quantized else FORMAT_VERSION,
                    num_layers=str(len(kvc.layers)))
    if kvc.layers and not is_quantized:
        metadata.setdefault("cache_dtype", _dtype_name(kvc.layers[0].keys.dtype))
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise _error(name, "cannot save: metadata must map strings to strings")

    _check_metadata_values(name, metadata)
    layout = {key: _Entry(_safetensors_name(t.dtype), tuple(t.shape)) for key, t in tensors.items()}
    num_layers = _check_layout(name, metadata, layout)
    _check_contents(name, _layers_of(tensors, num_layers, metadata), tensors["tokens"])
    metadata["payload_sha256"] = _payload_sha256(metadata, tensors)
    return _sorted_header(safetensors.torch.save(tensors, metadata=metadata))


def _sorted_header(blob: bytes) -> bytes:
    """`blob` with its header's keys in sorted order (safetensors writes the metadata from a hash map, in a new order
    each run), so that the same cache is the same bytes: `cmp` and content hashes can tell a re-run reproduced it.
    The tensors' offsets count from the data's start and do not move; the header stays padded to 8 bytes."""
    length = int.from_bytes(blob[:8], "little")
    header = json.dumps(json.loads(blob[8 : 8 + length]), sort_keys=True, separators=(",", ":"),
                        ensure_ascii=False).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + blob[8 + length :]


def _tensors_of(kvc: KvcFile) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors by file name; shared storage is copied because safetensors refuses aliases."""
    named = {"tokens": kvc.tokens}
    for i, layer in enumerate(kvc.layers):
        for field in LAYER_FIELDS:
            value = getattr(layer, field)
            if _is_float(value) or field not in ("keys", "values"):
                named[f"layers.{i}.{field}"] = value
            else:
                named.update({f"layers.{i}.{field}.{part}": getattr(value, part) for part in CODE_FIELDS})
    tensors, seen = {}, set()
    for name, tensor in named.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if tensor.numel() and storage in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    return tensors


def _write_atomically(path: Path, blob: bytes) -> None:
    try:
        write_atomically(path, blob)
    except OSError as exc:
        raise OutputError(visible(f"{path}: cannot write the cache ({exc.strerror or exc})")) from None


# --- loading --------------------------------------------------------------------------------------------------


def read_metadata(path: Path) -> dict[str, str]:
    """The header's metadata plus `file_size`, reading only the header: enough for `inspect`, checksum unchecked."""
    path = Path(path)
    with _open_regular(path) as (f, size):
        length = _header_length(path, f.read(8), size)
        metadata, _ = _parse_header(path, f.read(length), size - 8 - length)
    _check_format(path, metadata)
    return {**metadata, "file_size": str(size)}


def is_kvc_file(path: Path) -> bool:
    """What `-o` may replace: a file named .kvc (a broken cache is re-made in place), or one whose header says it is
    a klevict cache whatever its name (the rest unchecked)."""
    if path.suffix.lower() == ".kvc":
        return True
    try:
        read_metadata(path)
    except CacheFileError:
        return False
    return True


def load_kvc(
    path: Path, specs: list[LayerSpec] | None = None, expect: dict[str, str] | None = None,
    vocab_size: int | None = None, using: str | None = None,
) -> KvcFile:
    """Load a cache only if every check passes: layout, checksum, contents, then model identity, shapes and
    vocabulary (a checksum only proves the file is as written, not that what was written makes sense). `using`
    names the loading model in messages."""
    path = Path(path)
    with _open_regular(path) as (f, size):
        length = _header_length(path, f.read(8), size)
        metadata, entries = _parse_header(path, f.read(length), size - 8 - length)
        _check_format(path, metadata)
        _check_metadata_values(path, metadata)
        num_layers = _check_layout(path, metadata, entries)
        tensors = _read_tensors(path, f, 8 + length, metadata, entries)

    layers = _layers_of(tensors, num_layers, metadata)
    _check_contents(path, layers, tensors["tokens"])
    _check_expected(path, metadata, expect or {}, using)
    _check_specs(path, layers, specs)
    if vocab_size is not None:
        check_vocabulary(path, tensors["tokens"], vocab_size)
    return KvcFile(layers=layers, tokens=tensors["tokens"], metadata=metadata)


@contextlib.contextmanager
def _open_regular(path: Path) -> Iterator[tuple[BinaryIO, int]]:
    """Open a regular file for reading (never a FIFO that would block), turning OS errors into one line."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise _error(path, "not a regular file")
        with open(path, "rb") as f:
            yield f, os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise _error(path, "no such file") from None
    except OSError as exc:
        raise _error(path, f"cannot read the file ({exc.strerror or exc})") from None


def _read_tensors(
    path: Path, f: BinaryIO, start: int, metadata: dict[str, str], entries: dict[str, _Entry]
) -> dict[str, torch.Tensor]:
    """Checksum the data in fixed-size blocks before allocating anything for it, so that a corrupt or hostile file,
    however large, is refused in constant memory; then read each tensor straight into its own storage."""
    import torch

    digest = _metadata_digest(metadata)
    for name in sorted(entries):
        entry = entries[name]
        _frame(digest, name, entry.dtype, entry.shape, entry.end - entry.begin)
        f.seek(start + entry.begin)
        for block in _blocks(path, f, entry.end - entry.begin):
            digest.update(block)
    if digest.hexdigest() != metadata.get("payload_sha256"):
        raise _error(path, "checksum mismatch: the file is corrupt or was edited")
    tensors = {}
    for name, entry in entries.items():
        raw = torch.empty(entry.end - entry.begin, dtype=torch.uint8)
        f.seek(start + entry.begin)
        if raw.numel() and f.readinto(memoryview(raw.numpy())) != raw.numel():
            raise _error(path, "the file changed while it was read")
        tensors[name] = raw.view(getattr(torch, _DTYPES[entry.dtype])).reshape(entry.shape)
    return tensors


def _blocks(path: Path, f: BinaryIO, size: int, block: int = 1 << 20) -> Iterator[bytes]:
    while size > 0:
        data = f.read(min(size, block))
        if not data:
            raise _error(path, "the file changed while it was read")
        size -= len(data)
        yield data


def _header_length(path: Path, prefix: bytes, size: int) -> int:
    """The little-endian u64 in front of the JSON header, bounded before anything is allocated for it."""
    if size < 8 or len(prefix) < 8:
        raise _error(path, f"file is truncated or not a .kvc file (only {size} bytes)")
    length = int.from_bytes(prefix[:8], "little")
    if length > MAX_HEADER_BYTES and all(32 <= b < 127 or b in b"\t\n\r" for b in prefix[:8]):
        # a document given for a cache (`klevict ask report.pdf QUESTION`): its first characters read as a length
        raise _error(path, f"not a .kvc file: it begins as text ('{prefix[:8].decode()}'), as a document does;"
                           " klevict compress makes a cache of a document")
    if length > MAX_HEADER_BYTES:
        raise _error(path, f"not a .kvc file: header too large ({length} bytes)")
    if length > size - 8:
        raise _error(path, f"file is truncated: the header needs {length} bytes but only {size - 8} follow")
    return length


def _parse_header(path: Path, raw: bytes, data_size: int) -> tuple[dict[str, str], dict[str, _Entry]]:
    """Parse the JSON header and check that its tensors exactly tile the `data_size` bytes after it."""
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _error(path, f"not a .kvc file: the header is not valid JSON ({_show(exc)})") from None
    if not isinstance(header, dict):
        raise _error(path, "not a .kvc file: the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        raise _error(path, "not a klevict cache file (no metadata)")
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _error(path, "header metadata must map strings to strings")
    entries = {name: _parse_entry(path, name, spec) for name, spec in header.items()}

    end = 0
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != end:
            raise _error(path, f"tensor {_show(name)} overlaps another or leaves a gap in the data")
        end = entry.end
    if end > data_size:
        raise _error(path, f"file is truncated: the data needs {end} bytes but only {data_size} are present")
    if end < data_size:
        extra = data_size - end
        raise _error(path, f"{extra} byte{'s' if extra != 1 else ''} of trailing garbage after the data")
    return metadata, entries


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A repeated key would mean one thing to us and maybe another to safetensors."""
    result = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


def _parse_entry(path: Path, name: str, spec: object) -> _Entry:
    """One tensor's dtype, shape and offsets, with its byte length matching its shape."""
    bad = _error(path, f"tensor {_show(name)} has a malformed header entry")
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise bad
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise bad
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(n) for n in offsets):
        raise bad
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise _error(path, f"tensor {_show(name)} has unsupported dtype {_show(dtype)}")
    begin, end = offsets
    if end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
        raise _error(path, f"tensor {_show(name)} has {end - begin} bytes, which does not match its shape")
    return _Entry(dtype, tuple(shape), begin, end)


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _check_format(path: Path, metadata: dict[str, str]) -> None:
    if metadata.get("format") != FORMAT:
        raise _error(path, "not a klevict cache file")
    version = metadata.get("format_version")
    if version not in READABLE_VERSIONS:
        shown = "(missing)" if version is None else _show(version)
        readable = " and ".join(READABLE_VERSIONS)
        raise _error(path, f"unsupported .kvc format version {shown} (this klevict reads {readable})")


def _check_layout(path: Path, metadata: dict[str, str], layout: dict[str, _Entry]) -> int:
    """Names, dtypes and shapes must describe `num_layers` consistent packed layers; returns that count."""
    raw = metadata.get("num_layers", "")
    if not (raw.isascii() and raw.isdigit()):
        raise _error(path, f"metadata num_layers is not a count ({_show(raw)})")
    num_layers = int(raw)
    quantization = _quantization(path, metadata)
    fields = _file_fields(quantization is not None)
    needed = len(fields) * num_layers + 1
    if len(layout) != needed:
        raise _error(path, f"holds {len(layout)} tensors but {num_layers} layers need {needed}")
    names = ["tokens"] + [f"layers.{i}.{field}" for i in range(num_layers) for field in fields]
    missing = [name for name in names if name not in layout]
    if missing:
        raise _error(path, f"missing tensor {missing[0]}")

    def require(name: str, dtypes: tuple[str, ...], ndim: int) -> tuple[int, ...]:
        entry = layout[name]
        if entry.dtype not in dtypes:
            wanted = " or ".join(_DTYPES[d] for d in dtypes)
            raise _error(path, f"tensor {name} has dtype {_dtype_name(entry.dtype)}; expected {wanted}")
        if len(entry.shape) != ndim:
            raise _error(path, f"tensor {name} has shape {list(entry.shape)}; expected {ndim} dimensions")
        return entry.shape

    require("tokens", ("I32",), 1)
    cache_dtype = None
    for i in range(num_layers):
        prefix = f"layers.{i}."
        if quantization is None:
            counts = {require(prefix + "keys", _FLOATS, 2)[0], require(prefix + "values", _FLOATS, 2)[0]}
            cache_dtype = cache_dtype or layout[prefix + "keys"].dtype
            for name in (prefix + "keys", prefix + "values"):
                if layout[name].dtype != cache_dtype:
                    found, wanted = _dtype_name(layout[name].dtype), _dtype_name(cache_dtype)
                    raise _error(path, f"tensor {name} has dtype {found} but the cache holds {wanted}")
        else:
            counts = _check_codes_layout(path, i, require, *quantization)
        counts |= {require(prefix + "positions", ("I32",), 1)[0], require(prefix + "rope_positions", ("I32",), 1)[0]}
        heads = require(prefix + "lengths", ("I32",), 1)[0]
        if len(counts) != 1:
            raise _error(path, f"layer {i}: keys, values and positions disagree on the number of entries")
    declared = metadata.get("cache_dtype")
    if cache_dtype and declared is not None and declared.removeprefix("torch.") != _dtype_name(cache_dtype):
        found = _dtype_name(cache_dtype)
        raise _error(path, f"metadata cache_dtype {_show(declared)} disagrees with the {found} tensors")
    return num_layers


def _quantization(path: Path, metadata: dict[str, str]) -> tuple[int, int, int] | None:
    """(bits, group, exact) of a quantized cache (format version 2, cache_dtype int8 / int4); None for a float
    one."""
    declared = metadata.get("cache_dtype")
    if metadata.get("format_version") != QUANTIZED_VERSION:
        if declared in QUANTIZED_BITS:
            raise _error(path, f"metadata cache_dtype {declared} needs format version {QUANTIZED_VERSION}")
        return None
    if declared not in QUANTIZED_BITS:
        raise _error(path, f"a version {QUANTIZED_VERSION} file holds an int8 or int4 cache, not"
                           f" {_show(declared or '(no cache_dtype)')}")
    counts = []
    for key, low, high in (("quant_group", 1, MAX_GROUP), ("quant_exact", 0, MAX_EXACT)):
        value = metadata.get(key, "")
        if not (value.isascii() and value.isdigit() and low <= int(value) <= high):
            raise _error(path, f"metadata {key} is not a count in {low}..{high} ({_show(value or '(missing)')})")
        counts.append(int(value))
    return QUANTIZED_BITS[declared], *counts


def _file_fields(quantized: bool) -> list[str]:
    """A layer's tensors in the file (after `layers.{i}.`)."""
    if not quantized:
        return list(LAYER_FIELDS)
    return [f"{field}.{part}" if field in ("keys", "values") else field
            for field in LAYER_FIELDS for part in (CODE_FIELDS if field in ("keys", "values") else ("",))]


def _check_codes_layout(path: Path, i: int, require, bits: int, group: int, exact: int) -> set[int]:
    """Quantized keys and values: uint8 codes (int4: two per byte) and float16 steps and minima of the same shape,
    as many as the codes' width and the group size imply, and (heads, exact, width) float16 exact entries; returns
    the entry counts they state."""
    counts = set()
    heads = {require(f"layers.{i}.lengths", ("I32",), 1)[0]}
    for field in ("keys", "values"):
        name = f"layers.{i}.{field}"
        codes = require(name + ".codes", ("U8",), 2)
        steps = require(name + ".steps", ("F16",), 2)
        if require(name + ".minima", ("F16",), 2) != steps:
            raise _error(path, f"layer {i}: {field} steps and minima differ in shape")
        width = codes[1] * 8 // bits
        if field == "keys" and steps[1] != width:
            raise _error(path, f"layer {i}: key codes hold {width} channels but their steps {steps[1]}")
        if field == "values" and (steps[0] != codes[0] or steps[1] != -(-width // group)):
            raise _error(path, f"layer {i}: value steps {list(steps)} do not fit {codes[0]} entries of {width}"
                               f" channels in groups of {group}")
        if require(name + ".exact", ("F16",), 3) != (*heads, exact, width):
            raise _error(path, f"layer {i}: {field}.exact is not {exact} entries of {width} channels per head")
        counts |= {codes[0]}
    return counts


def _layers_of(tensors: dict[str, torch.Tensor], num_layers: int, metadata: dict[str, str]) -> list[PackedLayer]:
    def field(i: int, name: str):
        prefix = f"layers.{i}.{name}"
        if prefix in tensors:
            return tensors[prefix]
        bits, group = QUANTIZED_BITS[metadata["cache_dtype"]], int(metadata["quant_group"])
        return Quantized(*(tensors[f"{prefix}.{part}"] for part in CODE_FIELDS), bits=bits, group=group)

    return [PackedLayer(**{name: field(i, name) for name in LAYER_FIELDS}) for i in range(num_layers)]


def _check_contents(path: Path, layers: list[PackedLayer], tokens: torch.Tensor) -> None:
    """Values the layout cannot vouch for: counts, and positions that index the streamed tokens in order."""
    import torch

    if tokens.numel() and int(tokens.min()) < 0:
        raise _error(path, "a token id is negative")
    for i, layer in enumerate(layers):
        lengths = layer.lengths.to(torch.int64)
        entries = layer.positions.numel()
        if lengths.numel() and int(lengths.min()) < 0:
            raise _error(path, f"layer {i}: a head has a negative entry count")
        if int(lengths.sum()) != entries:
            total = int(lengths.sum())
            raise _error(path, f"layer {i}: head lengths sum to {total} but the layer holds {entries} entries")
        if not _is_float(layer.keys):
            _check_codes(path, i, layer.keys, layer.values, lengths)
        if entries == 0:
            continue
        if _is_float(layer.keys):
            if not (torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()):
                raise _error(path, f"layer {i}: keys or values hold NaN or infinity")
            largest = max(float(layer.keys.abs().max()), float(layer.values.abs().max()))
            if largest > MAX_MAGNITUDE:
                raise _error(path, f"layer {i}: a key or value of magnitude {largest:.3g}, beyond any model's"
                                   f" ({MAX_MAGNITUDE:g} at most)")
        if int(layer.positions.min()) < 0 or int(layer.positions.max()) >= tokens.numel():
            raise _error(path, f"layer {i}: positions out of range for the {tokens.numel()} streamed tokens")
        if int(layer.rope_positions.min()) < 0:
            raise _error(path, f"layer {i}: a rope position is negative")
        if not _increasing_within_heads(layer.positions, lengths):
            raise _error(path, f"layer {i}: positions are not strictly increasing within a head")


def _check_codes(path: Path, i: int, keys: Quantized, values: Quantized, lengths: torch.Tensor) -> None:
    """One key group for every `group` entries of each head (a partial one last); steps finite and positive, minima
    finite, every value the codes can stand for within MAX_MAGNITUDE, exact entries finite and within it."""
    import torch

    groups = int((-(-lengths // keys.group)).sum())
    if keys.steps.shape[0] != groups:
        raise _error(path, f"layer {i}: {keys.steps.shape[0]} key groups, but heads of {lengths.tolist()[:8]}"
                           f" entries in groups of {keys.group} make {groups}")
    for q in (keys, values):
        exact = q.exact.float().abs()
        if not (torch.isfinite(exact).all() and (exact <= MAX_MAGNITUDE).all()):
            raise _error(path, f"layer {i}: an exact entry is not finite or beyond any model's magnitude")
        if not q.steps.numel():
            continue
        steps, minima = q.steps.float(), q.minima.float()
        if not (torch.isfinite(steps).all() and torch.isfinite(minima).all()) or float(steps.min()) <= 0:
            raise _error(path, f"layer {i}: a quantization step is not a finite positive number, or a minimum is"
                               " not finite")
        largest = float(torch.maximum(minima.abs(), (minima + steps * ((1 << q.bits) - 1)).abs()).max())
        if largest > MAX_MAGNITUDE:
            raise _error(path, f"layer {i}: codes that stand for magnitudes up to {largest:.3g}, beyond any model's"
                               f" ({MAX_MAGNITUDE:g} at most)")


def check_vocabulary(path: Path | str, tokens: torch.Tensor, vocab_size: int) -> None:
    """Token ids the tokenizer cannot decode mean a cache built for another vocabulary, or a forged one."""
    if tokens.numel() and int(tokens.max()) >= vocab_size:
        raise _error(path, f"token id {int(tokens.max())} is outside the model's vocabulary of {vocab_size}")


def check_tokenizer(path: Path | str, metadata: dict[str, str], tokenizer_sha256: str) -> None:
    """Tokens decoded by another tokenizer than the one that made them read as garbage (`inspect --text --model`):
    refused where the file names its tokenizer."""
    made = metadata.get("tokenizer_sha256")
    if made is not None and made != tokenizer_sha256:
        raise _error(path, f"this cache was made with another tokenizer ({_show(made)[:12]}, this model's is"
                           f" {_show(tokenizer_sha256)[:12]}) — give --model the model that made it")


# Metadata that must hold a count (or "all"), and metadata that must hold a JSON object.
_COUNT_KEYS = ("next_position", "next_rope", "prefix_tokens", "document_tokens", "chunk_size", "probe_window",
               "budget_tokens")
_JSON_KEYS = ("method_params", "method_state")


def _check_metadata_values(path: Path | str, metadata: dict[str, str]) -> None:
    """Values that code later parses: ASCII counts (int() would also take "²", "+1" or "1_0") and JSON objects."""
    for key in _COUNT_KEYS:
        value = metadata.get(key)
        if value is None or (key == "budget_tokens" and value == "all"):
            continue
        if not (value.isascii() and value.isdigit()):
            raise _error(path, f"metadata {key} is not a count ({_show(value)})")
    for key in _JSON_KEYS:
        if key not in metadata:
            continue
        try:
            value = json.loads(metadata[key], parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:
            raise _error(path, f"metadata {key} is not valid JSON ({_show(exc)})") from None
        if not isinstance(value, dict):
            raise _error(path, f"metadata {key} is not a JSON object")
        if key == "method_params":
            _check_method_params(path, value)


_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _check_method_params(path: Path | str, params: dict) -> None:
    """The method's parameters as written (`Policy.params`): names to short strings, numbers sane (no negative
    top_k, no rank of a billion). Informational when loading, but a file that states nonsense is refused."""
    for name, value in params.items():
        shown = f"metadata method_params {_show(name)}"
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise _error(path, f"{shown} is not a string or a number")
        text = str(value)
        if len(text) > MAX_PARAM_CHARS or not text.isprintable():
            raise _error(path, f"{shown} is not a short, printable value")
        if isinstance(value, int | float) or _NUMBER.fullmatch(text):
            number = float(text)
            if not 0 <= number <= MAX_PARAM:
                raise _error(path, f"{shown} is {_show(text)}, outside [0, {MAX_PARAM:.0f}]")


def _increasing_within_heads(positions: torch.Tensor, lengths: torch.Tensor) -> bool:
    """Each head's segment must rise; the step from one head's last entry to the next head's first may fall."""
    import torch

    if positions.numel() < 2:
        return True
    rising = positions[1:] > positions[:-1]
    starts = torch.cumsum(lengths, 0)[:-1]
    starts = starts[(starts > 0) & (starts < positions.numel())]
    rising[starts - 1] = True
    return bool(rising.all())


def _check_expected(path: Path, metadata: dict[str, str], expect: dict[str, str], using: str | None) -> None:
    """Refuse a cache from another model or tokenizer, saying which one made it and how to proceed (`using`: the
    id of the model loading it)."""
    wrong = {key for key, value in expect.items() if metadata.get(key) != value}
    if wrong & {"model_id", "model_config_sha256", "model_weights_sha256"}:
        made = metadata.get("model_id", "an unknown model")
        what = "architecture (config)" if "model_config_sha256" in wrong else "weights"
        if made == using:  # pointing at the same name again would not help: it now holds another model
            changed = "its architecture (config) has" if "model_config_sha256" in wrong else "its weights have"
            raise _error(path, f"this cache was made by model {_show(made)}, and {changed} changed since then"
                               " (another version of it?) — recompress the document with the model as it is now")
        raise _error(
            path,
            f"this cache was made by model {_show(made)}, whose {what} {'differ' if what == 'weights' else 'differs'}"
            f" from the model you are using — recompress with this model or pass --model {_show(made)}",
        )
    if "tokenizer_sha256" in wrong:
        made = _show(metadata.get("tokenizer_sha256", "unknown"))[:12]
        raise _error(
            path,
            f"this cache was made with a different tokenizer ({made}, yours is"
            f" {_show(expect['tokenizer_sha256'])[:12]}) — recompress it with the model you are using",
        )
    for key in sorted(wrong):
        found = metadata.get(key)
        shown = "missing" if found is None else repr(_show(found))
        raise _error(path, f"metadata {_show(key)} is {shown} but {_show(expect[key])!r} was expected")


def _check_specs(path: Path, layers: list[PackedLayer], specs: list[LayerSpec] | None) -> None:
    """The cache must fit the loading model layer by layer: heads and key/value widths."""
    if specs is None:
        return
    if len(layers) != len(specs):
        raise _error(
            path, f"made for a model with a different shape ({len(layers)} layers; this model has {len(specs)})"
        )
    for i, (layer, spec) in enumerate(zip(layers, specs)):
        found = (layer.lengths.numel(), width(layer.keys), width(layer.values))
        wanted = (spec.heads, spec.key_dim, spec.value_dim)
        if found != wanted:
            raise _error(
                path,
                f"made for a model with a different shape (layer {i}: {found[0]} KV heads, key/value dims"
                f" {found[1]}/{found[2]}; this model has {wanted[0]} heads, {wanted[1]}/{wanted[2]})",
            )


# --- shared ---------------------------------------------------------------------------------------------------


def _payload_sha256(metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """Covers every byte that matters, so an edited budget or a flipped bit is caught rather than used."""
    import torch

    digest = _metadata_digest(metadata)
    for name in sorted(tensors):
        tensor = tensors[name]
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        _frame(digest, name, _safetensors_name(tensor.dtype), tensor.shape, raw.numel())
        digest.update(raw.numpy())
    return digest.hexdigest()


def _metadata_digest(metadata: dict[str, str]):
    digest = hashlib.sha256()
    rest = {key: value for key, value in metadata.items() if key != "payload_sha256"}
    digest.update(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode() + b"\n")
    return digest


def _frame(digest, name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> None:
    """What precedes a tensor's bytes in the checksum: its name, dtype, shape and length."""
    digest.update(json.dumps([name, dtype, list(shape), nbytes]).encode() + b"\n")


def _is_float(tensor: torch.Tensor | Quantized) -> bool:
    return not hasattr(tensor, "codes")


def quantized(kvc: KvcFile) -> bool:
    return bool(kvc.layers) and not _is_float(kvc.layers[0].keys)


def width(tensor: torch.Tensor | Quantized) -> int:
    """Channels per entry of packed keys or values."""
    return tensor.shape[1] if _is_float(tensor) else tensor.width


def nbytes(tensor: torch.Tensor | Quantized) -> int:
    """Bytes of packed keys or values (codes with their steps and minima)."""
    return tensor.numel() * tensor.element_size() if _is_float(tensor) else tensor.nbytes()


def float_itemsize(name: str | None) -> int | None:
    """Bytes per number of a float dtype a .kvc may hold, by its name (`float16`); None for any other name."""
    code = next((c for c in _FLOATS if _DTYPES[c] == name), None)
    return None if code is None else _ITEMSIZE[code]


def kv_bytes(kvc: KvcFile) -> int:
    """Bytes of every layer's keys and values as the file stores them (what `--max-bytes` limits)."""
    return sum(nbytes(layer.keys) + nbytes(layer.values) for layer in kvc.layers)


def _safetensors_name(dtype: torch.dtype) -> str:
    return _SAFETENSORS_NAMES.get(str(dtype), _dtype_name(dtype))


def _dtype_name(dtype: torch.dtype | str) -> str:
    """'bfloat16' for torch.bfloat16 or 'BF16'; the spelling metadata `cache_dtype` and messages use."""
    return _DTYPES.get(dtype, dtype) if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def _show(value: object, limit: int = 60) -> str:
    """Text from the file, shortened so a hostile header cannot flood the one-line message."""
    text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _error(path: Path, message: str) -> CacheFileError:
    """Every failure names the file and fits on one line, even if the file name or header holds a newline."""
    return CacheFileError(visible(f"{path}: {message}"))
