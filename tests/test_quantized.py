"""int8 / int4 caches: the codes' error is bounded, a quantized layer attends exactly as a float cache of its
dequantized entries, and every damage to the quantized file is a one-line CacheFileError."""

import pytest
import safetensors.torch
import torch

from klevict_cli.bench import continuation_logits, token_metrics
from klevict_cli.cache import KVCache, LayerCache
from klevict_cli.documents import Document
from klevict_cli.errors import ResourceError, UsageError
from klevict_cli.kvc import load_kvc, packed_from_padded, save_kvc
from klevict_cli.options import Budget
from klevict_cli.quantized import QuantizedLayerCache, layer_cache, quantize_packed
from klevict_cli.session import ReadSettings
from klevict_kernels.quantize import dequantize, pack_int4, quantize, unpack_int4
from tests.conftest import tiny_session
from tests.test_kvc import rejects, write_raw

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = ("The harbour master counted seventeen ships on Monday and twenty-three on Friday. " * 6
        + "The lighthouse keeper wrote both numbers in a red notebook and went home for supper. " * 6)


# ---- the codes ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dim", [-2, -1])
def test_every_element_is_within_half_a_step_of_its_code(bits, dim):
    torch.manual_seed(0)
    x = torch.randn(3, 70, 16) * torch.logspace(-2, 2, 16)  # channels of very different magnitudes
    x[:, 0] *= 50  # an outlier entry, as an attention sink is
    codes, steps, minima = quantize(x, bits, 32, dim=dim)
    back = dequantize(codes, steps, minima, bits, 32, dim=dim)
    step = steps.float().repeat_interleave(32, dim=dim).narrow(dim % 3, 0, x.shape[dim])
    levels = (1 << bits) - 1
    # half a step, plus what float16 rounding of the step can add at the top of the range
    assert ((back - x).abs() <= step * (0.5 + levels * 1e-3) + 1e-6).all()
    assert codes.dtype == torch.uint8 and codes.shape[-1] == 16 * bits // 8


def test_int8_error_is_small_against_the_range():
    torch.manual_seed(1)
    x = torch.randn(2, 64, 32)
    codes, steps, minima = quantize(x, 8, 32, dim=-2)
    err = (dequantize(codes, steps, minima, 8, 32, dim=-2) - x).abs().max()
    assert err <= (x.max() - x.min()) / 255  # at most one code's width, anywhere


def test_padding_does_not_widen_a_group():
    torch.manual_seed(2)
    x = torch.randn(2, 20, 8)
    valid = torch.ones(2, 20, dtype=torch.bool)
    valid[1, 12:] = False
    padded = x.masked_fill(~valid[..., None], 0.0)
    padded[1, 12:] = 1000.0  # padding far outside the real range: must be ignored
    codes, steps, minima = quantize(padded, 4, 32, dim=-2, valid=valid)
    alone, alone_steps, alone_minima = quantize(x[1:, :12], 4, 32, dim=-2)
    assert torch.equal(steps[1:], alone_steps) and torch.equal(minima[1:], alone_minima)
    assert torch.equal(unpack_int4(codes)[1:, :12], unpack_int4(alone))


