"""From the command line's options to a loaded model and the settings of a read — shared by one document (cli.py) and
a batch of them (batch.py), and below both. Nothing here imports torch until a model is asked for."""

from __future__ import annotations

import contextlib
import functools

from klevict_cli.display import err, shown
from klevict_cli.errors import ResourceError, UsageError
from klevict_cli.options import (
    Budget, format_size, parse_budget, parse_byte_limit, parse_size, parse_working_limit,
)

# 10 % of the document, but never fewer than 96 entries per head: below that a short note's facts are lost (20 notes
# of 320 tokens, two planted codes each: the full cache answered 31/40, `compress` 14/40 at 10 % = 34 entries per head,
# 18/40 at 64, as the full cache from 96 on; docs/research-log.md "a short note's default"), and 96 entries of the
# default model are 2.2 MB in fp16. A budget the user gives is taken as given.
DEFAULT_BUDGET = Budget(fraction=0.1, at_least=96)


@functools.lru_cache(maxsize=4)
def _session(model: str | None, device: str, dtype: str, quiet: bool):
    """One model load per process, whatever the number of commands or questions."""
    from klevict_cli.attention import ATTENTION_NAME
    from klevict_cli.models import load_model
    from klevict_cli.session import Session

    return Session(load_model(model, device=device, dtype=dtype, attn_implementation=ATTENTION_NAME, quiet=quiet))


def release_sessions() -> None:
    """Let every loaded model go, before another loads where one at a time is enough (`ask` on caches of several
    models): the loads are cached for the process, so dropping a session alone would keep its model."""
    import gc

    _session.cache_clear()
    gc.collect()  # a model's modules hold reference cycles (hooks): freed now, not at some later collection


def session_for(opts: dict):
    if opts.get("threads") is not None:
        import torch

        torch.set_num_threads(opts["threads"])
    quiet = opts["quiet"] or not err.is_terminal
    what = f"model {shown(opts['model'])}" if opts["model"] else "the default model"
    loading = contextlib.nullcontext() if quiet else err.status(f"loading {what}")
    with loading:
        return _session(opts["model"], opts["device"], opts["dtype"], quiet)


def read_settings(opts: dict, reconstruct_default: bool = False):
    """The reading settings the options ask for (shared by one document and a batch of them)."""
    from klevict_cli.session import ReadSettings

    return ReadSettings(**read_options(opts, reconstruct_default))


def read_options(opts: dict, reconstruct_default: bool = False) -> dict:
    """`read_settings`'s fields, every option checked, without importing the engine (torch, transformers)."""
    reconstruct, estimate = opts.get("reconstruct"), opts.get("estimate")
    return dict(
        # a saved cache serves many questions: compress re-reads by default, and measures its drift where that is cheap
        # next to the read (None: engine.drift_steps); summarize does neither
        measure_drift=(None if reconstruct_default else False) if estimate is None else bool(estimate),
        working=parse_working_limit(opts.get("working_limit")),
        reconstruct=reconstruct_default if reconstruct is None else bool(reconstruct),
        budget=read_budget(opts), max_kl=opts.get("max_kl"), method=opts["method"], chunk_size=opts["chunk_size"],
        cache_dtype=opts.get("cache_dtype"),
        max_bytes=parse_byte_limit(str(opts["max_bytes"])) if opts.get("max_bytes") is not None else None,
        probe_window=opts["probe_window"], probe_dtype=opts["probe_dtype"], position_mode=opts["position_mode"],
        seed=opts["seed"],
        max_new_tokens=opts["max_new_tokens"],
        max_memory=parse_size("max_memory", opts["max_memory"]) if opts.get("max_memory") else None,
    )


def read_budget(opts: dict):
    """The budget asked for: `--budget`, else DEFAULT_BUDGET — or, with `--max-kl` or `--max-bytes`, no cap unless
    `--budget` sets one."""
    if opts.get("budget") is None:
        return None if opts.get("max_kl") is not None or opts.get("max_bytes") is not None else DEFAULT_BUDGET
    return parse_budget(str(opts["budget"]))


def prepare_session(session, settings) -> None:
    """Refuse settings that no document could meet with this model, before reading any; then make the probe copy
    the reads will run their probes on (Session.probe_model), once, with the model: a cost of the model (about
    0.1 s for the default one), not of the first document read."""
    if settings.chunk_size > session.adapter.max_positions:
        raise UsageError(f"invalid --chunk-size {settings.chunk_size}; the model has only"
                         f" {session.adapter.max_positions} positions")
    # weights (and their probe copy) and the runtime: no budget helps
    floor = session.estimate_peak_bytes(0, 0, settings.probe_dtype) if settings.max_memory else 0
    if settings.max_memory is not None and settings.max_memory < floor:
        copy = session.probe_copy_dtype(settings.probe_dtype) is not None
        raise ResourceError(f"--max-memory {format_size(settings.max_memory)} is less than the model alone needs"
                            f" (about {format_size(floor)} with the runtime{' and its probe copy' if copy else ''});"
                            f" raise --max-memory{', use --probe-dtype float32' if copy else ''} or use a smaller"
                            " --model")
    if session.uses_probe_copy(settings):
        session.probe_model(settings.probe_dtype)
