"""The pack in the real ComfyUI frontend (comfyui-frontend-package), driven by headless Chromium.

What a user sees: the nodes are registered, the web extension loads without errors, the Apply
node shows a status badge with the server's real compile numbers after a run, the Settings node
greys out inert widgets without touching values or order, a workflow saved with the ORIGINAL
pack loads with every value in the right widget and runs, and the example workflows load.
Screenshots go to the test's tmp dir and to tests/browser/artifacts/.
"""
import copy
import json
import time
from pathlib import Path

import pytest

from harness import add_diagnostics, make_tiny_wan, wan_t2v_prompt

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FIXTURE = HERE / "fixtures" / "original_pack_ui_workflow.json"
EXAMPLES = REPO / "example_workflows"
PACK_JS = "torch_compile_speed.js"
PACK_MODULE = "TorchCompileSpeed"  # the pack's folder name in the test server's custom_nodes

# The original pack's 12 widgets, then the 2 WanVideoWrapper keys; later additions go after these.
SETTINGS_ORDER = ["backend", "fullgraph", "mode", "dynamic", "dynamo_cache_size_limit",
                  "compile_transformer_blocks_only", "reuse_if_similar", "experimental_ptx",
                  "ptx_fast_math", "warmup_runs", "ptx_cache_dir", "dynamo_recompile_limit",
                  "force_parameter_static_shapes", "allow_unmerged_lora_compile"]
ORIGINAL_ORDER = SETTINGS_ORDER[:12]
PTX_DEPENDENTS = ["ptx_fast_math", "warmup_runs", "ptx_cache_dir"]
SPEED_OVERRIDES = ["backend", "dynamic"]
DEPENDENTS = PTX_DEPENDENTS + SPEED_OVERRIDES


def pack_errors(page):
    """Uncaught exceptions, and console errors that come from this pack's extension. (The
    frontend logs its own errors too: 404s for optional files, and failed look-ups of
    api.comfy.org, which a machine without internet access cannot reach.)"""
    return [e for e in page.errors()
            if e.startswith("exception:") or PACK_JS in e or "TorchCompileSpeed.UI" in e]


def assert_png(path, min_bytes=10_000):
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert len(data) > min_bytes, f"{path} is only {len(data)} bytes: blank page?"


@pytest.fixture(scope="module")
def settings_spec(ui_host):
    """The server's TorchCompileSpeedSettings inputs: ``(names in widget order, {name: default})``."""
    info = ui_host.object_info("TorchCompileSpeedSettings")
    order = info["input_order"]["required"] + info["input_order"].get("optional", [])
    specs = {**info["input"]["required"], **info["input"].get("optional", {})}
    return order, {k: specs[k][1].get("default") for k in order}


def assert_settings_names(names, spec_names):
    assert names == spec_names, names
    assert names[:len(SETTINGS_ORDER)] == SETTINGS_ORDER, "the first 14 widgets moved"


def disabled_map(widgets):
    return {w["name"]: w["disabled"] for w in widgets if w["name"] in DEPENDENTS}


def expected_disabled(ptx, mode):
    return {**{n: not ptx for n in PTX_DEPENDENTS}, **{n: mode == "speed" for n in SPEED_OVERRIDES}}


# --------------------------------------------------------------------------- registration

def test_nodes_registered_and_extension_loaded(comfy_page, settings_spec):
    page = comfy_page
    types = page.evaluate("""(() => {
        const t = LiteGraph.registered_node_types;
        const info = k => t[k] && {category: t[k].category, title: t[k].title,
                                   comfyClass: t[k].comfyClass};
        return {settings: info('TorchCompileSpeedSettings'), apply: info('ApplyTorchCompile')};
    })()""")
    assert types["settings"] and types["apply"], types
    assert types["settings"]["category"] == "optimization"
    assert types["apply"]["title"] == "Apply Torch Compile"

    # The server lists the pack's JS file, and the frontend ran it.
    assert f"/extensions/{PACK_MODULE}/{PACK_JS}" in page.host.get("/extensions")
    loaded = page.evaluate("""(() => ({
        registered: (app.extensions ?? []).some(e => e.name === 'TorchCompileSpeed.UI'),
        api: typeof window.TorchCompileSpeedUI?.badgeFor === 'function',
    }))()""")
    assert loaded == {"registered": True, "api": True}, loaded

    # A fresh Settings node has one widget per input, in the contract's order (12 original first).
    names = page.evaluate("""(() => {
        const n = LiteGraph.createNode('TorchCompileSpeedSettings');
        app.graph.add(n);
        return n.widgets.map(w => w.name);
    })()""")
    assert_settings_names(names, settings_spec[0])
    assert pack_errors(page) == [], pack_errors(page)


