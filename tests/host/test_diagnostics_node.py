"""Diagnostics on a real ComfyUI server: the Torch Compile Diagnostics node lists the
graph breaks of ComfyUI's default CPU attention with reason and file:line, reports 0 breaks
and a measured eager/compiled ratio with SDPA, explains a static-shape recompile, sends the
speedup to the UI, and auto-disables a compile that is slower than eager."""
import json
import re
import threading

import pytest
import torch

from harness import add_diagnostics, rel_l2, wan_t2v_prompt

FAST = {"backend": "aot_eager"}  # real dynamo tracing, no C++ build
RATIO = re.compile(r"^  ratio\s+(\d+\.\d+)x \(eager / compiled\)$", re.M)
VERDICT = re.compile(r"^Verdict: (?:compiled is (?:(\d+\.\d+)x faster|slower \((\d+\.\d+)x\))); "
                     r"(\d+) graph breaks?; (\d+) recompiles?", re.M)
STATUS_EVENT = "torch_compile_speed.status"

# A dynamo backend certainly slower than eager (+50 ms per graph call), for auto_disable tests.
# ComfyUI imports single-file custom nodes, so a test can register it in its own server.
SLOW_BACKEND = '''"""TEST-ONLY, written by tests/host/test_diagnostics.py: a backend slower than eager."""
import time

import torch


def _slow(gm, example_inputs):
    def run(*args):
        time.sleep(0.05)
        return gm.forward(*args)
    return run


torch._dynamo.register_backend(_slow, name="tcs_test_slow")
NODE_CLASS_MAPPINGS = {}
'''


def report_of(host, history, node_id="diag"):
    texts = host.outputs(history, node_id)["text"]
    assert len(texts) == 1
    return texts[0]


def verdict(text):
    """(ratio, graph breaks, recompiles) from the report's verdict line."""
    m = VERDICT.search(text)
    assert m, text
    ratio = float(m.group(1) or m.group(2))
    return ratio, int(m.group(3)), int(m.group(4))


class StatusListener:
    """Collects this client's ``torch_compile_speed.status`` events over the websocket."""

    def __init__(self, host):
        import websocket
        self.events = []
        self.ws = websocket.create_connection(
            f"ws://127.0.0.1:{host.port}/ws?clientId={host.client_id}", timeout=5)
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        import websocket
        while not self._stop:
            try:
                msg = self.ws.recv()
            except websocket.WebSocketTimeoutException:
                continue
            except Exception:  # noqa: BLE001 - closed
                return
            if not isinstance(msg, str) or not msg:  # binary previews; "" once closed
                continue
            try:
                data = json.loads(msg)
            except ValueError:
                continue
            if data.get("type") == STATUS_EVENT:
                self.events.append(data["data"])

    def wait_for(self, predicate, timeout=10.0):
        """The first collected event for which ``predicate`` is true (waits for it), or None."""
        import time
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in list(self.events) if predicate(e)]
            if found:
                return found[0]
            time.sleep(0.05)
        return None

    def close(self):
        self._stop = True
        self.ws.close()
        self._thread.join(10)


def test_node_is_listed_with_tooltips(comfy_host):
    d = comfy_host.object_info("TorchCompileDiagnostics")
    assert d["display_name"] == "Torch Compile Diagnostics" and d["category"] == "optimization"
    assert d["input_order"]["required"] == ["model", "samples", "measure_runs", "auto_disable_if_slower"]
    req = d["input"]["required"]
    assert [req[k][0] for k in d["input_order"]["required"]] == ["MODEL", "LATENT", "INT", "BOOLEAN"]
    assert req["measure_runs"][1]["default"] == 5 and (req["measure_runs"][1]["min"],
                                                      req["measure_runs"][1]["max"]) == (1, 50)
    assert req["auto_disable_if_slower"][1]["default"] is False
    assert all(v[1].get("tooltip") for v in req.values())
    assert d["output"] == ["MODEL", "STRING"] and d["output_name"] == ["model", "report"]
    assert d["output_node"] is True and d["description"]


def test_default_cpu_attention_graph_breaks_with_file_line(make_host, tiny_wan):
    """ComfyUI's default CPU attention asks psutil for free memory (reads /proc/meminfo) inside
    the block: the report names that place, the attention code that calls it, and measures."""
    host = make_host(cross_attention=False)
    eager = host.latent(host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="eager")))
    prompt = wan_t2v_prompt(tiny_wan, compile_settings=FAST, prefix="breaks")
    add_diagnostics(prompt, measure_runs=3)
    hist = host.run(prompt)
    text = report_of(host, hist)
    ratio, breaks, _ = verdict(text)
    assert breaks >= 1, text
    assert float(RATIO.search(text).group(1)) == pytest.approx(ratio, abs=0.01)
    section = text[text.index("Graph breaks:"):text.index("Recompiles:")]
    assert "traced WanAttentionBlock on inputs from a real eager call" in section
    assert len(re.findall(r"^  \d+\. \S+\.py:\d+ in \w+ \[WanAttentionBlock\]$", section, re.M)) == breaks
    assert len(re.findall(r"^     reason: \S", section, re.M)) == breaks
    assert re.search(r"^  1\. comfy/model_management\.py:\d+ in get_free_memory", section, re.M), section
    assert re.search(r"called from: comfy/ldm/modules/attention\.py:\d+ in attention_sub_quad", section)
    assert "psutil" in section and "`open`" in section  # the /proc/meminfo read
    # the model went on to sample, compiled, with the eager result
    probe = host.probe(hist)
    assert probe["apply_model_wrapper_keys"] == ["torch_compile_speed"]
    assert rel_l2(host.latent(hist), eager) < 1e-3