def test_int4_codes_pack_two_to_a_byte():
    codes = torch.randint(0, 16, (5, 3, 10), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (5, 3, 5) and torch.equal(unpack_int4(packed), codes)


def test_a_constant_group_is_exact():
    x = torch.full((1, 32, 4), 0.25)
    codes, steps, minima = quantize(x, 4, 32, dim=-2)
    assert torch.equal(dequantize(codes, steps, minima, 4, 32, dim=-2), x)


# ---- the quantized layer -------------------------------------------------------------------------------------------
def quantized_layer(bits=4, heads=2, width=40, dim=8, short=30):
    """A loaded quantized layer whose second head holds fewer entries, and the float entries it was made of."""
    torch.manual_seed(3)
    keys, values = torch.randn(heads, width, dim), torch.randn(heads, width, dim)
    valid = torch.ones(heads, width, dtype=torch.bool)
    valid[1, short:] = False
    positions = torch.arange(width).expand(heads, width).masked_fill(~valid, -1)
    packed = quantize_packed(packed_from_padded(keys, values, positions, positions, valid), bits)
    return layer_cache(packed, None, "cpu", torch.float32), keys, values, valid


def test_a_quantized_layer_reads_its_codes_and_keeps_the_sink_exact():
    layer, keys, values, valid = quantized_layer(bits=8)
    assert layer.capacity == 40 and layer.keys.shape == keys.shape
    assert torch.equal(layer.keys[:, 0], keys[:, 0].half().float())  # each head's first entry kept as it is
    assert torch.equal(layer.values[:, 0], values[:, 0].half().float())
    assert (layer.keys - keys)[valid].abs().max() < 0.05 and (layer.values - values)[valid].abs().max() < 0.05


def test_appended_entries_are_floats_after_the_codes():
    layer, keys, _, _ = quantized_layer()
    before = layer.keys.clone()
    new = torch.randn(2, 3, 8)
    layer.append(new, new * 2, torch.tensor([[40, 41, 42]]), torch.tensor([[40, 41, 42]]))
    assert layer.capacity == 43
    assert torch.equal(layer.keys[:, :40], before) and torch.equal(layer.keys[:, 40:], new)
    assert torch.equal(layer.values[:, 40:], new * 2)
    float_bytes = LayerCache(layer.keys, layer.values, layer.positions, layer.rope_positions, layer.valid).nbytes()
    assert layer.nbytes() < 0.4 * float_bytes


def test_clone_truncate_and_eviction_keep_what_they_should():
    layer, _, _, _ = quantized_layer()
    layer.append(torch.ones(2, 2, 8), torch.ones(2, 2, 8), torch.tensor([[40, 41]]), torch.tensor([[40, 41]]))
    copy = layer.clone()
    copy.append(torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), torch.tensor([[42]]), torch.tensor([[42]]))
    assert (layer.capacity, copy.capacity) == (42, 43)
    copy.truncate(42)
    assert torch.equal(copy.keys, layer.keys) and torch.equal(copy.values, layer.values)
    keys, values, valid = layer.keys.clone(), layer.values.clone(), layer.valid.clone()
    even = layer.positions % 2 == 0
    layer.keep(even)  # an eviction among the loaded entries: held as floats from then on
    assert layer.frozen is None
    for h in range(2):
        kept = even[h] & valid[h]
        assert torch.equal(layer.keys[h, : int(kept.sum())], keys[h][kept])
        assert torch.equal(layer.values[h, : int(kept.sum())], values[h][kept])


# ---- through the engine -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def session():
    return tiny_session()


@pytest.fixture(scope="module")
def read(session):
    ids = session.lm.tokenizer(TEXT)["input_ids"]
    settings = ReadSettings(budget=Budget(tokens=48), method="kl", chunk_size=64, probe_window=8)
    return session.read_tokens(ids[:-24], settings, reserve=24), ids[-24:]


def as_floats(stream):
    """The same stream with every layer a float cache of its dequantized entries."""
    floats = stream.clone()
    floats.cache = KVCache([LayerCache(layer.keys, layer.values, layer.positions, layer.rope_positions, layer.valid,
                                       layer.window) for layer in stream.cache.layers])
    return floats


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_attention_over_codes_equals_attention_over_the_dequantized_cache(session, read, dtype):
    result, continuation = read
    stored, _ = session.as_stored(result.stream, dtype)
    assert all(isinstance(layer, QuantizedLayerCache) for layer in stored.cache.layers)
    logits = continuation_logits(result.engine, stored.clone(), result.logits, continuation)
    reference = continuation_logits(result.engine, as_floats(stored), result.logits, continuation)
    assert torch.allclose(logits, reference, atol=1e-5, rtol=1e-5)


def test_int8_moves_the_model_much_less_than_int4(session, read):
    result, continuation = read
    full = continuation_logits(result.engine, result.stream.clone(), result.logits, continuation)
    kl = {}
    for dtype in ("int8", "int4"):
        stored, _ = session.as_stored(result.stream, dtype)
        logits = continuation_logits(result.engine, stored, result.logits, continuation)
        kl[dtype] = token_metrics(full, logits, torch.tensor(continuation))["kl"]
    assert kl["int8"] < 1e-3 and kl["int8"] < 0.1 * kl["int4"], kl


