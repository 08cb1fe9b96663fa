"""The built-in adapter of ``nn.Module``: its state dict by FQN, filled in place (any runtime).

Also what it needs to tell: state-dict hooks that return throwaway copies
(``throwaway_copies``) or route state back (``routes_state_back``), tied
weights (``tied_groups``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from .._format.values import tensor_ref
from .._hf import select_names
from .._runtimes import (
    empty_like_meta,
    fsdp1_load_model_state,
    fsdp1_model_state,
    is_fsdp1,
    materialize_device,
    unwrap,
    wrapper_renamer,
)
from ..errors import StateMismatchError, UnsupportedStateError, format_offenders
from .base import (
    MISSING,
    SEP,
    Adapter,
    Raw,
    fill_from_saved,
    is_tensor,
    join_path,
)

__all__ = [
    "ModuleAdapter",
    "Selected",
    "Patterns",
    "SelectedAdapter",
    "trainable",
    "select",
    "throwaway_copies",
    "routes_state_back",
    "tied_groups",
]


class ModuleAdapter(Adapter):
    """``nn.Module`` of any runtime: its state dict by FQN, filled in place.

    Plain modules, FSDP2, TP and HSDP: ``state_dict(keep_vars=True)`` yields
    the Parameters themselves (DTensors when sharded), so a load ``copy_``-es
    into their storage and never swaps a Parameter or its ``.data`` — FSDP2's
    all-gathers and the optimizer keep seeing the same objects.

    DDP and ``torch.compile`` wrappers are looked through, so names carry no
    ``module.``/``_orig_mod.`` prefix and checkpoints move between runtimes.

    FSDP1 goes through torch's sharded state dict (``ShardedTensor``\\ s),
    filled and handed back with ``set_model_state_dict`` (collective).

    Parameters or buffers still on the meta device get new tensors of their
    live dtype and sharding, on the device ``_runtimes.materialize_device``
    picks, installed with ``load_state_dict(assign=True)`` — FSDP2's post-load
    hook then re-pads its sharded storage. Only entries the checkpoint has
    are materialized; the rest stay on meta and are reported missing.
    """

    def matches(self, obj):
        return isinstance(obj, torch.nn.Module)

    def save(self, obj, path, walker, *, keep: Optional[Callable[[str], bool]] = None):
        """``obj``'s state dict by FQN; ``keep`` (a :class:`Selected`'s): only the names it keeps."""
        m = unwrap(obj)
        if is_fsdp1(m):
            return _kept(fsdp1_model_state(m), keep, path)
        sd = _kept(_module_tensors(m, path), keep, path)
        meta = [k for k, t in sd.items() if is_tensor(t) and t.is_meta]
        if meta:
            raise UnsupportedStateError(
                f"{path}: tensors on the meta device hold no data and cannot be saved: {format_offenders(meta)}"
            )
        # Tied parameters (one tensor under several names) are written once,
        # under the first name in module order; the others are references to
        # it in the values tree (the manifest's record of the alias).
        for names in tied_groups(sd):
            for alias in names[1:]:
                sd[alias] = Raw(tensor_ref(join_path(path, names[0])))
        return sd

    def load(self, obj, path, saved, walker, *, keep: Optional[Callable[[str], bool]] = None):
        """Plan filling ``obj`` in place; ``keep``: only the names it keeps (the rest stay as they are)."""
        m = unwrap(obj)
        if is_fsdp1(m):
            # The whole dict goes back to torch (it wants every key); only the kept ones are filled.
            sd = fsdp1_model_state(m)
            extra = self._fsdp1_extra_state(sd, path, saved, walker)
            self._targets(_kept({k: v for k, v in sd.items() if k not in extra}, keep, path), path, saved, walker)
            walker.flat.finalizers.append(lambda: fsdp1_load_model_state(m, sd))
            return
        back: Dict[str, str] = {}
        sd = _kept(_module_tensors(m, path, back), keep, path)
        extra = self._extra_state(m, sd, path, saved, walker, back)
        copies = throwaway_copies(m, sd)
        quant = _bnb_quant_states(m, sd, copies, path)
        if quant:
            # Read as new tensors (their sizes may differ from the live ones:
            # the packed JSON of the state), then installed.
            copies = [k for k in copies if k not in quant.keys]
            for k in quant.keys:
                del sd[k]
                node = saved.get(k, MISSING) if isinstance(saved, dict) else MISSING
                if node is MISSING:
                    walker.missing_values.append(join_path(path, k))
                    continue
                fill_from_saved(quant.parts_of(k), k, node, join_path(path, k), walker)
            walker.flat.finalizers.append(quant.install)
        if copies and not routes_state_back(m, [back[k] for k in copies]):
            raise UnsupportedStateError(
                f"{path}: state_dict() returns tensors that are copies, not the module's parameters or buffers "
                f"({format_offenders([join_path(path, k) for k in copies])}), and no load_state_dict pre-hook or "
                "_load_from_state_dict override could put them back: a load would fill the copies and leave the "
                "weights as they are. Register the inverse hook (module.register_load_state_dict_pre_hook) or "
                "make state_dict() return views of the parameters"
            )
        assign = self._materialize_meta(m, sd, path, walker)
        self._untie_targets(sd, path, walker)
        self._targets(sd, path, saved, walker)
        if assign:
            walker.flat.finalizers.append(lambda: m.load_state_dict({back[k]: v for k, v in assign.items()}, strict=False, assign=True))
        if copies:
            # DCP's flow for such modules: the copies were filled; the module's
            # own load_state_dict (and its hooks) puts them into the weights.
            # Extra state goes in too: load_state_dict hands it to set_extra_state.
            walker.flat.finalizers.append(
                lambda: m.load_state_dict(
                    {back[k]: v for k, v in ({**sd, **{k: h["v"] for k, (_, h) in extra.items()}}).items()}, strict=keep is None
                )
            )
        else:
            for owner, h in extra.values():
                walker.flat.finalizers.append(lambda o=owner, h=h: o.set_extra_state(h["v"]))

    @staticmethod
    def _extra_state(m, sd, path, saved, walker, back):
        """Give each submodule's ``get_extra_state()`` value back through its ``set_extra_state``.

        As ``nn.Module.load_state_dict`` does: the saved value (a dict, an
        int, ``io.BytesIO``, a tensor, a dict holding tensors...) is rebuilt
        whole (tensors as new full tensors, at any world size) and handed to
        ``set_extra_state`` once every tensor was read and checked. The key
        leaves ``sd``: the live ``get_extra_state()`` result is a copy that
        filling would not reach. Returns ``key -> (submodule, holder)``;
        ``holder["v"]`` is the value once the load's tensors are in.
        """
        from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX

        out: Dict[str, Any] = {}
        for k in [k for k in sd if k == _EXTRA_STATE_KEY_SUFFIX or k.endswith(SEP + _EXTRA_STATE_KEY_SUFFIX)]:
            del sd[k]
            own = back.get(k, k)
            owner = m.get_submodule(own[: -len(_EXTRA_STATE_KEY_SUFFIX)].rstrip(SEP))
            node = saved.get(k, MISSING) if isinstance(saved, dict) else MISSING
            where = join_path(path, k)
            if node is MISSING:
                walker.missing_values.append(where)
                continue
            holder: Dict[str, Any] = {}
            fill_from_saved(holder, "v", node, where, walker)
            out[k] = (owner, holder)
        return out

    @staticmethod
    def _fsdp1_extra_state(sd, path, saved, walker):
        """FSDP1: each ``get_extra_state()`` value rebuilt from the checkpoint into the state dict handed back.

        torch's ``set_model_state_dict`` passes the dict to the modules'
        ``load_state_dict``, which gives each value to its
        ``set_extra_state``; the key leaves the fill targets (the live value
        is a copy that filling would not reach) and is replaced, in ``sd``,
        by the saved value (tensors in it as new full tensors).
        """
        from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX

        keys = [k for k in sd if k == _EXTRA_STATE_KEY_SUFFIX or k.endswith(SEP + _EXTRA_STATE_KEY_SUFFIX)]
        for k in keys:
            node = saved.get(k, MISSING) if isinstance(saved, dict) else MISSING
            where = join_path(path, k)
            if node is MISSING:
                del sd[k]
                walker.missing_values.append(where)
                continue
            sd[k] = None  # never filled in place: the saved value replaces it
            fill_from_saved(sd, k, node, where, walker)
        return set(keys)

    @staticmethod
    def _untie_targets(sd, path, walker):
        """Fill each tied tensor once, from whichever of its names the checkpoint has.

        The other names leave ``sd`` (not missing: they are the same tensor)
        and, if the checkpoint holds them too, are skipped rather than
        reported unexpected.
        """
        for names in tied_groups(sd):
            present = [n for n in names if join_path(path, n) in walker.saved_tensors]
            primary = present[0] if present else names[0]
            for n in names:
                if n != primary:
                    del sd[n]
                    if n in present:
                        walker.flat.skip.append(join_path(path, n))
                        walker.flat.tied.append((join_path(path, primary), join_path(path, n)))

    @staticmethod
    def _targets(sd, path, saved, walker):
        for k, t in sd.items():
            if is_tensor(t):
                walker.target(join_path(path, k), t, saved.get(k) if isinstance(saved, dict) else None)
            else:
                sub = saved.get(k, MISSING) if isinstance(saved, dict) else MISSING
                walker.walk(t, sub, join_path(path, k), None)

    @staticmethod
    def _materialize_meta(m, sd, path, walker) -> Dict[str, Any]:
        """Swap meta entries of ``sd`` the checkpoint has for empty real tensors; return them."""
        meta_keys = [k for k, t in sd.items() if is_tensor(t) and t.is_meta and join_path(path, k) in walker.saved_tensors]
        # A tied tensor is materialized under all its names, so that
        # load_state_dict(assign=True) installs one Parameter everywhere and
        # the tie survives (HF directories hold only one of the names).
        for names in tied_groups(sd):
            if any(n in meta_keys for n in names):
                meta_keys += [n for n in names if n not in meta_keys]
        if not meta_keys:
            return {}

        device_of = materialize_device(m)
        made: Dict[int, Any] = {}  # tied weights share one new Parameter
        out = {}
        for k in meta_keys:
            t = sd[k]
            if id(t) not in made:
                new = _empty_like_meta(t, device_of(t))
                if isinstance(t, torch.nn.Parameter):
                    # assign=True installs a Parameter as is: every tied name gets this one object
                    new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                made[id(t)] = new
            sd[k] = out[k] = made[id(t)]
        return out


#: bitsandbytes' 4-bit parameter type, by name (nothing is imported for it).
BNB_PARAMS4BIT = "bitsandbytes.nn.modules.Params4bit"


class _QuantStates:
    """The quantization states of bitsandbytes ``Params4bit`` parameters, put back after the load fills them.

    ``Linear4bit.state_dict()`` writes each 4-bit weight's ``QuantState``
    as new tensors beside it (``weight.absmax``, ``weight.quant_map``,
    ``weight.nested_*``, ``weight.quant_state.bitsandbytes__nf4``): copies a
    load fills, which ``install`` turns back into the parameter's
    ``quant_state`` (``QuantState.from_dict``, as bitsandbytes' own
    pre-quantized loading does). The packed weight itself is filled in place.
    """

    def __init__(self):
        self.keys: List[str] = []
        self.by_param: List[Any] = []  # (param, prefix, {key: filled copy})

    def __bool__(self) -> bool:
        return bool(self.by_param)

    def parts_of(self, key: str) -> Dict[str, Any]:
        """The dict the load puts ``key``'s saved tensor in."""
        return next(parts for _, _, parts in self.by_param if key in parts)

    def install(self) -> None:
        for param, prefix, parts in self.by_param:
            qs_cls = type(param.quant_state)
            stats = {k[len(prefix) :]: v for k, v in parts.items() if v is not None}
            param.quant_state = qs_cls.from_dict(qs_dict=stats, device=param.device)


