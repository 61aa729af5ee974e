"""`--probe-dtype`: the forwards whose tokens are only samples of what the model may see next (look-ahead drafts, the
re-reading, the drift's sampled continuation) run on a copy of the model at a cheaper precision; the read, and every
logit that is a measurement, run on the model itself."""

from __future__ import annotations

import functools

import pytest
import torch

from klevict_cli import options
from klevict_cli.adapter_check import adapter_for
from klevict_cli.bench import continuation_logits, token_metrics
from klevict_cli.engine import Engine
from klevict_cli.errors import UsageError
from klevict_cli.models import probe_copy
from klevict_cli.policies import make_policy
from klevict_cli.probes import Reconstruction
from tests.conftest import tiny_llama
from tests.test_drift import lane_by_lane

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTEXT, CONTINUATION, CHUNK = 200, 16, 64


def test_a_probe_copy_holds_the_parameters_at_its_dtype_and_leaves_the_model_as_it_was():
    model = tiny_llama(seed=1, tie_word_embeddings=True)
    before = {name: p.clone() for name, p in model.named_parameters()}
    copy = probe_copy(model, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in copy.parameters())
    assert copy.get_output_embeddings().weight is copy.get_input_embeddings().weight  # still tied
    assert all(b.dtype == torch.float32 for b in copy.buffers())  # rotary frequencies as they were
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[name])
    for (name, p), q in zip(model.named_parameters(), copy.parameters()):
        torch.testing.assert_close(q.float(), p, rtol=1e-2, atol=1e-2, msg=name)


def test_auto_takes_bfloat16_only_where_the_device_computes_it_natively(monkeypatch):
    cpu = torch.device("cpu")
    for native in (True, False):
        monkeypatch.setattr(options, "native_bfloat16", lambda device, native=native: native)
        want = torch.bfloat16 if native else None
        assert options.resolve_probe_dtype("auto", cpu, torch.float32) == want
        assert options.resolve_probe_dtype("auto", cpu, torch.bfloat16) is None  # already 16-bit: the model itself
        assert options.resolve_probe_dtype("float32", cpu, torch.float32) is None
        assert options.resolve_probe_dtype("bfloat16", cpu, torch.float16) == torch.bfloat16
    for unoffered in ("int8", "float16"):  # float16's range overflows in some models' probes
        with pytest.raises(UsageError):
            options.resolve_probe_dtype(unoffered, cpu, torch.float32)


def read(probe_dtype: torch.dtype | None, method: str = "kl", budget: int | None = 40, reread: bool = False,
         measure: bool = True, context: int = CONTEXT):
    model = tiny_llama(seed=3)
    ids = torch.randint(3, 300, (CONTEXT + CONTINUATION,), generator=torch.Generator().manual_seed(5)).tolist()
    copies = []

    def copy():
        copies.append(probe_copy(model, probe_dtype))
        return copies[-1]

    policy = make_policy(method)
    source = Reconstruction([1, 2], [3], [4], span=32) if reread or policy.reconstruction == "required" else None
    engine = Engine(model, adapter_for(model), policy, budget, chunk_size=CHUNK, reconstruction=source,
                    measure_drift=measure, probe_model=copy if probe_dtype is not None else None,
                    score_dtype=probe_dtype or torch.float32)  # as Session.engine
    stream = engine.new_stream()
    last = engine.feed(stream, ids[:context])
    return engine, stream, last, ids, copies


def test_the_drift_is_measured_on_the_model_though_its_tokens_were_sampled_on_the_copy(monkeypatch):
    """The continuation's logits before the choice are the model's over everything read (each lane read alone over
    the full cache gives them; a read of 120 tokens evicts once, at its end), not the copy's; the sampled tokens are
    forgotten."""
    seen = []
    measure = Engine.measure_drift
    monkeypatch.setattr(Engine, "measure_drift", lambda self, stream, drafted: seen.append(drafted) or measure(
        self, stream, drafted))
    engine, stream, _, ids, copies = read(torch.bfloat16, context=120)
    assert len(copies) == 1 and stream.tokens == ids[:120]
    full_engine, full, *_ = read(None, budget=None, context=120)
    torch.testing.assert_close(seen[0].logits, lane_by_lane(full_engine, full, seen[0]), rtol=1e-4, atol=1e-4)
    # the copy's own logits for the same tokens are another distribution: measuring on them would not be this
    sampled_on_copy = lane_by_lane(Engine(copies[0], adapter_for(copies[0]), make_policy("none"), None), full,
                                   seen[0]).float()
    assert not torch.allclose(sampled_on_copy, seen[0].logits, rtol=1e-4, atol=1e-4)
    assert stream.drift["kl"] > 0


