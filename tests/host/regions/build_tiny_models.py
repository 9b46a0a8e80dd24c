"""Build tiny REAL ComfyUI diffusion models and check TorchCompileSpeed's regional compile on them.

Run by ``tests/host/test_regions_real_models.py`` in a subprocess (ComfyUI's ``comfy`` package
parses ``sys.argv`` on import, so it is kept out of the pytest process)::

    [TCS_COMFY_HOST=0.3.75] .venv/bin/python tests/host/regions/build_tiny_models.py [--cases wan,flux] [--run wan] [--policy static]

The ComfyUI is the host ``TCS_COMFY_HOST`` selects (``harness.resolve_host``; ``0.33.0`` by default).
For every case it instantiates the real model class from that ComfyUI (tiny config,
``comfy.ops.disable_weight_init``, on the ``meta`` device) and calls
``compile_core.plan.regions.plan_regions(model, blocks_only=True)``. It then counts, in a forward pass of
the same tiny model on CPU, how often each planned region is entered through ``nn.Module.__call__``:
the engine attaches the compiled callable as ``_compiled_call_impl``, so a region the model runs
without calling it is never compiled. Cases in ``--run`` are also run eagerly and through
``compile_core.run.engine.prepare(...).run(...)`` with the ``aot_eager`` backend (CPU, random weights).

Prints one JSON object per line and case on stdout (nothing else goes to stdout).
"""
from __future__ import annotations

import argparse
import functools
import inspect
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
HOST_DIR = REPO / "tests" / "host"
if str(HOST_DIR) not in sys.path:
    sys.path.insert(0, str(HOST_DIR))
from harness import resolve_host  # noqa: E402 - TCS_COMFY_HOST picks the ComfyUI, as for every host test

COMFY_DIR = resolve_host()

RUN_CASES = ("wan", "vace_wan", "flux", "chroma", "hunyuan_video", "ltxv", "qwen_image", "unet_sd15",
             "unknown_aura")
# Shape policy per run case (others: the settings default, i.e. what a user gets). The UNet runs
# 'static': under 'auto' its layers get symbolic H/W, and after the first parameter-shape mismatch
# dynamo's automatic dynamic makes the weights symbolic too; the CPU compile then takes ~6x longer
# (about 35 CPU-seconds for the tiny SD1.5 UNet) and the graph count stops being one per layer type.
RUN_POLICY = {"unet_sd15": "static", "unet_sdxl": "static"}


# --------------------------------------------------------------------------- tiny models

def _ops():
    import comfy.ops
    return comfy.ops.disable_weight_init


def _host_params(params_cls, **optional):
    """The ``optional`` config keys that this host's ``params_cls`` dataclass has as fields.

    Flux/Chroma/HunyuanVideo pass their constructor ``**kwargs`` straight into a params dataclass
    whose required fields grow between ComfyUI versions (0.33 added ``txt_ids_dims``, Chroma's
    ``vec_in_dim``, HunyuanVideo's ``meanflow_sum``); an unknown key would raise, a missing one too.
    The values given are what ``comfy.model_detection`` sets for the plain model of each family.
    """
    import dataclasses
    names = {f.name for f in dataclasses.fields(params_cls)}
    return {k: v for k, v in optional.items() if k in names}


def build_wan(device):
    from comfy.ldm.wan.model import WanModel
    return WanModel(model_type="t2v", dim=64, ffn_dim=128, num_layers=3, num_heads=2, in_dim=16,
                    out_dim=16, text_dim=32, device=device, operations=_ops())


def inputs_wan(device):
    import torch
    return dict(x=torch.randn(1, 16, 2, 8, 8, device=device), timestep=torch.tensor([500.0], device=device),
                context=torch.randn(1, 8, 32, device=device))


def build_vace_wan(device):
    from comfy.ldm.wan.model import VaceWanModel
    return VaceWanModel(dim=64, ffn_dim=128, num_layers=2, num_heads=2, in_dim=16, out_dim=16, text_dim=32,
                        vace_layers=1, vace_in_dim=32, device=device, operations=_ops())


def inputs_vace_wan(device):
    import torch
    d = inputs_wan(device)
    d.update(vace_context=torch.randn(1, 1, 32, 2, 8, 8, device=device), vace_strength=[1.0])
    return d


def build_flux(device):
    from comfy.ldm.flux.model import Flux, FluxParams
    return Flux(in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=32, hidden_size=64,
                mlp_ratio=2.0, num_heads=2, depth=2, depth_single_blocks=2, axes_dim=[8, 12, 12],
                theta=10000, patch_size=2, qkv_bias=True, guidance_embed=False,
                **_host_params(FluxParams, txt_ids_dims=[]),  # 0.33+: Flux.1 keeps txt ids at zero
                device=device, operations=_ops())


