"""TEST-ONLY ComfyUI node pack for TorchCompileSpeed's integration tests.

Loaded only by the test server started by ``tests/host/harness.py``; never ship or install it.
All node names start with ``TCSTest``:

- ``TCSTestZeroConditioning``: zero text conditioning ``[1, L, 4096]`` (no text encoder needed).
- ``TCSTestProbe``: reports dynamo counters and how a MODEL is compiled, as ui output.
- ``TCSTestLatentAfter``: latent pass-through that waits for another node (orders branches).
- ``TCSTestReferenceCompileArgs``: the dict WanVideoWrapper's own settings node emits.
- ``TCSTestWanStyleConsumer``: consumes a WANCOMPILEARGS dict the way WanVideoWrapper does.
- ``TCSTestRawCompileArgs``: any JSON value as WANCOMPILEARGS (malformed input from "another node").
- ``TCSTestStateSnapshot``: a digest of the server process's global torch state (leak checks).
- ``TCSTestForceLowVram``: a MODEL clone that ComfyUI loads partially (lowvram patching) on CPU.
- ``TCSTestDynamicVramLoader``: a real ``ModelPatcherDynamic`` (ComfyUI 0.33+ dynamic VRAM) on CPU.
- ``TCSTestPatcherInfo``: what a MODEL's patcher is (class, dynamic or not, its model, a digest).

Importing this module also registers two TEST-ONLY torch.compile backends, so they appear in
the settings node's backend choices (it lists every registered backend):

- ``tcs_test_raising_backend``: raises ``RuntimeError("boom")`` whenever dynamo asks it to compile.
- ``tcs_test_unloadable_backend``: a FAKE entry-point backend whose import fails, like a broken
  third-party backend install (``torch.compile(backend=...)`` itself raises).
"""
import contextlib
import json
import logging
import math
import os
import signal
import sys

import torch

log = logging.getLogger("tcs_test_nodes")
CATEGORY = "_for_testing/tcs"

# How ComfyUI-WanVideoWrapper's sampler reads the dict: these keys are indexed directly.
WAN_REQUIRED_KEYS = ("dynamo_cache_size_limit", "force_parameter_static_shapes",
                     "compile_transformer_blocks_only", "fullgraph", "dynamic", "backend", "mode")


def _plain_counters():
    """``torch._dynamo.utils.counters`` as a nested plain dict of ints (str keys)."""
    from torch._dynamo.utils import counters
    return {str(k): {str(kk): int(vv) for kk, vv in v.items()} for k, v in counters.items()}


def _is_optimized(mod):
    from torch._dynamo.eval_frame import OptimizedModule
    return isinstance(mod, OptimizedModule)


class TCSTestZeroConditioning:
    """TEST-ONLY: conditioning of zeros for a WAN model (text_dim 4096)."""
    CATEGORY = CATEGORY
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"length": ("INT", {"default": 8, "min": 1, "max": 512})},
                "optional": {"nonce": ("INT", {"default": 0, "min": 0, "max": 2**63 - 1})}}

    def make(self, length, nonce=0):  # nonce only changes the cache key of downstream nodes
        return ([[torch.zeros(1, length, 4096), {}]],)


class TCSTestProbe:
    """TEST-ONLY output node: snapshot of dynamo counters and of the MODEL's compile state."""
    CATEGORY = CATEGORY
    RETURN_TYPES = ()
    FUNCTION = "probe"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "label": ("STRING", {"default": "probe"})},
                "optional": {"model": ("MODEL",)}}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")  # re-run on every queue

    def probe(self, samples, label, model=None):
        counters = _plain_counters()
        report = {"label": label, "counters": counters, "memory": _memory(),
                  "stats": counters.get("stats", {}), "recompiles": counters.get("recompiles", {})}
        if model is not None:
            report.update(_model_report(model))
        server = _pack_module("comfy_server", "nodes")
        if server is not None:  # what the pack's bridge tells a background compile of this server
            report["server"] = {"idle": server.server_idle()}
        report["process"] = _process_report()
        if _WATCH:
            report["watch"] = _WATCH[0].report()
        return {"ui": {"probe": [report]}}


def _memory() -> dict:
    """The server process's resident memory, and on CUDA the peak torch allocated since the
    previous probe (then reset) and what the device has in use now (comfy-aimdo's memory too)."""
    import psutil
    out = {"rss_gb": psutil.Process().memory_info().rss / 2 ** 30}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        free, total = torch.cuda.mem_get_info()
        out.update(cuda_peak_gb=torch.cuda.max_memory_allocated() / 2 ** 30,
                   cuda_used_gb=(total - free) / 2 ** 30)
        torch.cuda.reset_peak_memory_stats()
    return out


def _model_report(patcher):
    dm = patcher.model.diffusion_model
    modules = list(dm.modules())
    to = patcher.model_options.get("transformer_options", {}).get("wrappers", {})
    own = getattr(patcher, "wrappers", {}) or {}

    def wrapper_keys(kind):
        return sorted(set(to.get(kind, {})) | set(own.get(kind, {})))

    return {
        "state_dict_has_orig_mod": any("_orig_mod" in k for k in patcher.model.state_dict().keys()),
        "modules_with_compiled_call_impl": sum(
            1 for m in modules if m.__dict__.get("_compiled_call_impl") is not None),
        "apply_model_wrapper_keys": wrapper_keys("apply_model"),
        "model_options_keys": sorted(patcher.model_options),
        "comfy_attention_modules": sum(1 for n, _ in dm.named_modules() if n.endswith("comfy_attention")),
        "diffusion_model_wrapper_keys": wrapper_keys("diffusion_model"),
        "diffusion_model_type": type(dm).__name__,
        "is_optimized_module": any(_is_optimized(m) for m in [dm, *modules]),
        "pack_status": _pack_status(patcher),
    }