@pytest.mark.parametrize("support, rel", [(None, 1e-3), (8, 0.05)])
def test_the_drift_through_the_copys_head_is_the_models_kl_to_its_rounding(monkeypatch, support, rel):
    """With a probe copy, the continuation's logits after the choice are not computed whole: the change of the
    model's head inputs goes through the copy's head over each row's likeliest tokens (kernels/kl.py,
    SupportedReference), and the KL from that change is the model's own KL over the chosen cache, lane by lane, to
    within bfloat16's rounding of the change (the KL's slope in the change is small where the caches are close)
    where the support is every token (the tiny model's 300), and a little below it where it is the union of each
    row's 8 likeliest."""
    from klevict_cli import engine as engine_module

    if support is not None:
        monkeypatch.setattr(engine_module, "DRIFT_SUPPORT", support)
    seen = []
    measure = Engine.measure_drift
    monkeypatch.setattr(Engine, "measure_drift", lambda self, stream, drafted: seen.append(drafted) or measure(
        self, stream, drafted))
    engine, stream, *_ = read(torch.bfloat16, context=120)
    drafted = seen[0]
    assert drafted.head_inputs is not None and drafted.head_inputs.shape[0] == len(drafted.tokens) - 1
    after = lane_by_lane(engine, stream, drafted)  # the model's full logits over the chosen cache
    p, q = drafted.logits.double().log_softmax(-1), after.double().log_softmax(-1)
    exact = float((p.exp() * (p - q)).sum(-1).mean())
    assert exact > 1e-3 and stream.drift["sampled_kl"] == pytest.approx(exact, rel=rel)
    assert len(drafted.supported.support) == 300 if support is None else len(drafted.supported.support) < 300


def test_the_output_head_gets_its_rows_laid_out_plainly_on_the_model_and_its_copy():
    """The last row of a longer forward keeps that forward's batch stride; a CPU's bfloat16 matmul of such a row copies
    the whole transposed head weight first (1.6 s for Gemma-3-270M's), so the head hook hands it a plain copy: the
    same logits, bit for bit, at either precision."""
    from klevict_cli import attention

    model = tiny_llama(seed=1, tie_word_embeddings=True)
    attention.install_head_hook(model.get_output_embeddings())
    copy = probe_copy(model, torch.bfloat16)  # carries the hook
    for m in (model, copy):
        head, seen = m.get_output_embeddings(), []
        handle = head.register_forward_pre_hook(lambda module, args: seen.append(args[0].stride()))
        hidden = torch.randn(1, 8, head.in_features).to(head.weight.dtype)
        row = hidden[:, -1:]
        assert row.stride() == (8 * head.in_features, head.in_features, 1)
        with torch.inference_mode():
            got = head(row)
        handle.remove()
        assert seen == [(head.in_features, head.in_features, 1)]
        assert torch.equal(got, torch.nn.functional.linear(hidden[0, -1:], head.weight)[None])


def test_the_read_itself_runs_on_the_model():
    """A read's own logits are the model's whatever runs its probes (a read of 120 tokens evicts once, at its end);
    nothing evicted, no copy is made."""
    for method in ("kl", "kvzip"):
        _, _, last, _, _ = read(None, method, context=120)
        _, _, last_copy, _, copies = read(torch.bfloat16, method, context=120)
        assert torch.equal(last, last_copy) and len(copies) == 1
    _, stream, _, ids, copies = read(torch.bfloat16, budget=None)
    assert copies == [] and stream.drift is None


@pytest.mark.parametrize("method, reread", [("kl", False), ("kl", True), ("kvzip", False)])
def test_probes_on_a_bfloat16_copy_keep_the_cache_as_close_to_the_full_one(method, reread):
    """The caches chosen with bfloat16 probes are as usable as with the model's own: the next tokens' KL against the
    full cache stays small, and within a factor of the float32 probes' (tiny random models: a loose bound)."""
    engine_f, stream_f, last_f, ids, _ = read(None, budget=None, measure=False)
    full = continuation_logits(engine_f, stream_f, last_f, ids[CONTEXT:])
    target = torch.tensor(ids[CONTEXT:])
    kls = {}
    for dtype in (None, torch.bfloat16):
        engine, stream, last, _, _ = read(dtype, method, budget=24, reread=reread, measure=False)
        kls[dtype] = token_metrics(full, continuation_logits(engine, stream, last, ids[CONTEXT:]), target)["kl"]
    assert kls[torch.bfloat16] < 0.05
    assert kls[torch.bfloat16] < 3 * kls[None] + 1e-3