# --------------------------------------------------------------------------- status badge

def test_status_badge_shows_real_compile_numbers(comfy_page, tiny_wan):
    page = comfy_page
    prompt = wan_t2v_prompt(tiny_wan, compile_settings={"backend": "aot_eager"}, prefix="badge")
    page.evaluate(f"app.loadApiJson({json.dumps(prompt)}, 'tcs_badge.json')")
    assert page.node("apply", "n.tcsStatus ?? null") is None

    t0 = time.monotonic()
    history = page.queue_and_wait(timeout=300)
    assert history["status"]["status_str"] == "success"
    status = page.wait_for("""(() => { const s = app.graph.getNodeById('apply')?.tcsStatus;
                                       return s && !['pending', 'compiling'].includes(s.state) && s; })()""",
                           timeout=30, what="a status event after sampling")
    run_s = time.monotonic() - t0
    print(f"\nqueued + ran + badge in {run_s:.1f}s; status {status}")

    assert status["node"] == "apply"
    assert status["state"] in ("cold", "warm", "reused"), status
    assert status["graphs"] >= 1
    assert status["region_count"] == 2 and status["regional"] is True
    assert status["compile_seconds"] > 0
    assert status["backend"] == "aot_eager" and status["recompiles"] >= 0

    badge = page.node("apply", "n.tcsBadge")
    text = "\n".join(badge["lines"])
    assert "2 regions" in text and "compile " in text and "recompile" in text, text
    assert badge["lines"][0].startswith("torch.compile: ")
    size = page.node("apply", "[n.size[0], n.size[1], n.computeSize()[1]]")
    assert size[1] >= size[2] + 40, f"the node did not grow to fit the badge: {size}"

    page.frame(["loader", "apply", "sampler"], zoom=0.9)
    shot = page.screenshot("badge_after_run.png")
    assert_png(shot)
    assert pack_errors(page) == [], pack_errors(page)


def test_diagnostics_report_and_speedup_show_in_the_ui(comfy_page, tiny_wan):
    page = comfy_page
    prompt = wan_t2v_prompt(tiny_wan, compile_settings={"backend": "aot_eager"}, prefix="diag")
    add_diagnostics(prompt, measure_runs=3)
    page.evaluate(f"app.loadApiJson({json.dumps(prompt)}, 'tcs_diag.json')")
    history = page.queue_and_wait(timeout=300)
    assert history["status"]["status_str"] == "success"
    report = page.wait_for("app.graph.getNodeById('diag')?.tcsReport ?? null", timeout=30,
                           what="the diagnostics report on the node")
    assert report.startswith("Torch Compile Diagnostics") and "Step time" in report, report
    assert page.node("diag", "n.widgets.find(w => w.name === 'tcs_report').value") == report
    # the report box is display-only: it never enters the prompt or the saved workflow
    prompt_out = page.evaluate("app.graphToPrompt().then(p => p.output)")
    assert "tcs_report" not in prompt_out["diag"]["inputs"]
    status = page.wait_for("""(() => { const s = app.graph.getNodeById('apply')?.tcsStatus;
                                       return s && typeof s.speedup === 'number' && s; })()""",
                           timeout=30, what="a status with the measured speedup")
    assert status["speedup"] > 0
    assert any("vs eager" in line for line in page.node("apply", "n.tcsBadge")["lines"])
    page.frame(["apply", "diag"], zoom=0.8)
    assert_png(page.screenshot("diagnostics_report.png"))
    assert pack_errors(page) == [], pack_errors(page)


