"""Scoring math for eviction policies: vectorised torch, device-agnostic, with float64 references in tests."""
