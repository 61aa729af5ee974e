"""Exactness of the chunked engine: full budget == one forward; eviction == masking; compact == re-rotation."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from klevict_cli.adapter_check import adapter_for
from klevict_cli.engine import PROBE_ROOM, Engine, plan_positions
from klevict_cli.probes import Drafts
from klevict_cli.sampling import sample_rows
from klevict_cli.errors import ResourceError
from klevict_cli.policies import make_policy
from klevict_cli.policies.kl import KL
from tests.conftest import tiny_llama
from tests.reference import causal_masks, reference_logits


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=1)


def test_reference_attention_matches_the_model(model):
    ids = torch.randint(0, 300, (40,)).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(reference_logits(model, ids, causal_masks(model, 40)), expected, atol=1e-4)


@pytest.mark.parametrize("chunk_size", [1, 7, 32, 500])
def test_full_budget_chunked_prefill_equals_one_forward(model, chunk_size):
    torch.manual_seed(0)
    document = torch.randint(0, 300, (90,)).tolist()
    question = torch.randint(0, 300, (9,)).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([document + question])).logits[0, -1]
    engine = Engine(model, adapter_for(model), make_policy("snapkv"), budget=None, chunk_size=chunk_size)
    stream = engine.new_stream()
    engine.feed(stream, document)
    got = engine.feed(stream, question, evict=False)
    assert (got - expected).abs().max().item() <= 1e-4
    assert stream.next_position == 99


@pytest.mark.parametrize("method", ["snapkv", "streaming", "kl"])
@pytest.mark.parametrize("chunk_size", [16, 25])
def test_eviction_equals_masking_the_evicted_entries(model, method, chunk_size):
    """Every token must see exactly the entries that were kept when it was read, at their original positions. (kl's
    refit of the kept values changes the values only, and is tested on its own in tests/test_refit.py.)"""
    torch.manual_seed(1)
    ids = torch.randint(0, 300, (100,)).tolist()
    budget = 24
    policy = KL(refit="never") if method == "kl" else make_policy(method)
    engine = Engine(model, adapter_for(model), policy, budget=budget, chunk_size=chunk_size,
                    probe_window=8)
    stream = engine.new_stream()
    n = len(ids) + 1
    masks = causal_masks(model, n)
    kept_before: list[set[int]] | None = None
    for start in range(0, len(ids), chunk_size):
        chunk = ids[start : start + chunk_size]
        if kept_before is not None:  # queries of this chunk see only what survived the previous eviction
            for layer_idx, layer in enumerate(stream.cache.layers):
                for h in range(layer.keys.shape[0]):
                    survivors = layer.positions[h][layer.valid[h]]
                    row = torch.zeros(n, dtype=torch.bool)
                    row[survivors] = True
                    masks[layer_idx][h, start:, :start] = row[:start]
        engine.feed(stream, chunk)
        kept_before = True
    held = sum(int(layer.valid.sum()) for layer in stream.cache.layers)
    assert held <= budget * sum(layer.keys.shape[0] for layer in stream.cache.layers)
    for layer_idx, layer in enumerate(stream.cache.layers):  # the next token sees the final cache
        for h in range(layer.keys.shape[0]):
            row = torch.zeros(n, dtype=torch.bool)
            row[layer.positions[h][layer.valid[h]]] = True
            row[-1] = True
            masks[layer_idx][h, -1] = row
    next_token = 5
    got = engine.feed(stream, [next_token], evict=False)
    expected = reference_logits(model, ids + [next_token], masks)
    assert (got - expected).abs().max().item() <= 1e-4


def test_cache_never_exceeds_budget_plus_chunk(model):
    ids = torch.randint(0, 300, (300,)).tolist()
    engine = Engine(model, adapter_for(model), make_policy("snapkv"), budget=40, chunk_size=32)
    stream = engine.new_stream()
    for start in range(0, 300, 32):
        engine.feed(stream, ids[start : start + 32])
        assert max(stream.cache.capacities()) <= 40
    assert all(all(c == 40 for c in counts) for counts in stream.cache.kept_counts())


def test_rerotated_key_equals_the_key_computed_at_the_new_position(model):
    adapter = adapter_for(model)
    rotary = model.model.rotary_emb
    torch.manual_seed(2)
    raw = torch.randn(1, 2, 5, 16)  # (batch, kv heads, tokens, head_dim)

    def rotate(positions):
        cos, sin = rotary(raw, position_ids=torch.tensor([positions]))
        return apply_rotary_pos_emb(raw, raw, cos, sin)[1][0]

    old, new = [900, 1000, 1200, 1500, 1999], [3, 4, 5, 6, 7]
    delta = torch.tensor(new) - torch.tensor(old)
    moved = adapter.rerotate(rotate(old), delta.expand(2, 5), 0)
    assert torch.allclose(moved, rotate(new), atol=1e-4)


def test_compact_mode_rerotates_kept_keys_to_consecutive_positions(model):
    torch.manual_seed(3)
    ids = torch.randint(0, 300, (60,)).tolist()
    streams = {}
    for mode in ("original", "compact"):
        engine = Engine(model, adapter_for(model), make_policy("snapkv"), budget=20, chunk_size=45, mode=mode,
                        probe_window=8)
        stream = engine.new_stream()
        engine.feed(stream, ids[:15])
        engine.feed(stream, ids[15:])  # first eviction happens here: both modes share the same history
        streams[mode] = (engine, stream)
    original, compact = streams["original"][1], streams["compact"][1]
    assert compact.next_rope == 20 and original.next_rope == 60 and compact.next_position == 60
    adapter = adapter_for(model)
    for idx, (lo, lc) in enumerate(zip(original.cache.layers, compact.cache.layers)):
        assert torch.equal(lo.positions, lc.positions)
        assert torch.equal(lc.rope_positions, torch.arange(20).expand_as(lc.rope_positions))
        expected = adapter.rerotate(lo.keys, lc.rope_positions - lo.rope_positions, idx)
        assert torch.allclose(lc.keys, expected, atol=1e-5)
        assert torch.equal(lc.values, lo.values)


def test_compact_mode_keeps_positions_bounded_on_a_document_longer_than_the_context():
    model = tiny_llama(seed=4, max_position_embeddings=128)
    ids = torch.randint(0, 300, (600,)).tolist()
    plan = plan_positions(len(ids), 48, chunk_size=32, reserve=32, max_positions=128)
    assert plan.mode == "compact"
    engine = Engine(model, adapter_for(model), make_policy("streaming"), budget=plan.budget, chunk_size=32,
                    mode=plan.mode)
    stream = engine.new_stream()
    logits = engine.feed(stream, ids)
    assert torch.isfinite(logits).all()
    assert stream.next_rope <= 48 and stream.next_position == 600
    assert max(int(layer.rope_positions.max()) for layer in stream.cache.layers) < 48


def test_compact_positions_evict_before_a_chunk_would_pass_the_models_last_position():
    """The working limit counts the mean entries per head; positions run with the head that keeps most (after
    compaction the next token sits past the longest head). A read whose longest head leaves no room for the next
    chunk and its probes evicts now, whatever the mean; in original positions the mean alone decides."""
    model = tiny_llama(seed=6, max_position_embeddings=256)
    ids = torch.randint(0, 300, (30,)).tolist()
    for mode in ("compact", "original"):
        engine = Engine(model, adapter_for(model), make_policy("streaming"), budget=40, chunk_size=16, mode=mode)
        stream = engine.new_stream()
        engine.feed(stream, ids)  # 30 held: under the budget and the working limit
        stream.next_rope = 256 - 16 - 16 - PROBE_ROOM  # as if one head had kept far more than the others
        assert not engine._must_evict(stream, 16, 16)
        stream.next_rope += 1
        assert engine._must_evict(stream, 16, 16) == (mode == "compact")


def test_a_compact_read_measures_its_drift():
    """The final eviction of a read in compact positions has room for the drift's continuation (PROBE_ROOM)."""
    plan = plan_positions(500, 60, chunk_size=16, reserve=32, max_positions=256)
    model = tiny_llama(seed=6, max_position_embeddings=256)
    ids = torch.randint(0, 300, (500,)).tolist()
    engine = Engine(model, adapter_for(model), make_policy("kl"), budget=plan.budget, chunk_size=16, probe_window=8,
                    mode=plan.mode, head_cap=plan.head_cap, measure_drift=True)
    stream = engine.new_stream()
    engine.feed(stream, ids)
    assert plan.mode == "compact" and stream.drift is not None and stream.next_rope <= plan.head_cap


