"""The only module that touches ComfyUI internals (ModelPatcher wrappers, folder_paths).

The compiled model is installed as an ``APPLY_MODEL`` wrapper on a *clone* of the
ModelPatcher, the same mechanism ComfyUI core's TorchCompileModel uses, so the input
model, the other graph branches and the state_dict keys stay untouched.
"""
from __future__ import annotations

import functools

import comfy.model_management
import comfy.patcher_extension as patcher_extension
import folder_paths

from ..compile_core.report import log
from ..compile_core.run import pacing, warmup
from ..compile_core.plan.regions import family_of
from ..compile_core.report.status import status_payload
from . import weight_routing
from .dynamic_vram import compile_clone

WRAPPER_KEY = "torch_compile_speed"
STATUS_EVENT = "torch_compile_speed.status"  # web/js listens for it (the node badge)
CORE_COMPILE_KEY = "torch.compile"  # comfy_api.torch_helpers' key


def diffusion_model(model_patcher):
    return model_patcher.get_model_object("diffusion_model")


def load_device(model_patcher):
    return model_patcher.load_device


def server_idle() -> bool:
    """No prompt running or queued on this ComfyUI server (a CPU model's background compile runs
    then, see ``compile_core.run.pacing``); True outside a server."""
    from server import PromptServer
    instance = getattr(PromptServer, "instance", None)
    return instance is None or instance.prompt_queue.get_tasks_remaining() == 0


def with_compile_wrapper(model_patcher, compiled, node_id=None):
    pacing.set_idle_check(server_idle)
    clone = compile_clone(model_patcher)
    apply_model = patcher_extension.WrappersMP.APPLY_MODEL
    clone.remove_wrappers_with_key(apply_model, WRAPPER_KEY)
    if clone.get_wrappers(apply_model, CORE_COMPILE_KEY):  # never compile twice
        clone.remove_wrappers_with_key(apply_model, CORE_COMPILE_KEY)
        log.warning("Apply Torch Compile replaced core's TorchCompileModel wrapper: compiling twice "
                    "would trace this pack's runtime code inside core's compiled model (graph "
                    "breaks, a second compile). Remove TorchCompileModel from this model's path.")
    other_compile_warned = []  # once per Apply

    def torch_compile_speed_wrapper(executor, *args, **kwargs):
        base_model = executor.class_obj
        x = args[0] if args else kwargs["x"]
        if not other_compile_warned:
            options = args[5] if len(args) > 5 else kwargs.get("transformer_options") or {}
            others = [k for k in options.get("wrappers", {}).get(apply_model, {})
                      if k != WRAPPER_KEY and "compile" in str(k).lower()]
            if others:
                other_compile_warned.append(True)
                compiled.inside_other_compile = True
                log.warning("this compiled model also carries another torch.compile wrapper (%s), "
                            "e.g. core's TorchCompileModel applied after Apply Torch Compile: "
                            "compiling twice, the other compile traces this pack's runtime code "
                            "(graph breaks, slower). Use one of the two.", ", ".join(map(str, others)))
        if not compiled.entry.runs and not compiled.entry.failed \
                and not compiled.compiling_in_background:  # the UI shows "compiling..."
            send_status({**status_payload(compiled, node_id), "state": "compiling"})
        out = _run(compiled, base_model.diffusion_model, lambda: executor(*args, **kwargs), x.device)
        if compiled.changed:
            send_status(status_payload(compiled, node_id))
        return out

    compiled.on_background_done = lambda: send_status(status_payload(compiled, node_id))
    # found again by compiled_model_of (the Diagnostics node) on this clone and its clones
    torch_compile_speed_wrapper.compiled_model = compiled
    torch_compile_speed_wrapper.node_id = node_id

    def torch_compile_speed_status(executor, *args, **kwargs):
        try:
            with compiled.sampling_run():
                return executor(*args, **kwargs)
        finally:  # once per sampling run, so a reloaded page or a cached node gets its badge too
            send_status(status_payload(compiled, node_id))

    clone.add_wrapper_with_key(apply_model, WRAPPER_KEY, torch_compile_speed_wrapper)
    outer = patcher_extension.WrappersMP.OUTER_SAMPLE
    clone.remove_wrappers_with_key(outer, WRAPPER_KEY)
    clone.add_wrapper_with_key(outer, WRAPPER_KEY, torch_compile_speed_status)
    return clone