def test_badge_formats_other_states(comfy_page, tiny_wan):
    """Synthetic status events (what the server sends in other situations) render sensibly."""
    page = comfy_page
    page.evaluate(f"app.loadApiJson({json.dumps(wan_t2v_prompt(tiny_wan))}, 'tcs_states.json')")
    base = {"node": "apply", "regions": "WanAttentionBlock x2", "region_count": 2, "regional": True,
            "backend": "inductor", "mode": "max-autotune-no-cudagraphs", "graphs": 1, "recompiles": 1,
            "compile_seconds": 83.4, "runs": 3, "fallback_reason": "", "fingerprint": "abc"}

    def send(payload):
        page.evaluate(f"window.comfyAPI.api.api.dispatchCustomEvent('torch_compile_speed.status', "
                      f"{json.dumps(payload)})")
        return page.node("apply", "n.tcsBadge")

    warm = send({**base, "state": "reused", "speedup": 1.314})
    assert warm["lines"][0] == "torch.compile: reused (in memory)"
    assert "1m 23s" in warm["lines"][1] and "1 recompile" in warm["lines"][1]
    assert any("1.31× vs eager" in line for line in warm["lines"]), warm

    whole = send({**base, "state": "cold", "regional": False, "region_count": 1, "recompiles": 0})
    assert whole["lines"][1].startswith("whole model") and "0 recompiles" in whole["lines"][1]

    compiling = send({**base, "state": "compiling", "graphs": 0, "compile_seconds": 0})
    assert compiling["lines"][0] == "torch.compile: compiling… (first step)"

    why = "compiled steps took 1.04x eager's on NVIDIA H100 80GB HBM3, so it runs eagerly"
    slower = send({**base, "state": "eager-slower", "fallback_reason": why})
    assert slower["lines"][0] == "torch.compile: eager (compiled was not faster here)"
    assert why in slower["lines"] and "1m 23s" in slower["lines"][1], slower

    width = page.node("apply", "n.size[0]")
    reason = ("BackendCompilerFailed: backend='inductor' raised: InvalidCxxCompiler: No working C++ "
              "compiler found in torch._inductor.config.cpp.cxx: (None, 'g++') -> fix: install a C++ "
              "compiler, pick another backend, or turn compile off")
    failed = send({**base, "state": "eager-fallback", "graphs": 0, "fallback_reason": reason})
    assert failed["lines"][0] == "torch.compile: eager fallback"
    assert reason in failed["lines"]
    # A long reason wraps (at most 3 lines, ellipsis) instead of widening the node over its
    # neighbours.
    assert page.node("apply", "n.size[0]") == width
    shown = page.node("apply", "n.tcsBadge.layout.lines")
    assert shown[0]["text"] == "torch.compile: eager fallback", shown
    reason_lines = [line["text"] for line in shown if line["source"] == failed["lines"].index(reason)]
    assert len(reason_lines) == 3 and reason_lines[-1].endswith("…"), shown
    assert failed["color"] != warm["color"]
    assert page.node("apply", "n.tcsStatus.state") == "eager-fallback"

    # Unknown nodes and junk payloads are ignored without errors.
    send({**base, "node": "no-such-node", "state": "cold"})
    page.evaluate("window.comfyAPI.api.api.dispatchCustomEvent('torch_compile_speed.status', null)")
    assert page.node("apply", "n.tcsStatus.state") == "eager-fallback"

    page.frame(["apply", "sampler"], zoom=0.8)
    assert_png(page.screenshot("badge_eager_fallback.png"))
    assert pack_errors(page) == [], pack_errors(page)


# --------------------------------------------------------------------------- settings widgets

TOGGLE_JS = """(nodeId, name, value) => {
    const n = app.graph.getNodeById(nodeId);
    const w = n.widgets.find(w => w.name === name);
    w.value = value;
    w.callback?.(w.value, app.canvas, n, app.canvas.graph_mouse);
    return n.widgets.map(w => ({name: w.name, value: w.value, disabled: !!w.disabled}));
}"""


