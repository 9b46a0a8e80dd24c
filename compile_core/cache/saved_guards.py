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
- ``ValuePickler``: fixes for torch's guard pickler (ComfyUI 0.12+'s dtype attributes; the
  instance attributes of a tensor subclass such as ComfyUI-GGUF's ``GGMLTensor``).

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

import builtins
import dataclasses
import enum
import hashlib
import inspect
import re
import sys
import types
from typing import Callable

import torch
from torch import nn

_ROOT_GLOBALS = nn.Module._call_impl.__globals__  # the traced frame is Module._call_impl


# a root may hold any character but a quote or bracket: dynamo names another pack's
# module after the key ComfyUI put in sys.modules, its folder's path on 0.33
# (``G['__import_/…/custom_nodes/ComfyUI-GGUF_dot_dequant']``); it is a dict key, never evaluated
_NAME = re.compile(r"G\['([^'\]]+)'\]")
# (a string key may be all digits: a ModuleList's or Sequential's ``_modules['0']``)
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\['([A-Za-z0-9_]+)'\]|\[([0-9]+)\]")


def parse(name: str) -> tuple[str, list[tuple[str, object]]] | None:
    """Dynamo's global guard name (``G['x'].a['b'][0]``) as (root, steps), or None when it is
    anything else. Names come from saved files, which may come from the fleet's store: they
    are walked with getattr/getitem, never evaluated."""
    return _parse(_NAME, name)


_KEY_AT = re.compile(r"list\(dict\.keys\((.+)\)\)\[([0-9]+)\]\Z")


def _parse(root: re.Pattern, name: str) -> tuple[str, list[tuple[str, object]]] | None:
    """``<root><steps>``, or dynamo's N-th key of a dict, ``list(dict.keys(<that>))[N]``."""
    key_at = _KEY_AT.match(name)
    if key_at:
        inner = _parse(root, key_at.group(1))
        return None if inner is None else (inner[0], [*inner[1], ("key_at", int(key_at.group(2)))])
    m = root.match(name)
    steps = _steps(name, m.end()) if m else None
    return None if steps is None else (m.group(1), steps)


_LOCAL = re.compile(r"(self|args|kwargs)(?![A-Za-z0-9_])")  # Module._call_impl's locals


def parse_local(name: str) -> tuple[str, list[tuple[str, object]]] | None:
    """A guard name on the traced call's own arguments (``kwargs['transformer_options']['f']``)
    as (root, steps), or None. Also dynamo's name for a class attribute of an argument,
    ``dict(type(<path>)[.__mro__[N]].__dict__)['key']<steps>``, as a ``class_attr`` step: the
    attribute as the class resolves it (``class_attr``)."""
    m = _CLASS_ATTR.match(name)
    if not m:
        return _parse(_LOCAL, name)
    inner, rest = _parse(_LOCAL, m.group(1)), _steps(name, m.end())
    if inner is None or rest is None:
        return None
    return inner[0], [*inner[1], ("class_attr", m.group(2)), *rest]


_CLASS_ATTR = re.compile(r"dict\(type\(([^()]*)\)(?:\.__mro__\[[0-9]+\])?\.__dict__\)\['([A-Za-z_][A-Za-z0-9_]*)'\]")


def class_attr(cls: type, key: str) -> object:
    """``key`` as looked up on ``cls``: the first class in its MRO whose ``__dict__`` has it
    (what dynamo's guards on ``dict(type(x).__mro__[N].__dict__)[key]`` and on the classes
    before N not holding it check together)."""
    for c in cls.__mro__:
        if key in c.__dict__:
            return c.__dict__[key]
    raise KeyError(key)


_NTH_KEY = re.compile(r"\)\)\[([0-9]+)\]\]")


def _steps(name: str, pos: int) -> list[tuple[str, object]] | None:
    """The steps after a root: ``.attr``, ``['key']``, ``[0]``, and dynamo's N-th dict key,
    ``[list(dict.keys(<the path so far>))[N]]`` (only with exactly the path so far inside)."""
    steps = []
    while pos < len(name):
        nth = f"[list(dict.keys({name[:pos]}"
        if name.startswith(nth, pos):
            m = _NTH_KEY.match(name, pos + len(nth))
            if not m:
                return None
            steps.append(("nth_key", int(m.group(1))))
            pos = m.end()
            continue
        step = _STEP.match(name, pos)
        if not step:
            return None
        attr, key, index = step.groups()
        steps.append(("attr", attr) if attr else ("item", key if key is not None else int(index)))
        pos = step.end()
    return steps