def _run(compiled, dm, call, device):
    """``compiled.run`` with the LoRA-patched weight fetches of its regions behind one custom op
    (``weight_routing``): a strength change is then data, not a recompile."""
    if compiled.entry.failed:
        return compiled.run(dm, call, device)
    with weight_routing.routed(dm, compiled.plan):  # (a background compile holds it too)
        return compiled.run(dm, call, device, functools.partial(weight_routing.routed, dm, compiled.plan))


def compiled_model_of(model_patcher):
    """``(CompiledModel, Apply node id)`` installed on this model by ``with_compile_wrapper``,
    or ``(None, None)`` when the model is not compiled by this pack."""
    for w in model_patcher.get_wrappers(patcher_extension.WrappersMP.APPLY_MODEL, WRAPPER_KEY):
        compiled = getattr(w, "compiled_model", None)
        if compiled is not None:
            return compiled, getattr(w, "node_id", None)
    return None, None


def without_compile_wrapper(model_patcher):
    """A clone of ``model_patcher`` that runs eagerly (our APPLY_MODEL wrapper removed)."""
    clone = model_patcher.clone()
    clone.remove_wrappers_with_key(patcher_extension.WrappersMP.APPLY_MODEL, WRAPPER_KEY)
    clone.remove_wrappers_with_key(patcher_extension.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)
    return clone


def diagnosis_calls(model_patcher, compiled, latent_samples):
    """What the Diagnostics node measures: one eager and one compiled model step on inputs
    shaped like ``latent_samples`` (random values), as ``diagnostics.diagnose`` takes them.

    Eager is ``BaseModel.apply_model`` without our wrapper; compiled is the same call through
    ``CompiledModel.run``, exactly as the wrapper runs it during sampling. ``transformer_options``
    are the model's own (minus wrappers) plus what the sampler adds per step, so the compiled
    regions see what they see while sampling (and do not recompile for the diagnosis).

    Both calls check ComfyUI's interrupt first, so a cancel (POST /interrupt) stops the
    measuring loop between runs; ``check_interrupt`` is that check for ``diagnose``."""
    import os
    import types
    import uuid

    from ..compile_core.plan import regions

    comfy.model_management.load_models_gpu([model_patcher])
    base = model_patcher.model
    dm = base.diffusion_model
    device = model_patcher.load_device
    dtype = base.manual_cast_dtype or base.get_dtype()
    shape = tuple(latent_samples.shape)
    family = regions.family_of(dm)
    try:
        sigma = float(base.model_sampling.percent_to_sigma(0.5))
    except Exception:  # noqa: BLE001 - any mid-schedule sigma will do
        sigma = 0.5
    inputs, known = warmup.latent_inputs(dm, family, shape, device, dtype, sigma)
    options = dict(model_patcher.model_options.get("transformer_options", {}))
    options.pop("wrappers", None)
    options.pop("callbacks", None)
    options.update({"cond_or_uncond": [0] * shape[0], "uuids": [uuid.uuid4()] * shape[0],
                    "sigmas": inputs["t"]})
    inputs["transformer_options"] = options

    check_interrupt = comfy.model_management.throw_exception_if_processing_interrupted

    def eager_step():
        return base.apply_model(**inputs)

    def eager():
        check_interrupt()
        return eager_step()

    def compiled_call():
        check_interrupt()
        return _run(compiled, dm, eager_step, device)

    note = (f"latent {list(shape)} with random values, "
            + (f"{family} inputs" if known else "x and t only (no input recipe for "
               f"{type(dm).__name__})") + f", on {device}")
    comfy_root = os.path.dirname(os.path.dirname(os.path.abspath(comfy.model_management.__file__)))
    return types.SimpleNamespace(
        diffusion_model=dm, device=device, eager=eager, compiled=compiled_call, note=note,
        path_roots=(comfy_root,), reraise=(comfy.model_management.InterruptProcessingException,),
        check_interrupt=check_interrupt)