def _bnb_quant_states(m: torch.nn.Module, sd: Dict[str, Any], copies: List[str], path: str) -> _QuantStates:
    """The quantization-state copies of ``m``'s bitsandbytes 4-bit weights among ``copies`` (see :class:`_QuantStates`).

    Raises:
        UnsupportedStateError: a 4-bit weight not quantized yet (its
            ``quant_state`` is None: move the module to its device first).
    """
    out = _QuantStates()
    for k, t in sd.items():
        if f"{type(t).__module__}.{type(t).__qualname__}" != BNB_PARAMS4BIT:
            continue
        prefix = k + SEP
        mine = [c for c in copies if c.startswith(prefix)]
        if not mine:
            continue
        if getattr(t, "quant_state", None) is None:
            raise UnsupportedStateError(
                f"{join_path(path, k)}: a bitsandbytes 4-bit weight that is not quantized yet (quant_state is None); "
                "move the module to its device (.to(device) quantizes it) before loading"
            )
        out.keys.extend(mine)
        out.by_param.append((t, prefix, {c: None for c in mine}))
    return out


def _empty_like_meta(t, device) -> torch.Tensor:
    """An uninitialized tensor (DTensor: same mesh/placements/shape) replacing meta ``t``."""
    return empty_like_meta(t, device)


