"""The baseline eviction policies: each keeps exactly its budget in the engine, and hand-made caches whose answer is
known prove each rule (streaming, tova, h2o, knorm, keydiff, value, caote, random, pyramidkv)."""

from __future__ import annotations

import pytest
import torch

from klevict_kernels.attention_rules import pyramid_budgets
from klevict_kernels.output_rules import output_change, projected_value_norm
from klevict_cli.adapter_check import adapter_for
from klevict_cli.attention import LayerProbe
from klevict_cli.cache import KVCache, LayerCache
from klevict_cli.engine import Engine
from klevict_cli.policies import POLICIES, EvictionStep, make_policy, select_keep
from tests.conftest import tiny_llama

BASELINES = ["streaming", "snapkv", "pyramidkv", "h2o", "tova", "value", "caote", "keydiff", "knorm", "random"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3)


# ---- hand-made caches ------------------------------------------------------------------------------------------
def layer_of(keys: torch.Tensor, values: torch.Tensor | None = None) -> LayerCache:
    h, c, _ = keys.shape
    positions = torch.arange(c).expand(h, c).clone()
    values = values if values is not None else torch.zeros_like(keys)
    return LayerCache(keys, values, positions, positions.clone(), torch.ones(h, c, dtype=torch.bool))


def step_of(layer: LayerCache, weights=None, output=None, adapter=None, generator=None) -> EvictionStep:
    probes = {}
    if weights is not None:
        hq, w, _ = weights.shape
        output = output if output is not None else torch.zeros(hq, w, layer.values.shape[-1])
        probes[0] = LayerProbe(query=torch.zeros(hq, w, layer.keys.shape[-1]), weights=weights, output=output)
    w = weights.shape[1] if weights is not None else 1
    return EvictionStep(cache=KVCache([layer]), adapter=adapter, probes=probes,
                        probe_positions=torch.arange(layer.capacity - w, layer.capacity), generator=generator)


def kept(policy_name: str, layer: LayerCache, budget: int, **step) -> list[list[int]]:
    """Positions each head keeps (no protected entries, so only the rule decides)."""
    scores = make_policy(policy_name).score(step_of(layer, **step), 0)
    mask = select_keep(layer, scores, budget, torch.zeros_like(layer.valid))
    return [sorted(layer.positions[h][mask[h]].tolist()) for h in range(mask.shape[0])]


class OProj:
    """A stand-in adapter exposing only the output projection."""

    def __init__(self, weight: torch.Tensor):
        self.proj = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        self.proj.weight.data = weight

    def output_projection(self, layer_idx: int):
        return self.proj


def test_every_baseline_is_registered():
    assert set(BASELINES) <= set(POLICIES)
    for name in BASELINES:
        assert make_policy(name).name == name
        if name != "snapkv":  # documented by its module
            assert POLICIES[name].__doc__.strip().startswith(f"`{name}`")


def test_streaming_keeps_the_sinks_and_the_most_recent():
    layer = layer_of(torch.randn(2, 20, 4))
    assert kept("streaming", layer, 8) == [[0, 1, 2, 3, 16, 17, 18, 19]] * 2


def test_tova_keeps_the_top_attention_of_the_last_query_only():
    weights = torch.full((2, 3, 6), 0.01)  # 2 query heads sharing one KV head, 3 probe rows, 6 entries
    weights[:, :2, 0] = 0.9  # earlier rows love entry 0: TOVA must ignore them
    weights[0, 2, 4] = 0.6
    weights[1, 2, 1] = 0.5
    weights[1, 2, 2] = 0.3
    weights[0, 2, 2] = 0.25  # group sum: entry 4 = 0.61, entry 2 = 0.56, entry 1 = 0.51
    layer = layer_of(torch.randn(1, 6, 4))
    assert kept("tova", layer, 2, weights=weights) == [[2, 4]]