def compile_ahead(model_patcher, compiled) -> None:
    """Compile before sampling: run the compiled model on inputs shaped like the declared
    latent(s), ``warmup_runs`` times, with ComfyUI's progress bar.

    A cancel (POST /interrupt) is checked before every run and propagates, so the prompt stops
    (ComfyUI 0.3.75's ``InterruptProcessingException`` is an ``Exception``: it must not be taken
    for a compile-ahead failure). Any other failure is logged and sampling compiles instead."""
    import time

    import comfy.utils
    import torch

    interrupt = comfy.model_management.InterruptProcessingException
    check_interrupt = comfy.model_management.throw_exception_if_processing_interrupted
    sizes = warmup.ahead_sizes(compiled.settings)
    if not sizes:
        return
    try:
        base = model_patcher.model
        check_interrupt()
        comfy.model_management.load_models_gpu([model_patcher])
        device = model_patcher.load_device
        dtype = base.manual_cast_dtype or base.get_dtype()
        runs = compiled.settings.warmup_runs
        pbar = comfy.utils.ProgressBar(runs * len(sizes))
        compiled.mark_warmed()
        for size in sizes:
            inputs = warmup.ahead_inputs(base.diffusion_model, family_of(base.diffusion_model),
                                         base.latent_format.latent_channels, size, device, dtype)
            if inputs is None:
                log.info("no compile-ahead recipe for %s; it compiles at the first sampling step",
                         type(base.diffusion_model).__name__)
                return
            start = time.perf_counter()
            for _ in range(runs):
                check_interrupt()
                with torch.no_grad():
                    _run(compiled, base.diffusion_model, lambda: base.apply_model(**inputs), device)
                pbar.update(1)
            log.info("compiled ahead for %dx%dx%d (%d run(s)) in %.1f s", *size, runs,
                     time.perf_counter() - start)
        check_interrupt()
    except interrupt:
        log.info("compile-ahead cancelled (interrupt)")
        raise
    except Exception as exc:  # noqa: BLE001 - an optimisation: sampling compiles instead
        log.warning("compile-ahead skipped (%s: %s); the first sampling step compiles instead",
                    type(exc).__name__, exc)


def user_directory() -> str:
    return folder_paths.get_user_directory()


def send_status(payload: dict) -> None:
    """Tell the frontend (all clients) what compile did; never fails the run."""
    try:
        from server import PromptServer
        PromptServer.instance.send_sync(STATUS_EVENT, payload)
    except Exception as exc:  # noqa: BLE001 - a UI message must not break sampling
        log.warn_once("status-send", "could not send the status to the UI: %s", exc)


def prewarm_when_server_starts() -> bool:
    """Warm torch's compiler stack in the background once the server is up (after every custom
    node has loaded, so no other pack's imports race ours); see compile_core.cache.prewarm."""
    try:
        from server import PromptServer
        app, on_prompt = PromptServer.instance.app, PromptServer.instance.add_on_prompt_handler
    except Exception:  # noqa: BLE001 - not inside a ComfyUI server (tests, tooling), or one
        return False  # without the on-prompt hook: the first compile probes, on the prompt thread

    async def torch_compile_speed_prewarm(_app):
        try:
            _start_prewarm()
        except Exception as exc:  # noqa: BLE001 - an optimisation: ComfyUI must always start
            log.warning("background warm-up not started (%s: %s)", type(exc).__name__, exc)

    on_prompt(after_startup_probes)  # the probes run beside no prompt: see compile_core.cache.prewarm
    app.on_startup.append(torch_compile_speed_prewarm)
    return True


