"""The .kvc file must round-trip exactly and turn every kind of damage into a one-line CacheFileError."""

import json
import os
import random
import stat
import struct
import tracemalloc

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from klevict_cli import kvc
from klevict_cli.errors import CacheFileError, OutputError
from klevict_cli.kvc import KvcFile, LayerSpec, PackedLayer, load_kvc, read_metadata, save_kvc

TOKENS = 40
LENGTHS = [3, 0, 5, 1]
KEY_DIM, VALUE_DIM = 8, 6
META = {"budget": "2048", "model_id": "tiny/model", "model_config_sha256": "c" * 64, "tokenizer_sha256": "t" * 64}


def make_layer(lengths=LENGTHS, dtype=torch.float32, compact=False) -> PackedLayer:
    """Random entries with each head's positions strictly increasing, as the engine produces them."""
    positions = [torch.sort(torch.randperm(TOKENS)[:n]).values for n in lengths]
    positions = torch.cat(positions).to(torch.int32)
    n = int(sum(lengths))
    rope = torch.cat([torch.arange(k) for k in lengths]).to(torch.int32) if compact else positions.clone()
    return PackedLayer(
        keys=torch.randn(n, KEY_DIM).to(dtype),
        values=torch.randn(n, VALUE_DIM).to(dtype),
        positions=positions,
        rope_positions=rope,
        lengths=torch.tensor(lengths, dtype=torch.int32),
    )


def make_kvc(num_layers=2, dtype=torch.float32, seed=0) -> KvcFile:
    torch.manual_seed(seed)
    layers = [make_layer(dtype=dtype, compact=i == 1) for i in range(num_layers)]
    return KvcFile(layers=layers, tokens=torch.randint(0, 1000, (TOKENS,), dtype=torch.int32), metadata=dict(META))


SPECS = [LayerSpec(heads=len(LENGTHS), key_dim=KEY_DIM, value_dim=VALUE_DIM)] * 2


def assert_same(a: KvcFile, b: KvcFile) -> None:
    assert len(a.layers) == len(b.layers)
    for x, y in zip(a.layers, b.layers):
        for field in kvc.LAYER_FIELDS:
            tx, ty = getattr(x, field), getattr(y, field)
            assert tx.dtype == ty.dtype and tx.shape == ty.shape and torch.equal(tx.cpu(), ty.cpu()), field
    assert torch.equal(a.tokens.cpu(), b.tokens.cpu()) and a.tokens.dtype == b.tokens.dtype


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "doc.kvc"
    original = make_kvc()
    save_kvc(path, original)
    return path, original


def write_raw(path, tensors, metadata, fix_checksum=True):
    """A file that save_kvc would refuse to write, to reach the checks behind the checksum."""
    metadata = {"format": "klevict-kvc", "format_version": "1", **metadata}
    if fix_checksum:
        metadata["payload_sha256"] = kvc._payload_sha256(metadata, tensors)
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)


def raw_parts(path):
    tensors = safetensors.torch.load(path.read_bytes())
    metadata = read_metadata(path)
    metadata.pop("file_size")
    return tensors, metadata


def rejects(path, substring, **kwargs) -> str:
    with pytest.raises(CacheFileError) as info:
        load_kvc(path, **kwargs)
    message = str(info.value)
    assert substring in message
    assert message.startswith(f"{path}: ")
    assert "\n" not in message and "\r" not in message
    assert info.value.exit_code == 4
    return message


# --- round trips ----------------------------------------------------------------------------------------------


def test_round_trip_is_exact(saved):
    path, original = saved
    loaded = load_kvc(path, specs=SPECS, expect=dict(META))
    assert_same(original, loaded)
    assert META.items() <= loaded.metadata.items()
    assert loaded.metadata["format"] == "klevict-kvc" and loaded.metadata["format_version"] == "1"
    assert loaded.metadata["num_layers"] == "2" and len(loaded.metadata["payload_sha256"]) == 64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_round_trip(tmp_path, dtype):
    original = make_kvc(dtype=dtype)
    save_kvc(tmp_path / "h.kvc", original)
    loaded = load_kvc(tmp_path / "h.kvc")
    assert_same(original, loaded)
    assert loaded.metadata["cache_dtype"] == str(dtype).removeprefix("torch.")


def test_save_returns_size_and_read_metadata_is_cheap(saved):
    path, _ = saved
    metadata = read_metadata(path)
    assert metadata["file_size"] == str(path.stat().st_size)
    assert metadata["budget"] == "2048"