def test_plan_positions_caps_the_budget_and_refuses_what_cannot_fit():
    plan = plan_positions(10_000, 5000, chunk_size=512, reserve=512, max_positions=2048)
    assert plan.mode == "compact" and plan.budget == 2048 - 512 - PROBE_ROOM and plan.notes
    assert plan_positions(1000, 100, 512, 512, 2048).mode == "original"
    with pytest.raises(ResourceError):
        plan_positions(10_000, None, 512, 512, 2048)
    with pytest.raises(ResourceError):
        plan_positions(10_000, 100, 512, 512, 2048, mode="original")


def test_generation_is_deterministic_given_a_seed(model):
    ids = torch.randint(0, 300, (50,)).tolist()

    def run(seed):
        engine = Engine(model, adapter_for(model), make_policy("snapkv"), budget=20, chunk_size=16, seed=seed)
        stream = engine.new_stream()
        engine.feed(stream, ids)
        return list(engine.generate(stream, [1, 2], 12, set(), temperature=1.0, top_p=0.9))

    assert run(7) == run(7)
    assert len(run(7)) == 12 and run(8) != run(7)  # and the seed is what decides


def test_a_banned_span_is_one_the_answer_already_wrote():
    from klevict_cli.sampling import SpanBan

    def banned(answer, span, vocab=6):
        ban = SpanBan(span)
        for i in range(1, len(answer) + 1):
            ban.add(answer[:i])  # as generate records each token it writes
        return ban.apply(torch.zeros(vocab), answer)

    # the last two tokens (3, 4) were followed by 5 and by 1 before: a span of 3 may not repeat either
    out = banned([3, 4, 5, 2, 3, 4, 1, 3, 4], 3)
    assert torch.isinf(out[[1, 5]]).all() and torch.isfinite(out[[0, 2, 3, 4]]).all()
    assert torch.isfinite(banned([3, 4, 5, 3, 4], 0)).all()  # 0: off
    assert torch.isfinite(banned([3, 4, 5, 3, 4], 4)).all()  # (4, 5) then (3, 4): no 4-run yet
    assert torch.isinf(banned([3, 4, 5, 3, 4], 3)[5])  # (3, 4) was followed by 5
    assert torch.isfinite(banned([0, 1, 0, 0, 1, 1, 0], 2, vocab=2)).all()  # 0 was followed by both: bans none


