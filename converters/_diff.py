"""Compare two checkpoints tensor by tensor, streaming (used by ``shardckpt diff``)."""

from __future__ import annotations

import collections
import itertools
import math
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from shardckpt import _knobs
from shardckpt._format import itemsize, plural, torch_dtype
from shardckpt._format.values import has_plain, is_tensor_ref, plain_values

from ._common import Reader
from ._options import Progress
from ._source import BLOCK_BYTES, SrcTensor, open_checkpoint, plan_blocks

__all__ = ["diff", "DiffReport"]


@dataclass
class Change:
    name: str
    what: str  # "dtype", "shape", "values"
    detail: str
    differing: int = 0
    max_abs_diff: Optional[float] = None
    a: Any = None  # dtype or shape in A (for "dtype" / "shape" changes)
    b: Any = None

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"name": self.name, "what": self.what, "detail": self.detail}
        if self.what == "values":
            mx = self.max_abs_diff
            out["differing"] = self.differing
            out["max_abs_diff"] = None if mx is None or math.isnan(mx) else mx  # JSON has no NaN
        else:
            out["a"], out["b"] = self.a, self.b
        return out


@dataclass
class ValueChange:
    """A plain value that differs: ``what`` is "changed", "only_in_a" or "only_in_b"."""

    path: str
    what: str
    a: Any = None
    b: Any = None

    def line(self) -> str:
        if self.what == "only_in_a":
            return f"{self.path}: only in A"
        if self.what == "only_in_b":
            return f"{self.path}: only in B"
        return f"{self.path}: {json_short(self.a)} -> {json_short(self.b)}"

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"path": self.path, "what": self.what}
        if self.what != "only_in_b":
            out["a"] = plain_values(self.a)
        if self.what != "only_in_a":
            out["b"] = plain_values(self.b)
        return out


@dataclass
class DiffReport:
    """Result of :func:`diff`. ``same`` is True when nothing differs."""

    a: str
    b: str
    added: List[str] = field(default_factory=list)  # only in b
    removed: List[str] = field(default_factory=list)  # only in a
    changed: List[Change] = field(default_factory=list)
    identical: int = 0
    value_changes: List[ValueChange] = field(default_factory=list)

    @property
    def same(self) -> bool:
        return not (self.added or self.removed or self.changed or self.value_changes)

    def lines(self) -> List[str]:
        out = [f"- {n}" for n in self.removed] + [f"+ {n}" for n in self.added]
        for c in self.changed:
            out.append(f"~ {c.name}: {c.detail}")
        out += [f"~ value {v.line()}" for v in self.value_changes]
        verdict = "same" if self.same else "different"
        nv = len(self.value_changes)
        out.append(
            f"{verdict}: {plural(self.identical, 'tensor')} identical, {len(self.changed)} changed, "
            f"{len(self.removed)} only in A, {len(self.added)} only in B, "
            f"{nv} {'value differs' if nv == 1 else 'values differ'}"
        )
        return out

    def to_json(self) -> Dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "same": self.same,
            "only_in_a": self.removed,
            "only_in_b": self.added,
            "changed": [c.to_json() for c in self.changed],
            "identical": self.identical,
            "value_changes": [v.to_json() for v in self.value_changes],
        }


def prefetch(pool: ThreadPoolExecutor, jobs: Iterable[Callable[[], Any]], depth: int) -> Iterator[Any]:
    """Run ``jobs`` on ``pool`` with at most ``depth`` pending; yield results in order."""
    pending: collections.deque = collections.deque()
    it = iter(jobs)
    try:
        for job in itertools.islice(it, max(1, depth)):
            pending.append(pool.submit(job))
        while pending:
            res = pending.popleft().result()
            for job in itertools.islice(it, 1):
                pending.append(pool.submit(job))
            yield res
    finally:
        for f in pending:
            f.cancel()
        wait(list(pending))


