"""Every read with look-ahead drafts measures how far its last eviction moved the model (`Engine.measure_drift`):
the drafts read again over the chosen cache, their next-token KL against the cache before the choice."""

from __future__ import annotations

import json
import math

import pytest
import torch

from klevict_cli.adapter_check import adapter_for
from klevict_cli.calibrations import DRIFT_CALIBRATION, DriftCalibration
from klevict_cli.engine import DRIFT_CHEAP, DRIFT_LANES, DRIFT_STEPS, Engine, drift_steps
from klevict_cli.policies.kl import KL
from klevict_cli.report import estimated_kl
from tests.conftest import tiny_llama


def read(budget: int | None, seed: int = 3, lookahead: int = 16):
    model = tiny_llama(seed=seed)
    torch.manual_seed(seed)
    ids = torch.randint(0, 300, (120,)).tolist()
    engine = Engine(model, adapter_for(model), KL(lookahead=lookahead), budget=budget, chunk_size=64, probe_window=8,
                    measure_drift=True)
    stream = engine.new_stream()
    engine.feed(stream, ids)
    return engine, stream, ids


def lane_by_lane(engine, stream, drafted):
    """Each lane's tokens read alone, teacher-forced, over the stream's cache (then forgotten): the logits after
    each, in the continuation's step-major order."""
    rows = torch.empty_like(drafted.logits)
    with torch.inference_mode():
        for lane in range(drafted.lanes):
            ids = drafted.tokens[lane :: drafted.lanes]
            rows[lane :: drafted.lanes], _ = engine.forward(stream, ids, logits_rows=len(ids))
            engine.forget_drafts(stream, len(ids))
    return rows


def test_the_drift_is_the_drafts_kl_against_the_cache_before_the_choice(monkeypatch):
    """Recomputed by hand: every lane of the sampled continuation read on its own, over everything read (the read's
    one eviction is its last) and over the chosen cache, gives the logits the lanes side by side gave; the estimate
    is their mean KL carried through the calibration, the sampled tokens are forgotten, and the same seed gives the
    same."""
    seen = []
    measure = Engine.measure_drift
    monkeypatch.setattr(Engine, "measure_drift", lambda self, stream, drafted: seen.append(drafted) or measure(
        self, stream, drafted))
    engine, stream, ids = read(40)
    drafted = seen[0]
    assert stream.tokens == ids and stream.next_rope == len(ids)  # every sampled token forgotten
    assert drafted.lanes == DRIFT_LANES > 1
    assert stream.drift["drafts"] == len(drafted.tokens) == DRIFT_LANES * DRIFT_STEPS
    assert len({tuple(drafted.tokens[lane :: drafted.lanes]) for lane in range(drafted.lanes)}) == drafted.lanes
    full_engine, full, _ = read(None)  # nothing evicted
    torch.testing.assert_close(drafted.logits, lane_by_lane(full_engine, full, drafted), rtol=1e-4, atol=1e-4)
    after = lane_by_lane(engine, stream, drafted)
    p, q = drafted.logits.double().log_softmax(-1), after.double().log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert abs(stream.drift["sampled_kl"] - float(kl.mean())) <= 1e-6 + 1e-4 * float(kl.mean())
    scale, slope = DRIFT_CALIBRATION.points[0][1], DRIFT_CALIBRATION.slope  # a 120-token read: the shortest point's
    assert stream.drift["calibration"] == scale and stream.drift["slope"] == slope
    assert stream.drift["kl"] == pytest.approx(scale * stream.drift["sampled_kl"] ** slope, rel=1e-12)
    lanes = kl.view(-1, drafted.lanes).mean(dim=0)  # the interval is over the lanes' means, carried through the power
    half = 1.96 * float(lanes.std()) / DRIFT_LANES ** 0.5
    sampled = stream.drift["sampled_kl"]
    upper = scale * (sampled + half) ** slope  # the sampled interval's upper end, carried through
    assert stream.drift["kl"] + stream.drift["ci95"] == pytest.approx(upper, rel=1e-3, abs=1e-7)  # float32: ~1e-6
    assert 0 < stream.drift["kl"] and stream.drift["ci95"] > 0
    assert read(40)[1].drift == stream.drift


def test_the_calibration_follows_the_read_length_between_its_measured_points():
    """The scale interpolated in log(length) between the measured points, the nearest beyond them."""
    calibration = DriftCalibration(((512, 0.5), (2048, 0.9)))
    assert calibration.scale(100) == 0.5 and calibration.scale(512) == 0.5
    assert calibration.scale(1024) == pytest.approx(0.7)  # halfway in log(length)
    assert calibration.scale(2048) == pytest.approx(0.9) and calibration.scale(10**6) == 0.9


