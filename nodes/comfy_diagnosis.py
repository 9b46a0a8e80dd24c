"""What the Diagnostics node measures on a ComfyUI model: one eager and one compiled model
step on inputs shaped like a latent."""
from __future__ import annotations

import os
import types
import uuid

import comfy.model_management

from ..compile_core.plan import regions
from ..compile_core.run import warmup
from .comfy_model import run_compiled


def diagnosis_calls(model_patcher, compiled, latent_samples):
    """What the Diagnostics node measures: one eager and one compiled model step on inputs
    shaped like ``latent_samples`` (random values), as ``diagnostics.diagnose`` takes them.

    Eager is ``BaseModel.apply_model`` without our wrapper; compiled is the same call through
    ``CompiledModel.run``, exactly as the wrapper runs it during sampling. ``transformer_options``
    are the model's own (minus wrappers) plus what the sampler adds per step, so the compiled
    regions see what they see while sampling (and do not recompile for the diagnosis).

    Both calls check ComfyUI's interrupt first, so a cancel (POST /interrupt) stops the
    measuring loop between runs; ``check_interrupt`` is that check for ``diagnose``."""
    comfy.model_management.load_models_gpu([model_patcher])
    base = model_patcher.model
    dm = base.diffusion_model
    device = model_patcher.load_device
    shape = tuple(latent_samples.shape)
    family = regions.family_of(dm)
    inputs, known = _step_inputs(model_patcher, family, shape)
    check_interrupt = comfy.model_management.throw_exception_if_processing_interrupted

    def eager_step():
        return base.apply_model(**inputs)

    def eager():
        check_interrupt()
        return eager_step()

    def compiled_call():
        check_interrupt()
        return run_compiled(compiled, dm, eager_step, device)

    note = (f"latent {list(shape)} with random values, "
            + (f"{family} inputs" if known else "x and t only (no input recipe for "
               f"{type(dm).__name__})") + f", on {device}")
    comfy_root = os.path.dirname(os.path.dirname(os.path.abspath(comfy.model_management.__file__)))
    return types.SimpleNamespace(
        diffusion_model=dm, device=device, eager=eager, compiled=compiled_call, note=note,
        path_roots=(comfy_root,), reraise=(comfy.model_management.InterruptProcessingException,),
        check_interrupt=check_interrupt)


def _step_inputs(model_patcher, family, shape):
    """``(apply_model keyword arguments, whether the family has an input recipe)`` at a
    mid-schedule sigma, with the model's ``transformer_options`` as the sampler passes them."""
    base = model_patcher.model
    dtype = base.manual_cast_dtype or base.get_dtype()
    try:
        sigma = float(base.model_sampling.percent_to_sigma(0.5))
    except Exception:  # noqa: BLE001 - any mid-schedule sigma will do
        sigma = 0.5
    inputs, known = warmup.latent_inputs(base.diffusion_model, family, shape,
                                         model_patcher.load_device, dtype, sigma)
    options = dict(model_patcher.model_options.get("transformer_options", {}))
    options.pop("wrappers", None)
    options.pop("callbacks", None)
    options.update({"cond_or_uncond": [0] * shape[0], "uuids": [uuid.uuid4()] * shape[0],
                    "sigmas": inputs["t"]})
    inputs["transformer_options"] = options
    return inputs, known
