"""Lazy eviction, reconstruction probes and the strongest peers (kvzip, kvgrad, expected_attention,
observed_attention): each rule against a direct computation, and each in the engine."""

from __future__ import annotations

import pytest
import torch

from klevict_kernels.attention_rules import attention_column_sums, input_times_gradient, restricted_max_attention
from klevict_kernels.expected_attention import QueryMoments, expected_attention
from klevict_cli.adapter_check import adapter_for
from klevict_cli.engine import Engine
from klevict_cli.fisher import attention_output_gradient_norms
from klevict_cli.policies import make_policy
from klevict_cli.policies.kl import KL
from klevict_cli.probes import Reconstruction
from tests.conftest import tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FIELDS = ("keys", "values", "positions", "rope_positions", "valid")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3)


def reconstruction(span: int = 16, sees: str = "all") -> Reconstruction:
    return Reconstruction(first=[7, 8, 9], later=[10, 11], suffix=[12], span=span, overlap=3, sees=sees)


class Spy(KL):
    """kl that records the probe positions of each eviction (not of reconstruction sets)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.evictions: list[int] = []
        self.peak = 0.0

    def score_layers(self, step, layer_ids):
        if step.judged is None:
            self.evictions.append(int(step.probe_positions[-1]) + 1)
        return super().score_layers(step, layer_ids)


# ---- lazy eviction ---------------------------------------------------------------------------------------------
def test_a_document_within_the_working_limit_is_compressed_in_one_choice(model):
    ids = torch.randint(0, 300, (120,)).tolist()
    policy = Spy(lookahead=0)
    engine = Engine(model, adapter_for(model), policy, budget=20, chunk_size=16, probe_window=8, working=120)
    stream = engine.new_stream()
    engine.feed(stream, ids)
    assert policy.evictions == [120]  # one eviction, after the last chunk
    assert engine.held_per_head(stream) == 20


@pytest.mark.parametrize("working", [0, 40, 64])
def test_the_cache_never_outgrows_the_working_limit_and_ends_at_the_budget(model, working):
    ids = torch.randint(0, 300, (150,)).tolist()
    engine = Engine(model, adapter_for(model), KL(lookahead=4), budget=20, chunk_size=16, probe_window=8,
                    working=working)
    stream = engine.new_stream()
    held = []
    engine.feed(stream, ids, progress=lambda n: held.append(engine.held_per_head(stream)))
    limit = max(working, 20 + 16)
    assert engine.working == limit
    assert max(held) <= limit - 16  # after each chunk (and its eviction) the next chunk still fits
    assert held[-1] == 20


# ---- reconstruction probes -------------------------------------------------------------------------------------
def test_reconstruction_probes_leave_no_trace_and_judge_each_span_once(model):
    ids = torch.randint(0, 300, (70,)).tolist()
    engine = Engine(model, adapter_for(model), KL(lookahead=0), budget=None, chunk_size=32)
    stream = engine.new_stream()
    engine.feed(stream, ids)
    before = [[getattr(layer, f).clone() for f in FIELDS] for layer in stream.cache.layers]
    source = reconstruction(span=16)
    seen = []
    for probe_set in engine.probe_sets(stream, source.requests(stream.tokens, 0)):
        lo, hi = probe_set.judged
        prompt = [7, 8, 9] if lo == 1 else [10, 11] + ids[lo - 3 : lo]
        assert stream.tokens == ids + prompt + [12] + ids[lo:hi]  # the instruction, then the span re-read
        assert probe_set.rows == hi - lo and probe_set.logits is None  # a re-reading reads no next-token logits
        seen.append((lo, hi))
    assert seen == [(1, 18), (18, 35), (35, 52), (52, 70)]  # 69 tokens in 4 even spans of about 16
    assert stream.tokens == ids and stream.next_rope == 70
    for layer, saved in zip(stream.cache.layers, before):
        assert all(torch.equal(getattr(layer, f), old) for f, old in zip(FIELDS, saved))


class RereadSpy(KL):
    """kl that records the spans each re-reading judged, and the recent window of each eviction."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.spans: list[tuple[int, int]] = []
        self.recent: list[range] = []

    def absorb_reconstruction(self, step, layer_ids):
        self.spans.append(step.judged)
        super().absorb_reconstruction(step, layer_ids)

    def score_layers(self, step, layer_ids):
        self.recent.append(step.recent)
        return super().score_layers(step, layer_ids)