def inputs_flux(device):
    import torch
    return dict(x=torch.randn(1, 16, 8, 8, device=device), timestep=torch.tensor([0.5], device=device),
                context=torch.randn(1, 8, 32, device=device), y=torch.randn(1, 32, device=device))


def build_chroma(device):
    from comfy.ldm.chroma.model import Chroma, ChromaParams
    return Chroma(in_channels=64, out_channels=64, context_in_dim=32, hidden_size=64, mlp_ratio=2.0,
                  num_heads=2, depth=2, depth_single_blocks=2, axes_dim=[8, 12, 12], theta=10000,
                  patch_size=2, qkv_bias=True, in_dim=64, out_dim=64, hidden_dim=64, n_layers=1,
                  **_host_params(ChromaParams, txt_ids_dims=[], vec_in_dim=None),  # 0.33+: no vector_in
                  device=device, operations=_ops())


def inputs_chroma(device):
    import torch
    return dict(x=torch.randn(1, 16, 8, 8, device=device), timestep=torch.tensor([0.5], device=device),
                context=torch.randn(1, 8, 32, device=device), guidance=torch.tensor([0.0], device=device))


def build_hunyuan_video(device):
    from comfy.ldm.hunyuan_video.model import HunyuanVideo, HunyuanVideoParams
    return HunyuanVideo(in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=32, hidden_size=64,
                        mlp_ratio=2.0, num_heads=2, depth=2, depth_single_blocks=2, axes_dim=[8, 12, 12],
                        theta=256, patch_size=[1, 2, 2], qkv_bias=True, guidance_embed=False, byt5=False,
                        meanflow=False, use_cond_type_embedding=False, vision_in_dim=None,
                        **_host_params(HunyuanVideoParams, meanflow_sum=False),  # 0.33+
                        device=device, operations=_ops())


def inputs_hunyuan_video(device):
    import torch
    return dict(x=torch.randn(1, 16, 2, 8, 8, device=device), timestep=torch.tensor([0.5], device=device),
                context=torch.randn(1, 8, 32, device=device), y=torch.randn(1, 32, device=device),
                attention_mask=torch.ones(1, 8, device=device, dtype=torch.long))


def build_ltxv(device):
    from comfy.ldm.lightricks.model import LTXVModel
    return LTXVModel(in_channels=32, cross_attention_dim=64, attention_head_dim=32, num_attention_heads=2,
                     caption_channels=32, num_layers=2, device=device, operations=_ops())


def inputs_ltxv(device):
    import torch
    return dict(x=torch.randn(1, 32, 2, 4, 4, device=device), timestep=torch.tensor([0.5], device=device),
                context=torch.randn(1, 8, 32, device=device), attention_mask=None)


def build_qwen_image(device):
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel
    return QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                       attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32,
                                       axes_dims_rope=(8, 12, 12), device=device, operations=_ops())


def inputs_qwen_image(device):
    import torch
    return dict(x=torch.randn(1, 16, 1, 8, 8, device=device), timestep=torch.tensor([0.5], device=device),
                context=torch.randn(1, 8, 32, device=device))


def _unet_common(device):
    return dict(image_size=32, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=[1, 1],
                channel_mult=[1, 2], use_spatial_transformer=True, legacy=False, context_dim=32,
                use_temporal_attention=False, use_temporal_resblock=False, dtype=None, device=device,
                operations=_ops())


def build_unet_sd15(device):
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    return UNetModel(**_unet_common(device), num_heads=2, use_linear_in_transformer=False,
                     adm_in_channels=None, transformer_depth=[1, 1], transformer_depth_middle=1,
                     transformer_depth_output=[1, 1, 1, 1])


def inputs_unet_sd15(device):
    import torch
    return dict(x=torch.randn(1, 4, 16, 16, device=device), timesteps=torch.tensor([500.0], device=device),
                context=torch.randn(1, 8, 32, device=device))


def build_unet_sdxl(device):
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    return UNetModel(**_unet_common(device), num_head_channels=16, use_linear_in_transformer=True,
                     num_classes="sequential", adm_in_channels=48, transformer_depth=[0, 2],
                     transformer_depth_middle=2, transformer_depth_output=[0, 0, 2, 2])


def inputs_unet_sdxl(device):
    d = inputs_unet_sd15(device)
    import torch
    d["y"] = torch.randn(1, 48, device=device)
    return d


def build_unknown_aura(device):
    from comfy.ldm.aura.mmdit import MMDiT
    return MMDiT(in_channels=4, out_channels=4, patch_size=2, dim=64, n_layers=2, n_double_layers=1,
                 n_heads=2, global_conddim=64, cond_seq_dim=32, max_seq=64, device=device, operations=_ops())