def test_settings_widgets_grey_out_without_changing_values(comfy_page, settings_spec):
    page = comfy_page
    page.evaluate("""(() => {
        app.graph.clear();
        const n = LiteGraph.createNode('TorchCompileSpeedSettings');
        n.id = 'tcs_settings'; n.pos = [80, 80];
        app.graph.add(n);
    })()""")
    start = page.widgets("tcs_settings")
    names = [w["name"] for w in start]
    assert_settings_names(names, settings_spec[0])
    values = {w["name"]: w["value"] for w in start}
    assert values["mode"] == "speed" and values["experimental_ptx"] is False  # node defaults
    assert disabled_map(start) == expected_disabled(False, "speed")
    serialized = page.node("tcs_settings", "n.serialize().widgets_values")

    ptx, mode = False, "speed"
    for name, value in [("experimental_ptx", True), ("mode", "default"), ("experimental_ptx", False),
                        ("mode", "max-autotune"), ("mode", "speed"), ("experimental_ptx", True)]:
        now = page.call(TOGGLE_JS, "tcs_settings", name, value)
        ptx = value if name == "experimental_ptx" else ptx
        mode = value if name == "mode" else mode
        values[name] = value
        assert [w["name"] for w in now] == names, "widget order changed"
        assert {w["name"]: w["value"] for w in now} == values, f"values changed after {name}={value}"
        assert disabled_map(now) == expected_disabled(ptx, mode), f"after {name}={value}: {now}"
        # No other widget is ever disabled by us.
        assert not any(w["disabled"] for w in now if w["name"] not in DEPENDENTS)

    # Serialization keeps every value by position, and the API prompt still sends every input
    # (a greyed-out widget is inert in the UI, not missing from the prompt).
    after = page.node("tcs_settings", "n.serialize().widgets_values")
    expected = list(serialized)
    expected[names.index("experimental_ptx")] = True
    expected[names.index("mode")] = "speed"
    assert after == expected and len(after) == len(names)
    prompt = page.evaluate("app.graphToPrompt().then(p => p.output)")
    assert list(prompt["tcs_settings"]["inputs"]) == names

    # onWidgetChanged path (what LiteGraph's own widget.setValue calls) flips it too.
    state = page.evaluate("""(() => {
        const n = app.graph.getNodeById('tcs_settings');
        const w = n.widgets.find(w => w.name === 'experimental_ptx');
        w.setValue(false, {e: undefined, node: n, canvas: app.canvas});
        return n.widgets.filter(w => w.name === 'ptx_fast_math').map(w => [w.value, !!w.disabled])[0];
    })()""")
    assert state == [True, True]

    # A value changed behind the extension's back (no callback) is caught on the next frame.
    page.evaluate("""(() => {
        const n = app.graph.getNodeById('tcs_settings');
        n.widgets.find(w => w.name === 'mode').value = 'default';
        app.canvas.setDirty(true, true); app.canvas.draw(true, true);
    })()""")
    assert disabled_map(page.widgets("tcs_settings")) == expected_disabled(False, "default")

    # Declared shapes make warmup_runs live again (it drives compile-ahead), PTX still off.
    now = page.call(TOGGLE_JS, "tcs_settings", "declared_shapes", "480x480x33")
    assert not {w["name"]: w["disabled"] for w in now}["warmup_runs"]
    assert {w["name"]: w["disabled"] for w in now}["ptx_fast_math"]
    now = page.call(TOGGLE_JS, "tcs_settings", "declared_shapes", "")
    assert {w["name"]: w["disabled"] for w in now}["warmup_runs"]

    # Back to the state to show: PTX off, mode speed -> 5 greyed-out widgets.
    page.call(TOGGLE_JS, "tcs_settings", "mode", "speed")
    page.frame(["tcs_settings"], zoom=0.7)
    shot = page.screenshot("settings_greyed_out.png")
    assert_png(shot)
    assert page.node("tcs_settings", "n.widgets.filter(w => w.computedDisabled).length") == 5
    assert pack_errors(page) == [], pack_errors(page)