def test_reading_a_header_imports_no_torch(saved):
    path, _ = saved
    """A batch decides whether a document is done from its cache's header: that must not cost torch's import
    (seconds), only the header's bytes."""
    import subprocess
    import sys

    code = ("import sys; from klevict_cli.kvc import read_metadata; "
            f"assert read_metadata({str(path)!r})['format'] == 'klevict-kvc'; print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_empty_cache_round_trips(tmp_path):
    empty = KvcFile(layers=[make_layer(lengths=[0, 0])], tokens=torch.zeros(0, dtype=torch.int32), metadata={})
    save_kvc(tmp_path / "e.kvc", empty)
    assert_same(empty, load_kvc(tmp_path / "e.kvc"))


def test_padded_packed_round_trip_with_ragged_heads():
    torch.manual_seed(1)
    layer = make_layer(lengths=[4, 0, 2, 7])
    keys, values, positions, rope, valid = kvc.padded_from_packed(layer)
    assert keys.shape == (4, 7, KEY_DIM) and valid.sum(dim=1).tolist() == [4, 0, 2, 7]
    assert (positions[~valid] == -1).all() and (keys[~valid] == 0).all()
    assert torch.equal(positions[0, :4], layer.positions[:4])
    back = kvc.packed_from_padded(keys, values, positions, rope, valid)
    for field in kvc.LAYER_FIELDS:
        assert torch.equal(getattr(back, field), getattr(layer, field)), field

    wider = kvc.padded_from_packed(layer, capacity=10)
    assert wider[0].shape == (4, 10, KEY_DIM)
    assert torch.equal(kvc.packed_from_padded(*wider).keys, layer.keys)


def test_padding_scattered_in_the_engine_cache_is_dropped_in_order():
    keys = torch.arange(2 * 4 * 1, dtype=torch.float32).reshape(2, 4, 1)
    positions = torch.tensor([[5, 1, 9, 3], [0, 2, 4, 6]])
    valid = torch.tensor([[False, True, True, False], [True, False, False, True]])
    packed = kvc.packed_from_padded(keys, keys, positions, positions, valid)
    assert packed.positions.tolist() == [1, 9, 0, 6] and packed.lengths.tolist() == [2, 2]
    assert packed.keys.flatten().tolist() == [1.0, 2.0, 4.0, 7.0]


# --- atomic writes --------------------------------------------------------------------------------------------


def test_atomic_write_leaves_no_temp_file(saved):
    path, _ = saved
    assert sorted(p.name for p in path.parent.iterdir()) == ["doc.kvc"]


@pytest.mark.parametrize("target", ["replace", "fsync"])
def test_interrupted_write_keeps_old_file_and_no_temp(saved, monkeypatch, target):
    path, _ = saved
    before = path.read_bytes()

    def interrupt(*args):
        temp = [p for p in path.parent.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]
        assert len(temp) == 1  # the write really was midway
        raise KeyboardInterrupt

    monkeypatch.setattr(os, target, interrupt)
    with pytest.raises(KeyboardInterrupt):
        save_kvc(path, make_kvc(seed=5))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["doc.kvc"]


def test_unwritable_destination_is_an_output_error(tmp_path):
    with pytest.raises(OutputError, match="cannot write") as info:
        save_kvc(tmp_path / "missing-dir" / "x.kvc", make_kvc())
    assert info.value.exit_code == 7  # the file was never bad: the place to put it is


def test_save_never_replaces_a_fifo_or_device(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match="not a regular file"):
        save_kvc(fifo, make_kvc())
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_save_refuses_an_inconsistent_cache(tmp_path):
    bad = make_kvc()
    bad.layers[0].positions = bad.layers[0].positions.to(torch.int64)
    with pytest.raises(CacheFileError, match="int32"):
        save_kvc(tmp_path / "x.kvc", bad)
    assert list(tmp_path.iterdir()) == []


# --- rejections -----------------------------------------------------------------------------------------------


def test_truncation_anywhere_is_rejected(saved):
    path, _ = saved
    data = path.read_bytes()
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    for cut in [0, 3, 7, 8, 20, header_end - 1, header_end, header_end + 5, len(data) - 1]:
        path.write_bytes(data[:cut])
        rejects(path, "truncated")


def test_flipped_bit_in_tensor_data(saved):
    path, _ = saved
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01
    path.write_bytes(bytes(data))
    rejects(path, "checksum mismatch")


def test_edited_metadata_value(saved):
    path, _ = saved
    data = path.read_bytes()
    assert data.count(b'"budget":"2048"') == 1
    path.write_bytes(data.replace(b'"budget":"2048"', b'"budget":"2049"'))
    rejects(path, "checksum mismatch: the file is corrupt or was edited")


def test_future_format_version(tmp_path):
    tensors, metadata = raw_parts_of_new(tmp_path)
    write_raw(tmp_path / "v.kvc", tensors, {**metadata, "format_version": "3"})
    rejects(tmp_path / "v.kvc", "unsupported .kvc format version 3 (this klevict reads 1 and 2)")


def raw_parts_of_new(tmp_path):
    save_kvc(tmp_path / "src.kvc", make_kvc())
    return raw_parts(tmp_path / "src.kvc")


def test_plain_safetensors_file_is_not_a_cache(tmp_path):
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(tmp_path / "w.kvc"))
    rejects(tmp_path / "w.kvc", "not a klevict cache file")


