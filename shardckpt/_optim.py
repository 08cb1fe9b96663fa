"""Old import path of the optimizer adapter; it lives in ``_state.optim``."""

from __future__ import annotations

from ._state.optim import OptimizerAdapter, find_module

__all__ = ["OptimizerAdapter", "find_module"]