@pytest.mark.parametrize("lookahead", [0, 4])
def test_a_re_reading_skips_the_recent_window_the_eviction_keeps_anyway_until_it_may_go(model, lookahead):
    """Without drafts every eviction keeps its last tokens read whatever the scores: they are not re-read then, but
    by the next eviction's re-reading (they may go then); drafts judge the last tokens too, so those are re-read."""
    ids = torch.randint(0, 300, (150,)).tolist()
    policy = RereadSpy(lookahead=lookahead)
    engine = Engine(model, adapter_for(model), policy, budget=20, chunk_size=32, probe_window=8, working=60,
                    reconstruction=reconstruction(span=16))
    stream = engine.new_stream()
    engine.feed(stream, ids)
    ends = [hi for _, hi in policy.spans]
    starts = [lo for lo, _ in policy.spans]
    assert starts[0] == 1 and all(a == b for a, b in zip(ends, starts[1:]))  # every position once, in order
    kept = [window for window in policy.recent if len(window)]
    assert len(kept) >= 3 and all(len(window) == 8 for window in kept[:-1])
    assert all(window.start in ends for window in kept[:-1])  # re-read up to each eviction's recent window
    if lookahead:  # the drafts judge the last choice (it keeps the last token only): the whole document is re-read
        assert kept[-1] == range(149, 150) and ends[-1] == 150
    else:
        assert kept[-1] == range(142, 150) and ends[-1] == 142
    assert stream.tokens == ids


@pytest.mark.parametrize("split", [True, False])  # the CPU's past-then-chunk attention, and the masked one
def test_a_span_re_read_where_the_positions_run_out_sits_after_it_and_sees_what_it_would_at_the_end(split,
                                                                                                    monkeypatch):
    """A document read close to the model's last position leaves no room for a re-reading after it; a span's
    re-reading sees only the sinks, the span and itself, so it sits as late as the positions allow (Engine.place):
    its logits there are the model's own over exactly those cached entries (a plain transformers cache holding
    them) at those positions; a span it would precede is not re-read, nor is a re-reading of the whole cache; the
    stream is as it was afterwards."""
    from transformers import DynamicCache

    from klevict_cli import attention
    from klevict_cli.adapters import run_with_cache
    from klevict_cli.probes import SINKS, ProbeRequest

    if not split:
        monkeypatch.setattr(attention, "_can_split", lambda *args: False)
    model, reference = (tiny_llama(seed=5, max_position_embeddings=96) for _ in range(2))
    reference.set_attn_implementation("eager")
    ids = torch.randint(0, 300, (80,)).tolist()
    engine = Engine(model, adapter_for(model), KL(lookahead=0), budget=None, chunk_size=32)
    stream = engine.new_stream()
    engine.feed(stream, ids)
    source = Reconstruction(first=[7, 8, 9], later=[10, 11], suffix=[12], span=16, overlap=3, sees="span")
    request = next(source.requests(stream.tokens, 20))  # the span [20, 35), behind its 6-token prompt and suffix
    (lo, hi), n = request.judged, len(request.ids)
    start = engine.place(stream, request)
    assert start == 96 - n < stream.next_rope and start > hi
    at_the_edge = ProbeRequest(request.ids + [5] * (start - hi), attends=request.attends)
    assert engine.place(stream, at_the_edge) == hi  # right after the last entry it sees
    assert engine.place(stream, ProbeRequest(at_the_edge.ids + [5], attends=request.attends)) is None
    seen = torch.tensor(list(range(SINKS)) + list(range(lo, hi)))
    with torch.inference_mode():
        logits, _ = engine.forward(stream, request.ids, logits_rows=n, attend_entries=request.attends, probing=True,
                                   rope_start=start)
        engine.forget_drafts(stream, n)
        full, cache = DynamicCache(), DynamicCache()
        run_with_cache(reference, full, input_ids=torch.tensor([ids]))
        for i, layer in enumerate(full.layers):
            cache.update(layer.keys[:, :, seen], layer.values[:, :, seen], i)
        expected = run_with_cache(reference, cache, input_ids=torch.tensor([request.ids]),
                                  position_ids=torch.arange(start, start + n)[None],
                                  cache_position=torch.arange(len(seen), len(seen) + n)).logits[0]
    assert (logits - expected).abs().max().item() <= 1e-4
    assert stream.tokens == ids and stream.next_rope == 80
    late = ProbeRequest(request.ids, attends=lambda layer: layer.valid)  # sees up to position 79
    assert engine.place(stream, late) is None
    assert engine.place(stream, ProbeRequest(request.ids)) is None  # the whole cache, from after it: no room
    judged = [probe_set.judged for probe_set in engine.probe_sets(stream, source.requests(stream.tokens, 0))]
    assert judged == [(1, 16), (16, 32), (32, 48), (48, 64)]  # (64, 80) would sit before its own span
    # told where the positions end, the source cuts the last spans so that each fits after itself
    judged = [probe_set.judged for probe_set in engine.probe_sets(stream, source.requests(stream.tokens, 0, 96))]
    assert judged == [(1, 16), (16, 32), (32, 48), (48, 64), (64, 77), (77, 80)]
    assert [s.judged for s in engine.probe_sets(stream, reconstruction(span=16).requests(stream.tokens, 0))] == []