def test_a_session_makes_one_copy_and_names_its_precision(monkeypatch):
    from tests.conftest import tiny_session

    session = tiny_session()
    monkeypatch.setattr(options, "native_bfloat16", lambda device: True)
    assert session.probe_precision("auto") == "bfloat16" and session.probe_precision("float32") == "float32"
    assert session.probe_model("float32") is None
    first = session.probe_model("auto")
    assert first is session.probe_model("bfloat16") and next(first.parameters()).dtype == torch.bfloat16
    monkeypatch.setattr(options, "native_bfloat16", lambda device: False)
    assert session.probe_precision("auto") == "float32" and session.probe_model("auto") is None


def test_the_copy_is_made_with_the_model_for_the_reads_that_probe():
    """prepare_session makes the probe copy before the first document is read (a cost of the model, not of that
    read), for the reads that run forwards on it and no others; the engine then uses that copy."""
    from klevict_cli.options import Budget
    from klevict_cli.reading import prepare_session
    from klevict_cli.session import ReadSettings
    from tests.conftest import tiny_session

    def copies(method: str, **settings) -> int:
        session = tiny_session()
        prepare_session(session, ReadSettings(budget=Budget(tokens=32), method=method, probe_dtype="bfloat16",
                                              **settings))
        return len(session.probe_copies)

    assert copies("kl") == 1  # its look-ahead drafts
    assert copies("kvzip") == 1  # a re-reading
    assert copies("streaming", measure_drift=True) == copies("snapkv", max_kl=0.1) == 1  # the drift's samples
    assert copies("streaming") == copies("snapkv", reconstruct=True) == copies("none", measure_drift=True) == 0
    assert copies("streaming", measure_drift=None) == 0  # measured only if the read is long: made then, if at all
    session = tiny_session()
    settings = ReadSettings(budget=Budget(tokens=32), method="kl", probe_dtype="bfloat16", chunk_size=64)
    prepare_session(session, settings)
    made = session.probe_copies[torch.bfloat16]
    engine = session.engine("kl", 32, settings, "original")
    assert engine.probe_model is made


@pytest.mark.parametrize("method, settings", [
    ("kl", {}), ("kvzip", {}), ("snapkv", {}), ("streaming", {"measure_drift": True}), ("snapkv", {"max_kl": 0.05}),
    ("streaming", {"measure_drift": None}), ("snapkv", {"max_bytes": "50%"}),
    ("snapkv", {"max_bytes": "50%", "cache_dtype": "int8"}),
])
def test_the_copy_is_foreseen_exactly_when_a_read_runs_on_it(method, settings):
    """`Session.uses_probe_copy` says beforehand what a read then does: it asks for the probe copy (a 150-token read,
    too short for a default drift estimate) exactly when that was foreseen."""
    from klevict_cli.options import Budget, parse_byte_limit
    from klevict_cli.session import ReadSettings
    from tests.conftest import tiny_session

    session = tiny_session()
    if "max_bytes" in settings:
        settings = {**settings, "max_bytes": parse_byte_limit(settings["max_bytes"])}
    read = ReadSettings(budget=Budget(tokens=24), method=method, probe_dtype="bfloat16", chunk_size=CHUNK, **settings)
    foreseen = session.uses_probe_copy(read)
    session.read_tokens(list(range(3, 150)), read)
    assert bool(session.probe_copies) == foreseen


def test_a_read_that_never_probes_makes_no_copy():
    """The engine asks for its copy only when a probing forward runs: a read that never probes makes none."""
    asked = []
    model = tiny_llama(seed=3)
    engine = Engine(model, adapter_for(model), make_policy("streaming"), 20, chunk_size=CHUNK,
                    probe_model=functools.partial(asked.append, "asked"))
    engine.feed(engine.new_stream(), list(range(3, 150)))
    assert asked == []


@pytest.mark.parametrize("probe_dtype, scored_at", [("bfloat16", torch.bfloat16), ("float32", torch.float32)])
def test_a_session_scores_at_its_probes_precision(monkeypatch, probe_dtype, scored_at):
    """kl's scoring products (the readout through W_O, kl_scores' product) run at the probes' precision; the scores
    themselves stay float32."""
    from klevict_cli.policies import kl as kl_policy
    from klevict_cli.session import ReadSettings
    from tests.conftest import tiny_session

    session = tiny_session()
    seen = []
    scores = kl_policy.kl_scores
    monkeypatch.setattr(kl_policy, "kl_scores", lambda *args, **kwargs: seen.append(
        (args[3].dtype, scores(*args, **kwargs))) or seen[-1][1])
    engine = session.engine("kl", 20, ReadSettings(budget=None, probe_dtype=probe_dtype), "original")
    assert engine.score_dtype == scored_at
    engine.feed(engine.new_stream(), list(range(3, 150)))
    assert seen and all(dtype == scored_at and got.dtype == torch.float32 for dtype, got in seen)