@pytest.mark.parametrize(
    "content",
    [random.Random(0).randbytes(4096), b"The quick brown fox jumps over the lazy dog.\n" * 20, b"", b"abc"],
    ids=["random", "text", "empty", "tiny"],
)
def test_not_safetensors_at_all(tmp_path, content):
    path = tmp_path / "junk.kvc"
    path.write_bytes(content)
    with pytest.raises(CacheFileError) as info:
        load_kvc(path)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)
    with pytest.raises(CacheFileError):
        read_metadata(path)


def test_giant_header_length(tmp_path):
    path = tmp_path / "g.kvc"
    path.write_bytes(struct.pack("<Q", 2**40) + b"{}" * 100)
    rejects(path, "header too large")


def test_a_document_given_for_a_cache_is_said_to_begin_as_text(tmp_path):
    """`klevict ask report.txt QUESTION` read its first characters as a header length: "header too large
    (2340012980694967881 bytes)" told the user nothing."""
    path = tmp_path / "report.txt"
    path.write_text("If they but knew it, almost all men in their degree cherish the ocean.\n", encoding="utf-8")
    rejects(path, "not a .kvc file: it begins as text ('If they '), as a document does; klevict compress makes")


def peak_python_memory(fn) -> int:
    """Peak bytes Python allocated while `fn` ran (a whole-file read would show as one huge bytes object)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


BIG = 128 * 2**20  # sparse: no disk is spent on it


def test_a_huge_junk_file_is_refused_in_constant_memory(tmp_path):
    path = tmp_path / "junk.kvc"
    with path.open("wb") as f:
        f.write(struct.pack("<Q", 20) + b"this is not JSON....")
        f.truncate(BIG)
    peak = peak_python_memory(lambda: rejects(path, "not valid JSON"))
    assert peak < 8 * 2**20, peak


def test_a_huge_file_with_a_plausible_header_is_refused_in_constant_memory(tmp_path):
    """The header tiles the data exactly, so only the checksum can tell: it must be taken without loading the data."""
    path = tmp_path / "big.kvc"
    count = BIG // 4
    header = json.dumps({
        "__metadata__": {"format": "klevict-kvc", "format_version": "1", "num_layers": "0", "payload_sha256": "0"},
        "tokens": {"dtype": "I32", "shape": [count], "data_offsets": [0, 4 * count]},
    }).encode()
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 4 * count)
    peak = peak_python_memory(lambda: rejects(path, "checksum mismatch"))
    assert peak < 8 * 2**20, peak


@pytest.mark.parametrize("header", [b'{"__metadata__": {', b"[1, 2]", b'{"a": NaN}', b"\xff\xfe{}"])
def test_malformed_header_json(tmp_path, header):
    path = tmp_path / "m.kvc"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    rejects(path, "header is not")


def test_duplicate_header_keys(saved):
    path, _ = saved
    data = path.read_bytes()
    header = data[8 : 8 + struct.unpack("<Q", data[:8])[0]]
    doubled = header.replace(b'"budget":"2048"', b'"budget":"2048","budget":"1"')
    path.write_bytes(struct.pack("<Q", len(doubled)) + doubled + data[8 + len(header) :])
    rejects(path, "duplicate key")


def test_trailing_garbage(saved):
    path, _ = saved
    with path.open("ab") as f:
        f.write(b"\x00garbage")
    rejects(path, "trailing garbage")


@pytest.mark.parametrize(
    ("dtype", "message"),
    [
        (torch.int64, "layers.1.positions has unsupported dtype I64"),
        (torch.float32, "layers.1.positions has dtype float32; expected int32"),
    ],
)
def test_wrong_dtype_tensor(tmp_path, dtype, message):
    tensors, metadata = raw_parts_of_new(tmp_path)
    tensors["layers.1.positions"] = tensors["layers.1.positions"].to(dtype)
    write_raw(tmp_path / "d.kvc", tensors, metadata)
    rejects(tmp_path / "d.kvc", message)


def test_mixed_cache_dtypes(tmp_path):
    tensors, metadata = raw_parts_of_new(tmp_path)
    tensors["layers.1.values"] = tensors["layers.1.values"].to(torch.float16)
    write_raw(tmp_path / "d.kvc", tensors, metadata)
    rejects(tmp_path / "d.kvc", "but the cache holds float32")


def test_missing_tensor(tmp_path):
    tensors, metadata = raw_parts_of_new(tmp_path)
    tensors["layers.1.extra"] = tensors.pop("layers.1.lengths")
    write_raw(tmp_path / "n.kvc", tensors, metadata)
    rejects(tmp_path / "n.kvc", "missing tensor layers.1.lengths")


def test_wrong_shape_for_the_model(saved):
    path, _ = saved
    rejects(path, "made for a model with a different shape", specs=SPECS[:1])
    other = [SPECS[0], LayerSpec(heads=len(LENGTHS), key_dim=KEY_DIM * 2, value_dim=VALUE_DIM)]
    rejects(path, "made for a model with a different shape (layer 1", specs=other)


def test_lengths_not_summing_to_entries(tmp_path):
    tensors, metadata = raw_parts_of_new(tmp_path)
    lengths = tensors["layers.0.lengths"]
    tensors["layers.0.lengths"] = lengths + torch.tensor([1, 0, 0, 0], dtype=torch.int32, device=lengths.device)
    write_raw(tmp_path / "l.kvc", tensors, metadata)
    rejects(tmp_path / "l.kvc", "head lengths sum to")


def test_positions_out_of_range(tmp_path):
    tensors, metadata = raw_parts_of_new(tmp_path)
    tensors["layers.0.positions"][-1] = TOKENS
    write_raw(tmp_path / "p.kvc", tensors, metadata)
    rejects(tmp_path / "p.kvc", "positions out of range")


def test_positions_not_increasing_within_a_head(tmp_path):
    tensors, metadata = raw_parts_of_new(tmp_path)
    tensors["layers.0.positions"][:3] = tensors["layers.0.positions"][:3].flip(0)
    write_raw(tmp_path / "o.kvc", tensors, metadata)
    rejects(tmp_path / "o.kvc", "not strictly increasing")


def test_negative_rope_position(tmp_path):
    tensors, metadata = raw_parts_of_new(tmp_path)
    tensors["layers.1.rope_positions"][0] = -3
    write_raw(tmp_path / "r.kvc", tensors, metadata)
    rejects(tmp_path / "r.kvc", "rope position is negative")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("field", ["keys", "values"])
def test_nan_or_infinite_keys_and_values_are_refused_even_with_a_valid_checksum(tmp_path, field, value):
    tensors, metadata = raw_parts_of_new(tmp_path)
    tensors[f"layers.1.{field}"][2, 3] = value
    write_raw(tmp_path / "n.kvc", tensors, metadata)
    rejects(tmp_path / "n.kvc", "layer 1: keys or values hold NaN or infinity")


def test_token_ids_outside_the_vocabulary_are_refused(saved):
    path, original = saved
    top = int(original.tokens.max())
    assert load_kvc(path, vocab_size=top + 1)
    rejects(path, f"token id {top} is outside the model's vocabulary of {top}", vocab_size=top)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [("method_params", "{not json", "metadata method_params is not valid JSON"),
     ("method_params", "[1, 2]", "metadata method_params is not a JSON object"),
     ("method_state", '{"a": NaN}', "metadata method_state is not valid JSON"),
     ("next_rope", "\u00b2", "metadata next_rope is not a count"),
     ("budget_tokens", "+64", "metadata budget_tokens is not a count")],
)
def test_metadata_that_code_parses_must_parse(tmp_path, key, value, message):
    tensors, metadata = raw_parts_of_new(tmp_path)
    write_raw(tmp_path / "m.kvc", tensors, {**metadata, key: value})
    rejects(tmp_path / "m.kvc", message)


def test_cache_from_another_model(saved):
    path, _ = saved
    message = rejects(
        path,
        "this cache was made by model tiny/model, whose architecture (config) differ",
        expect={**META, "model_id": "other/model", "model_config_sha256": "d" * 64},
    )
    assert "--model tiny/model" in message
    rejects(path, "made by model tiny/model", expect={"model_config_sha256": "e" * 64})


def test_cache_from_another_tokenizer(saved):
    path, _ = saved
    rejects(path, "made with a different tokenizer", expect={"tokenizer_sha256": "u" * 64})


def test_other_expected_metadata(saved):
    path, _ = saved
    rejects(path, "metadata budget is '2048' but '512' was expected", expect={"budget": "512"})


def test_missing_and_non_regular_files(tmp_path):
    rejects(tmp_path / "nope.kvc", "no such file")
    rejects(tmp_path, "not a regular file")


def test_newlines_in_names_stay_on_one_line(tmp_path):
    tensors, metadata = raw_parts_of_new(tmp_path)
    write_raw(tmp_path / "x.kvc", tensors, {**metadata, "model_id": "evil\nmodel"})
    rejects(tmp_path / "x.kvc", "evil\\nmodel", expect={"model_id": "good"})


# --- fuzzing --------------------------------------------------------------------------------------------------

_FUZZ_SOURCE = make_kvc(num_layers=1, seed=3)


@pytest.fixture(scope="module")
def fuzz_case(tmp_path_factory):
    """The valid file's bytes and metadata, and a scratch path each example overwrites."""
    path = tmp_path_factory.mktemp("fuzz") / "small.kvc"
    save_kvc(path, _FUZZ_SOURCE)
    return path.read_bytes(), load_kvc(path).metadata, path


