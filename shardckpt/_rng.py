"""``shardckpt.RNGState``: this process's random number generators, saved per rank."""

from __future__ import annotations

import random
import warnings
from typing import Any, Dict

import torch

from ._state import PerRank

__all__ = ["RNGState"]


class _Generators:
    """The default generators: torch CPU, torch CUDA (every device), Python, NumPy."""

    #: Restored after every other entry of a load (``_state.walk``): a data
    #: loader being restored may draw from these generators first.
    restore_last = True

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def state_dict(self) -> Dict[str, Any]:
        sd: Dict[str, Any] = {"torch": torch.get_rng_state()}
        # Only when CUDA is already up: saving a checkpoint must not create a
        # CUDA context (seeds set before that are applied lazily anyway).
        if self.cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = list(torch.cuda.get_rng_state_all())
        version, internal, gauss = random.getstate()
        sd["python"] = {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss}
        np = _numpy()
        if np is not None:
            kind, keys, pos, has_gauss, cached = np.random.get_state()
            sd["numpy"] = {
                "kind": str(kind),
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        return sd

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        torch.set_rng_state(sd["torch"].to(torch.uint8))
        cuda = sd.get("cuda")
        if cuda and self.cuda:
            if torch.cuda.is_available() and torch.cuda.device_count() >= len(cuda):
                torch.cuda.set_rng_state_all([t.to(torch.uint8).cpu() for t in cuda])
            else:
                have = torch.cuda.device_count() if torch.cuda.is_available() else 0
                warnings.warn(
                    f"RNGState: the checkpoint holds CUDA generator states for {len(cuda)} device(s), this process "
                    f"has {have}; CUDA generators were left as they are (CPU, Python and NumPy were restored)",
                    stacklevel=2,
                )
        py = sd.get("python")
        if py is not None:
            random.setstate((int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
        nps = sd.get("numpy")
        if nps is not None:
            np = _numpy()
            if np is None:
                warnings.warn("RNGState: the checkpoint holds NumPy's generator state but NumPy is not installed", stacklevel=2)
            else:
                keys = nps["keys"].numpy().astype(np.uint32)
                np.random.set_state((nps["kind"], keys, int(nps["pos"]), int(nps["has_gauss"]), float(nps["cached_gaussian"])))


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


class RNGState(PerRank):
    """The process's random generators, saved and restored per rank.

    Captures torch's CPU generator, every CUDA device's generator (when CUDA
    is initialized), Python's ``random`` and NumPy's global generator (when
    NumPy is installed). Each rank keeps its own streams: generator states are
    small uint8/int64 tensors written by their rank (``rng.@rank3.torch``).
    Restoring at the same world size continues every stream exactly.

    Args:
        cuda: include CUDA generators (default True).
        on_resize: as for :class:`shardckpt.PerRank` — the default ``"error"``
            refuses a load at another world size; ``"skip"`` keeps the live
            generators (e.g. seeded by rank) when resuming on a different
            number of ranks.

    Not captured: generators you create yourself (``torch.Generator()``:
    wrap an object whose ``state_dict`` returns ``gen.get_state()``), other
    accelerators' generators (MPS, XPU), NumPy ``Generator`` objects.
    A checkpoint with CUDA states loads on a machine without CUDA with a
    warning; the CPU, Python and NumPy streams are still restored.

    Example:
        >>> state = {"model": model, "optim": optim, "rng": shardckpt.RNGState()}  # doctest: +SKIP
        >>> shardckpt.save(state, url)   # doctest: +SKIP
        >>> shardckpt.load(state, url)   # doctest: +SKIP  # random streams continue
    """

    def __init__(self, *, cuda: bool = True, on_resize: Any = "error"):
        super().__init__(_Generators(cuda), on_resize=on_resize)

    def state_dict(self) -> Dict[str, Any]:
        """The current generator states (this process only)."""
        return self.obj.state_dict()

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Set the generators from :meth:`state_dict` output."""
        self.obj.load_state_dict(sd)

    def __repr__(self) -> str:
        return f"RNGState(cuda={self.obj.cuda}, on_resize={self.on_resize!r})"