def test_sdpa_no_breaks_measured_ratio_and_status_event(comfy_host, tiny_wan):
    listener = StatusListener(comfy_host)
    try:
        prompt = wan_t2v_prompt(tiny_wan, compile_settings=FAST, prefix="sdpa_diag")
        add_diagnostics(prompt, measure_runs=3)
        hist = comfy_host.run(prompt)
        # the sampling run's own status (sent after the diagnosis) still carries the speedup
        after = listener.wait_for(lambda e: "diagnostics_node" not in e and e.get("speedup"))
    finally:
        listener.close()
    text = report_of(comfy_host, hist)
    ratio, breaks, recompiles = verdict(text)
    assert breaks == 0 and recompiles == 0, text
    assert "Regions compiled: WanAttentionBlock x2" in text
    assert "Graph breaks: 0 (traced WanAttentionBlock on inputs from a real eager call)" in text
    assert float(RATIO.search(text).group(1)) == pytest.approx(ratio, abs=0.01)
    assert re.search(r"^  eager\s+\d+\.\d+ ms", text, re.M)
    assert re.search(r"^  compiled\s+\d+\.\d+ ms", text, re.M)
    assert "Peak memory: not measured on CPU" in text
    # the UI got the speedup on the Apply node's status (its badge shows it)
    measured = [e for e in listener.events if e.get("diagnostics_node") == "diag"]
    assert len(measured) == 1, listener.events
    event = measured[0]
    assert event["node"] == "apply"
    assert event["speedup"] == pytest.approx(ratio, abs=0.01)
    assert event["eager_ms"] > 0 and event["compiled_ms"] > 0 and event["graph_breaks"] == 0
    assert event["regions"] == "WanAttentionBlock x2"
    assert after is not None and after["node"] == "apply", listener.events
    assert after["speedup"] == event["speedup"] and after["runs"] > event["runs"]


def test_static_policy_new_size_recompile_is_explained(comfy_host, tiny_wan):
    # mode only matters to inductor: here it just gives this test a compiled entry of its own
    settings = {**FAST, "shape_policy": "static", "mode": "max-autotune"}
    first = wan_t2v_prompt(tiny_wan, compile_settings=settings, prefix="static_a")
    first["cond"]["inputs"]["length"] = 512  # WAN's text encoder pads to 512, as the diagnosis does
    comfy_host.run(first)
    second = wan_t2v_prompt(tiny_wan, compile_settings=settings, width=160, height=128,
                            prefix="static_b")
    second["cond"]["inputs"]["length"] = 512
    add_diagnostics(second, measure_runs=2)
    text = report_of(comfy_host, comfy_host.run(second))
    _, breaks, recompiles = verdict(text)
    assert breaks == 0 and recompiles >= 1, text
    section = text[text.index("Recompiles:"):text.index("Caches (")]
    assert re.search(r"^  1\. forward at comfy/ldm/wan/model\.py:\d+ \(\d+\.\d+ s, during this diagnosis\)$",
                     section, re.M), section
    assert re.search(r"^     guard: tensor '.+' size mismatch at index \d+\. expected \d+, actual \d+",
                     section, re.M), section
    assert "likely cause: a new latent size: use shape_policy auto or declare shapes" in section
    assert "(recompile, during this diagnosis)" in text  # also marked in the per-frame compile times


def test_auto_disable_when_compiled_is_slower(make_host, tiny_wan):
    host = make_host(start=False)
    (host.base_dir / "custom_nodes" / "tcs_test_slow_backend.py").write_text(SLOW_BACKEND)
    host.start()
    eager = host.latent(host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="eager")))
    settings = {"backend": "tcs_test_slow"}

    kept = wan_t2v_prompt(tiny_wan, compile_settings=settings, prefix="kept")
    add_diagnostics(kept, measure_runs=3, auto_disable_if_slower=False)
    hist = host.run(kept)
    ratio, _, _ = verdict(report_of(host, hist))
    assert ratio < 0.9
    assert host.probe(hist)["apply_model_wrapper_keys"] == ["torch_compile_speed"]  # not asked to

    offset = host.log_offset()
    disabled = wan_t2v_prompt(tiny_wan, compile_settings=settings, prefix="disabled")
    add_diagnostics(disabled, measure_runs=3, auto_disable_if_slower=True)
    hist = host.run(disabled)
    text = report_of(host, hist)
    ratio, _, _ = verdict(text)
    assert ratio < 0.9
    assert re.search(r"^Verdict: compiled is slower \(\d\.\d\dx\); .* — auto-disabled: "
                     r"eager model returned$", text, re.M), text
    probe = host.probe(hist)
    assert "torch_compile_speed" not in probe["apply_model_wrapper_keys"]
    assert probe["modules_with_compiled_call_impl"] == 0
    assert torch.equal(host.latent(hist), eager)  # the sampler ran the plain eager model
    log = host.log_text(since=offset)
    assert log.count("auto_disable_if_slower returns the eager model") == 1, log