def test_the_file_round_trips_to_the_same_cache(session, read, tmp_path):
    result, _ = read
    result.document = Document(TEXT, "note.txt", "0" * 64)
    path = tmp_path / "q.kvc"
    save_kvc(path, session.cache_file(result, "int4"))
    loaded, meta = session.load(path)
    stored, _ = session.as_stored(result.stream, "int4")
    assert meta["cache_dtype"] == "int4" and meta["format_version"] == "2"
    for a, b in zip(loaded.cache.layers, stored.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(a.positions, b.positions) and torch.equal(a.valid, b.valid)


# ---- the file's checks ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quantized_file(session, read, tmp_path_factory):
    result, _ = read
    result.document = Document(TEXT, "note.txt", "0" * 64)
    path = tmp_path_factory.mktemp("q") / "q.kvc"
    save_kvc(path, session.cache_file(result, "int4"))
    return path


def damaged(quantized_file, tmp_path, edit_tensors=None, **metadata):
    tensors = safetensors.torch.load(quantized_file.read_bytes())
    meta = {k: v for k, v in load_kvc(quantized_file).metadata.items() if k != "payload_sha256"}
    if edit_tensors:
        edit_tensors(tensors)
    path = tmp_path / "bad.kvc"
    write_raw(path, tensors, {**meta, **metadata})
    return path


def set_first(name, value):
    def edit(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] = value
    return edit


@pytest.mark.parametrize("name, value", [("layers.0.keys.steps", -1.0), ("layers.1.values.steps", 0.0),
                                         ("layers.0.keys.steps", float("nan")), ("layers.2.values.minima",
                                                                                  float("inf"))])
def test_corrupt_steps_or_minima_are_refused(quantized_file, tmp_path, name, value):
    rejects(damaged(quantized_file, tmp_path, set_first(name, value)), "not a finite positive number")


def test_codes_standing_for_huge_magnitudes_are_refused(quantized_file, tmp_path):
    rejects(damaged(quantized_file, tmp_path, set_first("layers.0.keys.steps", 60000.0)), "beyond any model's")


def test_a_non_finite_exact_entry_is_refused(quantized_file, tmp_path):
    rejects(damaged(quantized_file, tmp_path, set_first("layers.0.values.exact", float("nan"))), "exact entry")


@pytest.mark.parametrize("group, message", [("16", "key groups"), ("0", "quant_group"), ("x", "quant_group"),
                                            ("8", "value steps")])
def test_a_wrong_group_size_is_refused(quantized_file, tmp_path, group, message):
    rejects(damaged(quantized_file, tmp_path, quant_group=group), message)


def test_missing_or_wrong_exact_count_is_refused(quantized_file, tmp_path):
    rejects(damaged(quantized_file, tmp_path, quant_exact="2"), "keys.exact")
    rejects(damaged(quantized_file, tmp_path, quant_exact=""), "quant_exact")


def test_truncated_packed_codes_are_refused(quantized_file, tmp_path):
    def cut(tensors):
        tensors["layers.1.keys.codes"] = tensors["layers.1.keys.codes"][:-1].clone()
    rejects(damaged(quantized_file, tmp_path, cut), "disagree on the number of entries")
    data = quantized_file.read_bytes()
    (tmp_path / "short.kvc").write_bytes(data[:-100])
    rejects(tmp_path / "short.kvc", "truncated")


def test_codes_of_the_wrong_width_are_refused(quantized_file, tmp_path):
    def narrow(tensors):
        tensors["layers.0.keys.codes"] = tensors["layers.0.keys.codes"][:, :-1].clone()
    rejects(damaged(quantized_file, tmp_path, narrow), "key codes hold")


def test_version_and_cache_dtype_must_agree(quantized_file, tmp_path):
    rejects(damaged(quantized_file, tmp_path, format_version="1"), "needs format version 2")
    rejects(damaged(quantized_file, tmp_path, cache_dtype="float32"), "int8 or int4 cache")


# ---- a byte limit: fewer entries or fewer bits ------------------------------------------------------------------
def test_each_storage_gets_the_entries_its_bytes_allow(session):
    from klevict_cli.options import ByteLimit

    budgets = session.storage_budgets(ByteLimit(share=0.1), 400, None, None)
    assert list(budgets) == ["float16", "int8", "int4"]
    assert budgets["float16"] == pytest.approx(0.1 * 400 * 2, abs=1)  # float32 model: half the bytes per entry
    assert budgets["float16"] < budgets["int8"] < budgets["int4"] < 400
    assert session.storage_budgets(ByteLimit(share=0.1), 400, "int8", 50) == {"int8": 50}  # --budget caps it
    with pytest.raises(ResourceError, match="cannot hold one entry per head"):
        session.storage_budgets(ByteLimit(size=100), 400, None, None)


def test_the_storage_whose_cache_drifts_least_is_chosen(session, monkeypatch):
    """The read's last eviction tries each storage at its budget and keeps the one whose stored cache the drafts
    find closest; the cache then fits the byte limit as stored."""
    from klevict_cli.engine import Engine
    from klevict_cli.options import ByteLimit

    measured = {}
    real = Engine.measure_drift

    def drift(self, stream, drafted):
        out = real(self, stream, drafted)
        measured.setdefault(stream.stored_as, out["kl"])
        return {**out, "kl": {"float16": 3.0, "int8": 1.0, "int4": 2.0}[stream.stored_as]}

    monkeypatch.setattr(Engine, "measure_drift", drift)
    ids = session.lm.tokenizer(TEXT)["input_ids"]
    limit = ByteLimit(share=0.1)
    settings = ReadSettings(budget=None, method="kl", chunk_size=64, probe_window=8, max_bytes=limit)
    result = session.read_tokens(ids, settings, reserve=8)
    assert set(measured) == {"float16", "int8", "int4"}
    assert result.stream.stored_as == "int8" and result.stream.drift["kl"] == 1.0
    budgets = session.storage_budgets(limit, result.document_tokens + result.prefix_tokens, None, None)
    assert result.plan.budget == budgets["int8"]
    _, size = session.as_stored(result.stream, "int8")
    assert size <= limit.resolve((result.document_tokens + result.prefix_tokens) * session.bytes_per_token())


def test_a_storage_with_fewer_bits_is_tried_only_where_it_keeps_more_entries(session, monkeypatch):
    """A --budget that caps every storage at the same entries leaves int8 and int4 nothing to offer but coarser
    values: float16 is kept without measuring them, however the sample would have ranked them."""
    from klevict_cli.engine import Engine
    from klevict_cli.options import ByteLimit

    tried = []
    real = Engine.measure_drift

    def drift(self, stream, drafted):
        tried.append(stream.stored_as)
        return {**real(self, stream, drafted), "kl": {"float16": 3.0, "int8": 1.0, "int4": 2.0}[stream.stored_as]}

    monkeypatch.setattr(Engine, "measure_drift", drift)
    ids = session.lm.tokenizer(TEXT)["input_ids"]
    settings = ReadSettings(budget=Budget(tokens=40), method="kl", chunk_size=64, probe_window=8,
                            max_bytes=ByteLimit(share=0.5))
    result = session.read_tokens(ids, settings, reserve=8)
    assert tried == ["float16"] and result.stream.stored_as == "float16" and result.plan.budget == 40


def test_new_keys_or_values_for_a_quantized_layer_make_it_floats_first():
    """Re-rotating keys (compact positions) assigns new keys for every entry, and a refit writes into the values: a
    quantized layer must take them, not keep decoding its codes."""
    layer, keys, _, _ = quantized_layer()
    moved = layer.keys + 100
    layer.keys = moved
    assert layer.frozen is None and torch.equal(layer.keys, moved)
    layer, _, _, _ = quantized_layer()
    layer.materialize()
    layer.values[:, :5] = 0
    assert (layer.values[:, :5] == 0).all()


def test_int4_needs_an_even_number_of_channels():
    layer = packed_from_padded(torch.randn(1, 4, 3), torch.randn(1, 4, 3), torch.arange(4)[None], torch.arange(4)[None],
                               torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(UsageError, match="use --cache-dtype int8"):
        quantize_packed(layer, 4)
    assert quantize_packed(layer, 8).keys.width == 3


def test_dequantizing_for_a_bfloat16_model_rounds_once():
    torch.manual_seed(4)
    x = (torch.randn(2, 64, 16) + 3).bfloat16()
    codes, steps, minima = quantize(x, 8, 32, dim=-2)
    once = dequantize(codes, steps, minima, 8, 32, dim=-2, dtype=torch.bfloat16)
    exact = dequantize(codes, steps, minima, 8, 32, dim=-2, dtype=torch.float32).bfloat16()
    assert torch.equal(once, exact)


def test_a_byte_limit_never_keeps_more_than_the_positions_allow():
    """Compact positions (a document longer than the model's): every storage's budget is capped to what fits."""
    from klevict_cli.options import ByteLimit

    small = tiny_session(max_position_embeddings=160)
    ids = small.lm.tokenizer(TEXT * 2)["input_ids"][:400]
    settings = ReadSettings(budget=None, method="kl", chunk_size=32, probe_window=8, max_bytes=ByteLimit(share=0.9))
    result = small.read_tokens(ids, settings, reserve=8)
    assert result.plan.mode == "compact"
    assert max(result.engine.storage.values()) <= 160 - 32
    assert max(max(counts) for counts in result.stream.cache.kept_counts()) <= result.plan.budget <= 160 - 32


def test_a_long_answer_from_a_quantized_cache_evicts_within_its_budget(session, read, tmp_path, monkeypatch):
    """`ask` keeps a long answer within the cache's budget by evicting while it decodes: from a loaded int4 cache
    that turns the layers into floats first and goes on."""
    from klevict_cli.session import GenerateSettings

    materialized = []
    real = QuantizedLayerCache.materialize
    monkeypatch.setattr(QuantizedLayerCache, "materialize",
                        lambda self: materialized.append(self.frozen is not None) or real(self))

    result, _ = read
    result.document = Document(TEXT, "note.txt", "0" * 64)
    path = tmp_path / "q.kvc"
    save_kvc(path, session.cache_file(result, "int4"))
    stream, meta = session.load(path)
    budget = int(meta["budget_tokens"])
    answer = session.answer(stream, "Tell me everything.", GenerateSettings(max_new_tokens=160, repetition_penalty=1.0),
                            meta["position_mode"], method="kl", budget=budget)
    assert answer["new_tokens"] == 160 and any(materialized)  # it evicted among the loaded entries
    assert all(layer.frozen is not None for layer in stream.cache.layers)  # the loaded stream itself is unchanged
