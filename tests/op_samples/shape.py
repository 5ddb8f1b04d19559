"""Samples for the shape group (see tests/op_samples/__init__.py)."""

SAMPLES: dict = {}
TORCH: dict = {}
ERRORS: dict = {}
