"""The last save's exports (torchtitan's options): model-only state, ``export_dtype``, ``last_save_in_hf``.

``CheckpointManager(last_save_model_only=True)`` saves only ``state["model"]``
on ``save(..., last_step=True)``, its floating-point tensors cast to
``export_dtype`` when given; ``last_save_in_hf=True`` then writes the
committed step as a Hugging Face safetensors directory next to it
(``step-00001000-hf``).

This module sits with the users (layer 1): the converters it calls import
every converter, so they are imported only when an export or a dtype needs them.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from .._collective import ALL, Comm, agree
from .._format import torch_dtype
from .._runtimes import unwrap
from ..errors import SaveFailedError, UsageError, format_offenders

__all__ = ["HF_SUFFIX", "parse_export_dtype", "model_only_state", "export_hf", "export_remote_hf"]

#: Suffix of the directory ``last_save_in_hf`` writes next to a step (``step-00001000-hf``).
HF_SUFFIX = "-hf"


def parse_export_dtype(dtype: Any) -> Any:
    """``export_dtype`` as the converters take it (``torch.bfloat16``, ``"bf16"``...); None stays None.

    Raises:
        UnsupportedStateError: not a floating-point dtype shardckpt can write; TypeError: neither a dtype nor a name.
    """
    if dtype is None:
        return None
    # The converters package imports every converter: only when a dtype is given.
    from ..converters._options import parse_dtype

    return parse_dtype(dtype)


def model_only_state(state: Dict[str, Any], dtype: Any) -> Any:
    """``state["model"]`` for a model-only save, its floating-point tensors cast to ``dtype`` when given.

    Cast copies keep ties: a tensor under several names is cast once and,
    as ``save_pretrained`` does, kept under its first name only.

    Raises:
        UsageError: ``state`` has no ``"model"`` entry, or (with ``dtype``)
            ``state["model"]`` is neither a module nor a dict.

    Example:
        >>> model_only_state({"model": {"w": 1}, "optim": {}}, None)
        {'w': 1}
    """
    if not isinstance(state, dict) or "model" not in state:
        raise UsageError(
            "CheckpointManager: last_save_model_only saves state['model'], and the state has no 'model' entry "
            f"(it has {format_offenders(list(state) if isinstance(state, dict) else [])})"
        )
    model = state["model"]
    if dtype is None:
        return model
    import torch

    sd = unwrap(model).state_dict(keep_vars=True) if isinstance(model, torch.nn.Module) else model
    if not isinstance(sd, dict):
        raise UsageError(f"CheckpointManager: export_dtype needs state['model'] to be a module or a dict, got {type(model).__name__}")
    out, seen = {}, set()
    with torch.no_grad():
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                if id(v) in seen:
                    continue
                seen.add(id(v))
                v = v.detach()
                if v.is_floating_point():
                    v = v.to(torch_dtype(dtype))
            out[k] = v
    return out


def export_hf(
    comm: Comm, src_url: str, dst_url: str, *, step: int, dtype: Any = None,
    storage_options: Optional[Dict[str, Any]] = None, io_threads: Optional[int] = None,
) -> None:
    """Rank 0 writes the committed checkpoint ``src_url`` as a Hugging Face directory ``dst_url``; every rank returns when it is there.

    Args:
        comm: the manager's ranks (the export's errors are raised on every rank).
        src_url: the committed step.
        dst_url: the Hugging Face directory (replaced if present).
        step: the step, for messages.
        dtype, storage_options, io_threads: as :func:`converters.to_safetensors`.

    Raises:
        SaveFailedError (or the converter's error): the export failed on rank 0.
    """
    # The converters package imports every converter: only when exporting.
    from ..converters import to_safetensors

    def export() -> None:
        if comm.rank == 0:
            to_safetensors(src_url, dst_url, dtype=dtype, overwrite=True, storage_options=storage_options,
                           dst_storage_options=storage_options, io_threads=io_threads)

    agree(comm, export, what=f"Hugging Face export of step {step} to {dst_url}")


def export_remote_hf(comm: Comm, tiers: Any, step: int, *, dtype: Any = None, io_threads: Optional[int] = None) -> None:
    """Per-node local directories: once step ``step`` is durable, rank 0 exports the remote's copy to ``<remote>/step-N-hf``.

    Each node's directory holds only its ranks' files, so the export
    reads the remote copy, the one place holding all of them: every rank
    waits (up to the collective timeout) for the step's flush first
    (``tiers``: the manager's ``_flush.Tiers``, its flusher already made).
    No local ``step-N-hf`` is written.

    Raises:
        SaveFailedError: the step is not durable on the remote in time
            (its flush failed or is slow: logged); the step itself stays
            saved, and ``shardckpt export <remote step> <dir>`` exports it later.
    """
    flusher = tiers.flusher
    flusher.wait(comm.timeout_s)
    _, durable = agree(comm, lambda: flusher.durable_step, what=f"Hugging Face export of step {step}: the remote copy",
                       share=lambda v: v, mode=ALL)
    remote = tiers.remote
    if any(d is None or d < step for d in durable):
        raise SaveFailedError(
            f"Hugging Face export of step {step}: on per-node local directories only the remote copy holds every "
            f"node's files, and step {step} is not durable on {remote.root_url} after {comm.timeout_s:g} s (its flush "
            f"failed or is slow; see the log). Step {step} is saved; export it once it is flushed: "
            f"shardckpt export {remote.step_url(step)} {remote.step_url(step) + HF_SUFFIX}")
    export_hf(comm, remote.step_url(step), remote.step_url(step) + HF_SUFFIX, step=step, dtype=dtype,
              storage_options=remote.storage_options or None, io_threads=io_threads)
