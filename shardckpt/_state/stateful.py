"""The built-in adapter of any object with ``state_dict()``/``load_state_dict()`` (schedulers, scalers, loaders, RNG)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CheckpointError, StateMismatchError
from .base import (
    MISSING,
    Adapter,
    fill_from_saved,
)

__all__ = ["StatefulAdapter"]


class StatefulAdapter(Adapter):
    """Any object with ``state_dict()`` and ``load_state_dict()`` (schedulers, scalers...).

    On load the live ``state_dict()`` gives the structure and tensors to fill;
    values the checkpoint has come back; ``load_state_dict`` gets the result.
    """

    def matches(self, obj):
        return (
            not isinstance(obj, (dict, list, tuple, torch.Tensor))
            and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        )

    def save(self, obj, path, walker):
        return obj.state_dict()

    def load(self, obj, path, saved, walker):
        if saved is MISSING:
            walker.missing_values.append(path)
            return
        live_sd = obj.state_dict()
        holder = {"sd": live_sd}
        fill_from_saved(holder, "sd", saved, path, walker)
        def finish():
            try:
                obj.load_state_dict(holder["sd"])
            except CheckpointError:
                raise
            except Exception as e:
                # The object refused its saved state (its own check, e.g. a
                # version): say which one; the load names what was loaded.
                raise StateMismatchError(
                    f"{path}: {type(obj).__name__}.load_state_dict refused the checkpoint's state: {type(e).__name__}: {e}"
                ) from e
            _prime_loader(obj)

        # Generators (``RNGState``) are restored after everything else: a
        # loader primed above draws from them first (issue 19).
        (walker.late if getattr(obj, "restore_last", False) else walker.flat.finalizers).append(finish)


def _prime_loader(obj: Any) -> None:
    """Create a just-loaded torchdata ``StatefulDataLoader``'s iterator now, as its own ``state_dict()`` does.

    Its next ``iter()`` draws a base seed from torch's global generator
    unless an iterator is waiting; restored before that draw, an
    ``RNGState`` would come out one draw off. Created here, before the
    generators are restored (they are restored last), the draw happens
    first and ``iter(loader)`` reuses this iterator: the natural order
    (load, then ``iter``) is exact, and so is ``iter`` then load.
    """
    if type(obj).__name__ == "StatefulDataLoader" and getattr(obj, "_iterator", 1) is None and hasattr(
        obj, "_initial_iter_for_state_dict"
    ):
        obj.state_dict()
