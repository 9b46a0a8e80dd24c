"""The ``WANCOMPILEARGS`` contract: build the dict, and parse it once into ``CompileSettings``.

The dict is what crosses the wire between nodes (and into ComfyUI-WanVideoWrapper's
loader, which indexes 7 of its keys directly). Inside the pack nothing reads raw keys:
``CompileSettings.from_args`` validates the dict once, at the edge, and every later
decision uses the typed object.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from .shapes import POLICIES, torch_dynamic
from ..torch_support import inductor_names

# WanVideoWrapper's own settings node emits exactly these keys, in this order.
WAN_KEYS = (
    "backend", "fullgraph", "mode", "dynamic", "dynamo_cache_size_limit",
    "dynamo_recompile_limit", "compile_transformer_blocks_only",
    "force_parameter_static_shapes", "allow_unmerged_lora_compile",
)
# Its consumers index these directly (KeyError when missing), so we require them too.
REQUIRED_KEYS = (
    "dynamo_cache_size_limit", "force_parameter_static_shapes",
    "compile_transformer_blocks_only", "fullgraph", "dynamic", "backend", "mode",
)
# Extra keys the original ComfyUI-TorchCompileSpeed pack emitted (consumers ignore them).
LEGACY_EXTRA_KEYS = (
    "reuse_if_similar", "experimental_ptx", "ptx_fast_math", "warmup_runs",
    "ptx_cache_dir", "speed_preset",
)
# Keys this pack adds (after all of the above; every consumer ignores unknown keys).
NEW_EXTRA_KEYS = ("shape_policy", "declared_shapes", "background_compile")
# Keys earlier versions of this pack emitted that nothing reads any more: a dict (or a saved
# workflow) that still carries one loads as before, and the key is ignored.
RETIRED_KEYS = ("whole_graph",)
UI_MODES = ("default", "max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead", "speed")
SPEED_PRESET = {"backend": "inductor", "mode": "max-autotune-no-cudagraphs", "dynamic": True}
# What the pack's own Apply nodes compile the speed preset in. Autotuning (max-autotune-*, or
# coordinate-descent tuning) doubled the cold compile on a GPU for no faster step
# (docs/performance.md), so the user's wait buys nothing; WanVideoWrapper still receives the
# dict's SPEED_PRESET mode unchanged.
SPEED_PRESET_APPLY_MODE = "default"
LIMIT_RANGE = (0, 1024)  # as the original pack; 0: torch compiles nothing (preflight.limit_zero)
# background_compile when a dict (or an old workflow's node) does not say: on, so the first run
# never waits for a compile (benchmarks/results/background_cpu.md)
BACKGROUND_DEFAULT = True
WARMUP_RANGE = (0, 5)


class CompileArgsError(ValueError):
    """A WANCOMPILEARGS value is missing or wrong; the message names the key."""


def torch_modes() -> tuple[str, ...]:
    """Mode strings this torch's ``torch.compile(mode=)`` accepts."""
    try:
        modes = set(inductor_names.mode_options())
    except Exception:  # very old or stripped torch
        modes = {"reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"}
    modes.add("default")
    return tuple(sorted(modes))