def test_a_greedy_answer_never_writes_a_span_twice(model):
    """A tiny random model decoding greedily loops at once; with the ban, no run of 4 tokens repeats."""
    ids = torch.randint(0, 300, (50,)).tolist()

    def answer(no_repeat):
        engine = Engine(model, adapter_for(model), make_policy("snapkv"), budget=20, chunk_size=16)
        stream = engine.new_stream()
        engine.feed(stream, ids)
        return list(engine.generate(stream, [1, 2], 60, set(), no_repeat=no_repeat))

    def spans(tokens):
        return [tuple(tokens[i : i + 4]) for i in range(len(tokens) - 3)]

    looping, banned = spans(answer(0)), spans(answer(4))
    assert len(set(looping)) < len(looping)  # the loop the ban is for
    assert len(banned) == 57 and len(set(banned)) == len(banned)


def test_past_then_chunk_attention_equals_one_masked_call():
    from klevict_cli.attention import _attend_past_then_chunk

    gen = torch.Generator().manual_seed(0)  # a CPU-only kernel: its inputs stay on the CPU under KLEVICT_TEST_DEVICE
    hq, hk, t, past, d = 6, 3, 9, 20, 8
    q, k, v = (torch.randn(1, h, n, d, generator=gen, device="cpu")
               for h, n in ((hq, t), (hk, past + t), (hk, past + t)))
    valid = torch.rand(hk, past, generator=gen, device="cpu") > 0.4
    valid[1] = False  # a head whose whole past was evicted (padding only)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    causal = torch.ones(t, t, dtype=torch.bool, device="cpu").tril()
    mask = torch.cat((valid.repeat_interleave(2, dim=0)[:, None].expand(-1, t, -1), causal.expand(hq, -1, -1)), -1)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[None], scale=0.3)
    actual, lse = _attend_past_then_chunk(q, k, v, valid, groups=2, scaling=0.3)
    assert torch.allclose(actual, expected, atol=1e-6)
    logits = (q @ k.transpose(2, 3) * 0.3).masked_fill(~mask[None], float("-inf"))
    assert torch.allclose(lse, logits.logsumexp(dim=-1), atol=1e-5)  # each row's normaliser, for probe_entries