def _pack_status(patcher):
    """The pack's status payload of this model (None when the pack did not compile it)."""
    bridge, status = _pack_module("comfy_bridge", "nodes"), _pack_module("status", "compile_core.report")
    compiled = bridge.compiled_model_of(patcher)[0] if bridge is not None else None
    return status.status_payload(compiled) if compiled is not None else None


class TCSTestLatentAfter:
    """TEST-ONLY: returns ``samples`` unchanged once ``after`` exists (forces execution order)."""
    CATEGORY = CATEGORY
    RETURN_TYPES = ("LATENT",)
    FUNCTION = "passthrough"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "after": ("LATENT",)}}

    def passthrough(self, samples, after):
        return (samples,)


class TCSTestReferenceCompileArgs:
    """TEST-ONLY: the 9-key dict WanVideoWrapper's WanVideoTorchCompileSettings emits.

    ``drop_keys`` (comma separated) removes keys, to check consumers fail like the real one.
    """
    CATEGORY = CATEGORY
    RETURN_TYPES = ("WANCOMPILEARGS",)
    RETURN_NAMES = ("torch_compile_args",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"backend": ("STRING", {"default": "inductor"}),
                             "mode": ("STRING", {"default": "default"}),
                             "drop_keys": ("STRING", {"default": ""})}}

    def make(self, backend, mode, drop_keys):
        args = {"backend": backend, "fullgraph": False, "mode": mode, "dynamic": False,
                "dynamo_cache_size_limit": 64, "dynamo_recompile_limit": 128,
                "compile_transformer_blocks_only": True, "force_parameter_static_shapes": False,
                "allow_unmerged_lora_compile": False}
        for k in filter(None, (s.strip() for s in drop_keys.split(","))):
            args.pop(k, None)
        return (args,)


class TCSTestWanStyleConsumer:
    """TEST-ONLY: reads WANCOMPILEARGS like WanVideoWrapper's sampler and compiles each block.

    Unlike the real wrapper it restores the dynamo config it changes and never assigns the
    compiled blocks back into the model.
    """
    CATEGORY = CATEGORY
    RETURN_TYPES = ()
    FUNCTION = "consume"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"compile_args": ("WANCOMPILEARGS",), "model": ("MODEL",)}}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")

    def consume(self, compile_args, model):
        import comfy.model_management
        cfg = torch._dynamo.config
        report = {"keys": sorted(compile_args),
                  "types": {k: type(v).__name__ for k, v in compile_args.items()},
                  "values": {k: v for k, v in compile_args.items()
                             if v is None or isinstance(v, (str, bool, int, float))},
                  "ran": False, "output_shape": None}
        a = {k: compile_args[k] for k in WAN_REQUIRED_KEYS}  # KeyError, like the real wrapper
        if "dynamo_recompile_limit" not in compile_args:
            log.warning("[tcs_test_nodes] compile_args has no dynamo_recompile_limit")
        report["allow_unmerged_lora_compile"] = compile_args.get("allow_unmerged_lora_compile", False)
        saved = {n: getattr(cfg, n) for n in ("cache_size_limit", "recompile_limit",
                                               "force_parameter_static_shapes")}
        try:
            cfg.cache_size_limit = a["dynamo_cache_size_limit"]
            cfg.force_parameter_static_shapes = a["force_parameter_static_shapes"]
            if "dynamo_recompile_limit" in compile_args:
                cfg.recompile_limit = compile_args["dynamo_recompile_limit"]
            comfy.model_management.load_models_gpu([model])
            dm = model.model.diffusion_model
            dev, dt = comfy.model_management.get_torch_device(), model.model.get_dtype()
            with torch.no_grad():
                x = torch.randn(1, 2 * 8 * 8, dm.dim, device=dev, dtype=dt)  # latent [1,16,2,16,16]
                e0 = torch.randn(1, 1, 6, dm.dim, device=dev, dtype=dt) * 0.1  # as in forward_orig
                freqs = dm.rope_encode(2, 16, 16, device=dev, dtype=dt)
                context = torch.randn(1, 8, dm.dim, device=dev, dtype=dt)
                for block in dm.blocks:
                    compiled = torch.compile(block, fullgraph=a["fullgraph"], dynamic=a["dynamic"],
                                             backend=a["backend"], mode=a["mode"])
                    x = compiled(x, e=e0, freqs=freqs, context=context, context_img_len=None)
            report.update(ran=True, output_shape=list(x.shape), finite=bool(torch.isfinite(x).all()))
        finally:
            for n, v in saved.items():
                setattr(cfg, n, v)
        return {"ui": {"consumer": [report]}}


# --------------------------------------------------------------------------- reliability

RAISING_BACKEND = "tcs_test_raising_backend"
UNLOADABLE_BACKEND = "tcs_test_unloadable_backend"


def _tcs_test_raising_backend(gm, example_inputs):
    """TEST-ONLY backend: a compiler that always fails (a runtime compile failure)."""
    raise RuntimeError("boom")


class _BrokenEntryPoint:
    """TEST-ONLY FAKE of an ``importlib.metadata`` entry point for a torch.compile backend whose
    package is installed but broken: ``load()`` raises, as e.g. a CUDA-mismatched torch_tensorrt
    does. torch looks the backend up (and so fails) inside ``torch.compile(...)`` itself."""
    name = UNLOADABLE_BACKEND
    value = "tcs_test_broken_backend_pkg:backend"

    def load(self):
        raise ImportError("tcs_test_broken_backend_pkg: libtcs_missing.so.1: cannot open shared "
                          "object file: No such file or directory")


