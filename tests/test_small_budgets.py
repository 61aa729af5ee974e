"""Every policy at budgets of 8 to 64 entries per head — a short note at 10 %, or `--budget 64` on any document: the
cache the engine returns keeps the attention sinks and the recent window, holds the budget, and stays one the model
can use (no value outside the range the model produced, the next tokens' distributions close to the full cache's)."""

from __future__ import annotations

import pytest
import torch

from klevict_cli.adapter_check import adapter_for
from klevict_cli.bench import continuation_logits, token_metrics
from klevict_cli.engine import Engine, sink_count
from klevict_cli.policies import POLICIES, make_policy
from klevict_cli.probes import Reconstruction
from tests.conftest import tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTEXT, CONTINUATION, CHUNK = 200, 16, 64


@pytest.fixture(scope="module")
def setting():
    model = tiny_llama(seed=3)
    adapter = adapter_for(model)
    ids = torch.randint(3, 300, (CONTEXT + CONTINUATION,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = Engine(model, adapter, make_policy("none"), None, chunk_size=CHUNK)
    stream = engine.new_stream()
    last = engine.feed(stream, ids[:CONTEXT])
    largest = [layer.values[layer.valid].abs().max() for layer in stream.cache.layers]
    full = continuation_logits(engine, stream, last, ids[CONTEXT:])
    return model, adapter, ids, full, largest


@pytest.mark.parametrize("budget", [8, 16, 32, 64])
@pytest.mark.parametrize("method", [m for m in POLICIES if m != "none"])
def test_every_policy_keeps_a_usable_cache_at_small_budgets(setting, method, budget):
    model, adapter, ids, full, largest = setting
    policy = make_policy(method)
    source = Reconstruction([1, 2], [3], [4], span=32) if policy.reconstruction == "required" else None
    engine = Engine(model, adapter, policy, budget, chunk_size=CHUNK, reconstruction=source)
    stream = engine.new_stream()
    last = engine.feed(stream, ids[:CONTEXT])
    # the probe window read, or where drafts probe the last choice, only the last token read
    recent = 1 if engine.draft_count(CONTEXT) else engine.recent_window(CONTEXT - (CONTEXT - 1) // CHUNK * CHUNK)
    must = set(range(sink_count(budget))) | set(range(CONTEXT - recent, CONTEXT))
    assert len(must) < budget
    for n, layer in enumerate(stream.cache.layers):
        for h in range(layer.keys.shape[0]):
            assert must <= set(layer.positions[h][layer.valid[h]].tolist()), (method, n, h)
        assert layer.values[layer.valid].abs().max() <= 1.5 * largest[n]
    assert engine.held_per_head(stream) <= budget
    kl = token_metrics(full, continuation_logits(engine, stream, last, ids[CONTEXT:]), torch.tensor(ids[CONTEXT:]))
    assert kl["kl"] < 0.05