def _read(reader: Reader, t: SrcTensor, s: int, e: int, block_bytes: int) -> torch.Tensor:
    parts = [reader.read(t, blk) for blk in plan_blocks(t, s, e, block_bytes)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _compare(x: torch.Tensor, y: torch.Tensor, atol: float) -> Tuple[int, float]:
    """(number of differing elements, max |x - y| over them)."""
    if x.is_floating_point():
        xd, yd = x.to(torch.float64), y.to(torch.float64)
        both_nan = torch.isnan(xd) & torch.isnan(yd)
        delta = (xd - yd).abs()
        neq = ~((xd == yd) | both_nan)
        if atol > 0:
            neq &= ~(delta <= atol)
        n = int(neq.sum())
        if not n:
            return 0, 0.0
        d = delta[neq]
        return n, float("nan") if torch.isnan(d).all() else float(torch.nan_to_num(d, nan=0.0).max())
    if x.dtype == torch.bool:
        n = int((x != y).sum())
        return n, float(n > 0)
    neq = x != y
    n = int(neq.sum())
    if not n:
        return 0, 0.0
    return n, float((x[neq].to(torch.float64) - y[neq].to(torch.float64)).abs().max())


def _values_diff(a: Any, b: Any, path: str, out: List[ValueChange]) -> None:
    if len(out) >= 100:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        if is_tensor_ref(a) and is_tensor_ref(b):
            return  # tensors are compared by name
        for k in sorted(set(a) | set(b), key=str):
            p = f"{path}.{k}" if path else str(k)
            if k not in a:
                if has_plain(b[k]):
                    out.append(ValueChange(p, "only_in_b", b=b[k]))
            elif k not in b:
                if has_plain(a[k]):
                    out.append(ValueChange(p, "only_in_a", a=a[k]))
            else:
                _values_diff(a[k], b[k], p, out)
        return
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _values_diff(x, y, f"{path}.{i}" if path else str(i), out)
        return
    if a != b or type(a) is not type(b):
        out.append(ValueChange(path or "<root>", "changed", a, b))


def json_short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def diff(
    a: str,
    b: str,
    *,
    storage_options: Optional[Dict[str, Any]] = None,
    b_storage_options: Optional[Dict[str, Any]] = None,
    atol: float = 0.0,
    progress: bool = False,
    io_threads: Optional[int] = None,
    block_bytes: int = BLOCK_BYTES,
) -> DiffReport:
    """Compare checkpoints ``a`` and ``b`` (any layouts/world sizes; safetensors dirs too).

    Tensors are streamed in aligned blocks from both sides (memory: a few
    blocks), compared bit-exactly (NaN equals NaN) or within ``atol`` for
    floats; the report lists tensors only in one side, dtype/shape changes,
    and for changed values the number of differing elements and the largest
    absolute difference. Plain values are compared too. Checksums of both
    sides are verified on the way (a damaged side raises). A safetensors
    side compared with a native one has its names put under ``model.``.
    """
    io_threads = _knobs.IO_THREADS if io_threads is None else io_threads  # read at each call
    sa = open_checkpoint(a, storage_options)
    sb = open_checkpoint(b, b_storage_options if b_storage_options is not None else storage_options)
    # A safetensors directory holds bare model names; compared with a native
    # checkpoint of {"model": ...} they sit under "model.".
    for x, y in ((sa, sb), (sb, sa)):
        if x.kind == "safetensors" and y.kind != "safetensors" and any(n.startswith("model.") for n in y.tensors):
            x.tensors = {f"model.{n}": t for n, t in x.tensors.items()}
    rep = DiffReport(a=a, b=b)
    rep.removed = sorted(set(sa.tensors) - set(sb.tensors))
    rep.added = sorted(set(sb.tensors) - set(sa.tensors))
    ra, rb = Reader(sa), Reader(sb)
    common = sorted(set(sa.tensors) & set(sb.tensors))
    work = []
    for name in common:
        ta, tb = sa.tensors[name], sb.tensors[name]
        if ta.dtype != tb.dtype:
            rep.changed.append(Change(name, "dtype", f"dtype {ta.dtype} -> {tb.dtype}", a=ta.dtype, b=tb.dtype))
        elif tuple(ta.shape) != tuple(tb.shape):
            rep.changed.append(
                Change(name, "shape", f"shape {list(ta.shape)} -> {list(tb.shape)}", a=list(ta.shape), b=list(tb.shape))
            )
        else:
            work.append(name)
    ra.check_source_files(work)
    rb.check_source_files(work)
    total = sum(sa.tensors[n].nbytes for n in work)
    bar = Progress(2 * total, progress, "diff")
    stats: Dict[str, List[float]] = {n: [0, 0.0] for n in work}

    def jobs():
        for name in work:
            ta, tb = sa.tensors[name], sb.tensors[name]
            isz = itemsize(ta.dtype)
            step = max(1, block_bytes // isz) if (ta.flat and tb.flat) else max(1, block_bytes // max(1, ta.row * isz)) * ta.row
            for s in range(0, ta.numel, step):
                yield _job(name, ta, tb, s, min(ta.numel, s + step))

    def _job(name, ta, tb, s, e):
        def run():
            x = _read(ra, ta, s, e, block_bytes)
            y = _read(rb, tb, s, e, block_bytes)
            n = x.numel()
            if torch.equal(x, y):
                return name, 0, 0.0, n
            dt = torch_dtype(ta.dtype)
            cnt, mx = _compare(x.view(dt), y.view(dt), atol)
            return name, cnt, mx, n

        return run

    try:
        with ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix="shardckpt-diff") as pool:
            for name, cnt, mx, n in prefetch(pool, jobs(), max(2, io_threads)):
                st = stats[name]
                st[0] += cnt
                if cnt and (math.isnan(mx) or mx > st[1] or math.isnan(st[1])):
                    st[1] = mx if not math.isnan(st[1]) else st[1]
                bar.update(2 * n)
    finally:
        bar.close()
    ra.finish()
    rb.finish()
    for name in work:
        cnt, mx = stats[name]
        if cnt:
            numel = sa.tensors[name].numel
            rep.changed.append(Change(name, "values", f"{int(cnt)} of {numel} elements differ, max |a-b| = {mx:.6g}", int(cnt), mx))
        else:
            rep.identical += 1
    rep.changed.sort(key=lambda c: c.name)
    if sa.values is not None and sb.values is not None:  # safetensors sources have no values
        _values_diff(sa.values, sb.values, "", rep.value_changes)
    return rep