def test_clicking_a_toggle_in_the_canvas_updates_the_greyed_out_widgets(comfy_page):
    """A real mouse click (DevTools Input events) on the experimental_ptx toggle."""
    page = comfy_page
    page.evaluate("""(() => {
        app.graph.clear();
        const n = LiteGraph.createNode('TorchCompileSpeedSettings');
        n.id = 'tcs_click'; n.pos = [100, 100];
        app.graph.add(n);
        app.canvas.ds.scale = 1; app.canvas.ds.offset = [0, 0];
        app.canvas.setDirty(true, true); app.canvas.draw(true, true);
    })()""")

    def click_widget(name):
        # Where the widget is, once two drawn frames agree on it: on a busy machine a click
        # computed from the first frame's layout missed the toggle (CI-like fresh clone run).
        x, y = page.wait_for(f"""(async () => {{
            const frame = () => new Promise(r => requestAnimationFrame(() => r()));
            const at = () => {{
                app.canvas.setDirty(true, true);
                const n = app.graph.getNodeById('tcs_click');
                const w = n.widgets.find(w => w.name === {json.dumps(name)});
                const wy = w.last_y ?? w.y;
                const p = app.canvas.ds.convertOffsetToCanvas([n.pos[0] + n.size[0] - 30, n.pos[1] + wy + 10]);
                const r = app.canvas.canvas.getBoundingClientRect();
                return [r.left + p[0] / (window.devicePixelRatio || 1), r.top + p[1] / (window.devicePixelRatio || 1)];
            }};
            await frame(); const a = at(); await frame(); const b = at();
            return a.every(Number.isFinite) && a[0] === b[0] && a[1] === b[1] ? b : null;
        }})()""", timeout=30, what=f"a stable position of the {name} widget")
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            page.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left",
                                                   "buttons": 1 if kind == "mousePressed" else 0,
                                                   "clickCount": 1, "pointerType": "mouse"})
        page.evaluate("new Promise(r => requestAnimationFrame(() => r()))")

    before = page.widgets("tcs_click")
    assert disabled_map(before)["ptx_fast_math"] is True
    is_on = """(() => { const n = app.graph.getNodeById('tcs_click');
        const w = n.widgets.find(w => w.name === 'experimental_ptx'); return w.value === true; })()"""
    click_widget("experimental_ptx")
    try:
        page.wait_for(is_on, timeout=10, what="the click to turn experimental_ptx on")
    except TimeoutError:  # a click the busy page dropped: once more (a click that hit another
        click_widget("experimental_ptx")  # widget fails the unchanged-values check below)
        page.wait_for(is_on, timeout=30, what="a second click to turn experimental_ptx on")
    now = page.widgets("tcs_click")
    assert disabled_map(now) == expected_disabled(True, "speed")
    assert [w["value"] for w in now if w["name"] != "experimental_ptx"] == \
        [w["value"] for w in before if w["name"] != "experimental_ptx"]

    # A click on a greyed-out widget (dynamic, overridden by mode speed) changes nothing.
    click_widget("dynamic")
    assert page.widgets("tcs_click") == now
    assert pack_errors(page) == [], pack_errors(page)


# --------------------------------------------------------------------------- old workflows

ORIGINAL_VALUES = {  # the fixture's values, by name
    "backend": "eager", "fullgraph": False, "mode": "default", "dynamic": True,
    "dynamo_cache_size_limit": 77, "compile_transformer_blocks_only": True,
    "reuse_if_similar": False, "experimental_ptx": False, "ptx_fast_math": False,
    "warmup_runs": 3, "ptx_cache_dir": "mycache", "dynamo_recompile_limit": 99,
}


def _legacy(workflow, model_name):
    """The same workflow as an older frontend saved it: only linked inputs, no widget slots.
    It loads another model file, so that the server runs every node again (nothing cached)."""
    wf = copy.deepcopy(workflow)
    remap = {}
    for node in wf["nodes"]:
        kept = [i for i in node.get("inputs", []) if "widget" not in i]
        for new_slot, inp in enumerate(kept):
            inp.pop("localized_name", None)
            if inp.get("link") is not None:
                remap[inp["link"]] = new_slot
        node["inputs"] = kept
        for out in node.get("outputs", []):
            out.pop("localized_name", None)
        if node["type"] == "UNETLoader":
            node["widgets_values"][0] = model_name
    wf["links"] = [[lid, o, os_, t, remap.get(lid, ts), typ] for lid, o, os_, t, ts, typ in wf["links"]]
    return wf