def test_repetition_penalty_lowers_only_the_answers_recent_tokens():
    from klevict_cli.sampling import penalise_repeats

    logits = torch.tensor([2.0, -1.0, 3.0, 0.5])
    out = penalise_repeats(logits, [0, 1, 0], 2.0)
    assert out.tolist() == [1.0, -2.0, 3.0, 0.5]
    assert penalise_repeats(logits, [0], 1.0) is logits and torch.equal(logits, torch.tensor([2.0, -1.0, 3.0, 0.5]))
    assert penalise_repeats(logits, [2] + [1] * 64, 2.0)[2] == 3.0  # outside the 64-token window


@pytest.mark.parametrize("tokens", [1, 16])  # one token: the masked grouped path; a chunk: past-then-chunk
def test_probe_weights_are_the_attention_that_produced_the_probe_outputs(model, tokens):
    """Each query head's recorded weights over the cache, applied to its KV head's values, give its output."""
    torch.manual_seed(3)
    engine = Engine(model, adapter_for(model), make_policy("snapkv"), budget=None, chunk_size=32)
    stream = engine.new_stream()
    engine.feed(stream, torch.randint(0, 300, (40,)).tolist())
    _, ctx = engine.forward(stream, torch.randint(0, 300, (tokens,)).tolist(), probe_rows=tokens)
    for i, probe in ctx.probes.items():
        layer = stream.cache.layers[i]
        groups = probe.weights.shape[0] // layer.values.shape[0]
        values = layer.values.repeat_interleave(groups, dim=0)  # (Hq, C, Dv)
        assert torch.allclose(probe.weights @ values, probe.output, atol=1e-5)
        assert torch.allclose(probe.weights.sum(-1), torch.ones(()), atol=1e-5)


class ProbeSpy(KL):
    """`kl`, remembering the probe positions of every eviction."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen: list[torch.Tensor] = []

    def score_layers(self, step, layer_ids):
        self.seen.append(step.probe_positions.clone())
        return super().score_layers(step, layer_ids)


def test_look_ahead_probes_the_last_eviction_with_drafts_and_forgets_them(model):
    torch.manual_seed(5)
    ids = torch.randint(0, 300, (96,)).tolist()
    policy = ProbeSpy(lookahead=6)
    engine = Engine(model, adapter_for(model), policy, budget=24, chunk_size=32, probe_window=8, working=0)
    stream = engine.new_stream()
    engine.feed(stream, ids)
    *earlier, last = policy.seen
    assert [p.tolist() for p in earlier] == [list(range(s - 8, s)) for s in (32, 64)]  # each chunk's last tokens
    assert torch.equal(last, torch.arange(96, 102))  # the last eviction: six tokens sampled past the end
    assert stream.tokens == ids and stream.next_rope == 96
    for layer in stream.cache.layers:
        for h in range(layer.keys.shape[0]):
            kept = set(layer.positions[h][layer.valid[h]].tolist())
            # no draft left; the drafts judged the last tokens read, so only the sinks and the last one are sure
            assert max(kept) < 96 and {0, 1, 2, 3, 95} <= kept
    assert engine.held_per_head(stream) == 24


@pytest.mark.parametrize("last_chunk, from_read, forwards", [(32, True, 2), (4, True, 3), (32, False, 3)])
def test_drafts_from_the_read_skip_one_round_where_the_last_chunk_predicted_enough(model, last_chunk, from_read,
                                                                                   forwards):
    """`drafts_from_read` (the default): the read's own predictions of its last tokens stand in for the first Jacobi
    round, so two rounds cost two drafted forwards, not three (the last chunk asks for that many logits rows); a last
    chunk shorter than the drafts, or drafts not from the read, take the full rounds. The drafts are forgotten."""
    torch.manual_seed(5)
    ids = torch.randint(0, 300, (64 + last_chunk,)).tolist()
    policy = KL(lookahead=6)
    policy.drafts_from_read = from_read
    policy.draft_rounds = lambda reread, read, count: 2
    engine = Engine(model, adapter_for(model), policy, budget=24, chunk_size=32, probe_window=8, working=0)
    calls = []
    forward = engine.forward
    engine.forward = lambda stream, chunk, **kw: calls.append((len(chunk), kw.get("logits_rows"))) or forward(
        stream, chunk, **kw)
    stream = engine.new_stream()
    engine.feed(stream, ids)
    # the read's last chunk: the drafts' rows of logits where they start from them, else the last token's only
    assert calls[2] == (last_chunk, 6 if forwards == 2 else 1)
    assert [n for n, _ in calls[3:]] == [6] * forwards
    assert stream.tokens == ids and engine.held_per_head(stream) == 24


def test_a_look_ahead_that_evicts_nothing_leaves_the_full_cache_model(model):
    """Drafted tokens must leave no trace: with room for everything, the next logits are the full model's."""
    torch.manual_seed(6)
    ids = torch.randint(0, 300, (70,)).tolist()
    question = torch.randint(0, 300, (5,)).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids + question])).logits[0, -1]
    engine = Engine(model, adapter_for(model), KL(lookahead=8), budget=None, chunk_size=32, probe_window=8)
    stream = engine.new_stream()
    logits = engine.feed(stream, ids)
    engine.budget = 70  # room for every entry: the eviction runs, drafts and all, and keeps everything
    drafts = Drafts(8).requests(stream.tokens, logits, engine.room(stream), engine.generator)
    engine.evict_with(stream, engine.probe_sets(stream, drafts), recent=8, final=True)
    assert stream.tokens == ids and stream.next_rope == 70
    got = engine.feed(stream, question, evict=False)
    assert (got - expected).abs().max().item() <= 1e-4