def _register_test_backends():
    from torch._dynamo.backends import registry
    registry._lazy_import()  # built-in and entry-point backends first (what list_backends does)
    if RAISING_BACKEND not in registry._COMPILER_FNS:
        torch._dynamo.register_backend(name=RAISING_BACKEND)(_tcs_test_raising_backend)
    registry._BACKENDS.setdefault(UNLOADABLE_BACKEND, _BrokenEntryPoint())


_register_test_backends()


class TCSTestRawCompileArgs:
    """TEST-ONLY: emits ``json.loads(value)`` as WANCOMPILEARGS: any dict, list, number, string or
    null, as a buggy or foreign node could send to ApplyTorchCompile."""
    CATEGORY = CATEGORY
    RETURN_TYPES = ("WANCOMPILEARGS",)
    RETURN_NAMES = ("torch_compile_args",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("STRING", {"default": "{}", "multiline": True})}}

    def make(self, value):
        return (json.loads(value),)


# Process state that is not state anyone could leak: ComfyUI/pytest bookkeeping and the
# handshake inductor writes into os.environ before loading every compiled CPU .so.
_NOT_STATE_ENV = {"_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"}


def _digest(value):
    """A JSON-able, comparable form of a config value (sets sorted: their order is not state)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (set, frozenset)):
        return sorted(repr(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_digest(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _digest(v) for k, v in value.items()}
    return repr(value)


def state_digest():
    """TEST-ONLY: ``compile_core.torch_support.scoped.snapshot()`` (the pack's own definition of leakable state:
    dynamo/inductor (incl. its triton sub-config)/fx config, the pack's env vars, TF32 flags and
    matmul precision) plus the whole environment, grad mode and default dtype."""
    import importlib
    pack = _pack_module("scoped", "compile_core.torch_support")
    if pack is None:  # the pack is loaded as a custom node; its module name has the folder's name
        pack = importlib.import_module("TorchCompileSpeed.compile_core.torch_support.scoped")
    snap = pack.snapshot()
    out = {}
    for section, values in snap.items():
        if isinstance(values, dict):
            out[section] = {str(k): _digest(v) for k, v in values.items()}
        else:
            out[section] = _digest(values)
    out["environ"] = {k: v for k, v in os.environ.items() if k not in _NOT_STATE_ENV}
    out["process"] = {"grad": torch.is_grad_enabled(), "default_dtype": str(torch.get_default_dtype()),
                      "deterministic": torch.are_deterministic_algorithms_enabled(),
                      "num_threads": torch.get_num_threads(),
                      "cudnn_benchmark": torch.backends.cudnn.benchmark}
    return out


class TCSTestStateSnapshot:
    """TEST-ONLY output node: the server's global torch state now (``state_digest``), as ui output.
    ``samples`` passes through, so a sampler can be ordered after it (latent_image = this node)."""
    CATEGORY = CATEGORY
    RETURN_TYPES = ("LATENT",)
    FUNCTION = "snapshot"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "label": ("STRING", {"default": "snapshot"})}}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")

    def snapshot(self, samples, label):
        return {"ui": {"state": [{"label": label, "state": state_digest()}]}, "result": (samples,)}


_LOWVRAM_BUDGET_KEY = "tcs_test_lowvram_budget"


def _lowvram_patcher_class():
    """TEST-ONLY: a ModelPatcher subclass that loads with a tiny memory budget on CPU.

    On ``--cpu`` ComfyUI always loads models fully (``load_models_gpu``: a CPU load device means
    VRAMState.DISABLED), so its lowvram path (modules left "offloaded" with
    ``comfy_cast_weights`` and LoRA ``weight_function`` patches applied at each forward) never
    runs. This subclass starts every load from unpatched weights and caps the memory
    ``partially_load`` may use, which is what a GPU short of VRAM gets. ``clone()`` keeps the
    class, so ApplyTorchCompile and LoRA loaders downstream keep it too."""
    import comfy.model_patcher

    class TCSTestLowVramPatcher(comfy.model_patcher.ModelPatcher):
        def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
            budget = int(self.model_options.get(_LOWVRAM_BUDGET_KEY, 0))
            if not budget:
                return super().partially_load(device_to, extra_memory, force_patch_weights)
            if not self.model.model_lowvram or self.model.current_weight_patches_uuid != self.patches_uuid:
                self.unpatch_model(self.offload_device, unpatch_weights=True)  # load from scratch
            return super().partially_load(device_to, min(extra_memory, budget), force_patch_weights)

    return TCSTestLowVramPatcher


class TCSTestForceLowVram:
    """TEST-ONLY: a clone of MODEL that ComfyUI loads partially (``budget_mb`` of weights loaded,
    the rest in lowvram mode), as on a GPU without enough free VRAM."""
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "force"
    _cls = None

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "budget_mb": ("FLOAT", {"default": 2.0, "min": 0.001, "max": 1e6})}}

    def force(self, model, budget_mb):
        if TCSTestForceLowVram._cls is None:
            TCSTestForceLowVram._cls = _lowvram_patcher_class()
        clone = model.clone()
        clone.__class__ = TCSTestForceLowVram._cls
        clone.model_options[_LOWVRAM_BUDGET_KEY] = int(budget_mb * 1024 * 1024)
        return (clone,)



# --------------------------------------------------------------------------- dynamic VRAM (0.33+)

_LOAD_DIGESTS = {}  # id(patcher) -> _patcher_digest(patcher) when TCSTestDynamicVramLoader made it


def _load_aimdo_library():
    """TEST-ONLY: load comfy-aimdo's native library, as ComfyUI's main.py does on a GPU.

    On ``--cpu`` main.py never calls ``comfy_aimdo.control.init()``, and ``ModelPatcherDynamic``
    needs the library (``register_load_device`` makes ``comfy_aimdo.host_buffer.HostBuffer``s).
    ``init()`` works without a GPU (it only loads the .so); ``host_buffer`` binds the library
    when it is imported, so it is imported again once the library is there. Nothing else changes:
    ``comfy.memory_management.aimdo_enabled`` stays False, so ComfyUI's own paths stay the CPU ones."""
    import importlib

    import comfy_aimdo.control
    import comfy_aimdo.host_buffer
    if comfy_aimdo.host_buffer.lib is not None:
        return
    if comfy_aimdo.control.lib is None and not comfy_aimdo.control.init("cuda"):
        raise RuntimeError("comfy-aimdo's library did not load")
    importlib.reload(comfy_aimdo.host_buffer)


