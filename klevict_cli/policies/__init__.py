"""Eviction policies, by name. Every policy implements `base.Policy`."""

from __future__ import annotations

from klevict_cli.errors import UsageError
from klevict_cli.policies.base import EvictionStep, Policy, select_keep
from klevict_cli.policies.simple import FullCache, Streaming
from klevict_cli.policies.snapkv import SnapKV

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (FullCache, Streaming, SnapKV)}


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise UsageError(f"unknown method '{name}'; choose from: {', '.join(POLICIES)}")
    return POLICIES[name]()


__all__ = ["POLICIES", "EvictionStep", "Policy", "make_policy", "select_keep"]
