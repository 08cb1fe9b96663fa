"""Load: plan and check, agree, stream, agree, finish.

Load (two agreements between ranks; with several ranks, byte ranges that
several need are read by one and sent to the others in ``_replicas``' agreed
rounds of point-to-point transfers, between steps 2 and 4):

  1. plan and check everything that needs no tensor bytes (``plan.py``:
     :func:`plan_load`, a frozen :class:`LoadPlan` that knows its files and
     chunks): the manifest; the live state walked; names, shapes and dtypes
     matched (every offender of every kind in one error); self-overlapping
     targets refused; then the data files present at their recorded sizes;
  2. agree: every rank's plan succeeded (``_collective.agree``, bounded by
     ``collective_timeout_s``) — the point of no return;
  3. stream (``stream.py``): ``_readers.read_verified`` reads only the byte
     ranges this rank needs (rounded to checksum blocks; whole chunks for
     v1), through a bounded, reused buffer pool (pinned for CUDA targets),
     verifies each unit, and each piece is ``copy_``-ed (casting where the
     dtypes differ) straight into the live tensor (a DTensor's local
     tensor). With ``atomic=True`` the pieces go to staging tensors instead
     (``stage.py``);
  4. agree: every rank streamed without error (a damaged block names the
     tensors this rank had already overwritten); then, for ``atomic=True``,
     the staged tensors are copied in; then plain values are put back and
     stateful objects get ``load_state_dict``.

``pipeline.py`` runs these steps (:func:`load_into`, the one load) and holds
the public :func:`load` and :func:`read` that call it (the memory tier's
restore calls it too).
"""

from __future__ import annotations

from .pipeline import load, load_into, read
from .plan import DEFAULT_CAST, KeyMap, LoadPlan, LoadResult, Target, dtype_problem, new_tensors, plan_load, saved_chunks
from .stream import StreamHook, load_settings, stream_into

__all__ = [
    "load", "read", "load_into", "LoadResult", "LoadPlan", "Target", "plan_load", "saved_chunks",
    "dtype_problem", "new_tensors", "DEFAULT_CAST", "KeyMap", "StreamHook", "load_settings", "stream_into",
]