def _patcher_digest(patcher):
    """A JSON-able digest of a ModelPatcher's state, to tell whether anything changed it."""
    model = patcher.model
    dm = model.diffusion_model
    with torch.no_grad():
        weights = float(sum(p.detach().double().sum() for p in dm.parameters()))

    def keys(d):
        return sorted(str(k) for k in (d or {}))

    return {
        "class": type(patcher).__name__,
        "model_id": id(model),
        "patches_uuid": str(getattr(patcher, "patches_uuid", "")),
        "patches": keys(patcher.patches),
        "object_patches": keys(patcher.object_patches),
        "model_options": keys(patcher.model_options),
        "transformer_options": keys(patcher.model_options.get("transformer_options")),
        "wrappers": {str(k): keys(v) for k, v in (getattr(patcher, "wrappers", {}) or {}).items()},
        "callbacks": {str(k): keys(v) for k, v in (getattr(patcher, "callbacks", {}) or {}).items()},
        "attachments": keys(getattr(patcher, "attachments", {})),
        "additional_models": keys(getattr(patcher, "additional_models", {})),
        "non_dynamic_delegate_model": repr(getattr(patcher, "non_dynamic_delegate_model", None)),
        "has_cached_patcher_init": getattr(patcher, "cached_patcher_init", None) is not None,
        "load_device": str(patcher.load_device),
        "model_dynamic_patchers": len(getattr(model, "dynamic_patchers", ()) or ()),
        "modules_with_compiled_call_impl": sum(
            1 for m in dm.modules() if m.__dict__.get("_compiled_call_impl") is not None),
        "weights_sum": weights,
    }


@contextlib.contextmanager
def _gpu_like_dtypes():
    """TEST-ONLY: what ComfyUI 0.33 decides on an NVIDIA GPU with dynamic VRAM, on the CPU: comfy-aimdo
    on (``comfy.ops`` then loads Linear weights lazily, in the file's dtype, recording the model's
    dtype beside them) and a float16 model computed in float16 (no manual cast; on a CPU ComfyUI
    would cast to float32 at every op). Only for the load it wraps: the globals are restored."""
    import comfy.memory_management
    import comfy.model_management as mm
    saved = (comfy.memory_management.aimdo_enabled, mm.unet_dtype, mm.unet_manual_cast)
    comfy.memory_management.aimdo_enabled = True
    mm.unet_dtype = lambda *a, **k: torch.float16
    mm.unet_manual_cast = lambda *a, **k: None
    try:
        yield
    finally:
        comfy.memory_management.aimdo_enabled, mm.unet_dtype, mm.unet_manual_cast = saved


def gpu_like_load_diffusion_model(unet_path, model_options=None, disable_dynamic=False):
    """TEST-ONLY: ``comfy.sd.load_diffusion_model`` under ``_gpu_like_dtypes`` (also as the
    patcher's ``cached_patcher_init``, so ``clone(disable_dynamic=True)`` reloads the same way)."""
    import comfy.sd
    with _gpu_like_dtypes():
        return comfy.sd.load_diffusion_model(unet_path, model_options or {}, disable_dynamic=disable_dynamic)


class TCSTestDynamicVramLoader:
    """TEST-ONLY: a UNETLoader whose MODEL is a real ``comfy.model_patcher.ModelPatcherDynamic``
    (ComfyUI 0.33+) on CPU, as a GPU server's UNETLoader returns it (there ``main.py`` sets
    ``CoreModelPatcher = ModelPatcherDynamic``).

    On a CPU load device ``ModelPatcherDynamic.__new__`` returns a plain ModelPatcher, so the
    instance is made with ``object.__new__`` and ComfyUI's own ``__init__`` (after loading
    comfy-aimdo's library, see ``_load_aimdo_library``). The model is loaded by
    ``comfy.sd.load_diffusion_model`` (plain, on CPU), and ``cached_patcher_init`` is the one that
    loader sets, so ``clone(disable_dynamic=True)`` reloads the file as on a GPU;
    ``reloadable=False`` drops it, like a custom loader that sets none. ``gpu_dtypes=True`` loads
    (and reloads) as a GPU server does, see ``gpu_like_load_diffusion_model``. The patcher is meant
    to be cloned, not sampled: ComfyUI never loads a dynamic patcher on a CPU device."""
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"unet_name": ("STRING", {"default": ""}),
                             "reloadable": ("BOOLEAN", {"default": True})},
                "optional": {"gpu_dtypes": ("BOOLEAN", {"default": False})}}

    def load(self, unet_name, reloadable, gpu_dtypes=False):
        import comfy.model_patcher
        import comfy.sd
        import folder_paths

        dynamic_cls = getattr(comfy.model_patcher, "ModelPatcherDynamic", None)
        if dynamic_cls is None:
            raise RuntimeError("this ComfyUI has no ModelPatcherDynamic (dynamic VRAM is 0.33+)")
        _load_aimdo_library()
        path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        load = gpu_like_load_diffusion_model if gpu_dtypes else comfy.sd.load_diffusion_model
        plain = load(path)
        patcher = object.__new__(dynamic_cls)
        patcher.__init__(plain.model, plain.load_device, plain.offload_device)
        patcher.cached_patcher_init = (load, (path,)) if reloadable else None
        assert type(patcher) is dynamic_cls and patcher.is_dynamic()
        _LOAD_DIGESTS[id(patcher)] = _patcher_digest(patcher)
        return (patcher,)