def test_a_span_re_reading_records_its_span_alone_and_scores_as_kvzip_normalises(model):
    """A re-reading that attends to the sinks, its span and itself alone records its attention over the span only
    (about half the columns it attends to): there it is KVzip's restricted softmax already, so the scores equal
    those of recording every column it attends to and renormalising over them."""
    import dataclasses
    import functools

    from klevict_cli.policies.base import reconstruction_columns, spread
    from klevict_cli.probes import SINKS, _span_entries

    ids = torch.randint(0, 300, (70,)).tolist()
    engine = Engine(model, adapter_for(model), KL(lookahead=0), budget=None, chunk_size=32)
    stream = engine.new_stream()
    engine.feed(stream, ids)
    compared = 0
    for request in reconstruction(span=16, sees="span").requests(stream.tokens, 0):
        lo, hi = request.judged
        every = dataclasses.replace(request, entries=functools.partial(_span_entries, lo, hi, sinks=SINKS, end=70))
        scores = []
        for asked in (request, every):
            for probe_set in engine.probe_sets(stream, (r for r in [asked])):
                assert probe_set.restricted
                step = engine.eviction_step(stream, probe_set.ctx, None, probe_set.rows, judged=probe_set.judged,
                                            appended=probe_set.appended, restricted=asked is request)
                layer = step.cache.layers[1]
                columns, inside, judged = reconstruction_columns(step, 1)
                assert (inside is None) == (asked is request)
                width = hi - lo if asked is request else len(set(range(SINKS)) | set(range(lo, hi))) + len(asked.ids)
                assert step.probes[1].weights.shape[-1] == width
                scores.append(spread(layer, columns, restricted_max_attention(step.probes[1].weights, inside, judged)))
        torch.testing.assert_close(scores[0], scores[1], rtol=1e-5, atol=1e-7)
        assert (scores[0] > 0).sum() == layer.valid.shape[0] * (hi - lo)  # each head's span entries, nothing else
        compared += 1
    assert compared == 4 and stream.tokens == ids


@pytest.mark.parametrize("lo, hi", [(1, 2), (1, 9), (1, 24), (1, 25), (5, 70), (1, 4097), (300, 812)])
def test_a_re_reading_cuts_what_it_rereads_into_even_spans(lo, hi):
    """Every position of [lo, hi) once, in order, in spans of 3/4 to 3/2 of the span size (or one span, where the
    whole is shorter): no short last span costs a forward of its own."""
    spans = reconstruction(span=16).spans(lo, hi)
    assert [p for a, b in spans for p in range(a, b)] == list(range(lo, hi))
    sizes = [b - a for a, b in spans]
    assert max(sizes) - min(sizes) <= 1
    assert all(12 <= size <= 24 for size in sizes) or (len(spans) == 1 and hi - lo < 12)


def test_a_re_reading_reads_no_next_token_distributions(model):
    """Every policy judges a re-reading by its attention: it skips the logits (a vocabulary-sized product per
    token), and the stream is what it was once each span is forgotten."""
    ids = torch.randint(0, 300, (50,)).tolist()
    engine = Engine(model, adapter_for(model), KL(lookahead=0), budget=None, chunk_size=32)
    stream = engine.new_stream()
    engine.feed(stream, ids)
    spans = []
    for probe_set in engine.probe_sets(stream, reconstruction(span=16).requests(stream.tokens, 0)):
        assert probe_set.logits is None and probe_set.ctx.probes[1].weights.shape[1] == probe_set.rows
        spans.append(probe_set.judged)
    assert spans == [(1, 17), (17, 33), (33, 50)] and stream.tokens == ids


