"""The compiled model on a ComfyUI ModelPatcher.

The compiled model is installed as an ``APPLY_MODEL`` wrapper on a *clone* of the
ModelPatcher, the same mechanism ComfyUI core's TorchCompileModel uses, so the input
model, the other graph branches and the state_dict keys stay untouched. An ``OUTER_SAMPLE``
wrapper marks each sampling run and sends the node badge's status after it.
"""
from __future__ import annotations

import functools

import comfy.model_management
import comfy.patcher_extension as patcher_extension

from ..compile_core import api
from ..compile_core.report import log
from ..compile_core.run import background
from ..compile_core.torch_support.other_compiles import dynamo_disabled
from . import memory_compiler, weight_routing
from .comfy_server import send_if_any, send_status, server_idle
from .dynamic_vram import compile_clone

WRAPPER_KEY = "torch_compile_speed"
CORE_COMPILE_KEY = "torch.compile"  # comfy_api.torch_helpers' key (KJNodes uses it too)
COMPILE_KWARGS = "torch_compile_kwargs"  # what set_torch_compile_wrapper leaves in model_options
# comfy.ops' weight casts, which KJNodes' dynamic-VRAM compile marks torch._dynamo.disable
WEIGHT_CASTS = ("cast_bias_weight", "uncast_bias_weight", "cast_modules_with_vbar",
                "resolve_cast_module_with_vbar")
APPLY_MODEL = patcher_extension.WrappersMP.APPLY_MODEL
OUTER_SAMPLE = patcher_extension.WrappersMP.OUTER_SAMPLE
# what a cancelled prompt raises inside a model call (an Exception on older ComfyUI): it is no
# failure of the compiled call, so it propagates without an eager run
INTERRUPT = (comfy.model_management.InterruptProcessingException,)


def diffusion_model(model_patcher):
    return model_patcher.get_model_object("diffusion_model")


def load_device(model_patcher):
    return model_patcher.load_device


def with_compile_wrapper(model_patcher, compiled, node_id=None):
    """A clone of ``model_patcher`` (``dynamic_vram.compile_clone``) whose model calls run
    ``compiled``; a torch.compile wrapper of another node on it (core's TorchCompileModel,
    KJNodes' TorchCompileModelAdvanced) is removed with the compile kwargs it left, with a
    warning that names that node."""
    background.set_idle_check(server_idle)
    clone, compiled.memory_path = compile_clone(model_patcher)
    clone.remove_wrappers_with_key(APPLY_MODEL, WRAPPER_KEY)
    others = clone.get_wrappers(APPLY_MODEL, CORE_COMPILE_KEY)
    if others:  # never compile twice
        node = compile_node_name(others[0])
        clone.remove_wrappers_with_key(APPLY_MODEL, CORE_COMPILE_KEY)
        clone.model_options.pop(COMPILE_KWARGS, None)  # (other packs read it as "compiled")
        log.warning("Apply Torch Compile replaced %s wrapper: compiling twice would trace this "
                    "pack's runtime code inside the other compiled model (graph breaks, a second "
                    "compile). Remove %s from this model's path.", node, node.split(" (")[0])
    _report_disabled_casts()
    compiled.state.compile_context = memory_compiler.paused
    compiled.on_background_done = lambda: send_status(api.status(compiled, node_id))
    clone.add_wrapper_with_key(APPLY_MODEL, WRAPPER_KEY, _apply_model_wrapper(compiled, node_id))
    clone.remove_wrappers_with_key(OUTER_SAMPLE, WRAPPER_KEY)
    clone.add_wrapper_with_key(OUTER_SAMPLE, WRAPPER_KEY, _sampling_wrapper(compiled, node_id))
    return clone


def _report_disabled_casts() -> None:
    """Say once when comfy.ops' weight casts are dynamo-disabled process-wide (KJNodes'
    TorchCompileModelAdvanced does it, for good, once it ran on a dynamic-VRAM model), and what
    that costs this pack's compiled blocks. The pack leaves them as they are: they are another
    pack's, and its compile relies on them."""
    import comfy.ops
    off = [n for n in WEIGHT_CASTS if dynamo_disabled(getattr(comfy.ops, n, None))]
    if off:
        log.warn_once("disabled-weight-casts:" + ",".join(off),
                      "comfy.ops %s %s marked torch._dynamo.disable for this whole process by "
                      "another pack (KJNodes' TorchCompileModelAdvanced does it once it ran on a "
                      "dynamic-VRAM model) until ComfyUI restarts. What it costs here: in a "
                      "compiled block every layer that casts its weight at run time (offloaded or "
                      "dynamic-VRAM weights, a LoRA applied at run time) ends one graph and starts "
                      "the next, with eager Python between, so a block with N such layers runs as "
                      "N+1 graphs instead of one. Restart ComfyUI without that node (or with its "
                      "disable_dynamic_vram on) to compile whole blocks again.",
                      ", ".join(off), "is" if len(off) == 1 else "are")