def backend_choices() -> list[str]:
    """``inductor`` and ``cudagraphs`` first (the original order), then every other registered backend."""
    first = ["inductor", "cudagraphs"]
    try:
        others = torch.compiler.list_backends(exclude_tags=())
    except Exception:
        others = []
    return first + sorted(b for b in others if b not in first and not b.endswith("_TESTING_ONLY"))


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    backend: str = "inductor"
    fullgraph: bool = False
    mode: str = "default"
    dynamic: bool | None = False
    cache_size_limit: int = 64
    recompile_limit: int = 128
    blocks_only: bool = True
    force_parameter_static_shapes: bool = False
    allow_unmerged_lora_compile: bool = False
    reuse_if_similar: bool = True
    experimental_ptx: bool = False
    ptx_fast_math: bool = True
    warmup_runs: int = 1
    ptx_cache_dir: str = ""
    speed_preset: bool = False
    shape_policy: str = "auto"
    # ((min_w, min_h, min_frames), (max_w, max_h, max_frames)) in pixels/frames, or None
    declared_shapes: tuple | None = None
    # compile in a worker thread while the first run goes on eagerly (compile_core.run.background)
    background_compile: bool = BACKGROUND_DEFAULT

    @classmethod
    def from_args(cls, args: Any) -> "CompileSettings":
        """Validate a WANCOMPILEARGS dict (ours, WanVideoWrapper's, or the old pack's). Keys
        it does not know (``RETIRED_KEYS`` among them) are ignored."""
        if not isinstance(args, Mapping):
            raise CompileArgsError(
                f"compile_args must be a WANCOMPILEARGS dict, got {type(args).__name__}. "
                "Connect a 'Torch Compile Speed Settings' node.")
        missing = [k for k in REQUIRED_KEYS if k not in args]
        if missing:
            raise CompileArgsError(f"compile_args is missing key(s) {', '.join(missing)}")
        a = dict(args)
        speed = a.get("mode") == "speed"
        if speed:  # a dict built elsewhere with the UI-only mode: translate like our node does
            a.update(SPEED_PRESET)
        preset = speed or _bool(a, "speed_preset", default=False)
        mode = _mode(a["mode"])
        return cls(
            backend=_backend(a["backend"]),
            fullgraph=_bool(a, "fullgraph"),
            mode=SPEED_PRESET_APPLY_MODE if preset and mode == SPEED_PRESET["mode"] else mode,
            dynamic=_bool(a, "dynamic", allow_none=True),
            cache_size_limit=_int(a, "dynamo_cache_size_limit", LIMIT_RANGE),
            recompile_limit=_int(a, "dynamo_recompile_limit", LIMIT_RANGE, default=128),
            blocks_only=_bool(a, "compile_transformer_blocks_only"),
            force_parameter_static_shapes=_bool(a, "force_parameter_static_shapes"),
            allow_unmerged_lora_compile=_bool(a, "allow_unmerged_lora_compile", default=False),
            reuse_if_similar=_bool(a, "reuse_if_similar", default=True),
            experimental_ptx=_bool(a, "experimental_ptx", default=False),
            ptx_fast_math=_bool(a, "ptx_fast_math", default=True),
            warmup_runs=_int(a, "warmup_runs", WARMUP_RANGE, default=1),
            ptx_cache_dir=_str(a, "ptx_cache_dir", default=""),
            speed_preset=preset,
            shape_policy=_choice(a, "shape_policy", POLICIES, default="auto"),
            declared_shapes=parse_declared_shapes(_str(a, "declared_shapes", default="")),
            background_compile=_bool(a, "background_compile", default=BACKGROUND_DEFAULT),
        )

    def compile_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.compile`` (``mode`` only means something to inductor)."""
        mode = self.mode if self.backend == "inductor" and self.mode != "default" else None
        return {"backend": self.backend, "mode": mode, "fullgraph": self.fullgraph,
                "dynamic": torch_dynamic(self.shape_policy)}

    def artifact_key(self) -> tuple:
        """Everything here that changes the compiled code (used in the reuse fingerprint)."""
        return (self.backend, self.mode, self.fullgraph, self.blocks_only,
                self.force_parameter_static_shapes,
                self.experimental_ptx and self.ptx_fast_math, self.shape_policy)


def build_compile_args(backend="inductor", fullgraph=False, mode="speed", dynamic=False,
                       dynamo_cache_size_limit=64, compile_transformer_blocks_only=True,
                       reuse_if_similar=True, experimental_ptx=False, ptx_fast_math=True,
                       warmup_runs=1, ptx_cache_dir="", dynamo_recompile_limit=128,
                       force_parameter_static_shapes=False,
                       allow_unmerged_lora_compile=False, shape_policy="auto",
                       declared_shapes="", background_compile=None) -> dict[str, Any]:
    """The settings node's output: WanVideoWrapper's 9 keys in its order, then the legacy extras.

    ``mode="speed"`` is not a torch mode, so it is translated here, before the dict is built.
    """
    speed = mode == "speed"
    if speed:
        backend, mode, dynamic = SPEED_PRESET["backend"], SPEED_PRESET["mode"], SPEED_PRESET["dynamic"]
    args = {
        "backend": backend,
        "fullgraph": fullgraph,
        "mode": mode,
        "dynamic": dynamic,
        "dynamo_cache_size_limit": dynamo_cache_size_limit,
        "dynamo_recompile_limit": dynamo_recompile_limit,
        "compile_transformer_blocks_only": compile_transformer_blocks_only,
        "force_parameter_static_shapes": force_parameter_static_shapes,
        "allow_unmerged_lora_compile": allow_unmerged_lora_compile,
        "reuse_if_similar": reuse_if_similar,
        "experimental_ptx": experimental_ptx,
        "ptx_fast_math": ptx_fast_math,
        "warmup_runs": warmup_runs,
        "ptx_cache_dir": ptx_cache_dir or "",
        "speed_preset": speed,
        "shape_policy": shape_policy,
        "declared_shapes": declared_shapes or "",
        "background_compile": BACKGROUND_DEFAULT if background_compile is None else background_compile,
    }
    CompileSettings.from_args(args)  # fail here, with the key named, not later in a sampler
    return args


def _bool(a, key, default=None, allow_none=False):
    v = a.get(key, default)
    if isinstance(v, bool) or (allow_none and v is None):
        return v
    raise CompileArgsError(f"compile_args[{key!r}] must be true or false, got {v!r}")


def _int(a, key, bounds, default=None):
    v = a.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise CompileArgsError(f"compile_args[{key!r}] must be an integer, got {v!r}")
    lo, hi = bounds
    if not lo <= v <= hi:
        raise CompileArgsError(f"compile_args[{key!r}] must be between {lo} and {hi}, got {v}")
    return v


def _str(a, key, default=None):
    v = a.get(key, default)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise CompileArgsError(f"compile_args[{key!r}] must be a string, got {v!r}")
    return v


def _choice(a, key, choices, default):
    v = a.get(key, default)
    if v not in choices:
        raise CompileArgsError(f"compile_args[{key!r}] must be one of {', '.join(choices)}, got {v!r}")
    return v


def parse_declared_shapes(text: str) -> tuple | None:
    """``"832x480x81"`` (one size) or ``"512x512x1-1280x720x81"`` (min-max): width x height x frames."""
    text = text.strip().lower().replace(" ", "")
    if not text:
        return None
    try:
        parts = [tuple(int(n) for n in p.split("x")) for p in text.split("-")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or any(len(p) != 3 or min(p) < 1 for p in parts):
        raise CompileArgsError(
            f"compile_args['declared_shapes'] = {text!r}: use WIDTHxHEIGHTxFRAMES, or MIN-MAX "
            "like 512x512x1-1280x720x81")
    lo, hi = parts[0], parts[-1]
    if any(a > b for a, b in zip(lo, hi)):
        raise CompileArgsError(f"compile_args['declared_shapes'] = {text!r}: min exceeds max")
    return lo, hi


def _backend(v):
    if not isinstance(v, str) or v not in backend_choices():
        raise CompileArgsError(
            f"compile_args['backend'] = {v!r} is not a torch.compile backend here; "
            f"choose one of {', '.join(backend_choices())}")
    return v


def _mode(v):
    modes = torch_modes()
    if not isinstance(v, str) or v not in modes:
        raise CompileArgsError(
            f"compile_args['mode'] = {v!r} is not a torch.compile mode; choose one of "
            f"{', '.join(modes)} (or 'speed' in the settings node)")
    return v