def test_kl_with_reconstruction_keeps_what_the_re_reading_paid_attention_to(model):
    ids = torch.randint(0, 300, (90,)).tolist()
    engine = Engine(model, adapter_for(model), KL(lookahead=4), budget=20, chunk_size=32, probe_window=8,
                    reconstruction=reconstruction())
    stream = engine.new_stream()
    engine.feed(stream, ids)
    # re-read up to the recent window the last choice keeps anyway (no drafts judge a choice that keeps 22 %)
    assert stream.reconstructed == 90 - 8 and stream.tokens == ids and engine.held_per_head(stream) == 20
    for layer in stream.cache.layers:
        stored = layer.extras[KL.QUESTION_EXTRA]
        assert stored.shape == layer.valid.shape and (stored[layer.valid] > 0).any()
        assert KL.COPY_EXTRA not in layer.extras  # the re-reading stands in for the read's own estimate of it

def test_kl_drafts_a_share_of_its_look_ahead_when_the_document_is_re_read_too(model):
    """With a re-reading, the look-ahead is sampled where the last choice keeps at most `reread_drafts_up_to` of the
    document, or where the read is at least `cheap_drafts` times the drafts' two rounds; without one, whatever is
    kept; drafted in one forward from the read's own predictions without a re-reading, in two (one Jacobi round more)
    with one. The drafts are forgotten either way."""
    for length, source, budget, drafted in ((90, reconstruction(), 12, 8), (90, reconstruction(), 20, 0),
                                            (90, None, 20, 8), (260, reconstruction(), 80, 8)):
        ids = torch.randint(0, 300, (length,)).tolist()
        policy = KL(lookahead=8)
        assert policy.reread_drafts_up_to == 0.15 and policy.cheap_drafts * 2 * 8 == 256
        engine = Engine(model, adapter_for(model), policy, budget=budget, chunk_size=32, probe_window=8,
                        reconstruction=source)
        assert engine.draft_count(len(ids)) == drafted
        appended = []
        forward = engine.forward
        engine.forward = lambda stream, chunk, **kw: appended.append(len(chunk)) or forward(stream, chunk, **kw)
        stream = engine.new_stream()
        engine.feed(stream, ids)
        rounds = 2 if source else 1  # the drafts' forwards are the read's last ones
        assert (appended[-rounds:] == [8] * rounds) == bool(drafted)
        assert stream.tokens == ids and engine.held_per_head(stream) == budget
    assert KL(lookahead=0).draft_count(reread=True, kept_fraction=0.1, read=90) == 0


def test_kl_drafts_in_two_rounds_where_the_second_is_cheap_against_the_read_or_the_document_is_re_read():
    """One Jacobi round (the read's own predictions) for a short read that is not re-read; two where the document
    is re-read, or the read is at least 16 times the drafts (the second round's forward then costs little)."""
    kl = KL()
    assert kl.draft_rounds(reread=False, read=512, count=64) == 1
    assert kl.draft_rounds(reread=False, read=1023, count=64) == 1
    assert kl.draft_rounds(reread=False, read=1024, count=64) == 2
    assert kl.draft_rounds(reread=True, read=300, count=64) == 2


def test_kl_refits_without_a_re_reading_only_where_it_keeps_little():
    policy = KL(refit="final")
    assert policy.refit_up_to == 0.15
    assert policy.refits(final=True, kept_fraction=0.1, reread=False)
    assert not policy.refits(final=True, kept_fraction=0.2, reread=False)
    assert policy.refits(final=True, kept_fraction=0.5, reread=True)
    assert not policy.refits(final=False, kept_fraction=0.1, reread=True)