class TCSTestPatcherInfo:
    """TEST-ONLY output node: what MODEL's patcher is now: its class, ``is_dynamic()`` (where
    ComfyUI has it), its model and parent (by id) and a state digest; for a patcher made by
    TCSTestDynamicVramLoader also the digest it had when it was made. ``after`` (any latent)
    only orders this node after another one, e.g. a sampler."""
    CATEGORY = CATEGORY
    RETURN_TYPES = ()
    FUNCTION = "info"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "label": ("STRING", {"default": "info"})},
                "optional": {"after": ("LATENT",)}}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")

    def info(self, model, label, after=None):
        is_dynamic = getattr(model, "is_dynamic", None)
        parent = getattr(model, "parent", None)
        report = {"label": label, "class": type(model).__name__,
                  "class_module": type(model).__module__,
                  "is_dynamic": bool(is_dynamic()) if callable(is_dynamic) else None,
                  "patcher_id": id(model), "model_id": id(model.model),
                  "parent_id": None if parent is None else id(parent),
                  "digest": _patcher_digest(model), "digest_at_load": _LOAD_DIGESTS.get(id(model))}
        return {"ui": {"info": [report]}}


NODE_CLASS_MAPPINGS = {c.__name__: c for c in (TCSTestZeroConditioning, TCSTestProbe, TCSTestLatentAfter,
                                                TCSTestReferenceCompileArgs, TCSTestWanStyleConsumer,
                                                TCSTestRawCompileArgs, TCSTestStateSnapshot,
                                                TCSTestForceLowVram, TCSTestDynamicVramLoader,
                                                TCSTestPatcherInfo)}
NODE_DISPLAY_NAME_MAPPINGS = {k: f"[test] {k}" for k in NODE_CLASS_MAPPINGS}


# --- TCSTestAttentionOverride: an attention override set the way patch nodes do it


def _qkv_override(transform):
    """An ``optimized_attention_override(func, *args, **kwargs)`` that runs ComfyUI's own
    attention ``func`` on ``transform(q, k, v)``. Module-level objects: a stable identity, so
    running the same choice again is not a new function to dynamo."""
    def override(func, *args, **kwargs):
        names = ("q", "k", "v")
        qkv = list(args[:3]) + [kwargs.pop(n) for n in names[len(args[:3]):]]
        return func(*transform(*qkv), *args[3:], **kwargs)
    return override


ATTENTION_OVERRIDES = {
    "scale_q_0.5": _qkv_override(lambda q, k, v: (q * 0.5, k, v)),
    "scale_q_2": _qkv_override(lambda q, k, v: (q * 2.0, k, v)),
    "negate_v": _qkv_override(lambda q, k, v: (q, k, -v)),
}


class TCSTestAttentionOverride:
    """TEST-ONLY: a clone of MODEL with ``transformer_options["optimized_attention_override"]``
    set to a deterministic override (``none`` removes it), as SageAttention-style patch nodes do
    (``model.clone()`` + ``model_options`` edit; ComfyUI's attention calls
    ``override(original_attention, *args, **kwargs)``)."""
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "override": (["none", *ATTENTION_OVERRIDES], {"default": "none"})}}

    def patch(self, model, override):
        m = model.clone()
        opts = dict(m.model_options.get("transformer_options", {}))
        opts.pop("optimized_attention_override", None)
        if override != "none":
            opts["optimized_attention_override"] = ATTENTION_OVERRIDES[override]
        m.model_options["transformer_options"] = opts
        return (m,)


NODE_CLASS_MAPPINGS[TCSTestAttentionOverride.__name__] = TCSTestAttentionOverride
NODE_DISPLAY_NAME_MAPPINGS[TCSTestAttentionOverride.__name__] = "[test] TCSTestAttentionOverride"


# --- TCSTestWaitForInterrupt: a cancel that lands at a known model call