def test_h2o_accumulates_attention_across_evictions_and_the_sum_travels_with_the_entries():
    layer = layer_of(torch.randn(1, 4, 4))
    policy = make_policy("h2o")
    first = torch.tensor([[[0.4, 0.3, 0.1, 0.2]]])
    s1 = policy.score(step_of(layer, weights=first), 0)
    assert torch.allclose(s1, first[0])
    layer.keep(torch.tensor([[True, True, False, True]]))  # positions 0, 1, 3 survive, carrying 0.4, 0.3, 0.2
    layer.append(torch.randn(1, 2, 4), torch.zeros(1, 2, 4), torch.tensor([[4, 5]]), torch.tensor([[4, 5]]))
    assert layer.extras["h2o_attention"][0].tolist() == pytest.approx([0.4, 0.3, 0.2, 0.0, 0.0])
    second = torch.tensor([[[0.02, 0.05, 0.05, 0.5, 0.38]]])  # over positions 0, 1, 3, 4, 5
    s2 = policy.score(step_of(layer, weights=second), 0)
    assert s2[0].tolist() == pytest.approx([0.42, 0.35, 0.25, 0.5, 0.38])
    mask = select_keep(layer, s2, 3, torch.zeros_like(layer.valid))
    assert layer.positions[mask].tolist() == [0, 4, 5]  # the old heavy hitter beats recent-but-light entries


def test_knorm_keeps_the_lowest_norm_keys():
    scale = torch.tensor([3.0, 0.5, 2.0, 0.1, 1.0, 4.0])
    keys = torch.randn(1, 6, 8)
    keys = keys / keys.norm(dim=-1, keepdim=True) * scale[None, :, None]
    assert kept("knorm", layer_of(keys), 3) == [[1, 3, 4]]


def test_keydiff_drops_the_keys_most_similar_to_the_mean():
    e = torch.eye(4)
    keys = torch.stack([e[0], 1.1 * e[0], e[1], 0.9 * e[0], e[2], e[0] + 0.01 * e[3]])[None]
    # mean ≈ e0-heavy: the e0-like keys (0, 1, 3, 5) are redundant, the outliers (2, 4) are kept
    assert kept("keydiff", layer_of(keys), 2) == [[2, 4]]


def test_keydiff_ignores_padding_when_taking_the_mean():
    e = torch.eye(3)
    layer = layer_of(torch.stack([e[0], e[0], e[1], e[2]])[None])
    layer.valid[0, 2] = False
    layer.keys[0, 2] = 0  # what padding looks like after a re-pack
    score = make_policy("keydiff").score(step_of(layer), 0)
    mean = (2 * e[0] + e[2]) / 3
    expected = -torch.nn.functional.cosine_similarity(layer.keys[0], mean[None].expand(4, 3), dim=-1)
    assert torch.allclose(score[0][layer.valid[0]], expected[layer.valid[0]], atol=1e-6)