def test_the_likely_range_is_the_estimate_times_or_divided_by_its_factor_at_the_read_length():
    """Where the KL of the text that follows lands for 80 % of caches: the estimate divided and multiplied by the
    factor measured at the read's length (interpolated in log(length) as the scale is); unknown without one. Both
    models klevict ships with carry one, wider than nothing."""
    from klevict_cli import calibrations

    calibration = DriftCalibration(((256, 0.3),), range80=((256, 2.0), (1024, 3.0)))
    assert calibration.likely(0.01, 100) == pytest.approx((0.005, 0.02))
    assert calibration.likely(0.01, 512) == pytest.approx((0.004, 0.025))  # halfway in log(length)
    assert calibration.likely(0.01, 10**6) == pytest.approx((0.01 / 3, 0.03))
    assert DriftCalibration(((256, 0.3),)).likely(0.01, 512) is None
    gemma = next(json.loads(p.read_text()) for p in calibrations.FOLDER.glob("*.json") if "gemma" in p.name)
    for shipped in (DRIFT_CALIBRATION, calibrations.drift_calibration(gemma)):
        assert shipped.range80 and all(factor > 1 for _, factor in shipped.range80)
        assert {n for n, _ in shipped.range80} == {n for n, _ in shipped.points}  # measured where the scale was


def test_the_estimate_is_a_power_of_the_sampled_kl_and_so_is_its_interval():
    """measured = scale * sampled ** slope: with a slope below 1 a cache that moved the samples ten times as far is
    estimated to have moved less than ten times as far; the estimate plus its interval is the sampled interval's
    upper end carried through the same power (so at slope 1 the interval scales as the estimate does, even where it
    reaches below 0), and a KL a hair below 0 (float32) reads 0."""
    calibration = DriftCalibration(((256, 0.3),), slope=0.8)
    kl, ci = calibration.estimate(0.01, 0.002, 300)
    assert kl == pytest.approx(0.3 * 0.01 ** 0.8)
    assert kl + ci == pytest.approx(0.3 * 0.012 ** 0.8)
    assert calibration.estimate(0.1, 0, 300)[0] / kl == pytest.approx(10 ** 0.8)
    kl, ci = calibration.estimate(0.001, 0.002, 300)
    assert kl + ci == pytest.approx(0.3 * 0.003 ** 0.8)
    assert calibration.estimate(-1e-9, 0, 300) == (0.0, 0.0)
    proportional = DriftCalibration(((256, 0.5),))  # slope 1
    assert proportional.estimate(0.02, 0.004, 300) == pytest.approx((0.01, 0.002))
    assert proportional.estimate(0.01, 0.05, 300) == pytest.approx((0.005, 0.025))


def test_a_tolerance_carried_back_through_the_calibration_is_the_sampled_kl_it_allows():
    """`--max-kl` compares sampled KLs (they move with the summed scores that guide the search): the sampled KL a
    tolerance allows is estimated within it, and a hair more is not."""
    for slope in (0.62, 0.8, 1.0, 1.7):
        calibration = DriftCalibration(((256, 0.3), (1024, 0.5)), slope=slope)
        for tolerance in (1e-3, 0.03, 0.1, 7.0):
            for tokens in (100, 512, 5000):
                sampled = calibration.sampled_within(tolerance, tokens)
                assert calibration.estimate(sampled, 0.0, tokens)[0] <= tolerance
                assert calibration.estimate(sampled * (1 + 1e-9), 0.0, tokens)[0] > tolerance
        assert calibration.sampled_within(0.0, 512) == 0.0  # nothing may move
    assert DriftCalibration(((256, 0.3),), slope=0.5).sampled_within(1e300, 512) == math.inf  # anything may