@pytest.mark.parametrize("reread", [True, False])
def test_a_share_of_the_budget_is_kept_for_what_a_re_reading_needs_most(model, reread):
    """With a budget, the entries a re-reading needs most — by the most attention the re-reading paid them (KVzip's
    score, `question_share`), or without one by the read's own estimate of it (`copy_share`) — that share of what
    the floor leaves, over all layers and heads, score above every other entry; the rest keep the KL's order."""
    ids = torch.randint(0, 300, (90,)).tolist()
    engine = Engine(model, adapter_for(model), KL(lookahead=4, question_share=0.25, copy_share=0.5), budget=40,
                    chunk_size=32, probe_window=8, reconstruction=reconstruction() if reread else None)
    stream = engine.new_stream()
    engine.feed(stream, ids)
    kl, layers = engine.policy, list(range(len(stream.cache.layers)))
    name, share = (KL.QUESTION_EXTRA, 0.25) if reread else (KL.COPY_EXTRA, 0.5)
    with torch.inference_mode():
        logits, ctx = engine.probe_again(stream, 8)
        step = engine.eviction_step(stream, ctx, logits, 8, budget=20, recent=8)
        got, plain = kl.score_layers(step, layers), kl.probe_scores(step, layers)
    # candidates: what the engine does not keep anyway (the sinks and the recent window)
    valid = [stream.cache.layers[i].valid & ~step.kept_anyway(stream.cache.layers[i]) for i in layers]
    stored = torch.cat([stream.cache.layers[i].extras[name][v] for i, v in zip(layers, valid)])
    heads = sum(v.shape[0] for v in valid)
    lifted = torch.cat([(g - p)[v] for g, p, v in zip(got.values(), plain.values(), valid)]) > 0
    assert int(lifted.sum()) == int(share * (20 - 4 - 8) * heads)  # a share of what the sinks and window leave
    assert torch.equal(lifted, stored >= stored.topk(int(lifted.sum())).values[-1])
    scores = torch.cat([g[v] for g, v in zip(got.values(), valid)])
    assert scores[lifted].min() > scores[~lifted].max()
    assert not any((got[i] - plain[i])[step.kept_anyway(stream.cache.layers[i])].any() for i in layers)


def test_where_the_re_reading_relies_on_more_than_the_share_holds_the_kl_ranking_chooses_among_them(model):
    """An entry a copying query paid at least `relied_on` of its attention is one the re-reading relies on; where
    there are more of them than the question share holds, their scores no longer say which it needs more, so the
    share takes those with the highest KL scores among them; where they fit, the share is as before."""
    ids = torch.randint(0, 300, (90,)).tolist()
    engine = Engine(model, adapter_for(model), KL(lookahead=4, question_share=0.25), budget=40, chunk_size=32,
                    probe_window=8, reconstruction=reconstruction())
    stream = engine.new_stream()
    engine.feed(stream, ids)
    kl, layers = engine.policy, list(range(len(stream.cache.layers)))
    with torch.inference_mode():
        logits, ctx = engine.probe_again(stream, 8)
        step = engine.eviction_step(stream, ctx, logits, 8, budget=20, recent=8)
        plain = kl.probe_scores(step, layers)
        valid = [stream.cache.layers[i].valid & ~step.kept_anyway(stream.cache.layers[i]) for i in layers]
        stored = torch.cat([stream.cache.layers[i].extras[KL.QUESTION_EXTRA][v] for i, v in zip(layers, valid)])
        scores = torch.cat([plain[i][v] for i, v in zip(layers, valid)])
        count = int(0.25 * (20 - 4 - 8) * sum(v.shape[0] for v in valid))
        for relied_on, overflows in ((float(stored.quantile(0.5)), True), (float(stored.max()) + 1.0, False)):
            kl.relied_on = relied_on
            got = kl.score_layers(step, layers)
            lifted = torch.cat([(got[i] - plain[i])[v] for i, v in zip(layers, valid)]) > 0
            relied = stored >= relied_on
            assert int(relied.sum()) > count if overflows else not relied.any()
            assert int(lifted.sum()) == count
            if overflows:  # the relied-on entries the KL ranking values most
                assert not (lifted & ~relied).any()
                assert scores[lifted].min() >= scores[relied & ~lifted].max()
            else:  # as without the switch: the re-reading's highest scores
                assert torch.equal(lifted, stored >= stored.topk(count).values[-1])


def assert_max_of_restricted_attention(got, weights, inside, judged, factor):
    """By loops: each judged entry's score is the max over its group's query heads h and the rows t of its attention
    renormalised over `inside`, times factor(h, t, j); 0 for entries not judged (2 query heads per KV head)."""
    for kv in range(inside.shape[0]):
        for j in range(inside.shape[1]):
            best = 0.0
            for h in (2 * kv, 2 * kv + 1):
                for t in range(weights.shape[1]):
                    row = weights[h, t] * inside[kv]
                    best = max(best, float(row[j] / row.sum()) * factor(h, t, j))
            assert got[kv, j].item() == pytest.approx(best if judged[kv, j] else 0.0, rel=1e-5)


