"""What a saved region relied on that torch cannot save, and the checks that replace it.

This is the version-sensitive part of the saved regions (``precompiled``): dynamo's guard
names and types, and torch's guard pickler. Guard names may come from a saved file from the
fleet's store, so they are parsed against a strict grammar and walked with getattr/getitem,
never evaluated.

- ``GlobalChecks``: globals the traced code read (``G['...']`` guards, which torch drops).
- ``LocalChecks``: functions passed in the call's own arguments (an attention override in
  ``transformer_options``), whose identity guard torch cannot save: their code is compared.
- ``keep_guard``: torch's guard filter that sorts every guard into saved, replaced, or
  covered by the region key; anything else makes the region unsaveable.
- ``ValuePickler`` (``guard_pickling``): fixes for torch's guard pickler (ComfyUI 0.12+'s dtype
  attributes; the instance attributes of a tensor subclass such as ComfyUI-GGUF's ``GGMLTensor``).
- ``guard_names``: the parser and walker of guard names, and ``describe``.

The guard kinds torch cannot save (``CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES``:
DICT_VERSION, NN_MODULE, ID_MATCH, FUNCTION_MATCH, CLASS_MATCH, MODULE_MATCH, CLOSURE_MATCH,
WEAKREF_ALIVE), and what replaces each (``tests/unit/test_precompiled.py`` tests every one):

| where the guard is | replaced by |
|---|---|
| any kind on a global (``G[...]``) | ``GlobalChecks``: described at capture and load, identity per call |
| CLOSURE_MATCH / FUNCTION_MATCH on a function in the arguments | ``LocalChecks``: its code |
| ID_MATCH on an enum member in the arguments | ``LocalChecks``: class and member name |
| a class reached through ``type()`` / ``__mro__``, a nested class's TYPE_MATCH | the region key (every submodule's class) |
| CONSTANT_MATCH / EQUALS_MATCH on a constant in such a class (GGUF's ``dequant_dtype``) | ``LocalChecks``: the value the class resolves now |
| anything else on the arguments | nothing: the region takes the regular path |

Every other guard (sizes, strides, dtypes, devices, constants, dict keys, attributes) is saved
by torch and checked by it on every call.
"""
from __future__ import annotations

import dataclasses
import enum
import inspect
import types
from typing import Callable

import torch

from .guard_names import describe, parse, parse_local, resolve, walk
from ..torch_support import aot


@dataclasses.dataclass
class GlobalChecks:
    """The globals a saved region relied on: what they were, and the objects they are now."""
    names: list[str]
    described: list[str]

    @classmethod
    def capture(cls, names: list[str], fn_globals: dict) -> "GlobalChecks":
        checks = cls(names, [])
        checks._bind(fn_globals)
        checks.described = [describe(v) for v in checks._objects]
        return checks

    def _bind(self, fn_globals: dict) -> None:
        parsed = [parse(n) for n in self.names]
        bad = [n for n, p in zip(self.names, parsed) if p is None]
        if bad:
            raise ValueError(f"unexpected guard name {bad[0]!r}")
        self._globals, self._parsed = fn_globals, parsed
        self._objects = [resolve(p, fn_globals) for p in parsed]
        self._sizes = [len(v) if isinstance(v, _CONTAINERS) else None for v in self._objects]

    def matches_now(self, fn_globals: dict) -> str:
        """'' when every global is what it was at capture (by description); else the first that is not."""
        try:
            self._bind(fn_globals)
        except Exception as exc:  # noqa: BLE001 - a name that no longer resolves
            return f"a global it uses is gone ({exc.__class__.__name__}: {exc})"
        for name, want, value in zip(self.names, self.described, self._objects):
            if describe(value) != want:
                return f"{name} is now {describe(value)}, was {want}"
        return ""

    def changed(self) -> str:
        """Cheap per-call check against the objects bound at capture or load; '' when none changed."""
        for name, parsed, obj, size in zip(self.names, self._parsed, self._objects, self._sizes):
            try:
                now = resolve(parsed, self._globals)
            except Exception:  # noqa: BLE001
                return f"{name} is gone"
            if now is obj:
                if size is not None and len(now) != size:
                    return f"{name} changed size"
            elif not (isinstance(now, _CONSTANTS) and type(now) is type(obj) and now == obj):
                return f"{name} was replaced"
        return ""