def test_a_model_that_ships_its_own_drift_calibration_reads_with_it(monkeypatch):
    """A model's shipped drift calibration (calibrations.drift_calibration) replaces the engine's: the same read,
    the same sampled KL, through the model's own scale and slope; a model without one reads with DRIFT_CALIBRATION."""
    from klevict_cli import calibrations
    from klevict_cli.options import Budget
    from klevict_cli.session import ReadSettings
    from tests.conftest import tiny_session

    shipped = {"weights_sha256": "w", "drift_calibration": [[100, 3.0]], "drift_slope": 0.7,
               "drift_range80": [[100, 2.5]]}
    assert calibrations.drift_calibration(shipped) == DriftCalibration(((100, 3.0),), 0.7, ((100, 2.5),))
    assert calibrations.drift_calibration({"drift_calibration": [[512, 2]]}) == DriftCalibration(((512, 2.0),), 1.0)
    assert calibrations.drift_calibration({"ratios": {}}) is None and calibrations.drift_calibration(None) is None
    ids = torch.randint(0, 300, (120,), generator=torch.Generator().manual_seed(3)).tolist()
    settings = ReadSettings(budget=Budget(tokens=30), measure_drift=True, chunk_size=64)
    drifts = []
    for data in (None, shipped):
        monkeypatch.setattr(calibrations, "shipped_file", lambda sha, data=data: data)
        drifts.append(tiny_session().read_tokens(ids, settings, reserve=16).stream.drift)
    assert drifts[0]["calibration"] == DRIFT_CALIBRATION.points[0][1]  # a read shorter than the first point
    assert drifts[0]["slope"] == DRIFT_CALIBRATION.slope
    assert (drifts[1]["calibration"], drifts[1]["slope"]) == (3.0, 0.7)
    assert drifts[1]["sampled_kl"] == drifts[0]["sampled_kl"]
    assert drifts[1]["kl"] == pytest.approx(3.0 * drifts[1]["sampled_kl"] ** 0.7)
    assert drifts[1]["range80"] == pytest.approx([drifts[1]["kl"] / 2.5, drifts[1]["kl"] * 2.5])
    assert drifts[0]["range80"] == pytest.approx(list(DRIFT_CALIBRATION.likely(drifts[0]["kl"], 1)))


def test_after_several_evictions_the_drift_is_measured_against_the_whole_read(monkeypatch):
    """The continuation is sampled over every entry the read produced — what earlier evictions dropped was set
    aside — not only over what was held at the last eviction. With one layer an entry's key and value depend on its
    own token alone, so that cache is exactly the full read's: the sampled tokens' logits equal a full read's."""
    seen = []
    measure = Engine.measure_drift
    monkeypatch.setattr(Engine, "measure_drift", lambda self, stream, drafted: seen.append(drafted) or measure(
        self, stream, drafted))
    model = tiny_llama(seed=3, num_hidden_layers=1)
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = Engine(model, adapter_for(model), KL(lookahead=16), budget=20, chunk_size=32, probe_window=8,
                    measure_drift=True)
    stream = engine.new_stream()
    engine.feed(stream, ids)  # a working limit of 52 per head: evicted after most chunks
    assert stream.drift["covers"] == "read" and stream.evicted is None  # let go once measured
    full_engine = Engine(model, adapter_for(model), KL(), budget=None, chunk_size=32)
    full = full_engine.new_stream()
    full_engine.feed(full, ids)
    torch.testing.assert_close(seen[0].logits, lane_by_lane(full_engine, full, seen[0]), rtol=1e-4, atol=1e-4)
    assert seen[0].evicted_before


def test_where_the_evicted_cannot_be_set_aside_the_drift_says_it_covers_the_last_eviction_only():
    """Kept keys re-rotated (compact positions: the evicted ones could not sit among them), or no bytes to hold
    them (`--max-memory`): the estimate is the last eviction's, and says so."""
    model = tiny_llama(seed=3)
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    covers = {}
    for mode, room in (("original", 1 << 30), ("compact", 1 << 30), ("original", 0)):
        engine = Engine(model, adapter_for(model), KL(lookahead=16), budget=20, chunk_size=32, probe_window=8,
                        measure_drift=True, mode=mode, evicted_bytes=room)
        stream = engine.new_stream()
        engine.feed(stream, ids)
        covers[mode, room] = stream.drift["covers"]
    assert list(covers.values()) == ["read", "last eviction", "last eviction"]


def test_a_tighter_budget_drifts_further_and_keeping_everything_does_not_drift():
    drifts = [read(budget)[1].drift["kl"] for budget in (100, 60, 20)]
    assert drifts[0] < drifts[1] < drifts[2]
    engine, stream, _ = read(None)
    assert stream.drift is None  # nothing evicted: nothing measured