# ---- kvzip -----------------------------------------------------------------------------------------------------
def test_restricted_max_attention_matches_a_loop():
    torch.manual_seed(0)
    weights = torch.rand(4, 3, 10).softmax(dim=-1)  # 4 query heads, 2 KV heads
    inside = torch.rand(2, 10) > 0.3
    for judged in (inside & (torch.arange(10) < 6), (torch.arange(10) < 6).expand(2, 10)):  # some outside `inside`
        got = restricted_max_attention(weights, inside, judged)
        assert_max_of_restricted_attention(got, weights, inside, judged, lambda h, t, j: 1.0)


def test_kvzip_reconstructs_as_it_reads_keeps_the_sinks_and_its_budget(model):
    ids = torch.randint(0, 300, (100,)).tolist()
    engine = Engine(model, adapter_for(model), make_policy("kvzip"), budget=24, chunk_size=32, probe_window=8,
                    working=0, reconstruction=reconstruction())
    stream = engine.new_stream()
    engine.feed(stream, ids)
    assert stream.tokens == ids and stream.reconstructed == 96  # not the recent window kept anyway (the last chunk)
    assert engine.held_per_head(stream) == 24
    for layer in stream.cache.layers:
        for h in range(layer.keys.shape[0]):
            kept = set(layer.positions[h][layer.valid[h]].tolist())
            assert {0, 1, 2, 3} <= kept and max(kept) < 100


def test_kl_measures_what_questions_need_as_kvzip_does(model):
    """KL keeps, per entry, KVzip's score of the same re-reading: read in one choice
    (the same cache is re-read by both), the entries both keep carry the same score."""
    ids = torch.randint(0, 300, (60,)).tolist()
    kept = {}
    for policy, name in ((KL(lookahead=4), KL.QUESTION_EXTRA),
                         (make_policy("kvzip"), "kvzip")):
        engine = Engine(model, adapter_for(model), policy, budget=30, chunk_size=64, probe_window=8,
                        reconstruction=reconstruction())
        stream = engine.new_stream()
        engine.feed(stream, ids)
        kept[name] = {(i, h, int(p)): float(s) for i, layer in enumerate(stream.cache.layers)
                      for h in range(layer.keys.shape[0])
                      for p, s in zip(layer.positions[h][layer.valid[h]], layer.extras[name][h][layer.valid[h]])}
    common = set(kept[KL.QUESTION_EXTRA]) & set(kept["kvzip"])
    assert len(common) > 100 and any(kept["kvzip"][k] > 0 for k in common)
    for key in common:
        assert kept[KL.QUESTION_EXTRA][key] == pytest.approx(kept["kvzip"][key], rel=1e-5, abs=1e-7)


def test_kvzip_refuses_to_run_without_reconstruction(model):
    with pytest.raises(ValueError, match="reconstruction"):
        Engine(model, adapter_for(model), make_policy("kvzip"), budget=24)


# ---- observed attention ----------------------------------------------------------------------------------------
def test_attention_column_sums_match_the_full_attention_map():
    torch.manual_seed(1)
    query, key = torch.randn(4, 9, 8), torch.randn(2, 12, 8)
    allowed = torch.rand(2, 9, 12) > 0.2
    allowed[..., 0] = True
    got = attention_column_sums(query, key, allowed, 0.3, block=4)
    logits = torch.einsum("hqd,hcd->hqc", query, key.repeat_interleave(2, dim=0)) * 0.3
    weights = logits.masked_fill(~allowed.repeat_interleave(2, dim=0), float("-inf")).softmax(dim=-1)
    assert torch.allclose(got, weights.view(2, 2, 9, 12).sum(dim=(1, 2)), atol=1e-5)


def test_observed_attention_sees_every_query_of_the_read(model):
    """With one chunk and no eviction, the accumulated attention is the model's own attention map summed."""
    ids = torch.randint(0, 300, (40,)).tolist()
    engine = Engine(model, adapter_for(model), make_policy("observed_attention"), budget=None, chunk_size=40)
    stream = engine.new_stream()
    engine.feed(stream, ids)
    with torch.no_grad():
        maps = model(torch.tensor([ids]), output_attentions=True, attn_implementation="eager").attentions
    for layer, attn in zip(stream.cache.layers, maps):
        expected = attn[0].view(layer.keys.shape[0], -1, 40, 40).sum(dim=(1, 2))
        assert torch.allclose(layer.extras["observed_attention"], expected, atol=1e-4)