class TCSTestWaitForInterrupt:
    """TEST-ONLY: MODEL passed through unchanged, with a one-shot forward pre-hook on its
    diffusion model: its ``call``-th forward (counted from this node's run) logs
    ``TCSTest: waiting for an interrupt`` and blocks until ComfyUI's interrupt flag is set (the
    test POSTs /interrupt), then runs on. The next forward after that logs
    ``TCSTest: model call after the interrupt`` and removes the hook (no more calls were
    expected: a cancel must stop the prompt before another model call). Use a server of the
    test's own: the hook stays on the (shared) module until such a call happens."""
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "arm"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "call": ("INT", {"default": 1, "min": 1, "max": 1000}),
                             "timeout_s": ("FLOAT", {"default": 300.0, "min": 1.0, "max": 3600.0})}}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")  # re-arm on every queue

    def arm(self, model, call, timeout_s):
        import time
        import comfy.model_management as mm

        dm = model.get_model_object("diffusion_model")
        state = {"calls": 0, "waited": False}

        def pre_hook(module, args, kwargs=None):
            state["calls"] += 1
            if state["waited"]:
                log.warning("TCSTest: model call after the interrupt")
                handle.remove()
            elif state["calls"] == call:
                log.warning("TCSTest: waiting for an interrupt (model call %d)", call)
                deadline = time.monotonic() + timeout_s
                while not mm.processing_interrupted() and time.monotonic() < deadline:
                    time.sleep(0.01)
                state["waited"] = True
                log.warning("TCSTest: interrupt seen: %s", mm.processing_interrupted())
            return None

        handle = dm.register_forward_pre_hook(pre_hook)
        return (model,)


NODE_CLASS_MAPPINGS[TCSTestWaitForInterrupt.__name__] = TCSTestWaitForInterrupt
NODE_DISPLAY_NAME_MAPPINGS[TCSTestWaitForInterrupt.__name__] = "[test] TCSTestWaitForInterrupt"


# --- Apply Torch Compile (VAE)


class TCSTestRandomLatent:
    """TEST-ONLY: a LATENT of seeded standard-normal values, ``[1, channels, frames, height,
    width]`` (a video latent), or ``[1, channels, height, width]`` when ``frames`` is 0."""
    CATEGORY = CATEGORY
    RETURN_TYPES = ("LATENT",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        ints = {"min": 0, "max": 4096}
        return {"required": {"channels": ("INT", {"default": 16, **ints}),
                             "frames": ("INT", {"default": 2, **ints}),
                             "height": ("INT", {"default": 4, **ints}),
                             "width": ("INT", {"default": 4, **ints}),
                             "seed": ("INT", {"default": 0, "min": 0, "max": 2**31})}}

    def make(self, channels, frames, height, width, seed):
        g = torch.Generator().manual_seed(seed)
        shape = (1, channels, frames, height, width) if frames else (1, channels, height, width)
        return ({"samples": torch.randn(shape, generator=g)},)


class TCSTestVAEProbe:
    """TEST-ONLY output node: saves ``images`` (raw float tensor), or ``samples``' latent, to
    ``output/<label>.safetensors`` (key ``images``) and reports the dynamo counters and how
    ``vae`` is compiled: its CompiledModel's graphs/runs/failure (None for an eager VAE), the
    methods overridden on the instance, and modules carrying ``_compiled_call_impl`` now."""
    CATEGORY = CATEGORY
    RETURN_TYPES = ()
    FUNCTION = "probe"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"vae": ("VAE",), "label": ("STRING", {"default": "vae"})},
                "optional": {"images": ("IMAGE",), "samples": ("LATENT",)}}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")

    def probe(self, vae, label, images=None, samples=None):
        import folder_paths
        images = images if images is not None else samples["samples"]
        import safetensors.torch
        out = os.path.join(folder_paths.get_output_directory(), f"{label}.safetensors")
        safetensors.torch.save_file({"images": images.detach().float().contiguous().cpu()}, out)
        compiled = vae.__dict__.get("torch_compile_speed")
        entry = compiled.entry if compiled is not None else None
        report = {"label": label, "file": out, "counters": _plain_counters(),
                  "vae_id": id(vae), "model_id": id(vae.first_stage_model),
                  "instance_methods": sorted(k for k in ("decode", "decode_tiled", "encode", "encode_tiled")
                                             if k in vae.__dict__),
                  "modules_with_compiled_call_impl": sum(
                      1 for m in vae.first_stage_model.modules()
                      if m.__dict__.get("_compiled_call_impl") is not None),
                  "compiled": None if entry is None else {
                      "graphs": entry.graphs, "runs": entry.runs, "failed": entry.failed,
                      "regions": compiled.description, "fingerprint": entry.fingerprint}}
        return {"ui": {"probe": [report]}}


for _cls in (TCSTestRandomLatent, TCSTestVAEProbe):
    NODE_CLASS_MAPPINGS[_cls.__name__] = _cls
    NODE_DISPLAY_NAME_MAPPINGS[_cls.__name__] = f"[test] {_cls.__name__}"


# --- background compile: a model call that waits for the worker, a slow backend

SLOW_BACKEND = "tcs_test_slow_backend"


def _tcs_test_slow_backend(gm, example_inputs):
    """TEST-ONLY backend: sleeps 4 s, then compiles like ``aot_eager`` (a compile that is
    surely still running when a test acts during it)."""
    import time
    from torch._dynamo.backends.registry import lookup_backend
    time.sleep(4.0)
    return lookup_backend("aot_eager")(gm, example_inputs)


if SLOW_BACKEND not in __import__("torch._dynamo.backends.registry", fromlist=["x"])._COMPILER_FNS:
    torch._dynamo.register_backend(name=SLOW_BACKEND)(_tcs_test_slow_backend)

PAUSABLE_BACKEND = "tcs_test_pausable_backend"
PAUSABLE_WORK = 300  # torch.fx interpretations of 10 ms each: 3 s of compile work


def _tcs_test_pausable_backend(gm, example_inputs):
    """TEST-ONLY backend: 3 s of work made of torch.fx interpretations (as in a real compile's
    Python phases), then compiles like ``aot_eager``: a compile long enough for a prompt to
    come while it runs."""
    import time
    from torch._dynamo.backends.registry import lookup_backend
    graph = torch.fx.symbolic_trace(lambda x: (x + 1) * 2)
    for _ in range(PAUSABLE_WORK):
        torch.fx.Interpreter(graph).run(torch.ones(1))
        time.sleep(0.01)
    return lookup_backend("aot_eager")(gm, example_inputs)


