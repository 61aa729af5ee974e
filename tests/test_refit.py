"""Refitting kept values (kernels/refit.py): exact where it can be, a no-op when nothing is evicted, and in the
engine only where the policy asks for it."""

from __future__ import annotations

import torch

from klevict_cli.adapter_check import adapter_for
from klevict_cli.cache import mask_columns
from klevict_cli.engine import Engine
from klevict_cli.policies.kl import KL
from klevict_kernels.refit import refit_values
from tests.conftest import tiny_llama


def _probes(hq=4, kv=2, w=3, c=20, dv=5, appended=2, seed=0):
    g = torch.Generator().manual_seed(seed)  # a CPU generator: its draws move to the test device afterwards
    device = torch.get_default_device()
    logits = torch.randn(hq, w, c + appended, generator=g, dtype=torch.float64, device="cpu").to(device)
    weights = logits.softmax(dim=-1)
    values = torch.randn(kv, c + appended, dv, generator=g, dtype=torch.float64, device="cpu").to(logits.device)
    per_query = values.repeat_interleave(hq // kv, dim=0)
    outputs = weights @ per_query
    tail = weights[..., c:] @ per_query[:, c:]
    return weights[..., :c], outputs, values[:, :c], tail


def _refit(weights, outputs, values, keep, tail, ridge=0.1):
    return refit_values(weights, outputs, values, *mask_columns(keep), tail, ridge)


def _outputs_after(weights, values, keep, tail):
    """The probes' head outputs once only `keep` of the held entries remain (the appended ones stay)."""
    hq, kv = weights.shape[0], values.shape[0]
    kept = weights * keep.repeat_interleave(hq // kv, dim=0)[:, None, :]
    mass = kept.sum(-1, keepdim=True) + (1 - weights.sum(-1, keepdim=True))
    return (kept @ values.repeat_interleave(hq // kv, dim=0) + tail) / mass


def test_keeping_everything_leaves_the_values_as_they_are():
    weights, outputs, values, tail = _probes()
    keep = torch.ones(values.shape[:2], dtype=torch.bool)
    assert torch.allclose(_refit(weights, outputs, values, keep, tail), values, atol=1e-12)


def _exact_fit(weights, outputs, values, keep, tail):
    """The kept values that restore every probe's output exactly with the least change (unbounded), or None."""
    hq, kv = weights.shape[0], values.shape[0]
    rows = weights.reshape(kv, -1, weights.shape[-1]) * keep[:, None, :]
    mass = rows.sum(-1, keepdim=True) + (1 - weights.sum(-1).reshape(kv, -1, 1))
    residual = outputs.reshape(kv, -1, outputs.shape[-1]) * mass - tail.reshape(kv, -1, tail.shape[-1]) - rows @ values
    delta = torch.linalg.pinv(rows) @ residual
    return values + delta if torch.allclose(rows @ delta, residual, atol=1e-8) else None


def test_the_refit_restores_the_probes_outputs_exactly_where_the_model_s_range_allows_and_stays_in_it():
    """Enough kept entries for an exact fit: where that fit's values lie within the head's largest |value|, the
    outputs come back exactly; where it would need larger values, the refit stays within that bound and still
    moves the outputs closer than no refit."""
    seen = set()
    for seed in range(6):
        weights, outputs, values, tail = _probes(seed=seed)
        keep = torch.zeros(values.shape[:2], dtype=torch.bool)
        keep[:, ::2] = True  # 10 kept per head, 2 query heads x 3 probes = 6 rows: an exact fit exists
        exact = _exact_fit(weights, outputs, values, keep, tail)
        assert exact is not None
        plain = _outputs_after(weights, values, keep, tail)
        refit = _refit(weights, outputs, values, keep, tail, ridge=1e-10)
        assert (plain - outputs).abs().max() > 1e-2  # evicting moved the outputs
        assert torch.equal(refit[~keep], values[~keep])  # evicted entries are untouched (they are dropped anyway)
        bound = values.abs().amax(dim=(1, 2))
        within = bool((exact.abs().amax(dim=(1, 2)) <= bound).all())
        seen.add(within)
        if within:
            assert torch.allclose(_outputs_after(weights, refit, keep, tail), outputs, atol=1e-6)
        else:
            assert (refit.abs().amax(dim=(1, 2)) <= bound + 1e-12).all()
            error = (_outputs_after(weights, refit, keep, tail) - outputs).square().sum()
            assert error < (plain - outputs).square().sum()
    assert seen == {True, False}  # both cases were met


def test_where_little_attention_is_kept_the_refit_neither_grows_the_values_nor_worsens_the_outputs():
    """The entries the probes attend to least are kept (a tenth of the mass or less): the refit must stay within
    the model's range and leave every head's probe outputs no further from the full cache's than no refit."""
    for seed in range(4):
        weights, outputs, values, tail = _probes(w=16, c=40, seed=seed)
        mass = weights.reshape(2, -1, 40).sum(1)
        keep = torch.zeros(values.shape[:2], dtype=torch.bool).scatter_(1, mass.topk(4, largest=False).indices, True)
        refit = _refit(weights, outputs, values, keep, tail)
        assert (refit.abs().amax(dim=(1, 2)) <= values.abs().amax(dim=(1, 2)) + 1e-12).all()
        def error_per_head(v):
            return (_outputs_after(weights, v, keep, tail) - outputs).square().reshape(2, -1).sum(1)

        assert (error_per_head(refit) <= error_per_head(values) + 1e-12).all()


def test_the_ridge_trades_the_fit_for_staying_near_the_original_values():
    weights, outputs, values, tail = _probes(w=8, c=12)  # 16 rows, 4 kept: no exact fit
    keep = torch.zeros(values.shape[:2], dtype=torch.bool)
    keep[:, :4] = True
    errors, moves = [], []
    for ridge in (1e-6, 0.1, 10.0, 1e6):
        refit = _refit(weights, outputs, values, keep, tail, ridge=ridge)
        errors.append(float((_outputs_after(weights, refit, keep, tail) - outputs).square().sum()))
        moves.append(float((refit - values).square().sum()))
    assert errors == sorted(errors) and moves == sorted(moves, reverse=True)
    assert errors[0] < 0.5 * float((_outputs_after(weights, values, keep, tail) - outputs).square().sum())
    assert moves[-1] < 1e-8


def _read(refit: str, ids: list[int]):
    model = tiny_llama(seed=3)
    policy = KL(lookahead=8, refit=refit)
    policy.refit_up_to = 1.0
    engine = Engine(model, adapter_for(model), policy, budget=12, chunk_size=16, probe_window=4)
    stream = engine.new_stream()
    engine.feed(stream, ids)
    return stream, engine


def test_the_engine_refits_only_the_kept_values_of_the_last_eviction():
    torch.manual_seed(4)
    ids = torch.randint(0, 300, (64,)).tolist()
    plain, _ = _read("never", ids)
    refit, engine = _read("final", ids)
    full = engine.new_stream()
    engine.budget = None
    engine.feed(full, ids)
    first, read = plain.cache.layers[0], full.cache.layers[0]  # layer 0's values depend on the tokens alone
    for h in range(first.keys.shape[0]):
        assert torch.equal(first.values[h][first.valid[h]], read.values[h][first.positions[h][first.valid[h]]])
    changed = 0
    for p, r in zip(plain.cache.layers, refit.cache.layers):
        assert torch.equal(p.positions, r.positions) and torch.equal(p.keys, r.keys)  # the same choice
        changed += int((p.values - r.values)[p.valid].abs().amax(-1).gt(1e-6).sum())
    assert changed > 0