def _storage_ptr(t: Any) -> Optional[int]:
    """The address of the storage under ``t`` (a DTensor's local shard), or None (meta, empty, no storage)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    if not isinstance(local, torch.Tensor) or local.is_meta or local.numel() == 0:
        return None
    try:
        return local.untyped_storage().data_ptr()
    except Exception:  # tensor subclasses without storage
        return None


def throwaway_copies(m: torch.nn.Module, sd: Dict[str, Any]) -> List[str]:
    """Keys of ``sd`` (``m.state_dict(keep_vars=True)``) whose tensors share no storage with ``m``'s weights.

    A state-dict hook that splits a fused weight into new tensors, or one that
    re-creates them, gives copies: filling them in place would not reach the
    weights. Views of a parameter (a split that is a view) are not copies.

    Example:
        >>> m = torch.nn.Linear(2, 2)
        >>> throwaway_copies(m, {"weight": m.weight.detach().clone(), "bias": m.bias[:1]})
        ['weight']
    """
    own = set()
    for _, t in list(m.named_parameters(remove_duplicate=False)) + list(m.named_buffers(remove_duplicate=False)):
        ptr = _storage_ptr(t)
        if ptr is not None:
            own.add(ptr)
    out = []
    for k, t in sd.items():
        if is_tensor(t):
            ptr = _storage_ptr(t)
            if ptr is not None and ptr not in own:
                out.append(k)
    return sorted(out)


def routes_state_back(m: torch.nn.Module, keys: List[str]) -> bool:
    """True if ``m.load_state_dict`` can turn the copies under ``keys`` back into weights.

    Copies under the module's own parameter/buffer names are loaded by plain
    ``load_state_dict`` (a hook that re-creates tensors under unchanged
    names). Other names (a fused weight split into new ones) need a
    load-state-dict pre-hook or an overridden
    ``load_state_dict``/``_load_from_state_dict`` somewhere in ``m``: the
    inverse of the hook that made them.
    """
    names = {n for n, _ in m.named_parameters(remove_duplicate=False)} | {n for n, _ in m.named_buffers(remove_duplicate=False)}
    if all(k in names for k in keys):
        return True
    base = torch.nn.Module
    if type(m).load_state_dict is not base.load_state_dict:
        return True
    for sm in m.modules():
        if getattr(sm, "_load_state_dict_pre_hooks", None) or getattr(sm, "_load_state_dict_post_hooks", None):
            return True
        if type(sm)._load_from_state_dict is not base._load_from_state_dict:
            return True
    return False


def tied_groups(sd: Dict[str, Any]) -> List[List[str]]:
    """Names of ``sd`` that hold the same tensor object (tied weights), in order; only groups of two or more.

        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> tied_groups({"emb.weight": w, "bias": torch.zeros(1), "head.weight": w})
        [['emb.weight', 'head.weight']]
    """
    by_id: Dict[int, List[str]] = {}
    for k, t in sd.items():
        if is_tensor(t):
            by_id.setdefault(id(t), []).append(k)
    return [names for names in by_id.values() if len(names) > 1]


def _module_tensors(m: torch.nn.Module, path: str = "", back: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """``m.state_dict(keep_vars=True)`` under plain FQNs: wrapper segments removed at every depth.

    ``back`` (if given) receives plain name -> ``m``'s own key, for calls
    that hand a dict back to ``m.load_state_dict``.
    """
    rename = wrapper_renamer(m)
    out: Dict[str, Any] = {}
    for k, v in m.state_dict(keep_vars=True).items():
        n = rename(k)
        if n in out:
            raise UnsupportedStateError(
                f"{join_path(path, n)}: two entries of the module's state dict have this name once wrapper prefixes "
                "(_orig_mod., _checkpoint_wrapped_module., module.) are removed"
            )
        out[n] = v
        if back is not None:
            back[n] = k
    return out


# --------------------------------------------------------------------------
# the part that trains: a selection of a module's state


def _kept(sd: Dict[str, Any], keep: Optional[Callable[[str], bool]], path: str) -> Dict[str, Any]:
    """``sd`` restricted to the names ``keep`` keeps (all of it when ``keep`` is None).

    Raises:
        StateMismatchError: a pattern of :func:`select` matches no entry (a
            typo would otherwise drop tensors silently, as ``keys=`` refuses).
        UnsupportedStateError: nothing is kept (an empty selection saves nothing).
    """
    if keep is None:
        return sd
    if isinstance(keep, Patterns):
        try:
            chosen = set(select_names(sd, keep.patterns, what=f"{path}: shardckpt.select()"))
        except StateMismatchError as e:
            raise StateMismatchError(f"{e}; the module's entries are e.g. {format_offenders(sorted(sd))}") from None
        return {k: v for k, v in sd.items() if k in chosen}
    out = {k: v for k, v in sd.items() if keep(k)}
    if not out:
        raise UnsupportedStateError(
            f"{path}: the selection keeps none of the module's {len(sd)} state entries "
            f"(e.g. {format_offenders(sorted(sd))}); check the names or which parameters require grad"
        )
    return out


@dataclasses.dataclass(frozen=True)
class Patterns:
    """A :func:`select` keep-rule from name patterns: every pattern must match an entry (checked by ``_kept``)."""

    patterns: Tuple[str, ...]

    def __call__(self, name: str) -> bool:
        return any(name == p or fnmatch.fnmatchcase(name, p) for p in self.patterns)


class Selected:
    """Part of a module's state, by FQN: what :func:`trainable` and :func:`select` return.

    Saved and loaded like the module (any runtime, in place), holding only
    the kept entries: a load fills those and leaves the rest (a frozen base
    loaded from elsewhere) as it is. An optimizer of the kept parameters may
    sit beside it (``{"model": trainable(model), "optim": optim}``): its state
    is named by the module's FQNs as usual.
    """

    def __init__(self, module: torch.nn.Module, keep: Callable[[str], bool], what: str):
        self.module = module
        self.keep = keep
        self.what = what

    def __repr__(self) -> str:
        return f"Selected({type(self.module).__name__}, {self.what})"


def trainable(module: torch.nn.Module) -> Selected:
    """The parameters of ``module`` that require grad (LoRA adapters over a frozen base), by FQN.

    Args:
        module: any ``nn.Module`` (plain, DDP, FSDP1/FSDP2, compiled, peft).

    Returns:
        A :class:`Selected` to put in the state in place of the module.

    Raises:
        UnsupportedStateError: (at save/load) no parameter requires grad.

    Example:
        >>> shardckpt.save({"model": shardckpt.trainable(model), "optim": optim}, url)  # doctest: +SKIP
        >>> shardckpt.load({"model": shardckpt.trainable(model), "optim": optim}, url)  # doctest: +SKIP

    Limits: the names are taken when this is called; the base must already
    be in the model (loaded once, e.g. from an HF directory) before the
    adapter checkpoint is loaded.
    """
    m = unwrap(module)
    rename = wrapper_renamer(m)
    names = frozenset(rename(n) for n, p in m.named_parameters(remove_duplicate=False) if p.requires_grad)
    return Selected(module, names.__contains__, f"{len(names)} trainable parameters")


def select(module: torch.nn.Module, names: Union[Callable[[str], bool], Iterable[str]]) -> Selected:
    """The entries of ``module``'s state dict whose FQN ``names`` keeps.

    Args:
        module: any ``nn.Module``.
        names: a predicate on the FQN, or names / ``fnmatch`` patterns of
            which one must match: one string is one pattern (``"*lora_*"``),
            as for ``keys=``; or a list of them (``["*lora_A*", "*lora_B*"]``).

    Raises:
        UnsupportedStateError: no pattern given.
        StateMismatchError: (at save/load) a pattern matches none of the
            module's entries, e.g. a typo such as ``"*lroa_B*"`` (as ``keys=``
            refuses one).

    Example:
        >>> shardckpt.save({"model": shardckpt.select(model, "*lora_*"), "optim": optim}, url)  # doctest: +SKIP
    """
    if callable(names):
        return Selected(module, names, "a name predicate")
    # A string is iterable too: its characters ("*" first) would keep everything.
    pats = (names,) if isinstance(names, str) else tuple(str(x) for x in names)
    if not pats:
        raise UnsupportedStateError("select(): give at least one name pattern")
    return Selected(module, Patterns(pats), f"names matching {list(pats)}")


class SelectedAdapter(Adapter):
    """:class:`Selected`: the module adapter, restricted to the kept names."""

    def matches(self, obj):
        return isinstance(obj, Selected)

    def save(self, obj, path, walker):
        return ModuleAdapter().save(obj.module, path, walker, keep=obj.keep)

    def load(self, obj, path, saved, walker):
        ModuleAdapter().load(obj.module, path, saved, walker, keep=obj.keep)