def test_forgetting_drafts_just_read_restores_the_ragged_cache_exactly(model):
    """Drafts just read are cut off the end of every layer (Engine.forget_drafts): the cache, tokens and positions
    are then exactly what they were, padding and all, and reading the same drafts again gives the same logits."""
    torch.manual_seed(8)
    engine = Engine(model, adapter_for(model), KL(lookahead=0), budget=20, chunk_size=24, probe_window=8)
    stream = engine.new_stream()
    engine.feed(stream, torch.randint(0, 300, (70,)).tolist())
    assert any(not bool(layer.valid.all()) for layer in stream.cache.layers)  # ragged: some heads padded
    fields = ("keys", "values", "positions", "rope_positions", "valid")
    before = [[getattr(layer, f).clone() for f in fields] for layer in stream.cache.layers]
    tokens, rope = list(stream.tokens), stream.next_rope
    drafts = torch.randint(0, 300, (6,)).tolist()
    first, _ = engine.forward(stream, drafts, logits_rows=6)
    engine.forget_drafts(stream, 6)
    assert stream.tokens == tokens and stream.next_rope == rope
    for layer, saved in zip(stream.cache.layers, before):
        assert all(torch.equal(getattr(layer, f), old) for f, old in zip(fields, saved))
    again, _ = engine.forward(stream, drafts, logits_rows=6)
    assert torch.equal(first, again)


def test_sample_rows_draws_each_row_from_its_softmax():
    """Masked tokens (-inf, e.g. the first or last of the vocabulary) are never drawn; the rest at their softmax."""
    inf = float("-inf")
    logits = torch.tensor([[inf, 0.0, 1.0, 2.0], [2.0, 0.0, -1.0, inf]]).repeat(50_000, 1)
    drawn = torch.tensor(sample_rows(logits, torch.Generator().manual_seed(0))).view(50_000, 2)
    for row in range(2):
        frequencies = torch.bincount(drawn[:, row], minlength=4) / 50_000
        assert torch.allclose(frequencies, logits[row].softmax(dim=-1), atol=0.01)  # ~5 standard errors
    assert (drawn[:, 0] != 0).all() and (drawn[:, 1] != 3).all()


@pytest.mark.parametrize("mode", ["original", "compact"])
def test_look_ahead_is_deterministic_given_a_seed(model, mode):
    ids = torch.randint(0, 300, (90,)).tolist()

    def kept(seed):
        engine = Engine(model, adapter_for(model), KL(lookahead=8), budget=20, chunk_size=40, probe_window=8,
                        mode=mode, seed=seed)
        stream = engine.new_stream()
        engine.feed(stream, ids)
        longest = max(max(counts) for counts in stream.cache.kept_counts())  # compact: the fullest head's length
        assert stream.next_rope == (90 if mode == "original" else longest) and stream.tokens == ids
        return [layer.positions.tolist() for layer in stream.cache.layers]

    assert kept(3) == kept(3) and kept(4) != kept(3)  # the drafts are sampled from the seed


def test_the_cache_goes_in_under_the_name_the_forward_declares():
    """transformers 5.24 renamed `past_key_values` to `cache`; under the wrong name a model silently builds its own."""
    from klevict_cli.adapters import run_with_cache

    class Before524(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=False, **kwargs):
            return past_key_values if use_cache and not kwargs else None

    class Since524(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=False, **kwargs):
            return cache if use_cache and not kwargs else None

    ours = object()
    assert run_with_cache(Before524(), ours, input_ids=[1]) is ours
    assert run_with_cache(Since524(), ours, input_ids=[1]) is ours