def inputs_unknown_aura(device):
    import torch
    return dict(x=torch.randn(1, 4, 8, 8, device=device), timestep=torch.tensor([0.5], device=device),
                context=torch.randn(1, 8, 32, device=device))


CASES = {
    "wan": (build_wan, inputs_wan),
    "vace_wan": (build_vace_wan, inputs_vace_wan),
    "flux": (build_flux, inputs_flux),
    "chroma": (build_chroma, inputs_chroma),
    "hunyuan_video": (build_hunyuan_video, inputs_hunyuan_video),
    "ltxv": (build_ltxv, inputs_ltxv),
    "qwen_image": (build_qwen_image, inputs_qwen_image),
    "unet_sd15": (build_unet_sd15, inputs_unet_sd15),
    "unet_sdxl": (build_unet_sdxl, inputs_unet_sdxl),
    "unknown_aura": (build_unknown_aura, inputs_unknown_aura),
}


# --------------------------------------------------------------------------- helpers

class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _randomize(model, seed):
    """``disable_weight_init`` leaves ``torch.empty`` memory: give every tensor O(1)-stable values."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point():
                continue
            if p.ndim >= 2:
                v = torch.randn(p.shape, generator=g) / (p[0].numel() ** 0.5)
            elif name.endswith("bias"):
                v = torch.randn(p.shape, generator=g) * 0.02
            else:  # norm scales, modulation vectors, tables
                v = 1.0 + torch.randn(p.shape, generator=g) * 0.1
            p.copy_(v)


def _structure(module) -> tuple:
    """What dynamo specialises a region's graph on besides its inputs: classes, names, shapes."""
    return (type(module).__qualname__,
            tuple((n, type(m).__qualname__) for n, m in module.named_modules()),
            tuple((n, tuple(t.shape), str(t.dtype)) for n, t in
                  list(module.named_parameters()) + list(module.named_buffers())))


def _arg_sig(args, kwargs) -> tuple:
    """What dynamo guards on in a region's inputs (static shapes): tensor sizes, strides, dtypes and
    plain values, plus ``transformer_options['transformer_index']`` (ComfyUI's UNet counts its
    SpatialTransformers there and BasicTransformerBlock looks patches up by it)."""
    import torch

    def sig(v):
        if isinstance(v, torch.Tensor):
            return ("T", tuple(v.shape), v.stride(), str(v.dtype))
        if isinstance(v, (list, tuple)):
            return tuple(sig(x) for x in v)
        if isinstance(v, (int, float, bool, str, type(None))):
            return v
        return type(v).__name__
    opts = kwargs.get("transformer_options")
    if opts is None and args and isinstance(args[-1], dict):
        opts = args[-1]
    index = opts.get("transformer_index") if isinstance(opts, dict) else None
    return (tuple(sig(a) for a in args if not isinstance(a, dict)),
            tuple(sorted((k, sig(v)) for k, v in kwargs.items() if k != "transformer_options")),
            index)


def _count_calls(model, plan, call):
    """Route each region's ``__call__`` through a counter, exactly as the engine attaches its compiled
    callable (``_compiled_call_impl``), run ``call`` and return {path: calls}."""
    import torch
    from torch import nn
    counts = {p: 0 for p in plan.paths}

    def counting(path, module, *args, **kwargs):
        counts[path] += 1
        return nn.Module._call_impl(module, *args, **kwargs)

    mods = plan.modules(model)
    for p, m in zip(plan.paths, mods):
        m.__dict__["_compiled_call_impl"] = functools.partial(counting, p, m)
    try:
        with torch.no_grad():
            call()
    finally:
        for m in mods:
            m.__dict__.pop("_compiled_call_impl", None)
    return counts


def _compiled_leftovers(model) -> list[str]:
    return [n or "<root>" for n, m in model.named_modules() if "_compiled_call_impl" in m.__dict__]


def _graphs() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def plan_case(name, build, make_inputs):
    import torch
    from compile_core.plan import regions
    from compile_core.report.log import logger

    handler = _ListHandler()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with torch.device("meta"):  # also catches tensors a constructor makes without device=
            model = build("meta")
        plan = regions.plan_regions(model, blocks_only=True)
    finally:
        logger.removeHandler(handler)
    out = {"case": name, "class": f"{type(model).__module__}.{type(model).__qualname__}",
           "paths": list(plan.paths), "family": plan.family, "regional": plan.regional,
           "describe": plan.describe(model), "logs": handler.lines,
           "region_classes": [type(m).__qualname__ for m in plan.modules(model)]}
    if make_inputs is not None and plan.regional:
        # meta tensors cannot run ComfyUI's forward (model_management asks for memory stats),
        # so the call coverage uses the same tiny model on CPU with random weights.
        model = build("cpu").eval()
        _randomize(model, 0)
        kw = make_inputs("cpu")
        out["calls"] = _count_calls(model, plan, lambda: model(**kw))
    return out