def _root(name: str, fn_globals: dict):
    """What a guard's ``G['name']`` is in this process: the traced function's globals, then
    the globals of ``Module._call_impl`` (its frame), builtins, and already imported modules."""
    if name in fn_globals:
        return fn_globals[name]
    if name in _ROOT_GLOBALS:
        return _ROOT_GLOBALS[name]
    if name.startswith("__builtins_dict___"):
        return builtins.__dict__
    if name.startswith("__import_"):  # (a Windows path comes with its backslashes escaped)
        key = name[len("__import_"):].replace("_dot_", ".")
        return sys.modules[key] if key in sys.modules else sys.modules[key.replace("\\\\", "\\")]
    raise KeyError(name)


def resolve(parsed: tuple[str, list], fn_globals: dict) -> object:
    root, steps = parsed
    return _walk(_root(root, fn_globals), steps)


def _walk(value: object, steps: list) -> object:
    for kind, what in steps:
        if kind == "attr":
            value = getattr(value, what)
        elif kind == "nth_key":
            value = value[list(dict.keys(value))[what]]
        elif kind == "key_at":
            value = list(dict.keys(value))[what]
        elif kind == "class_attr":
            value = class_attr(type(value), what)
        else:
            value = value[what]
    return value


def code_digest(code: types.CodeType) -> str:
    """A hash of what a code object does, stable across processes: its bytecode, the names and
    constants it uses (nested code objects hashed the same way), not where it sits in memory."""
    h = hashlib.sha256(code.co_code + repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for const in code.co_consts:
        h.update(code_digest(const).encode() if isinstance(const, types.CodeType) else repr(const).encode())
    return h.hexdigest()[:16]


def describe(value: object) -> str:
    """A description of a global's value that is stable across processes."""
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, enum.Enum):
        return f"enum {type(value).__module__}.{type(value).__qualname__}.{value.name}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return f"constant {value!r}"
    if isinstance(value, torch.dtype):
        return f"dtype {value}"
    if isinstance(value, (types.FunctionType, types.MethodType)):
        fn = getattr(value, "__func__", value)
        code = fn.__code__
        # (not its file: the same code installed at another path, a fleet worker's, is the same;
        # its source lines are bound by ``source_check``)
        return f"function {fn.__module__}.{fn.__qualname__} {code_digest(code)}"
    if isinstance(value, type):
        return f"class {value.__module__}.{value.__qualname__}"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"callable {getattr(value, '__module__', '')}.{value.__qualname__}"
    if isinstance(value, (dict, list, tuple, set)):
        return f"{type(value).__name__} of {len(value)}"
    return f"object of {type(value).__module__}.{type(value).__qualname__}"


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
        values = [_walk({"self": module, "args": args, "kwargs": kwargs}[p[0]], p[1])
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
        owner = owners[(root, prefix)] = _walk(roots[root], prefix)
    if not suffix:
        return owner
    if (type(owner), suffix) in classes:
        return _SEEN_CLASS
    classes.add((type(owner), suffix))
    return _walk(owner, suffix)


_CHECKED = (types.FunctionType, enum.Enum, type(None), bool, int, float, str, torch.dtype)


def _identity(value: object) -> object:
    """What dynamo's identity guard on ``value`` stands for: a function's code, or the value."""
    return value.__code__ if type(value) is types.FunctionType else value


def _unsaved_kinds() -> tuple[str, ...]:
    """The guard kinds torch cannot save (torch's own list); empty on a torch without the list
    (2.8: no ``UNSUPPORTED_SERIALIZATION_GUARD_TYPES``, and no saved regions there either)."""
    from torch._dynamo.guards import CheckFunctionManager
    return tuple(sorted(getattr(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", ())))


def keep_guard(dropped: set[str], local_fns: set[str], unchecked: set[str]) -> Callable:
    """torch's guard filter for the AOT trace: which guards to save. Globals go to ``dropped``
    (replaced by ``GlobalChecks``); the code guard of a function passed in the call's own
    arguments, and a value guard on a constant in a submodule's class, go to ``local_fns``
    (replaced by ``LocalChecks``); type guards on nested classes, and the other guards that
    reach a class through ``type()``, are covered by the region key; any other guard torch
    cannot save, or a class value that is not a constant, goes to ``unchecked``: nothing would
    replace it, so such a region never takes the fast path."""
    unsaved = set(_unsaved_kinds())

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


class _Reduced:
    """Stands for one reduction (callable, args) inside another object's reduction."""
    __slots__ = ("reduction",)

    def __init__(self, reduction: tuple):
        self.reduction = reduction


def reduce_tensor_attributes(obj: object, reduction: object) -> object:
    """torch's reduction of a guarded tensor, with the instance attributes of a plain tensor
    subclass put back on what it rebuilds. torch rebuilds every guarded tensor as a FakeTensor
    with only its Python type recorded (``pytype``); a subclass that keeps its data in instance
    attributes (ComfyUI-GGUF's ``GGMLTensor``: ``tensor_type``, ``tensor_shape``, ``patches``)
    lost them, so rebuilding the guards on them failed at load (``'FakeTensor' object has no
    attribute 'patches'``). The rebuilt guards then read the same values as the traced ones.
    Only torch's own functions are named in the file (``torch._utils._set_obj_state``)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    if (type(obj) in (torch.Tensor, nn.Parameter) or isinstance(obj, torch._subclasses.FakeTensor)
            or is_traceable_wrapper_subclass(obj) or not getattr(obj, "__dict__", None)
            or not isinstance(reduction, tuple) or reduction[0] != _unpickle_tensor()):
        return reduction
    from torch._utils import _set_obj_state
    return _set_obj_state, (_Reduced(reduction), dict(obj.__dict__))


def _unpickle_tensor():
    from torch._dynamo.guards import GuardsStatePickler
    return GuardsStatePickler._unpickle_tensor


class ValuePickler:
    """While tracing for the AOT API, fix two things in torch's guard pickler (the method is
    swapped on torch's own class: a subclass would be pickled by name into the file):

    - pickle torch's dtype/layout/memory-format singletons by value. torch's guard pickler
      marks every unguarded plain attribute of a module as missing *by id*; ComfyUI 0.12+
      stores ``<param>_comfy_model_dtype = torch.float32`` on modules, so without this every
      tensor dtype in the saved guards became ``_Missing`` and no saved region could be loaded
      (``empty_strided(): argument 'dtype' must be torch.dtype``);
    - keep a tensor subclass's instance attributes (``reduce_tensor_attributes``: GGUF)."""
    _SINGLETONS = (torch.dtype, torch.layout, torch.memory_format)

    def __enter__(self):
        import torch._dynamo.guards as guards
        self._cls = getattr(guards, "GuardsStatePickler", None)
        if self._cls is not None:
            singletons, orig = self._SINGLETONS, self._cls.reducer_override

            def reducer_override(pickler, obj):
                if isinstance(obj, singletons):
                    return NotImplemented  # torch.float32 etc. pickle by name
                if isinstance(obj, _Reduced):
                    return obj.reduction
                reduction = orig(pickler, obj)
                return reduce_tensor_attributes(obj, reduction) if isinstance(obj, torch.Tensor) else reduction

            self._orig = orig
            self._cls.reducer_override = reducer_override
        return self

    def __exit__(self, *exc):
        if self._cls is not None:
            self._cls.reducer_override = self._orig


def subclass_globals(fn, guard_names: list[str]) -> dict[str, str]:
    """dynamo's globals for the tensor subclasses a traced function rewraps or guards
    (``__subclass_GGMLTensor_<id>_c<N>``, named after the class's id in the tracing process, so
    absent from any other), as {name: 'module:qualname'} for ``bind_subclasses`` to restore."""
    used = set(fn.__code__.co_names) | {p[0] for p in map(parse, guard_names) if p}
    out = {}
    for name in sorted(n for n in used if n.startswith("__subclass_")):
        cls = fn.__globals__.get(name, _ROOT_GLOBALS.get(name))
        if isinstance(cls, type) and issubclass(cls, torch.Tensor):
            out[name] = f"{cls.__module__}:{cls.__qualname__}"
    return out


def bind_subclasses(saved: dict) -> dict[str, type]:
    """The classes ``subclass_globals`` named, in this process: looked up in already imported
    modules (raises when one is not there or is not a tensor subclass)."""
    out = {}
    for name, where in saved.items():
        module, _, qualname = str(where).partition(":")
        cls = sys.modules[module]
        for part in qualname.split("."):
            cls = getattr(cls, part)
        if not (isinstance(cls, type) and issubclass(cls, torch.Tensor)):
            raise TypeError(f"{where} is not a tensor subclass")
        out[str(name)] = cls
    return out


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
    caller (``precompiled._Region``) uses it only once it accepted a call ``guard_check``
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