@pytest.mark.parametrize("variant", ["as_saved", "legacy_no_widget_slots"])
def test_original_pack_ui_workflow_loads_and_runs(comfy_page, settings_spec, variant):
    page = comfy_page
    workflow = json.loads(FIXTURE.read_text())
    settings = next(n for n in workflow["nodes"] if n["type"] == "TorchCompileSpeedSettings")
    assert settings["widgets_values"] == [ORIGINAL_VALUES[k] for k in ORIGINAL_ORDER]  # fixture sanity
    if variant != "as_saved":
        workflow = _legacy(workflow, page.host.add_model(make_tiny_wan(num_layers=2, dim=256, seed=1)))

    page.evaluate(f"app.loadGraphData({json.dumps(workflow)}, true, true, 'original_pack_{variant}')")
    widgets = page.widgets(settings["id"])
    by_name = {w["name"]: w["value"] for w in widgets}
    assert_settings_names([w["name"] for w in widgets], settings_spec[0])
    # Every input the original pack did not have holds its default (False for the two
    # WanVideoWrapper booleans).
    new_defaults = {k: v for k, v in settings_spec[1].items() if k not in ORIGINAL_VALUES}
    assert new_defaults["force_parameter_static_shapes"] is False
    assert new_defaults["allow_unmerged_lora_compile"] is False
    for name, value in {**ORIGINAL_VALUES, **new_defaults}.items():
        assert by_name[name] == value, f"{name}: {by_name[name]!r} != {value!r} (all: {by_name})"
    # ptx off, mode default: only the PTX options are greyed out.
    assert disabled_map(widgets) == expected_disabled(False, "default")
    assert [str(settings["id"]), "12", "WANCOMPILEARGS"] in page.links()

    history = page.queue_and_wait(timeout=300)
    assert history["status"]["status_str"] == "success"
    sent = history["prompt"][2][str(settings["id"])]["inputs"]
    assert sent == {**ORIGINAL_VALUES, **new_defaults}, sent
    # The badge got the run's status. (Whether dynamic=True compiles or falls back to eager is
    # the engine's business, tested in tests/host; here the run only has to succeed.)
    status = page.wait_for("""(() => { const s = app.graph.getNodeById(12)?.tcsStatus;
                                       return s && !['pending', 'compiling'].includes(s.state) && s; })()""",
                           timeout=30, what="a status event after sampling")
    assert status["backend"] == "eager" and status["node"] == "12", status

    page.frame([10, 11, 12, 15], zoom=0.9)
    assert_png(page.screenshot(f"original_pack_workflow_{variant}.png"))
    assert pack_errors(page) == [], pack_errors(page)


def test_a_workflow_saved_with_the_removed_whole_graph_widget_loads(comfy_page, settings_spec):
    """Workflows saved by earlier versions hold one settings value more than the node has widgets
    (``whole_graph``, the last input then, since removed): the frontend leaves a value past the
    last widget out, and every other value keeps its widget."""
    page = comfy_page
    workflow = json.loads((EXAMPLES / "wan_t2v_compile.json").read_text())
    settings = next(n for n in workflow["nodes"] if n["type"] == "TorchCompileSpeedSettings")
    names = settings_spec[0]
    # the inputs after the example's 14 values, none at its default (a shifted value would show)
    values = settings["widgets_values"] + ["static", "480x480x1", True]
    assert len(values) == len(names), names
    settings["widgets_values"] = values + [True]  # the removed whole_graph's saved value
    page.evaluate(f"app.loadGraphData({json.dumps(workflow)}, true, true, 'saved_with_whole_graph', "
                  "{showMissingNodesDialog: false})")
    widgets = page.widgets(settings["id"])
    assert [w["name"] for w in widgets] == names
    assert [w["value"] for w in widgets] == values, widgets
    assert page.node(settings["id"], "!!n.has_errors") is False
    prompt = page.evaluate("app.graphToPrompt().then(p => p.output)")
    assert prompt[str(settings["id"])]["inputs"] == dict(zip(names, values))
    assert pack_errors(page) == [], pack_errors(page)