def test_inspect_reads_only_a_sound_estimate():
    good = {"kl": 0.01, "ci95": 0.002, "drafts": 64}
    assert estimated_kl({"estimated_kl": json.dumps(good)}) == good
    for bad in ('{"kl": -1, "ci95": 0, "drafts": 3}', '{"kl": "x"}', "[1]", "not json", '{"kl": NaN, "ci95": 0, "drafts": 1}'):
        assert estimated_kl({"estimated_kl": bad}) is None
    assert estimated_kl({}) is None
    ranged = {**good, "range80": [0.005, 0.02]}
    assert estimated_kl({"estimated_kl": json.dumps(ranged)}) == ranged
    for bad in ([0.02, 0.005], [0.005], [-1, 0.02], "x", [0.005, None]):  # the estimate stands without its range
        assert estimated_kl({"estimated_kl": json.dumps({**good, "range80": bad})}) == good


def test_measuring_drafts_of_its_own_leaves_every_choice_as_it_was():
    """Measuring samples its drafts apart (its own generator, never the drafts that judge the choice) and forgets
    them: with or without it, every method keeps the same entries; without it nothing is claimed."""
    from klevict_cli.policies import make_policy

    model = tiny_llama(seed=4)
    torch.manual_seed(4)
    ids = torch.randint(0, 300, (120,)).tolist()
    for method, lookahead in (("snapkv", 0), ("kl", 0), ("kl", 16)):
        kept = {}
        for measure in (True, False):
            policy = make_policy(method)
            if method == "kl":
                policy.lookahead = lookahead  # 0: the last eviction judged by the last tokens read
            engine = Engine(model, adapter_for(model), policy, budget=30, chunk_size=64, probe_window=8,
                            measure_drift=measure)
            stream = engine.new_stream()
            engine.feed(stream, ids)
            kept[measure] = [layer.positions[layer.valid].tolist() for layer in stream.cache.layers]
            if measure:
                assert stream.drift["drafts"] == DRIFT_LANES * DRIFT_STEPS and stream.drift["kl"] > 0
                assert stream.tokens == ids
            else:
                assert stream.drift is None
        assert kept[True] == kept[False]


def read_within(max_kl: float, budget: int | None = None, reread: bool = False):
    engine, stream = stream_within(max_kl, budget, reread)
    return engine.held_per_head(stream), stream.drift["kl"]


def stream_within(max_kl: float, budget: int | None = None, reread: bool = False, mode: str = "original",
                  calibration: DriftCalibration | None = None):
    from klevict_cli.probes import Reconstruction

    model = tiny_llama(seed=3)
    torch.manual_seed(3)
    ids = torch.randint(0, 300, (160,)).tolist()
    source = Reconstruction([5, 6], [7], [8], span=32, sees="span") if reread else None
    engine = Engine(model, adapter_for(model), KL(lookahead=16), budget=budget, chunk_size=64, probe_window=8,
                    max_kl=max_kl, reconstruction=source, mode=mode, drift_calibration=calibration)
    stream = engine.new_stream()
    engine.feed(stream, ids)
    assert stream.tokens == ids
    return engine, stream


@pytest.mark.parametrize("reread", [False, True])
def test_max_kl_keeps_the_smallest_cache_the_tolerance_allows(reread):
    """The tolerance decides the size: anything goes down to the floor (the sinks, the probe window and one entry),
    nothing goes where even the whole read would drift further (then everything held stays); between, the drift
    measured on the chosen cache is within the tolerance, and a tighter tolerance never keeps less."""
    floor, loose = read_within(1e9, reread=reread)
    assert floor < 20  # of 160 read
    whole, _ = read_within(1e-12, reread=reread)
    assert whole == 160  # nothing read was evicted: no budget, and no smaller cache meets the tolerance
    tolerances = [loose / 2, loose / 8]
    held = [read_within(t, reread=reread) for t in tolerances]
    for (size, drift), tolerance in zip(held, tolerances):
        assert drift <= tolerance and floor < size < whole
    assert held[0][0] <= held[1][0]


