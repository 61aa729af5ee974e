"""An adapter for any model: its family's where klevict knows the family (adapters.py), otherwise the Llama-style
adapter, used only after a self-check on the model shows that it fits — reading through klevict's own engine, so this
sits above both the adapters and the engine."""

from __future__ import annotations

import torch
from torch import nn

from klevict_cli.adapters import ADAPTERS, ModelAdapter, known_adapter
from klevict_cli.engine import Engine
from klevict_cli.errors import ModelError
from klevict_cli.policies import make_policy

SELF_CHECK_TOKENS = 16  # tokens the self-check reads


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The adapter for `model`'s family. A family klevict does not know gets the Llama-style adapter only if
    `self_check` shows that the adapter fits the model; otherwise it is refused (ModelError, exit 5)."""
    known = known_adapter(model)
    if known is not None:
        return known
    try:
        adapter = ModelAdapter(model)
        self_check(model, adapter)
    except Exception as exc:  # whatever breaks on an architecture klevict does not know, the answer is the same
        reason = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"unsupported model architecture '{model.config.model_type}' ({reason}); klevict supports"
                         f" {', '.join(ADAPTERS)}, and other Llama-style decoders that pass its self-check") from exc
    return adapter


def self_check(model: nn.Module, adapter: ModelAdapter) -> None:
    """Raise ModelError unless the Llama-style `adapter` fits `model`, on 16 tokens: read in two chunks through
    klevict's cache and attention they give the model's own (eager) logits, as do logits finished from its output
    head's (`Engine.head_logits`); read 16 positions later, their keys are
    the re-rotated ones (`compact` mode); and a change of an attention output moves the logits exactly as the same
    change of the residual stream does — what the direct KL path assumes (a norm in between breaks it)."""
    param = next(model.parameters())
    # Half precision's rounding through SmolLM2's 30 layers reached 2.6e-2 (relative) in the residual check; what an
    # adapter that does not fit gets wrong is of order 1.
    tolerance = 1e-3 if param.dtype in (torch.float32, torch.float64) else 1e-1
    half = SELF_CHECK_TOKENS // 2
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.tensor([[(7 * i + 3) % vocab for i in range(SELF_CHECK_TOKENS)]], device=param.device)
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation("eager")
        own, moved_output, moved_residual = _own_logits_after_a_change(model, adapter, ids)
        # the model stands in for its own probe copy: rows only sampled from are finished by klevict from the
        # output head's (`sampled`), which must give the model's logits too
        engine = Engine(model, adapter, make_policy("none"), budget=None, chunk_size=half, probe_model=lambda: model)
        streams = []
        for offset in (0, SELF_CHECK_TOKENS):
            stream = engine.new_stream()
            stream.next_rope = offset
            engine.feed(stream, ids[0, :half].tolist())
            streams.append((stream, engine.forward(stream, ids[0, half:].tolist(), logits_rows=half)[0].float()))
        sampled = engine.forward(engine.new_stream(), ids[0].tolist(), logits_rows=half, sampled=True)[0].float()
    finally:
        model.set_attn_implementation(previous)
    if not _close(streams[0][1], own[half:], tolerance):
        raise ModelError("reading through klevict's cache and attention does not give the model's own logits")
    change = (moved_residual - own[-1]).abs().max().clamp_min(1e-30)
    if not _close((moved_output - own[-1]) / change, (moved_residual - own[-1]) / change, tolerance):
        raise ModelError("its layers do not add the attention output to the residual stream as it is, as Llama's do")
    for idx, (at_0, later) in enumerate(zip(streams[0][0].cache.layers, streams[1][0].cache.layers)):
        moved = at_0.clone()
        adapter.rerotate_layer(moved, torch.full_like(moved.positions, SELF_CHECK_TOKENS), idx)
        slot = adapter.rotary_slot
        if not _close(getattr(moved, slot).float(), getattr(later, slot).float(), tolerance):
            raise ModelError("its keys' positions cannot be moved the way Llama's are (re-rotation)")
    if not _close(sampled, own[half:], tolerance):
        raise ModelError("its logits are not its output head's as klevict finishes them (a transform after the head)")


def _own_logits_after_a_change(model: nn.Module, adapter: ModelAdapter, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The model's own logits for `ids` (plain forwards, no cache): as they are, with a change u added to the first
    layer's attention output at the last token, and with u added to that layer's input there instead (its attention
    output held as it was). Where the output is added to the residual stream as it is, both reach the same sum."""
    layer, projection = adapter.layers[0], adapter.output_projection(0)
    captured = []

    def logits(*handles) -> torch.Tensor:
        try:
            with torch.no_grad():
                return model(ids, use_cache=False).logits[0].float()
        finally:
            for handle in handles:
                handle.remove()

    own = logits(projection.register_forward_hook(lambda module, args, out: captured.append(out)))
    held = captured[0]
    u = torch.zeros_like(held)
    u[0, -1] = torch.randn(held.shape[-1], generator=torch.Generator().manual_seed(0)).to(held)
    u *= 4 * float(held[0, -1].norm()) / float(u.norm()) or 1.0  # large: the sum is the same, rounding is not

    def shift_input(module, args, kwargs):
        if args:
            return (args[0] + u, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] + u}

    moved_output = logits(projection.register_forward_hook(lambda module, args, out: out + u))
    moved_residual = logits(projection.register_forward_hook(lambda module, args, out: held),
                            layer.register_forward_pre_hook(shift_input, with_kwargs=True))
    return own, moved_output[-1], moved_residual[-1]


def _close(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> bool:
    """Equal to `tolerance` relative to the larger of 1 and `want`'s largest magnitude."""
    return bool((got - want).abs().max() <= tolerance * max(1.0, float(want.abs().max())))