# ---- expected attention ----------------------------------------------------------------------------------------
def test_expected_attention_without_spread_is_the_attention_of_the_mean_query():
    torch.manual_seed(2)
    keys, values = torch.randn(1, 6, 4), torch.randn(1, 6, 3)
    valid = torch.ones(1, 6, dtype=torch.bool)
    mean = torch.randn(2, 4)
    got = expected_attention(keys, values, valid, mean, torch.zeros(2, 4, 4), torch.eye(4), 0.5)
    probs = (0.5 * torch.einsum("cd,hd->hc", keys[0], mean)).softmax(dim=-1).mean(dim=0)
    assert torch.allclose(got[0], probs * values[0].norm(dim=-1), atol=1e-6)


def test_query_moments_are_those_of_the_pre_rope_queries(model):
    """The policy un-rotates the post-RoPE queries it observes: their moments must be q_proj's outputs'."""
    ids = torch.randint(0, 300, (30,)).tolist()
    policy = make_policy("expected_attention")
    engine = Engine(model, adapter_for(model), policy, budget=None, chunk_size=30)
    captured = []
    attn = model.model.layers[1].self_attn
    hook = attn.q_proj.register_forward_hook(lambda m, a, out: captured.append(out.detach()))
    engine.feed(engine.new_stream(), ids)
    hook.remove()
    q = captured[0][0, 4:].view(26, -1, attn.head_dim).transpose(0, 1)  # (Hq, T, D), after the 4 sinks
    reference = QueryMoments(q.shape[0], q.shape[-1], q.device)
    reference.add(q)
    got, want = policy.moments[1].mean_and_covariance(), reference.mean_and_covariance()
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(got, want))


@pytest.mark.parametrize("method", ["expected_attention", "observed_attention"])
def test_each_peer_keeps_exactly_its_budget(model, method):
    ids = torch.randint(0, 300, (120,)).tolist()
    engine = Engine(model, adapter_for(model), make_policy(method), budget=24, chunk_size=16, probe_window=8,
                    working=0)
    stream = engine.new_stream()
    engine.feed(stream, ids)
    assert stream.cache.kept_counts() == [[24] * layer.keys.shape[0] for layer in stream.cache.layers]


# ---- kvgrad ----------------------------------------------------------------------------------------------------
def test_input_times_gradient_matches_a_loop():
    torch.manual_seed(3)
    weights = torch.rand(4, 3, 8).softmax(dim=-1)
    inside = torch.rand(2, 8) > 0.2
    judged = inside & (torch.arange(8) >= 2)
    grads, values = torch.rand(3), torch.rand(4, 8)
    got = input_times_gradient(weights, inside, judged, grads, values)
    assert_max_of_restricted_attention(got, weights, inside, judged, lambda h, t, j: float(values[h, j] * grads[t]))


def test_output_gradient_norms_are_those_of_a_plain_forward(model):
    """‖∂Φ/∂a‖ at the probes, re-run against klevict's cache, equals autograd through the model's own forward."""
    ids = torch.randint(0, 300, (30,)).tolist()
    engine = Engine(model, adapter_for(model), KL(lookahead=0), budget=None, chunk_size=32)
    stream = engine.new_stream()
    engine.feed(stream, ids)
    got = attention_output_gradient_norms(model, engine.adapter.attentions, engine.adapter.final_norm, stream.cache,
                                          ids[-6:], torch.arange(24, 30))
    outputs, final = {}, {}
    hooks = [attn.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out[0]))
             for i, attn in enumerate(engine.adapter.attentions)]
    hooks.append(engine.adapter.final_norm.register_forward_pre_hook(lambda m, a: final.__setitem__("h", a[0])))
    with torch.enable_grad():
        model(torch.tensor([ids]), attn_implementation="eager")
        objective = final["h"][0, -6:].square().sum()
        grads = torch.autograd.grad(objective, [outputs[i] for i in sorted(outputs)])
    for hook in hooks:
        hook.remove()
    for i, g in enumerate(grads):
        assert torch.allclose(got[i], g[0, -6:].norm(dim=-1), rtol=1e-3, atol=1e-5)


def test_kvgrad_keeps_the_sinks_and_its_budget(model):
    ids = torch.randint(0, 300, (80,)).tolist()
    engine = Engine(model, adapter_for(model), make_policy("kvgrad"), budget=24, chunk_size=32, probe_window=8,
                    reconstruction=reconstruction())
    stream = engine.new_stream()
    engine.feed(stream, ids)
    assert stream.tokens == ids and engine.held_per_head(stream) == 24
    for layer in stream.cache.layers:
        assert {0, 1, 2, 3} <= set(layer.positions[0][layer.valid[0]].tolist())
        assert (layer.extras["kvgrad"][layer.valid] > 0).any()


