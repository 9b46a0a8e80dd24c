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

Importing this module also registers two TEST-ONLY torch.compile backends, so they appear in
the settings node's backend choices (it lists every registered backend):

- ``tcs_test_raising_backend``: raises ``RuntimeError("boom")`` whenever dynamo asks it to compile.
- ``tcs_test_unloadable_backend``: a FAKE entry-point backend whose import fails, like a broken
  third-party backend install (``torch.compile(backend=...)`` itself raises).
"""
import json
import logging
import math
import os

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
        report = {"label": label, "counters": counters,
                  "stats": counters.get("stats", {}), "recompiles": counters.get("recompiles", {})}
        if model is not None:
            report.update(_model_report(model))
        return {"ui": {"probe": [report]}}


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
        "diffusion_model_wrapper_keys": wrapper_keys("diffusion_model"),
        "diffusion_model_type": type(dm).__name__,
        "is_optimized_module": any(_is_optimized(m) for m in [dm, *modules]),
    }


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


# --------------------------------------------------------------------------- reliability (issue #5)

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
    """TEST-ONLY: ``compile_core.scoped.snapshot()`` (the pack's own definition of leakable state:
    dynamo/inductor (incl. its triton sub-config)/fx config, the pack's env vars, TF32 flags and
    matmul precision) plus the whole environment, grad mode and default dtype."""
    import importlib
    import sys
    pack = next((m for n, m in sys.modules.items() if n.endswith("compile_core.scoped")), None)
    if pack is None:  # the pack is loaded as a custom node; its module name has the folder's name
        pack = importlib.import_module("TorchCompileSpeed.compile_core.scoped")
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


NODE_CLASS_MAPPINGS = {c.__name__: c for c in (TCSTestZeroConditioning, TCSTestProbe, TCSTestLatentAfter,
                                                TCSTestReferenceCompileArgs, TCSTestWanStyleConsumer,
                                                TCSTestRawCompileArgs, TCSTestStateSnapshot,
                                                TCSTestForceLowVram)}
NODE_DISPLAY_NAME_MAPPINGS = {k: f"[test] {k}" for k in NODE_CLASS_MAPPINGS}