PROBE_WAIT_S = 20.0  # normally 1-2 s, once, right after start-up
_probe_wait = [PROBE_WAIT_S]  # 0 once a wait timed out: no prompt waits again


def after_startup_probes(json_data):
    """ComfyUI's on-prompt hook: a prompt posted while the start-up warm-up still probes
    torch's features waits for the probes (they must not run beside compiled code; see
    compile_core.cache.prewarm), so it runs after them; never longer than ``PROBE_WAIT_S``, and
    after one wait that timed out, no prompt waits again (it blocks ComfyUI's event loop)."""
    from ..compile_core.cache import prewarm
    try:
        wait = _probe_wait[0]
        if wait and not prewarm.probes_done(wait):
            _probe_wait[0] = 0.0
            log.warning("the start-up feature probes still run after %.0f s: prompts no longer "
                        "wait for them", wait)
    except Exception as exc:  # noqa: BLE001 - a prompt must always be taken
        log.warn_once("probes-wait", "could not wait for the start-up probes: %s", exc)
    return json_data


def _start_prewarm() -> None:
    """Replay the prewarm manifest (ours, or a new worker's from the fleet) in the background."""
    from ..compile_core.cache import prewarm
    from ..compile_core.cache.fleet import Fleet
    from ..compile_core.cache.persist import PersistentCache
    cache, fleet = PersistentCache.default(user_directory()), Fleet.from_env()

    def from_fleet():  # a new worker: the fleet's manifest, and its latest entries
        manifest = prewarm.clean(fleet.fetch_manifest())
        if manifest:
            device = comfy.model_management.get_torch_device()
            filled = fleet.prefetch(manifest["fingerprints"], device, cache)
            manifest["isa_dir"] = str(filled[0]) if filled and device.type == "cpu" else None
        return manifest

    prewarm.start(cache.root if cache else None, from_fleet if fleet and cache else None)


# --------------------------------------------------------------------------- VAE

VAE_METHODS = {"decode": ("decode", "decode_tiled"), "encode": ("encode", "encode_tiled")}
VAE_ATTR = "torch_compile_speed"  # on the compiled copy only: its CompiledModel


def vae_model(vae):
    """The VAE's ``nn.Module`` (``comfy.sd.VAE.first_stage_model``), or None for an invalid VAE."""
    return getattr(vae, "first_stage_model", None)


def vae_device(vae):
    import torch
    return torch.device(getattr(vae, "device", "cpu"))


def with_vae_compile(vae, compiled, which: str, node_id=None):
    """A shallow copy of ``vae`` whose decode (and/or encode) calls run through
    ``compiled.run``: the compiled callable is attached to the region modules only during the
    copy's call. The input VAE (same ``first_stage_model``, same patcher) stays eager."""
    import copy
    clone = copy.copy(vae)
    parts = ("decode", "encode") if which == "both" else (which,)
    for part in parts:
        for name in VAE_METHODS[part]:
            setattr(clone, name, _compiled_vae_call(clone, getattr(type(vae), name), compiled, node_id))
    setattr(clone, VAE_ATTR, compiled)
    return clone


def _compiled_vae_call(clone, method, compiled, node_id):
    """``method`` (an unbound ``comfy.sd.VAE`` method) on ``clone``, with the regions compiled."""
    def call(*args, **kwargs):
        if not compiled.entry.runs and not compiled.entry.failed \
                and not compiled.compiling_in_background:  # the UI shows "compiling..."
            send_status({**status_payload(compiled, node_id), "state": "compiling"})
        out = compiled.run(clone.first_stage_model, lambda: method(clone, *args, **kwargs),
                           vae_device(clone))
        if compiled.changed:
            send_status(status_payload(compiled, node_id))
        return out
    call.__name__ = method.__name__
    return call
