"""Compatibility home of the cache: the code lives in ``h2okv.core``."""

from .core import DEFAULT_CHUNK, BudgetSpec, H2OCache, SlotLayer
from .pending import PENDING

__all__ = ["DEFAULT_CHUNK", "PENDING", "BudgetSpec", "H2OCache", "SlotLayer"]