def compile_node_name(wrapper) -> str:
    """The node that put a torch.compile ``APPLY_MODEL`` wrapper on a model, told by the
    wrapper function's module: core's (``comfy_api.torch_helpers``) or KJNodes'."""
    module = str(getattr(wrapper, "__module__", "") or "")
    name = str(getattr(wrapper, "__qualname__", "") or "")
    if "kjnodes" in module.lower() or name.startswith("_kj_"):
        return "KJNodes' TorchCompileModelAdvanced"
    if module.startswith(("comfy_api.", "comfy_extras.", "comfy.")):
        return "core's TorchCompileModel"
    return f"another node's torch.compile ({module or name or 'unknown'})"


def _apply_model_wrapper(compiled, node_id):
    """The ``APPLY_MODEL`` wrapper: each model call through ``run_compiled``, with the badge's
    status before the first compile and after a call that changed it. Where another node's
    torch.compile wrapper follows on the same call (it was applied after Apply), that compile
    runs the model and this one steps aside (``_other_compile``)."""
    said = []  # once per Apply

    def torch_compile_speed_wrapper(executor, *args, **kwargs):
        base_model = executor.class_obj
        x = args[0] if args else kwargs["x"]
        if _other_compile(args, kwargs, said):
            return executor(*args, **kwargs)
        send_if_any(api.first_call_status(compiled, node_id))  # the UI shows "compiling..."
        def eager():
            return executor(*args, **kwargs)
        out = api.run_model_call(compiled, lambda: run_compiled(compiled, base_model.diffusion_model, eager, x.device),
                                 eager, INTERRUPT)
        send_if_any(api.changed_status(compiled, node_id))
        return out

    # found again by compiled_model_of (the Diagnostics node) on this clone and its clones
    torch_compile_speed_wrapper.compiled_model = compiled
    torch_compile_speed_wrapper.node_id = node_id
    return torch_compile_speed_wrapper


def _other_compile(args, kwargs, said: list) -> bool:
    """Whether this call's model also carries another node's torch.compile wrapper (core's
    TorchCompileModel or KJNodes' after Apply). Its compile would trace this pack's runtime
    code (KJNodes' fails on it), so the pack steps aside for the call: the other compile runs
    the blocks as they are, nothing of this pack is marked failed, and the same Apply without
    that node compiles in the next workflow. Said once per Apply."""
    options = args[5] if len(args) > 5 else kwargs.get("transformer_options") or {}
    others = {k: v for k, v in options.get("wrappers", {}).get(APPLY_MODEL, {}).items()
              if k != WRAPPER_KEY and "compile" in str(k).lower()}
    if others and not said:
        said.append(True)
        nodes = sorted({compile_node_name(f) for fs in others.values() for f in fs} or {"another node"})
        log.warning("this model also carries another torch.compile wrapper (%s: %s), applied after "
                    "Apply Torch Compile: that compile runs this model, and Apply Torch Compile "
                    "steps aside for it (compiling twice would trace this pack's runtime). Use one "
                    "of the two.", ", ".join(map(str, others)), " and ".join(nodes))
    return bool(others)


def _sampling_wrapper(compiled, node_id):
    """The ``OUTER_SAMPLE`` wrapper: one sampling run of ``compiled``, then the badge's status."""
    def torch_compile_speed_status(executor, *args, **kwargs):
        try:
            with compiled.sampling_run():
                return executor(*args, **kwargs)
        finally:  # once per sampling run, so a reloaded page or a cached node gets its badge too
            send_status(api.status(compiled, node_id))
    return torch_compile_speed_status


def run_compiled(compiled, dm, call, device):
    """``compiled.run`` with the LoRA-patched weight fetches of its regions behind one custom op
    (``weight_routing``): a strength change is then data, not a recompile."""
    if compiled.entry.failed or compiled.entry.slower:  # (eager: ComfyUI's own weight fetches)
        return compiled.run(dm, call, device)
    with weight_routing.routed(dm, compiled.plan):  # (a background compile holds it too)
        return compiled.run(dm, call, device, functools.partial(weight_routing.routed, dm, compiled.plan))


def compiled_model_of(model_patcher):
    """``(CompiledModel, Apply node id)`` installed on this model by ``with_compile_wrapper``,
    or ``(None, None)`` when the model is not compiled by this pack."""
    for w in model_patcher.get_wrappers(APPLY_MODEL, WRAPPER_KEY):
        compiled = getattr(w, "compiled_model", None)
        if compiled is not None:
            return compiled, getattr(w, "node_id", None)
    return None, None


def without_compile_wrapper(model_patcher):
    """A clone of ``model_patcher`` that runs eagerly (our APPLY_MODEL wrapper removed)."""
    clone = model_patcher.clone()
    clone.remove_wrappers_with_key(APPLY_MODEL, WRAPPER_KEY)
    clone.remove_wrappers_with_key(OUTER_SAMPLE, WRAPPER_KEY)
    return clone