# --------------------------------------------------------------------------- example workflows

def test_server_lists_example_workflows(ui_host):
    listed = ui_host.get("/workflow_templates")
    assert sorted(listed.get(PACK_MODULE, [])) == ["wan_t2v_compile", "wan_vae_compile",
                                                     "wanvideowrapper_compile_args"], listed
    served = ui_host.get(f"/api/workflow_templates/{PACK_MODULE}/wan_t2v_compile.json")
    assert served == json.loads((EXAMPLES / "wan_t2v_compile.json").read_text())


@pytest.mark.parametrize("name", ["wan_t2v_compile", "wan_vae_compile", "wanvideowrapper_compile_args"])
def test_example_workflow_loads(comfy_page, settings_spec, name):
    page = comfy_page
    on_disk = json.loads((EXAMPLES / f"{name}.json").read_text())
    exceptions_before = len(page.exceptions)
    # What the frontend's template browser does: fetch from the pack's template route, load it.
    page.evaluate(f"""(async () => {{
        const wf = await (await fetch(window.comfyAPI.api.api.apiURL(
            '/workflow_templates/{PACK_MODULE}/{name}.json'))).json();
        await app.loadGraphData(wf, true, true, '{name}', {{showMissingNodesDialog: false}});
    }})()""")
    assert page.exceptions[exceptions_before:] == []

    ours = [n for n in on_disk["nodes"]
            if n["type"] in ("TorchCompileSpeedSettings", "ApplyTorchCompile", "ApplyTorchCompileVAE")]
    assert ours
    for node in ours:
        assert page.node(node["id"], "n.type") == node["type"]
        assert page.node(node["id"], "!!n.has_errors") is False
        if node["type"] == "TorchCompileSpeedSettings":
            widgets = page.widgets(node["id"])
            names = [w["name"] for w in widgets]
            assert_settings_names(names, settings_spec[0])
            saved = node["widgets_values"]  # by position; newer inputs keep their defaults
            assert [w["value"] for w in widgets] == saved + [settings_spec[1][k] for k in names[len(saved):]]
            by_name = {w["name"]: w["value"] for w in widgets}
            assert disabled_map(widgets) == expected_disabled(by_name["experimental_ptx"], by_name["mode"])

    settings_id = next(n["id"] for n in ours if n["type"] == "TorchCompileSpeedSettings")
    targets = [t for o, t, typ in page.links() if o == str(settings_id) and typ == "WANCOMPILEARGS"]
    if name == "wan_vae_compile":  # one settings node feeds the model's and the VAE's Apply
        assert sorted(page.node(t, "n.type") for t in targets) == ["ApplyTorchCompile", "ApplyTorchCompileVAE"]
        return
    assert len(targets) == 1
    target_type = page.node(targets[0], "n.type")

    if name == "wan_t2v_compile":
        assert target_type == "ApplyTorchCompile"
        # The server accepts the wiring: only the (absent) model files fail validation.
        prompt = page.evaluate("app.graphToPrompt().then(p => p.output)")
        code, body = page.host.post_prompt_raw(prompt)
        assert code == 400, body
        bad = {nid: [e["type"] for e in err["errors"]] for nid, err in body["node_errors"].items()}
        loaders = {str(n["id"]) for n in on_disk["nodes"] if n["type"] in ("UNETLoader", "CLIPLoader", "VAELoader")}
        assert set(bad) <= loaders and bad, body
        assert all(t == "value_not_in_list" for ts in bad.values() for t in ts), body
    else:
        # WanVideoWrapper is not installed on the test server: the frontend keeps the node as a
        # missing-node placeholder (with its link), and ours loads normally.
        assert target_type == "WanVideoModelLoader"
        assert page.node(targets[0], "!!n.has_errors") is True

    page.frame([n["id"] for n in on_disk["nodes"]], zoom=0.95)
    assert_png(page.screenshot(f"example_{name}.png"))
    assert pack_errors(page) == [], pack_errors(page)