def test_value_norm_through_the_output_projection_matches_a_loop():
    torch.manual_seed(0)
    hq, hkv, c, dv, d = 4, 2, 5, 3, 7
    values = torch.randn(hkv, c, dv)
    o_weight = torch.randn(d, hq * dv)
    got = projected_value_norm(values, o_weight, hq)
    for h in range(hq):
        w_h = o_weight[:, h * dv : (h + 1) * dv].double()
        for j in range(c):
            assert got[h, j].item() == pytest.approx((w_h @ values[h // 2, j].double()).norm().item(), rel=1e-5)


def test_value_keeps_attention_times_projected_value_norm_summed_over_the_group():
    torch.manual_seed(1)
    hq, c, dv = 2, 5, 4
    values = torch.randn(1, c, dv)
    o_weight = torch.randn(6, hq * dv)
    weights = torch.rand(hq, 3, c).softmax(-1)
    score = make_policy("value").score(step_of(layer_of(torch.randn(1, c, dv), values), weights=weights,
                                                adapter=OProj(o_weight)), 0)
    expected = sum(weights[h].sum(0) * torch.stack([(o_weight[:, h * dv : (h + 1) * dv] @ values[0, j]).norm()
                                                    for j in range(c)]) for h in range(hq))
    assert torch.allclose(score[0], expected, rtol=1e-5)
    # equal attention: the entry whose value moves the residual stream most is kept
    flat = torch.full((hq, 1, c), 1.0 / c)
    s = make_policy("value").score(step_of(layer_of(torch.randn(1, c, dv), values), weights=flat,
                                            adapter=OProj(o_weight)), 0)
    norms = sum(projected_value_norm(values, o_weight, hq))
    assert int(s[0].argmax()) == int(norms.argmax())


def test_caote_equals_the_leave_one_out_change_of_the_head_output():
    torch.manual_seed(2)
    hq, hkv, w, c, dv = 4, 2, 3, 6, 5
    logits = torch.randn(hq, w, c, dtype=torch.float64) * 2
    values = torch.randn(hkv, c, dv, dtype=torch.float64)
    a = logits.softmax(-1)
    v = values.repeat_interleave(hq // hkv, dim=0)
    o = a @ v
    direct = torch.zeros(hq, c, dtype=torch.float64)
    for j in range(c):  # remove entry j from the softmax and recompute the head outputs
        keep = torch.ones(c, dtype=torch.bool)
        keep[j] = False
        o_without = logits[..., keep].softmax(-1) @ v[:, keep]
        direct[:, j] = (o_without - o).norm(dim=-1).sum(dim=1)
    assert torch.allclose(output_change(a, o, values).double(), direct, rtol=1e-4, atol=1e-6)
    score = make_policy("caote").score(step_of(layer_of(torch.randn(hkv, c, dv), values.float()),
                                               weights=a.float(), output=o.float()), 0)
    assert torch.allclose(score.double(), direct.view(hkv, 2, c).sum(1), rtol=1e-4, atol=1e-5)


def test_caote_is_finite_when_one_entry_holds_all_the_attention():
    weights = torch.tensor([[[1.0, 0.0, 0.0]]])
    score = output_change(weights, torch.ones(1, 1, 2), torch.zeros(1, 3, 2))
    assert torch.isfinite(score).all()


def test_random_is_seeded():
    layer = layer_of(torch.randn(2, 30, 4))

    def draw(seed):
        return kept("random", layer, 10, generator=torch.Generator().manual_seed(seed))

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


def test_pyramid_budgets_sum_to_the_total_and_decrease():
    for budget, layers, floor in [(100, 30, 32), (24, 3, 12), (7, 5, 1), (512, 24, 32), (1000, 2, 32)]:
        budgets = pyramid_budgets(budget, layers, floor)
        assert sum(budgets) == budget * layers
        assert all(b >= floor for b in budgets)
        assert budgets == sorted(budgets, reverse=True)
    budgets = pyramid_budgets(400, 10, 32)
    assert budgets[0] > 400 > budgets[-1] and budgets[-1] == 32
    assert pyramid_budgets(50, 1, 32) == [50]


# ---- in the engine ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", BASELINES)
def test_each_baseline_keeps_exactly_its_budget(model, method):
    torch.manual_seed(4)
    ids = torch.randint(0, 300, (120,)).tolist()
    budget = 24
    engine = Engine(model, adapter_for(model), make_policy(method), budget=budget, chunk_size=16, probe_window=8)
    stream = engine.new_stream()
    logits = engine.feed(stream, ids)
    assert torch.isfinite(logits).all()
    floor = 4 + 8  # the sinks and the probe window
    expected = (engine.policy.layer_budgets(budget, len(stream.cache.layers), floor)
                or [budget] * len(stream.cache.layers))
    assert stream.cache.kept_counts() == [[b] * layer.keys.shape[0] for b, layer in zip(expected, stream.cache.layers)]
    for layer in stream.cache.layers:  # the sinks and the most recent probe window always survive
        assert {0, 1, 2, 3, *range(112, 120)} <= set(layer.positions[0][layer.valid[0]].tolist())
        for extra in layer.extras.values():
            assert extra.shape == layer.valid.shape
    if method == "pyramidkv":
        assert expected[0] > budget > expected[-1] >= floor and sum(expected) == budget * len(expected)


def test_random_policy_runs_repeat_given_the_engine_seed(model):
    ids = torch.randint(0, 300, (80,)).tolist()

    def positions(seed):
        engine = Engine(model, adapter_for(model), make_policy("random"), budget=20, chunk_size=16, seed=seed)
        stream = engine.new_stream()
        engine.feed(stream, ids)
        return [layer.positions.tolist() for layer in stream.cache.layers]

    assert positions(1) == positions(1)
    assert positions(1) != positions(2)


def test_layer_cache_extras_follow_append_keep_truncate_and_clone():
    layer = layer_of(torch.randn(2, 3, 4))
    acc = layer.extra("acc")
    assert acc.shape == (2, 3) and not acc.any()
    layer.extras["acc"] = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    layer.append(torch.randn(2, 2, 4), torch.randn(2, 2, 4), torch.tensor([[3, 4]]), torch.tensor([[3, 4]]))
    assert layer.extras["acc"].tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 0, 0]]
    layer.keep(torch.tensor([[True, False, True, False, True], [False, True, False, False, False]]))
    assert layer.extras["acc"].tolist() == [[1, 3, 0], [5, 0, 0]]
    copy = layer.clone()
    copy.extras["acc"][0, 0] = 99
    assert layer.extras["acc"][0, 0] == 1
    layer.truncate(2)
    assert layer.extras["acc"].shape == (2, 2)