damage = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("overwrite"), st.integers(0, 10**6), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
)


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damages=st.lists(damage, min_size=1, max_size=3))
def test_random_damage_is_caught_or_harmless(fuzz_case, damages):
    original, metadata, path = fuzz_case
    data = bytearray(original)
    for kind, where, what in damages:
        where %= max(len(data), 1)
        if kind == "flip" and data:
            data[where] ^= 1 << what
        elif kind == "overwrite":
            data[where : where + len(what)] = what
        elif kind == "truncate":
            del data[where:]
    path.write_bytes(bytes(data))
    try:
        loaded = load_kvc(path)
    except CacheFileError as exc:
        assert "\n" not in str(exc)
        return
    assert_same(_FUZZ_SOURCE, loaded)
    assert loaded.metadata == metadata


# --- bounds on what a valid cache may hold (issue 42, item 6) ---------------------------------------------------


@pytest.mark.parametrize("value", [1e30, -7e4])
def test_keys_or_values_beyond_any_models_magnitude_are_refused_though_the_checksum_is_right(saved, value):
    path, _ = saved
    tensors, metadata = raw_parts(path)
    tensors["layers.1.values"][2, 0] = value
    write_raw(path, tensors, metadata)  # the checksum recomputed: only the bound can catch it
    rejects(path, "layer 1: a key or value of magnitude")


