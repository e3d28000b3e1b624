"""Small datasets for examples and tests (offline)."""

from .digits import digits_dataset

__all__ = ["digits_dataset"]
