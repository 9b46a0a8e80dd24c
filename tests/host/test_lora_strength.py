"""On a real ComfyUI server: a LoRA's strength changes with 0 new graphs after the
first, in the loading modes where ComfyUI applies the LoRA at every forward.

- Forced partial loading (TEST-ONLY ``TCSTestForceLowVram``): the LoRA sits in each layer's
  ``weight_function`` (``LowVramPatch``: its key and strength were guards, one graph per block
  and per strength).
- A GGUF Q8_0 model (ComfyUI-GGUF): the LoRA sits in the quantized weights' ``patches``.

Both go through the pack's ``tcs::weight_fetch`` op (``compile_core/torch_support/weight_fetch.py``) during
the compiled run. Each strength's output equals eager's at that strength (rel L2 < 1e-3), and
the regions really compile with inductor (the pack's log says so; no eager fallback).
"""
import re

import pytest

from harness import (ComfyHost, counters_delta, fallback_lines, make_tiny_wan_lora, new_graphs, pack_lines,
                     rel_l2)
from gguf_models import make_tiny_wan_gguf
from test_gguf import GGUF_PACK, gguf_prompt, require_gguf_loader, with_lora
from test_reliability_models import model_prompt

STRENGTHS = [1.0, 0.5, -0.7]
SETTINGS = {"backend": "inductor", "mode": "default"}


def _sweep(h, eager_prompt, compiled_prompt):
    """Per strength: (rel L2 compiled vs eager, new graphs since the previous compiled run)."""
    rows, prev, logs = [], None, []
    for s in STRENGTHS:
        eager = h.latent(h.run(eager_prompt(s)))
        offset = h.log_offset()
        hist = h.run(compiled_prompt(s))
        logs.append(h.log_text(since=offset))
        probe = h.probe(hist)
        assert "torch_compile_speed" in probe["apply_model_wrapper_keys"]
        new = new_graphs(counters_delta(prev["counters"], probe["counters"])) if prev else None
        rows.append((rel_l2(h.latent(hist), eager), new))
        prev = probe
    return rows, logs


def _check(rows, logs):
    print("per strength (rel L2 vs eager, new graphs):", list(zip(STRENGTHS, rows)))
    log = "".join(logs)
    assert not pack_lines(log, "torch.compile failed") and not fallback_lines(log), log
    # the first strength compiled the regions (traced, or a saved region captured), the others
    # compiled nothing: no dynamo graph, no "recompiled" line
    assert pack_lines(logs[0], "compiled WanAttentionBlock") or \
        pack_lines(logs[0], "saved region WanAttentionBlock-"), logs[0]
    assert not pack_lines("".join(logs[1:]), "recompiled"), logs[1:]
    assert [new for _, new in rows[1:]] == [0] * (len(STRENGTHS) - 1), rows
    for (err, _), s in zip(rows, STRENGTHS):
        assert err < 1e-3, (s, rows)


@pytest.fixture(scope="module")
def host(tmp_path_factory, tiny_wan_path):
    """One server for the module, with ComfyUI-GGUF, the tiny WAN (and its GGUF) and a LoRA."""
    h = ComfyHost(tmp_path_factory.mktemp("lora_strength") / "server", models=[tiny_wan_path])
    h.wan0 = tiny_wan_path.name
    h.lora = h.add_lora(make_tiny_wan_lora(num_layers=2, dim=256))
    if (GGUF_PACK / "nodes.py").is_file():
        ComfyHost._link(GGUF_PACK, h.base_dir / "custom_nodes" / "ComfyUI-GGUF")
    with h:
        yield h


def test_lora_strength_under_forced_partial_loading_compiles_once(host):
    h = host
    offset = h.log_offset()
    rows, logs = _sweep(
        h, lambda s: model_prompt(h, lora=s, lowvram_mb=3.0, prefix=f"pe{s}"),
        lambda s: model_prompt(h, compile_settings=SETTINGS, lora=s, where="after", lowvram_mb=3.0,
                               prefix=f"pc{s}"))
    log = h.log_text(since=offset)
    assert "loaded partially" in log and any(  # the LoRA really went into weight_function
        "lowvram patches: " in ln and not ln.endswith("lowvram patches: 0")
        for ln in log.splitlines() if "loaded partially" in ln), log
    _check(rows, logs)


def test_lora_strength_on_a_gguf_model_compiles_once(host):
    h = host
    if not (GGUF_PACK / "nodes.py").is_file():
        pytest.skip(f"ComfyUI-GGUF is not unpacked at {GGUF_PACK}")
    pytest.importorskip("gguf")
    require_gguf_loader(h)
    name = h.add_model(make_tiny_wan_gguf())
    rows, logs = _sweep(
        h, lambda s: with_lora(gguf_prompt(name, apply=False, prefix=f"ge{s}"), h.lora, s),
        lambda s: with_lora(gguf_prompt(name, compile_settings=SETTINGS, prefix=f"gc{s}"), h.lora, s))
    _check(rows, logs)


def test_lora_strength_with_a_background_compile_under_forced_partial_loading(host):
    """Background compile + LoRA under partial loading, end to end: the worker's graphs take
    the routed weight fetches, so after the swap the sampling thread compiles nothing, and
    later strengths compile nothing either. (Here the waiter holds the sampling thread inside
    a routed call while the worker traces; that the worker holds the routing by itself, between
    the sampling thread's calls, is checked in tests/unit/test_background.py and
    test_weight_fetch.py.)"""
    h = host
    bg = {"backend": "aot_eager", "background_compile": True}

    def compiled(s):
        p = model_prompt(h, compile_settings=bg, lora=s, where="after", lowvram_mb=3.0, prefix=f"pb{s}")
        p["waiter"] = {"class_type": "TCSTestWaitForBackground", "inputs": {"model": ["lora", 0], "call": 2}}
        p["sampler"]["inputs"]["model"] = p["probe"]["inputs"]["model"] = ["waiter", 0]
        return p
    rows, logs = _sweep(h, lambda s: model_prompt(h, lora=s, lowvram_mb=3.0, prefix=f"pbe{s}"), compiled)
    print("per strength (rel L2 vs eager, new graphs):", list(zip(STRENGTHS, rows)))
    assert len(pack_lines(logs[0], "swapped in at model call 3")) == 1, logs[0]
    assert pack_lines(logs[0], "in the background: "), logs[0]  # the worker's graphs
    compiled_regions = [int(k) for n, k in re.findall(r"TCSTest: call (\d+) regions compiled (\d+)", logs[0])
                        if int(n) >= 3]
    assert compiled_regions and set(compiled_regions) == {2}, logs[0]  # compiled after the swap
    log = "".join(logs)
    assert not pack_lines(log, "recompiled") and not pack_lines(log, "failed"), log
    assert [new for _, new in rows[1:]] == [0] * (len(STRENGTHS) - 1), rows
    assert all(err < 1e-3 for err, _ in rows), rows