if PAUSABLE_BACKEND not in __import__("torch._dynamo.backends.registry", fromlist=["x"])._COMPILER_FNS:
    torch._dynamo.register_backend(name=PAUSABLE_BACKEND)(_tcs_test_pausable_backend)


def _pack_module(name, package="compile_core"):
    """The pack's ``<package>.<name>`` module as ComfyUI loaded it (None when not loaded).

    Iterates a copy: ``dict.copy`` holds the GIL throughout, while iterating ``sys.modules`` itself
    (or building its item tuples, which can run the garbage collector) lets the background compile
    thread import a module mid-way and fail the loop with "dictionary changed size"."""
    import sys
    return next((m for n, m in sys.modules.copy().items() if n.endswith(f"{package}.{name}")), None)


class TCSTestWaitForBackground:
    """TEST-ONLY: MODEL passed through, with a forward pre-hook on its diffusion model that, at
    its ``call``-th forward, waits until the pack's background compile worker is idle, and at
    every forward logs ``TCSTest: call N regions compiled K at T``: K = region modules whose
    ``_compiled_call_impl`` is the compiled path (``shapes.shaped_call``) right now, T the
    server's ``perf_counter`` (the benchmark's step times). ``in_graphs`` False: the hook is
    left out of a graph that compiles the diffusion model itself (core's, the pack's whole
    model), whose calls then log nothing: its clock and log would break that graph in two and
    slow what is measured."""
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "arm"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "call": ("INT", {"default": 2, "min": 1, "max": 1000})},
                "optional": {"in_graphs": ("BOOLEAN", {"default": True})}}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")

    def arm(self, model, call, in_graphs=True):
        import time

        import torch
        dm = model.get_model_object("diffusion_model")
        state = {"calls": 0}
        for h in list(getattr(dm, "_tcs_bg_hooks", [])):
            h.remove()

        def pre_hook(module, args):
            if not in_graphs and torch.compiler.is_compiling():
                return
            state["calls"] += 1
            if state["calls"] == call:
                _pack_module("background", "compile_core.run").wait_idle(300)
            compiled = sum(1 for m in module.modules() if any(name in getattr(
                m.__dict__.get("_compiled_call_impl"), "__qualname__", "")
                for name in ("shaped_call", "eager_on_failure")))  # (the engine's region calls)
            log.warning("TCSTest: call %d regions compiled %d at %.4f", state["calls"], compiled,
                        time.perf_counter())

        dm._tcs_bg_hooks = [dm.register_forward_pre_hook(pre_hook)]
        return (model,)


NODE_CLASS_MAPPINGS[TCSTestWaitForBackground.__name__] = TCSTestWaitForBackground


def _process_report() -> dict:
    """What the server process holds at this point: objects frozen out of the garbage
    collector's reach, its threads, and the modules of the on-prompt handlers ComfyUI calls."""
    import gc
    import threading
    from server import PromptServer
    handlers = getattr(PromptServer.instance, "on_prompt_handlers", [])
    return {"gc_frozen": gc.get_freeze_count(), "threads": sorted(t.name for t in threading.enumerate()),
            "on_prompt_handlers": [getattr(h, "__module__", "?") for h in handlers]}


JOB_CONTROL = (signal.SIGSTOP, signal.SIGCONT, signal.SIGTSTP) if hasattr(signal, "SIGSTOP") else ()
# functions and methods of torch a pack could replace to pause a compile (module, class, name)
WATCHED = (("torch._dynamo.symbolic_convert", "InstructionTranslatorBase", "step"),
           ("torch._dynamo.convert_frame", None, "compile_lock"),
           ("torch._guards", "Guard", "create"),
           ("torch._subclasses.fake_tensor", "FakeTensorMode", "dispatch"),
           ("torch.fx.experimental.symbolic_shapes", "ShapeEnv", "evaluate_expr"),
           ("torch._inductor.graph", "GraphLowering", "run_node"),
           ("torch.fx.interpreter", "Interpreter", "run_node"),
           ("torch._inductor.scheduler", "Scheduler", "can_fuse"))


class _ProcessWatch:
    """TEST-ONLY (``TCS_TEST_WATCH=1``): watches the server process from its start, and only
    looks: job-control signals sent (an audit hook), torch functions replaced, the interpreter's
    switch interval, and threads or child processes given a lower priority (sampled)."""

    def __init__(self):
        import importlib
        import sys
        import threading
        self.signals, self.replaced, self.intervals, self.niced, self.samples = [], set(), set(), set(), 0
        self.interval = sys.getswitchinterval()
        self.targets = []
        for module, cls, name in WATCHED:
            try:
                owner = importlib.import_module(module)
                owner = getattr(owner, cls) if cls else owner
                self.targets.append((owner, name, getattr(owner, name)))
            except (ImportError, AttributeError):
                continue
        sys.addaudithook(self._audit)
        threading.Thread(target=self._loop, name="tcs-test-watch", daemon=True).start()

    def _audit(self, event, args):
        if event in ("os.kill", "os.killpg", "signal.pthread_kill") and len(args) > 1 and args[1] in JOB_CONTROL:
            self.signals.append([event, int(args[0]), int(args[1])])

    def _loop(self):
        import sys
        import time
        import psutil
        me = psutil.Process()
        while True:
            self.samples += 1
            self.intervals.add(sys.getswitchinterval())
            for owner, name, original in self.targets:
                if getattr(owner, name, None) is not original:
                    self.replaced.add(f"{getattr(owner, '__name__', owner)}.{name}")
            if self.samples % 10 == 0:
                self._sample_priorities(me, psutil)
            time.sleep(0.005)

    def _sample_priorities(self, me, psutil):
        try:
            procs = [me] + me.children(recursive=True)
        except psutil.Error:
            return
        for proc in procs:
            try:
                if proc.nice() > 0 or os.sched_getscheduler(proc.pid) != os.SCHED_OTHER:
                    self.niced.add(" ".join(proc.cmdline()[:2]) or str(proc.pid))
            except (psutil.Error, OSError):
                continue
        for tid in os.listdir("/proc/self/task"):
            try:
                if os.getpriority(os.PRIO_PROCESS, int(tid)) > 0:
                    self.niced.add(f"thread {tid}")
            except OSError:
                continue

    def report(self) -> dict:
        return {"samples": self.samples, "job_control_signals": list(self.signals),
                "replaced": sorted(self.replaced), "switch_interval_at_start": self.interval,
                "switch_intervals": sorted(self.intervals), "niced": sorted(self.niced)}