def run_case(name, build, make_inputs):
    """Eager vs ``engine.prepare(...).run(...)`` (aot_eager) on CPU with random weights."""
    import torch
    from compile_core.run import engine
    from compile_core.plan import regions
    from compile_core.cache.registry import ReuseRegistry
    from compile_core.plan.settings import CompileSettings, build_compile_args

    torch.manual_seed(0)
    model = build("cpu").eval()
    _randomize(model, 0)
    kw = make_inputs("cpu")
    plan = regions.plan_regions(model, blocks_only=True)

    # Distinct (structure, input signature) pairs among the regions: dynamo needs one graph each.
    sigs: dict[str, tuple] = {}
    hooks = []
    for p, m in zip(plan.paths, plan.modules(model)):
        def pre(mod, args, kwargs, p=p):
            sigs.setdefault(p, (_structure(mod), _arg_sig(args, kwargs)))
        hooks.append(m.register_forward_pre_hook(pre, with_kwargs=True))
    with torch.no_grad():
        t0 = time.perf_counter()
        eager = model(**kw)
        eager_s = time.perf_counter() - t0
    for h in hooks:
        h.remove()
    distinct = len(set(sigs.values()))
    distinct_structures = len({_structure(m) for m in plan.modules(model)})

    extra = {"background_compile": False}  # graphs are counted in the first call
    if name in RUN_POLICY and "shape_policy" in inspect.signature(build_compile_args).parameters:
        extra["shape_policy"] = RUN_POLICY[name]
    settings = CompileSettings.from_args(build_compile_args(backend="aot_eager", mode="default", **extra))
    compiled = engine.prepare(model, settings, registry=ReuseRegistry())
    device = torch.device("cpu")
    with torch.no_grad():
        g0 = _graphs()
        t0 = time.perf_counter()
        out1 = compiled.run(model, lambda: model(**kw), device)
        first_s = time.perf_counter() - t0
        g1 = _graphs()
        out2 = compiled.run(model, lambda: model(**kw), device)
        g2 = _graphs()
    scale = eager.abs().max().item()
    return {"case": name, "run": {
        "shape_policy": getattr(settings, "shape_policy", None), "regions": len(plan.paths), "regions_called": len(sigs),
        "distinct_region_signatures": distinct, "distinct_region_structures": distinct_structures,
        "graphs_first": g1 - g0, "graphs_second": g2 - g1,
        "max_abs_diff": (out1 - eager).abs().max().item(),
        "max_abs_diff_second": (out2 - eager).abs().max().item(),
        "out_scale": scale, "out_shape": list(eager.shape), "finite": bool(torch.isfinite(eager).all()),
        "failed": compiled.entry.failed, "leftover_compiled_call_impl": _compiled_leftovers(model),
        "eager_s": round(eager_s, 3), "compile_run_s": round(first_s, 3),
    }}


# --------------------------------------------------------------------------- main

def setup_host() -> None:
    """Import the host's ``comfy`` as ComfyUI does on CPU (``model_zoo.py`` shares this)."""
    os.chdir(COMFY_DIR)
    sys.path.insert(0, str(COMFY_DIR))
    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))  # after ComfyUI: the pack's ``nodes`` package must not shadow nodes.py
    # SDPA attention, as ComfyUI picks on GPUs (on --cpu it would pick sub-quadratic attention,
    # whose psutil free-memory query graph-breaks every attention call).
    sys.argv = [sys.argv[0], "--cpu", "--use-pytorch-cross-attention"]
    import comfy.options
    comfy.options.enable_args_parsing()
    import torch
    import comfy.ops  # noqa: F401
    torch.set_num_threads(min(2, os.cpu_count() or 1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--run", default=",".join(RUN_CASES), help="cases to also run eager vs compiled")
    ap.add_argument("--policy", default="", help="shape policy for every run case (default: RUN_POLICY)")
    args = ap.parse_args(argv)
    if args.policy:
        RUN_POLICY.update(dict.fromkeys(CASES, args.policy))

    setup_host()

    stdout = sys.stdout
    sys.stdout = sys.stderr  # keep library chatter off the JSON channel
    rc = 0
    run = set(filter(None, args.run.split(",")))
    for name in filter(None, args.cases.split(",")):
        build, make_inputs = CASES[name]
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            rec = plan_case(name, build, make_inputs)
            if name in run:
                rec.update(run_case(name, build, make_inputs))
        except Exception as exc:  # noqa: BLE001 - reported per case, the test fails on it
            rec = {"case": name, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            rc = 1
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        rec["cpu_seconds"] = round(time.process_time() - c0, 2)  # wall time on an idle machine, roughly
        print(json.dumps(rec), file=stdout, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
