"""Eviction policies, by name. Every policy implements `base.Policy`."""

from __future__ import annotations

from klevict_cli.errors import UsageError
from klevict_cli.policies.base import EvictionStep, Policy, in_floor, select_global, select_keep
from klevict_cli.policies.simple import FullCache, Streaming
from klevict_cli.policies.snapkv import SnapKV
from klevict_cli.policies.attention_based import H2O, TOVA, ObservedAttention, PyramidKV
from klevict_cli.policies.expected_attention import ExpectedAttention
from klevict_cli.policies.kvzip import KVgrad, KVzip
from klevict_cli.policies.key_based import KeyDiff, KNorm
from klevict_cli.policies.output_based import CAOTE, ValueNorm
from klevict_cli.policies.random_choice import RandomChoice
from klevict_cli.policies.kl import KL, KLFisher, KLLayer, KLReconstruct

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (KL, KLFisher, KLLayer, KLReconstruct, FullCache, Streaming, SnapKV)}
# Baselines for `klevict bench` (and usable as --method anywhere).
POLICIES.update({cls.name: cls for cls in (KVzip, KVgrad, ExpectedAttention, ObservedAttention, PyramidKV, H2O, TOVA, ValueNorm,
                                           CAOTE, KeyDiff, KNorm, RandomChoice)})


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise UsageError(f"unknown method '{name}'; choose from: {', '.join(POLICIES)}")
    return POLICIES[name]()


__all__ = ["POLICIES", "EvictionStep", "Policy", "in_floor", "make_policy", "select_global", "select_keep"]
