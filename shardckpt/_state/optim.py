"""Optimizers in the state: per-parameter state by FQN, sharded like the parameters.

An optimizer keeps its state by parameter object and its groups by position;
neither survives a restart, a rewrap or a new world size. It is saved as

    {"state": {fqn: {"step": t, "exp_avg": t, ...}}, "param_groups": [{..., "params": [fqn, ...]}]}

(torch's FQN-keyed optimizer state dict), so names in the manifest read
``optim.state.layers.0.attn.wq.weight.exp_avg``. States shaped like their
parameter are DTensors / ShardedTensors exactly where the parameters are, and
are resharded on load like any tensor.

Pairing: the FQNs come from the ``nn.Module`` in the same ``state`` whose
parameters the optimizer holds (searched through nested dicts and lists), or
from the module of a ``Selected`` part of one (``trainable(model)``: the
optimizer of the adapters beside only the adapters). If
several do (a model and one of its submodules), the outermost one is used;
modules that are not nested in one another are ambiguous and raise.

Where torch's ``torch.distributed.checkpoint.state_dict`` serves, it is used:
``get_optimizer_state_dict`` names a stepped optimizer's state for every
runtime, ``set_optimizer_state_dict`` loads FSDP1 (it alone can turn
``ShardedTensor`` states back into ``FlatParameter`` shards). It is not used

* to save an optimizer that has not stepped: it would first run a zero-lr
  step to create state (``step`` becomes 1, moments 0), which changes the
  rest of the run (Adam's bias correction) — the empty state is saved as is;
* to load non-FSDP1 optimizers: torch's path also runs that step when the
  live optimizer is empty, and then calls ``Optimizer.load_state_dict``; here
  the FQN -> position mapping is done directly, with the same result.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import torch
import torch.nn as nn

from .._format import torch_dtype
from .._format.values import TAG, is_tensor_ref
from .._runtimes import is_fsdp1, param_fqns
from ..errors import CorruptCheckpointError, StateMismatchError, UnsupportedStateError, format_offenders
from .base import MISSING, SEP, Adapter, fill_from_saved, is_tensor, join_path
from .module import Selected
from .stateful import StatefulAdapter
from .subclass import is_subclass_node

__all__ = ["OptimizerAdapter", "find_module", "optimizer_state_problems", "state_shape_fits"]

STATE = "state"
GROUPS = "param_groups"
PARAMS = "params"

#: Param-group keys torch fills with a default when a loaded group lacks them
#: (the optimizers' ``__setstate__``), or that are bookkeeping rather than
#: hyperparameters (``initial_lr``, ``param_names``): a live group may have
#: them and the checkpoint not. Any other live key the saved group lacks
#: (SGD's ``momentum`` in an Adam checkpoint) would be gone after the load and
#: fail the first ``step()``. Saved keys the live group lacks are carried
#: along (LR schedulers add ``max_lr``... to the groups), not refused.
TOLERATED_GROUP_KEYS = frozenset(
    {
        "amsgrad", "nesterov", "maximize", "foreach", "capturable", "differentiable", "fused",
        "decoupled_weight_decay", "initial_lr", "param_names",
    }
)


#: How the live optimizer runs, not what it learned: the user chose these
#: for this machine (``fused`` kernels on CUDA, ``foreach`` off for mixed
#: sharded and plain parameters, ``capturable`` for CUDA graphs). A load keeps
#: the live group's values and takes every other key (``lr``, ``betas``,
#: ``weight_decay``, ``eps``, schedulers' ``initial_lr``...) from the checkpoint.
LIVE_GROUP_KEYS = ("foreach", "fused", "capturable", "differentiable")


def keep_live_settings(saved_group: Dict[str, Any], live_group: Dict[str, Any]) -> Dict[str, Any]:
    """``saved_group`` with :data:`LIVE_GROUP_KEYS` taken from ``live_group`` where it has them.

        >>> keep_live_settings({"lr": 0.1, "foreach": None}, {"lr": 1.0, "foreach": False})
        {'lr': 0.1, 'foreach': False}
    """
    return {**saved_group, **{k: live_group[k] for k in LIVE_GROUP_KEYS if k in live_group}}


def state_shape_fits(shape: Sequence[int], param_shape: Sequence[int]) -> bool:
    """True if a per-parameter optimizer state of ``shape`` can belong to a parameter of ``param_shape``.

    Accepted: the parameter's shape (moments, momentum buffers), a scalar
    (``step``), or the parameter's shape with some dimensions reduced to 1
    (factored second moments: Adafactor's ``row_var``/``col_var``).

    Example:
        >>> state_shape_fits([4, 1], [4, 8]), state_shape_fits([8, 4], [4, 8])
        (True, False)
    """
    shape, param_shape = list(shape), list(param_shape)
    if shape == param_shape or len(shape) == 0 or (len(shape) == 1 and shape[0] == 1):
        return True
    return len(shape) == len(param_shape) and all(a == b or a == 1 for a, b in zip(shape, param_shape))


def _kind(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, torch.Tensor):
        return "number" if v.numel() == 1 else "tensor"
    if isinstance(v, (list, tuple)):
        return f"sequence of {len(v)}"
    return type(v).__name__


def optimizer_state_problems(
    optim: torch.optim.Optimizer,
    saved_groups: Sequence[Any],
    live_groups_of_saved: Dict[int, int],
    saved_state_keys: Dict[str, Sequence[str]],
    live_state_keys: Dict[str, Sequence[str]],
    path: str,
) -> List[str]:
    """What makes a saved optimizer state unfit for ``optim``, one line per problem (empty: fits).

    Pure: compares decoded saved values with the live optimizer, changes
    nothing. The load calls it while planning, so a mismatch is raised before
    any tensor or value of the state is touched.

    Args:
        optim: the live optimizer.
        saved_groups: the saved ``param_groups`` (decoded values).
        live_groups_of_saved: saved group index -> the live group index it feeds.
        saved_state_keys: FQN -> the saved per-parameter state keys.
        live_state_keys: FQN -> the live per-parameter state keys (a stepped
            optimizer; empty for a fresh one, whose state is created by the load).
        path: the optimizer's path in the state, for messages.

    Checks: hyperparameter names (a live key the checkpoint lacks, beyond
    ``TOLERATED_GROUP_KEYS``: another kind of optimizer), the kind of each
    common hyperparameter value (number, bool, sequence of n...), and the
    per-parameter state keys against a stepped live optimizer.

    Example:
        ``Adam`` state into ``SGD(momentum=0.9)``: ``["optim.param_groups.0: the
        live SGD's hyperparameters dampening, momentum are not in the
        checkpoint, which has betas, eps instead"]``.
    """
    problems: List[str] = []
    for si, li in sorted(live_groups_of_saved.items()):
        saved = saved_groups[si]
        live = optim.param_groups[li]
        s_keys = {k for k in saved if k != PARAMS}
        l_keys = {k for k in live if k != PARAMS}
        lack = sorted(l_keys - s_keys - TOLERATED_GROUP_KEYS)
        where = f"{path}.{GROUPS}.{si}"
        if lack:
            extra = sorted(s_keys - l_keys - TOLERATED_GROUP_KEYS)
            said = f"the live {type(optim).__name__}'s hyperparameters {format_offenders(lack)} are not in the checkpoint"
            if extra:
                said += f", which has {format_offenders(extra)} instead"
            problems.append(f"{where}: {said}")
            continue
        bad = [
            f"{k} (saved {_kind(saved[k])}, live {_kind(live[k])})"
            for k in sorted((s_keys & l_keys) - {"param_names"})
            if "none" not in (_kind(saved[k]), _kind(live[k])) and _kind(saved[k]) != _kind(live[k])
        ]
        if bad:
            problems.append(f"{where}: values of another kind: {format_offenders(bad)}")
    for fqn in sorted(set(saved_state_keys) & set(live_state_keys)):
        s, l_ = set(saved_state_keys[fqn]), set(live_state_keys[fqn])
        if s != l_:
            problems.append(
                f"{path}.{STATE}.{fqn}: saved state keys {sorted(s)}, the live {type(optim).__name__} has {sorted(l_)}"
            )
    return problems


def _optimizer_params(optim: torch.optim.Optimizer) -> List[Any]:
    return [p for g in optim.param_groups for p in g[PARAMS]]


def _module_advice(key: str, loose: List[str]) -> str:
    """The fix for an optimizer without its module: :func:`trainable` when its parameters sit there bare."""
    if loose:
        # {name: p for trainable p} is the natural way to save adapters; the
        # model beside it would save the whole frozen base as well.
        return (
            f"Its parameters are there as bare tensors ({format_offenders(loose)}), which carry no module names "
            f"for its state: save them as shardckpt.trainable(model) instead, the parameters that require grad "
            f"by their names, e.g. {{'adapters': shardckpt.trainable(model), {key!r}: optimizer}}"
        )
    return (
        f"Put the model next to it, e.g. {{'model': model, {key!r}: optimizer}}, or only the part that trains: "
        f"{{'adapters': shardckpt.trainable(model), {key!r}: optimizer}}"
    )


def find_module(root: Any, optim: torch.optim.Optimizer, path: str) -> nn.Module:
    """The module in ``root`` (the user's state) whose parameters ``optim`` holds.

    Raises:
        UnsupportedStateError: no module holds all of them, or several
            unrelated ones do.
    """
    want = {id(p) for p in _optimizer_params(optim)}
    found: List[Tuple[str, nn.Module]] = []
    loose: List[str] = []  # the optimizer's parameters found as bare tensors (a dict of them)

    def visit(v: Any, where: str, depth: int) -> None:
        if depth > 32:
            return
        if isinstance(v, Selected):  # part of a module: its optimizer is named by the module's FQNs
            v = v.module
        if isinstance(v, torch.Tensor) and id(v) in want:
            loose.append(where)
        if isinstance(v, nn.Module):
            if want <= {id(p) for p in v.parameters()} and not any(m is v for _, m in found):
                found.append((where, v))
        elif isinstance(v, dict):
            for k, x in v.items():
                visit(x, join_path(where, k), depth + 1)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                visit(x, join_path(where, i), depth + 1)

    visit(root, "", 0)
    if not found:
        raise UnsupportedStateError(
            f"{path}: an optimizer is saved by parameter name, so its model must be in the same state; "
            f"no nn.Module there holds all of its parameters. " + _module_advice(path.split(SEP)[-1], loose)
        )
    outer = [(w, m) for w, m in found if all(any(x is o for x in m.modules()) for _, o in found)]
    if len(outer) != 1:
        raise UnsupportedStateError(
            f"{path}: the optimizer's parameters belong to several unrelated modules in the state "
            f"({', '.join(w for w, _ in found)}); keep only the one it optimizes"
        )
    return outer[0][1]


def _fqn_groups(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> List[List[str]]:
    """FQNs of each param group's parameters, in order."""
    fqns = param_fqns(model)
    groups, stray = [], 0
    for g in optim.param_groups:
        names: List[str] = []
        for p in g[PARAMS]:
            if id(p) not in fqns:
                stray += 1
                continue
            names.extend(fqns[id(p)])
        groups.append(names)
    if stray:
        raise UnsupportedStateError(f"{path}: {stray} optimizer parameter(s) are not parameters of its model")
    return groups


def _empty_state_dict(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> Dict[str, Any]:
    groups = []
    for g, names in zip(optim.param_groups, _fqn_groups(model, optim, path)):
        d = {k: v for k, v in g.items() if k != PARAMS}
        d[PARAMS] = names
        groups.append(d)
    return {STATE: {}, GROUPS: groups}


class OptimizerAdapter(Adapter):
    """``torch.optim.Optimizer``: state by FQN, sharded like the parameters (see module doc)."""

    def matches(self, obj):
        return isinstance(obj, torch.optim.Optimizer)

    def save(self, optim, path, walker):
        model = find_module(walker.root, optim, path)
        if not optim.state:
            return _empty_state_dict(model, optim, path)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optim)

    def load(self, optim, path, saved, walker):
        """Plan the load of ``optim``'s state, in five phases; the optimizer changes only in the finalizer.

        1. :func:`_match_groups`: the saved parameter names against the live
           ones (missing and unexpected recorded; reorganized groups refused
           when strict);
        2. :func:`_live_tensors`: the state tensors the optimizer already has
           and its parameters by name;
        3. :func:`_plan_param_state`: each parameter's saved state: live
           tensors filled in place, new ones created like their parameter or
           from the checkpoint, plain values filled later;
        4. :func:`_check_fits`: hyperparameters and state keys against the
           live optimizer, so a mismatch is refused before anything is loaded;
        5. :func:`_finisher`: after every tensor is in, the state dict handed
           to torch (``set_optimizer_state_dict`` for FSDP1, by FQN otherwise).

        Raises:
            StateMismatchError: no optimizer state saved at ``path``;
                reorganized groups (strict); state that does not fit.
            CorruptCheckpointError: a malformed saved state.
        """
        if saved is MISSING:
            walker.missing_values.append(path)
            return
        if not (isinstance(saved, dict) and isinstance(saved.get(STATE), dict) and isinstance(saved.get(GROUPS), list)):
            raise StateMismatchError(f"{path}: the checkpoint holds no optimizer state here")
        model = find_module(walker.root, optim, path)
        fsdp1 = is_fsdp1(model)
        live_groups, group_of, missing = _match_groups(model, optim, path, saved, walker)
        live_state, params_by_fqn = _live_tensors(model, optim, fsdp1)
        common = [f for g in live_groups for f in g if f in group_of]
        new_state, saved_keys, shape_problems = _plan_param_state(path, saved[STATE], common, live_state, params_by_fqn, walker)
        groups_holder: Dict[str, Any] = {}
        fill_from_saved(groups_holder, GROUPS, saved[GROUPS], join_path(path, GROUPS), walker)
        feeds = _check_fits(optim, path, live_groups, group_of, groups_holder, saved_keys, live_state, shape_problems)
        walker.flat.finalizers.append(
            _finisher(model, optim, path, fsdp1, new_state, saved_keys, groups_holder, feeds, set(missing))
        )


def _match_groups(model: nn.Module, optim: Any, path: str, saved: Dict[str, Any], walker: Any) -> Tuple[List[List[str]], Dict[str, int], List[str]]:
    """Phase 1: live parameter groups (FQNs), each saved FQN's group, and the live FQNs the checkpoint lacks.

    Records missing and unexpected parameters on ``walker``; with
    ``walker.strict`` refuses a live group drawing from several saved groups
    (its hyperparameters would be ambiguous).
    """
    live_groups = _fqn_groups(model, optim, path)
    live_fqns = [f for g in live_groups for f in g]
    group_of: Dict[str, int] = {}
    for i, g in enumerate(saved[GROUPS]):
        names = g.get(PARAMS) if isinstance(g, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise CorruptCheckpointError(f"{path}.param_groups.{i}: 'params' must be a list of parameter names")
        for n in names:
            group_of[n] = i
    live_set = set(live_fqns)
    missing = sorted(f for f in live_fqns if f not in group_of)
    unexpected = sorted(f for f in group_of if f not in live_set)
    walker.missing_values.extend(f"{path}.state.{f}" for f in missing)
    for f in unexpected:
        walker.unexpected(f"{path}.state.{f}")
        walker.flat.skip.append(f"{path}.state.{f}")
    # A live param group must map to one saved group: its hyperparameters
    # come from there.
    mixed = []
    for i, names in enumerate(live_groups):
        src = sorted({group_of[f] for f in names if f in group_of})
        if len(src) > 1:
            mixed.append(f"live group {i} <- saved groups {src}")
    if mixed and walker.strict:
        raise StateMismatchError(
            f"{path}: parameter groups were reorganized since the save ({'; '.join(mixed)}); "
            "pass strict=False to take each live group's hyperparameters from the first saved group it draws from"
        )
    return live_groups, group_of, missing


def _live_tensors(model: nn.Module, optim: Any, fsdp1: bool) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Phase 2: the optimizer's current state by FQN (empty before its first step), and its parameters by FQN."""
    live_state: Dict[str, Any] = {}
    if optim.state:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        live_state = dict(cast(Dict[str, Any], get_optimizer_state_dict(model, optim)[STATE]))
    params_by_fqn: Dict[str, Any] = {}
    if not fsdp1:
        fq = param_fqns(model)
        for p in _optimizer_params(optim):
            for f in fq.get(id(p), ()):
                params_by_fqn[f] = p
    return live_state, params_by_fqn


def _plan_param_state(
    path: str, saved_state: Dict[str, Any], common: List[str], live_state: Dict[str, Any], params_by_fqn: Dict[str, Any], walker: Any
) -> Tuple[Dict[str, Dict[str, Any]], Dict[str, List[str]], List[str]]:
    """Phase 3: each common parameter's state to load: ``(new state by FQN, saved keys by FQN, shape problems)``.

    A stepped optimizer already has its tensors (torch names them): filled
    in place. An empty one gets tensors shaped like their parameter (same
    DTensor sharding) or, for other shapes (scalar ``step``), full tensors
    built from the checkpoint. A saved state shaped like no parameter is a
    shape problem, refused in phase 4 together with the others.
    """
    new_state: Dict[str, Dict[str, Any]] = {}
    shape_problems: List[str] = []
    saved_keys: Dict[str, List[str]] = {}
    for fqn in common:
        node = saved_state.get(fqn, MISSING)
        if node is MISSING:
            continue  # saved without state (it had not been stepped)
        if not isinstance(node, dict) or TAG in node:
            raise CorruptCheckpointError(f"{path}.state.{fqn}: expected a dict of per-parameter state")
        got = live_state.get(fqn)
        live: Dict[str, Any] = got if isinstance(got, dict) else {}
        saved_keys[fqn] = list(node)
        st: Dict[str, Any] = {}
        new_state[fqn] = st
        for k, sub in node.items():
            name_path = join_path(join_path(join_path(path, STATE), fqn), k)
            t = live.get(k)
            if is_tensor_ref(sub):
                meta = walker.saved_tensors.get(sub["name"])
                param = params_by_fqn.get(fqn)
                if is_tensor(t):
                    walker.target(sub["name"], t)  # shape checked against the live tensor while planning
                    st[k] = t
                elif param is not None and meta is not None and not state_shape_fits(meta.shape, param.shape):
                    # Creating it from the checkpoint would give the
                    # optimizer a state of another parameter's shape.
                    shape_problems.append(f"{name_path}: saved shape {list(meta.shape)}, parameter shape {list(param.shape)}")
                elif param is not None and meta is not None and list(meta.shape) == list(param.shape):
                    st[k] = torch.zeros_like(param, dtype=torch_dtype(meta.dtype), requires_grad=False)
                    walker.target(sub["name"], st[k])
                else:
                    fill_from_saved(st, k, sub, name_path, walker)
            elif is_tensor(t) and is_subclass_node(sub):
                # A live tensor subclass (low-bit optimizer state): filled in place.
                walker.target(name_path, t, sub)
                st[k] = t
            else:
                fill_from_saved(st, k, sub, name_path, walker)
    return new_state, saved_keys, shape_problems


def _check_fits(
    optim: Any, path: str, live_groups: List[List[str]], group_of: Dict[str, int], groups_holder: Dict[str, Any],
    saved_keys: Dict[str, List[str]], live_state: Dict[str, Any], shape_problems: List[str],
) -> Dict[int, int]:
    """Phase 4: refuse saved state that does not fit the live optimizer, now, while planning.

    A mismatch found by the first ``step()`` (``KeyError: 'momentum'``)
    would come after the model was already loaded. Returns which live group
    each saved group feeds (saved index -> live index).
    """
    feeds: Dict[int, int] = {}
    for li, names in enumerate(live_groups):
        for f in names:
            if f in group_of:
                feeds.setdefault(group_of[f], li)
    live_keys = {f: list(v) for f, v in live_state.items() if isinstance(v, dict) and f in saved_keys}
    problems = shape_problems + optimizer_state_problems(
        optim, groups_holder[GROUPS], feeds, cast(Dict[str, Sequence[str]], saved_keys), cast(Dict[str, Sequence[str]], live_keys), path
    )
    if problems:
        raise StateMismatchError(
            f"{path}: the saved optimizer state does not fit the live {type(optim).__name__} "
            f"(another optimizer, or another model's state): {format_offenders(problems, sep='; ')}. "
            "Load it into the same kind of optimizer over the same model, or leave "
            f"{path!r} out of the state you load"
        )
    return feeds


def _finisher(
    model: nn.Module, optim: Any, path: str, fsdp1: bool, new_state: Dict[str, Dict[str, Any]], saved_keys: Dict[str, List[str]],
    groups_holder: Dict[str, Any], feeds: Dict[int, int], keep_missing: set,
) -> Callable[[], None]:
    """Phase 5: the finalizer that hands the loaded state to the optimizer once every tensor is in."""

    def finish():
        # Tensors made here and values filled later land out of order:
        # each parameter's state keeps the saved key order.
        ordered = {f: {k: st[k] for k in saved_keys[f] if k in st} | st for f, st in new_state.items()}
        # Before torch's load_state_dict sees them: its placement of the
        # ``step`` tensors follows the group's ``capturable``/``fused``.
        saved_g = [
            keep_live_settings(g, optim.param_groups[feeds[i]]) if i in feeds and isinstance(g, dict) else g
            for i, g in enumerate(groups_holder[GROUPS])
        ]
        osd = {STATE: ordered, GROUPS: saved_g}
        if fsdp1:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(model, optim, osd, options=StateDictOptions(strict=False))
        else:
            _load_by_fqn(model, optim, osd, keep_missing, path)

    return finish


def _load_by_fqn(model: nn.Module, optim: torch.optim.Optimizer, osd: Dict[str, Any], keep: set, path: str) -> None:
    """``optim.load_state_dict`` with FQN-keyed ``osd`` mapped onto the live positions.

    Parameters in ``keep`` (absent from the checkpoint, a non-strict load)
    keep their live state.
    """
    fq = param_fqns(model)
    group_of: Dict[str, Dict[str, Any]] = {}
    for g in osd[GROUPS]:
        for n in g[PARAMS]:
            group_of.setdefault(n, g)
    state: Dict[int, Any] = {}
    groups: List[Dict[str, Any]] = []
    idx = 0
    for g in optim.param_groups:
        src: Optional[Dict[str, Any]] = None
        ids = []
        for p in g[PARAMS]:
            fqn = fq[id(p)][0]
            if src is None and fqn in group_of:
                src = group_of[fqn]
            if fqn in osd[STATE]:
                state[idx] = osd[STATE][fqn]
            elif fqn in keep and p in optim.state:
                state[idx] = optim.state[p]
            ids.append(idx)
            idx += 1
        # The saved group's keys in the saved order; params (and param_names) are the live ones.
        live = {PARAMS: ids, **({"param_names": list(g["param_names"])} if "param_names" in g else {})}
        src = keep_live_settings(src, g) if src is not None else g
        ng = {k: live[k] if k in live else v for k, v in src.items() if k in live or k != "param_names"}
        groups.append(ng | {k: v for k, v in live.items() if k not in ng})
    optim.load_state_dict({STATE: state, GROUPS: groups})


class FlatOptimizerAdapter(Adapter):
    """An optimizer whose own ``state_dict()`` is not torch's ``{"state", "param_groups"}`` shape.

    torchtitan's ``OptimizersContainer`` is one ``torch.optim.Optimizer``
    spanning several model parts whose ``state_dict()`` is flat by FQN
    (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``). Such an object is
    saved and loaded through its own ``state_dict()``/``load_state_dict()``
    (tensors under their flat names, DTensors sharded as they are); an
    optimizer returning torch's shape goes to the by-parameter-name
    optimizer adapter as before.
    """

    def matches(self, obj):
        return isinstance(obj, torch.optim.Optimizer) and (
            type(obj).state_dict is not torch.optim.Optimizer.state_dict
            and type(obj).load_state_dict is not torch.optim.Optimizer.load_state_dict
        )

    @staticmethod
    def _torch_shaped(sd: Any) -> bool:
        return isinstance(sd, dict) and set(sd) == {"state", "param_groups"}

    def save(self, obj, path, walker):
        sd = obj.state_dict()
        if self._torch_shaped(sd):
            from .optim import OptimizerAdapter

            return OptimizerAdapter().save(obj, path, walker)
        return sd

    def load(self, obj, path, saved, walker):
        if self._torch_shaped(saved):
            from .optim import OptimizerAdapter

            OptimizerAdapter().load(obj, path, saved, walker)
            return
        StatefulAdapter().load(obj, path, saved, walker)