def test_max_memory_sets_the_largest_working_limit_that_fits(model):
    from klevict_cli.models import LoadedModel
    from klevict_cli.session import Session
    from tests.conftest import make_tokenizer

    session = Session(LoadedModel(model, make_tokenizer(), "tiny-llama", "memory", "c", "t", "w"))
    roomy = session.estimate_peak_bytes(90, 16)
    got = session.working_within(roomy, 20, 200, 16)
    assert got >= 90 and session.estimate_peak_bytes(got, 16) <= roomy < session.estimate_peak_bytes(got + 1, 16)
    assert session.working_within(roomy, 20, 60, 16) == 60  # never above the default
    assert session.working_within(0, 20, 200, 16) == 20  # never below the budget


def test_compact_positions_cap_the_working_limit(model):
    engine = Engine(model, adapter_for(model), KL(), budget=20, chunk_size=16, mode="compact", head_cap=50)
    assert engine.working == 50


@pytest.mark.parametrize("tokens", [1, 10])  # one token: the masked grouped path; a chunk: gathered past + chunk
@torch.inference_mode()
def test_attending_to_some_entries_is_reading_with_the_others_evicted(model, tokens):
    """A forward that sees only some cached entries (`attend_entries`, how a re-reading sees only its span) gives
    the logits and probe statistics of the same forward over a cache that holds only those entries."""
    ids = torch.randint(0, 300, (60,)).tolist()
    engine = Engine(model, adapter_for(model), KL(lookahead=0), budget=None, chunk_size=32)
    stream = engine.new_stream()
    engine.feed(stream, ids)
    evicted = stream.clone()

    def span(layer):
        return (layer.positions < 4) | ((layer.positions >= 20) & (layer.positions < 36))

    for layer in evicted.cache.layers:
        layer.keep(span(layer))
    new = torch.randint(0, 300, (tokens,)).tolist()
    seeing, ctx = engine.forward(stream, new, probe_rows=tokens, probe_entries=span, attend_entries=span)
    alone, ref = engine.forward(evicted, new, probe_rows=tokens)
    assert torch.allclose(seeing, alone, atol=1e-4)
    for i, probe in ctx.probes.items():
        assert torch.allclose(probe.output, ref.probes[i].output, atol=1e-5)
        positions = stream.cache.layers[i].positions
        columns = probe.columns if probe.columns is not None else torch.arange(positions.shape[1]).expand_as(positions)
        kept = positions.gather(1, columns)
        ref_positions = evicted.cache.layers[i].positions
        for h in range(positions.shape[0]):  # the weight on each entry, by position
            groups = probe.weights.shape[0] // positions.shape[0]
            for g in range(groups):
                q = h * groups + g
                mine = {int(p): float(w) for p, w in zip(kept[h], probe.weights[q, -1]) if w > 0}
                theirs = {int(p): float(w) for p, w in zip(ref_positions[h], ref.probes[i].weights[q, -1])
                          if w > 0 and (probe.columns is None or p < 36)}  # recorded: the span's entries only
                assert mine.keys() == theirs.keys() and any(p >= 20 for p in mine)
                assert all(abs(mine[p] - theirs[p]) < 1e-5 for p in mine)


def test_a_re_reading_sees_the_whole_cache_or_only_its_span(model):
    ids = torch.randint(0, 300, (70,)).tolist()
    engine = Engine(model, adapter_for(model), KL(lookahead=0), budget=None, chunk_size=32)
    stream = engine.new_stream()
    engine.feed(stream, ids)
    for sees in ("all", "span"):
        source = Reconstruction(first=[7, 8, 9], later=[10, 11], suffix=[12], span=16, overlap=3, sees=sees)
        sets = engine.probe_sets(stream, source.requests(stream.tokens, 20))
        probe_set = next(sets)
        layer = stream.cache.layers[0]
        visible = probe_set.ctx.visible(layer)
        hidden = layer.valid & ~visible
        assert (not hidden.any()) if sees == "all" else bool(
            ((layer.positions[hidden] >= 4) & ~((layer.positions[hidden] >= 20) & (layer.positions[hidden] < 36))).all()
            and hidden.any())
        sets.close()  # stopped after one span: the engine still forgets it
        assert stream.tokens == ids
    with pytest.raises(ValueError, match="sees"):
        Reconstruction(first=[7], later=[8], suffix=[9], sees="everything")