def test_the_largest_magnitude_allowed_loads(saved):
    path, _ = saved
    tensors, metadata = raw_parts(path)
    tensors["layers.0.keys"][0, 0] = kvc.MAX_MAGNITUDE
    write_raw(path, tensors, metadata)
    assert load_kvc(path).layers[0].keys[0, 0] == kvc.MAX_MAGNITUDE


@pytest.mark.parametrize(("params", "needle"), [
    ({"top_k": "-1"}, "method_params top_k is -1, outside [0, 1048576]"),
    ({"rank": "1e9"}, "method_params rank is 1e9, outside [0, 1048576]"),
    ({"rank": 1e9}, "method_params rank is 1000000000.0, outside"),
    ({"top_k": {"nested": "1"}}, "method_params top_k is not a string or a number"),
    ({"probes": "x" * 65}, "method_params probes is not a short, printable value"),
    ({"probes": "live\x1b[2J"}, "method_params probes is not a short, printable value"),
])
def test_nonsense_method_params_are_refused(saved, params, needle):
    path, _ = saved
    tensors, metadata = raw_parts(path)
    metadata["method_params"] = json.dumps(params)
    write_raw(path, tensors, metadata)
    rejects(path, needle)


def test_every_methods_own_params_pass_the_bounds():
    from klevict_cli.policies import POLICIES

    for name, policy in POLICIES.items():
        kvc._check_method_params("x.kvc", policy().params())