_CONTAINERS = (dict, list, set)
_CONSTANTS = (bool, int, float, str)


@dataclasses.dataclass
class LocalChecks:
    """Values the traced call reached through its own arguments whose guards torch cannot
    save: functions (a patch node's ``optimized_attention_override`` in ``transformer_options``;
    dynamo guards their ``__code__``) and enum members (a GGUF weight's ``tensor_type``), which
    dynamo guards by identity, and constants in a submodule's class (ComfyUI-GGUF's loader sets
    ``GGMLOps.Linear.dequant_dtype`` / ``patch_dtype`` on the class), which torch cannot rebuild
    because it saves a nested class's module as a plain ``nn.Module``. This compares what the
    identity stands for: the code object, member or constant itself when already seen to match,
    else ``describe`` (for a function: module, qualified name, file, line and a hash of
    bytecode, names and constants; for a member: its class and name; for a constant: its repr).
    What a function's closure or globals hold has guards of its own (saved by torch, or
    ``GlobalChecks``)."""
    names: list[str]
    described: list[str]

    def __post_init__(self):
        self._split = [_split_class_step(parse_local(n)) for n in self.names]
        self._seen: list[dict[int, object]] = [{} for _ in self.names]

    @classmethod
    def capture(cls, names: list[str], module, args: tuple, kwargs: dict) -> "LocalChecks":
        values = [walk({"self": module, "args": args, "kwargs": kwargs}[p[0]], p[1])
                  for p in (parse_local(n) for n in names)]
        checks = cls(names, [describe(v) for v in values])
        for seen, value in zip(checks._seen, values):
            seen[id(_identity(value))] = _identity(value)
        return checks

    def accepts(self, module, args: tuple, kwargs: dict) -> bool:
        """True when every value is one the region was traced with (cheap when seen). Paths are
        walked once per call, and a class's constant once per class (the region's linears)."""
        if not self.names:  # (most regions: nothing of theirs is checked here)
            return True
        roots, owners, classes = {"self": module, "args": args, "kwargs": kwargs}, {}, set()
        for split, want, seen in zip(self._split, self.described, self._seen):
            if split is None:
                return False
            try:
                value = _value(split, roots, owners, classes)
            except Exception:  # noqa: BLE001 - the argument is not there in this call
                return False
            if value is _SEEN_CLASS:
                continue
            if not isinstance(value, _CHECKED):
                return False
            key = _identity(value)
            if seen.get(id(key)) is not key:
                if describe(value) != want:
                    return False
                seen[id(key)] = key
        return True


def _split_class_step(parsed) -> tuple[str, tuple, tuple] | None:
    """(root, the steps to the object, the steps from its class on: empty unless a class
    constant)."""
    if parsed is None:
        return None
    root, steps = parsed
    at = next((i for i, s in enumerate(steps) if s[0] == "class_attr"), len(steps))
    return root, tuple(steps[:at]), tuple(steps[at:])


_SEEN_CLASS = object()


def _value(split: tuple, roots: dict, owners: dict, classes: set) -> object:
    """What a split name reaches in this call (``_SEEN_CLASS`` for a class constant already
    checked in it); ``owners`` and ``classes`` carry what this call walked."""
    root, prefix, suffix = split
    owner = owners.get((root, prefix), _SEEN_CLASS)
    if owner is _SEEN_CLASS:
        owner = owners[(root, prefix)] = walk(roots[root], prefix)
    if not suffix:
        return owner
    if (type(owner), suffix) in classes:
        return _SEEN_CLASS
    classes.add((type(owner), suffix))
    return walk(owner, suffix)


_CHECKED = (types.FunctionType, enum.Enum, type(None), bool, int, float, str, torch.dtype)


def _identity(value: object) -> object:
    """What dynamo's identity guard on ``value`` stands for: a function's code, or the value."""
    return value.__code__ if type(value) is types.FunctionType else value