@pytest.mark.parametrize("scale", [100.0, 0.01])
def test_max_kl_holds_the_estimate_to_the_tolerance_whatever_the_calibration(monkeypatch, scale):
    """The search compares sampled drifts with the tolerance carried back through the calibration: with one far
    from proportional (estimates 100x or 0.01x the square root of the sampled drift), the cache kept is estimated
    within the tolerance, and a budget at most 10 % smaller (or the floor) was measured and estimated beyond it."""
    measured = {}
    measure = Engine.measure_drift

    def recorded(self, stream, drafted):
        drift = measure(self, stream, drafted)
        measured[self.held_per_head(stream)] = drift["kl"]
        return drift

    calibration = DriftCalibration(((1, scale),), slope=0.5)
    monkeypatch.setattr(Engine, "measure_drift", recorded)
    engine, stream = stream_within(1e9, calibration=calibration)
    floor, loose = engine.held_per_head(stream), stream.drift["kl"]
    for tolerance in (loose / 2, loose / 8):
        measured.clear()
        engine, stream = stream_within(tolerance, calibration=calibration)
        kept = engine.held_per_head(stream)
        assert stream.drift["kl"] <= tolerance and measured[kept] == stream.drift["kl"]
        below = [size for size, kl in measured.items() if size < kept and kl > tolerance]
        assert kept == floor or (below and max(below) >= kept - max(1, kept // 10)), (kept, measured)


def test_max_kl_with_a_budget_never_keeps_more_than_it():
    size, _ = read_within(1e-12, budget=40)
    assert size == 40


@pytest.mark.parametrize("reread", [False, True])
def test_max_kl_keeps_the_drift_it_measured_for_the_budget_it_chose(monkeypatch, reread):
    """Each budget the search tries is measured once, the cache that keeps everything held (drift 0) never, and the
    kept cache's estimate is the measurement of its budget, not a second forward of the same cache."""
    measured = []
    measure = Engine.measure_drift

    def recorded(self, stream, drafted):
        drift = measure(self, stream, drafted)
        measured.append((self.held_per_head(stream), drift["kl"]))
        return drift

    monkeypatch.setattr(Engine, "measure_drift", recorded)
    _, loose = read_within(1e9, reread=reread)
    measured.clear()
    size, drift = read_within(loose / 4, reread=reread)
    sizes = [held for held, _ in measured]
    assert 1 < len(measured) == len(set(sizes)) and 160 not in sizes
    assert (size, drift) in measured and drift <= loose / 4


@pytest.mark.parametrize("reread, mode", [(False, "original"), (True, "original"), (False, "compact")])
def test_max_kl_keeps_the_copy_it_measured_as_evicting_again_would(monkeypatch, reread, mode):
    """The search's copy evicted to the budget it settles on becomes the cache (no second eviction and refit): the
    same entries, keys, values and positions, and the same next logits, as evicting the stream to that budget."""
    _, loose = read_within(1e9, reread=reread)
    kept = stream_within(loose / 4, reread=reread, mode=mode)
    chosen = Engine._budget_within

    def evicting_again(self, *args):
        budget, drift, copy = chosen(self, *args)
        assert copy is not None  # the search measured the budget it settled on
        return budget, drift, None

    monkeypatch.setattr(Engine, "_budget_within", evicting_again)
    again = stream_within(loose / 4, reread=reread, mode=mode)
    assert kept[1].next_rope == again[1].next_rope
    for a, b in zip(kept[1].cache.layers, again[1].cache.layers):
        for name in ("positions", "rope_positions", "keys", "values"):
            torch.testing.assert_close(getattr(a, name)[a.valid], getattr(b, name)[b.valid], rtol=0, atol=0)
    logits = [engine.forward(stream, [11, 12, 13], logits_rows=3)[0] for engine, stream in (kept, again)]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


@pytest.mark.parametrize("method", ["snapkv", "pyramidkv", "streaming", "random"])
def test_max_kl_sizes_any_policys_cache(method):
    """The search's guide is the policy's own scores, whatever they mean: for every policy the cache kept is within
    the tolerance (as measured) and smaller than the read."""
    from klevict_cli.policies import make_policy

    model = tiny_llama(seed=3)
    torch.manual_seed(3)
    ids = torch.randint(0, 300, (160,)).tolist()
    sizes = []
    for tolerance in (1e9, 0.05):
        engine = Engine(model, adapter_for(model), make_policy(method), budget=None, chunk_size=64, probe_window=8,
                        max_kl=tolerance)
        stream = engine.new_stream()
        engine.feed(stream, ids)
        assert stream.drift["kl"] <= tolerance
        sizes.append(engine.held_per_head(stream))
    assert sizes[0] <= sizes[1] < 160


def test_the_estimate_samples_what_the_read_affords():
    """DRIFT_STEPS tokens per lane whenever the estimate is asked for; by default (compress) only from DRIFT_CHEAP
    tokens read, where its cost is small beside the read's."""
    assert [drift_steps(n) for n in (4096, DRIFT_CHEAP, DRIFT_CHEAP - 1, 10)] == [DRIFT_STEPS] * 4
    assert [drift_steps(n, asked=False) for n in (4096, DRIFT_CHEAP, DRIFT_CHEAP - 1, 10)] == [DRIFT_STEPS] * 2 + [0, 0]
