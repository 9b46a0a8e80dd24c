"""The pack on an NVIDIA GPU, with the settings node's defaults (mode ``speed``, background
compile): inductor's Triton kernels for the blocks, compiled beside the model without autotuning
and swapped in, and the PTX warm-up in its own Triton folder.
Skipped without CUDA (see ``conftest.py``)."""
from __future__ import annotations

import os

import pytest
import torch
from torch._inductor.codecache import PyCodeCache

from compile_core.run import background, engine
from compile_core.plan.settings import CompileSettings, build_compile_args

cuda_only = pytest.mark.skipif(os.environ.get("TCS_GPU_TEST_DEVICE", "cuda") != "cuda",
                               reason="a CUDA-only path (TCS_GPU_TEST_DEVICE is not cuda)")


def node_defaults(**kw) -> CompileSettings:
    """What the settings node sends with its defaults (mode speed), ``kw`` changed."""
    return CompileSettings.from_args(build_compile_args(**kw))


def call(cm, model, device, *inputs):
    """One sampler step through the engine, as the APPLY_MODEL wrapper makes it."""
    with torch.no_grad():
        return cm.run(model, lambda: model(*inputs), device)


def model_and_inputs(wan, wan_inputs, device, blocks=3):
    model = wan.Model(n_blocks=blocks, dim=64).to(device).eval()
    x, t = wan_inputs(tokens=16)
    x, t = x.to(device), t.to(device)
    with torch.no_grad():
        return model, (x, t), model(x, t)


def kernel_sources(since: int) -> str:
    """The generated code inductor loaded after the first ``since`` modules (a cache hit loads
    it too)."""
    texts = []
    for module in PyCodeCache.modules[since:]:
        try:
            with open(module.__file__, encoding="utf-8") as f:
                texts.append(f.read())
        except (OSError, AttributeError, TypeError):
            pass
    return "\n".join(texts)


def test_node_defaults_compile_the_blocks_into_device_kernels_in_the_background(wan, wan_inputs, device,
                                                                               graph_count, pack_log):
    """The node's defaults as users run them: the first call runs eagerly while the worker
    compiles in mode default (the speed preset autotunes nothing beside the model); the next call
    runs the swapped-in graphs, made of device kernels."""
    model, inputs, ref = model_and_inputs(wan, wan_inputs, device)
    cm = engine.prepare(model, node_defaults())
    assert cm.settings.mode == "default" and cm.settings.backend == "inductor"
    assert cm.settings.background_compile
    loaded, g0 = len(PyCodeCache.modules), graph_count()
    first = call(cm, model, device, *inputs)
    assert background.wait_idle(timeout=600)
    g1 = graph_count()
    out = call(cm, model, device, *inputs)
    assert cm.swapped_at == 2 and cm.entry.graphs == 1 and not cm.entry.failed
    assert g1 - g0 == 1 and graph_count() == g1  # one graph, compiled by the worker
    code = kernel_sources(loaded)
    kernel = "async_compile.triton(" if device.type == "cuda" else "async_compile.cpp"
    assert kernel in code, code[:2000]
    torch.testing.assert_close(first, ref)
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    assert not pack_log.warnings()


@cuda_only
def test_the_ptx_warm_up_keeps_its_triton_kernels_in_its_folder_for_the_run(wan, wan_inputs, device, tmp_path,
                                                                             pack_log):
    """``experimental_ptx`` with the compile in the first call: TRITON_CACHE_DIR is the node's
    folder while the model runs (and only then: the global-state check of every test), and the
    first call is warmed."""
    model, inputs, ref = model_and_inputs(wan, wan_inputs, device)
    folder = tmp_path / "ptx"
    cm = engine.prepare(model, node_defaults(experimental_ptx=True, warmup_runs=1, background_compile=False), ptx_cache_dir=folder)
    out = call(cm, model, device, *inputs)
    kept = [p for p in folder.rglob("*") if p.suffix in (".cubin", ".ptx", ".json")]
    assert kept, sorted(str(p) for p in folder.rglob("*"))[:20]
    assert any("warmed Triton kernels 1 time(s)" in m for m in pack_log.infos()), pack_log.infos()
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