def keep_guard(dropped: set[str], local_fns: set[str], unchecked: set[str]) -> Callable:
    """torch's guard filter for the AOT trace: which guards to save. Globals go to ``dropped``
    (replaced by ``GlobalChecks``); the code guard of a function passed in the call's own
    arguments, and a value guard on a constant in a submodule's class, go to ``local_fns``
    (replaced by ``LocalChecks``); type guards on nested classes, and the other guards that
    reach a class through ``type()``, are covered by the region key; any other guard torch
    cannot save, or a class value that is not a constant, goes to ``unchecked``: nothing would
    replace it, so such a region never takes the fast path."""
    unsaved = set(aot.unsaved_guard_kinds())

    def nested_type(g) -> bool:
        if g.guard_type not in ("TYPE_MATCH", "BUILTIN_MATCH") or not g.has_value:
            return False
        return type(g.value).__qualname__ != type(g.value).__name__

    def local_fn(g) -> bool:
        if not g.has_value or parse_local(g.name) is None:
            return False
        if g.guard_type in ("CLOSURE_MATCH", "FUNCTION_MATCH"):
            return type(g.value) is types.FunctionType
        return g.guard_type == "ID_MATCH" and isinstance(g.value, enum.Enum)  # GGUF tensor_type

    def class_value(g) -> bool:  # CONSTANT_MATCH etc. on dict(type(x).__mro__[N].__dict__)[k]
        return g.guard_type in _VALUE_GUARDS and "type(" in g.name

    def keep(entries):
        out = []
        for g in entries:
            covered = nested_type(g) or "__mro__" in g.name or "type(" in g.name
            if g.is_global:
                dropped.add(g.name)
            elif class_value(g) and g.has_value and _is_constant(g.value) and parse_local(g.name):
                local_fns.add(g.name)
            elif class_value(g):
                unchecked.add(f"{g.name} ({g.guard_type})")
            elif g.guard_type in unsaved and not covered and local_fn(g):
                local_fns.add(g.name)
            elif g.guard_type in unsaved and not covered:
                unchecked.add(f"{g.name} ({g.guard_type})")
            out.append(not (g.is_global or covered or g.guard_type in unsaved))
        return out
    return keep


_VALUE_GUARDS = ("CONSTANT_MATCH", "EQUALS_MATCH")


def _is_constant(value: object) -> bool:
    return value is None or type(value) in (bool, int, float, str) or isinstance(value, torch.dtype)


_CALL_IMPL_PARAMS = [("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                     ("args", inspect.Parameter.VAR_POSITIONAL),
                     ("kwargs", inspect.Parameter.VAR_KEYWORD)]


def guard_checker(fn) -> Callable[[object, tuple, dict], bool] | None:
    """torch's saved guards of a region's AOT-compiled function as ``check(module, args,
    kwargs)``, or None where ``fn.guard_check`` must be used. ``guard_check`` binds every call
    to the function's signature with ``inspect.Signature.bind`` (about 3 us a block call, warm)
    to build the frame locals its guards read. A region is compiled from
    ``nn.Module._call_impl(self, *args, **kwargs)``, whose frame locals are exactly ``self``,
    ``args`` and ``kwargs`` (what ``bind`` and ``apply_defaults`` give): built here directly.
    Any other signature, a closure, or a torch whose function lacks these parts: None. The
    caller (``saved_region._Region``) uses it only once it accepted a call ``guard_check``
    accepted."""
    try:
        art = fn._artifacts
        params = [(p.name, p.kind) for p in art.signature.parameters.values()]
        manager, closure = art.guard_manager, art.runtime_env.closure
    except AttributeError:
        return None
    if manager is None or closure or params != _CALL_IMPL_PARAMS:
        return None
    check = manager.check

    def direct(module, args: tuple, kwargs: dict) -> bool:
        return check({"self": module, "args": args, "kwargs": kwargs})
    return direct


class NotSaveable(RuntimeError):
    """A traced region relies on a guard that neither torch nor our checks can carry."""
