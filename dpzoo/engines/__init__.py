"""Adapters that let other DP engines use dpzoo's per-layer rules."""
