"""Dynamo's guard names, read without evaluating them, and what the objects they name are.

A saved region's guard names may come from a saved file from the fleet's store, so they are
parsed against a strict grammar (``parse`` for globals, ``parse_local`` for the traced call's
own arguments) and walked with getattr/getitem (``resolve``, ``walk``), never evaluated.
``describe`` and ``code_digest`` describe a value the same way in every process;
``subclass_globals`` / ``bind_subclasses`` carry dynamo's names for tensor subclasses from the
tracing process to another.
"""
from __future__ import annotations

import builtins
import enum
import hashlib
import re
import sys
import types

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
    return walk(_root(root, fn_globals), steps)


def walk(value: object, steps: list) -> object:
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