_WATCH = [_ProcessWatch()] if os.environ.get("TCS_TEST_WATCH") == "1" else []


class TCSTestKJDisableWeightCasts:
    """TEST-ONLY: runs KJNodes' own ``patch_aimdo_for_compile()`` (its TorchCompileModelAdvanced
    runs it on a dynamic-VRAM model, which ComfyUI never makes on a CPU device, so its node
    cannot reach it here): comfy.ops' weight casts become ``torch._dynamo.disable`` wrappers for
    the rest of the process. Returns the names it finds disabled afterwards."""
    CATEGORY = CATEGORY
    RETURN_TYPES = ("LATENT",)
    FUNCTION = "patch"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",)}}

    def patch(self, samples):
        import comfy.ops
        kj = [m for name, m in list(sys.modules.items())
              if name.endswith("model_optimization_nodes") and hasattr(m, "patch_aimdo_for_compile")]
        if not kj:
            raise RuntimeError("KJNodes' model_optimization_nodes is not loaded in this server")
        kj[0].patch_aimdo_for_compile()
        disabled = [n for n in ("cast_bias_weight", "uncast_bias_weight")
                    if getattr(getattr(comfy.ops, n, None), "_torchdynamo_disable", False)]
        return {"ui": {"disabled": disabled}, "result": (samples,)}


NODE_CLASS_MAPPINGS[TCSTestKJDisableWeightCasts.__name__] = TCSTestKJDisableWeightCasts
NODE_DISPLAY_NAME_MAPPINGS[TCSTestKJDisableWeightCasts.__name__] = "[test] TCSTestKJDisableWeightCasts"


# --- TCSTestCudaPaths: the overlay host's CUDA-only paths, taken on the CPU (FAKE of the device)

_CUDA_PATHS = {"modulate": None}


def _modulate_through_kitchen(x, norm, shift, scale):
    """FAKE of a large CUDA tensor: WAN's ``modulate`` as it runs there, through comfy-kitchen's
    ``adaln`` op (its eager backend computes it on the CPU)."""
    import comfy.ldm.wan.model as wan
    import comfy.quant_ops
    shift, scale = wan.repeat_e(shift, x), wan.repeat_e(scale, x)
    return comfy.quant_ops.ck.adaln(x, scale, shift, norm.eps)


def _stand_in_attention(q, k, v, *args, **kwargs):
    """FAKE of a checkpoint's ``ComfyAttention.function`` (comfy-kitchen int8 attention, CUDA
    only): ComfyUI's own attention on a query scaled by 0.5, so its output differs from the
    default's and a stale compiled graph would show."""
    import comfy.ldm.modules.attention as attention
    q, k, v = (t.take() if isinstance(t, attention.AttentionTensorContainer) else t for t in (q, k, v))
    return attention.attention_pytorch(q * 0.5, k, v, *args, **kwargs)


class TCSTestCudaPaths:
    """TEST-ONLY, a FAKE of the GPU: makes the overlay's CUDA-only paths run on the CPU.
    ``adaln``: WAN's ``modulate`` calls comfy-kitchen's ``adaln`` op at every size and device
    (process-wide, in this test server); ``attention_function``: every ``ComfyAttention`` of the
    model gets a function, as a checkpoint with an attention config gives it on CUDA; ``none``
    puts both back. Runs at every prompt; returns the model unchanged (not a clone: the function
    is the model's own attribute, as ComfyUI sets it at load)."""
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "take"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "path": (["none", "adaln", "attention_function"], {"default": "none"})}}

    @classmethod
    def IS_CHANGED(cls, **_kwargs):
        return float("nan")

    def take(self, model, path):
        import comfy.ldm.wan.model as wan
        from comfy.ldm.modules.attention import ComfyAttention
        if _CUDA_PATHS["modulate"] is None:
            _CUDA_PATHS["modulate"] = wan.modulate
        wan.modulate = _modulate_through_kitchen if path == "adaln" else _CUDA_PATHS["modulate"]
        for m in model.model.diffusion_model.modules():
            if isinstance(m, ComfyAttention):
                m.function = _stand_in_attention if path == "attention_function" else None
        return (model,)


NODE_CLASS_MAPPINGS[TCSTestCudaPaths.__name__] = TCSTestCudaPaths
NODE_DISPLAY_NAME_MAPPINGS[TCSTestCudaPaths.__name__] = "[test] TCSTestCudaPaths"
