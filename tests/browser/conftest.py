"""Fixtures for the browser tests: headless Chromium (DevTools protocol, see cdp.py) driving the
real ComfyUI frontend (comfyui-frontend-package) served by a test ComfyUI server (tests/host).

Chromium comes from Debian (``scripts/install_system_deps.sh``). Without it these tests FAIL under CI
(``CI=true``) and are skipped elsewhere, with the reason.
"""
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
HOST_DIR = HERE.parent / "host"
for p in (HERE, HOST_DIR):  # ``import cdp`` / ``import harness`` under any --import-mode
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import cdp  # noqa: E402
from cdp import Chromium, find_chromium  # noqa: E402
import harness  # noqa: E402
from harness import ComfyHost  # noqa: E402

harness.API_NODES = False  # (no test uses ComfyUI's API nodes; a start without them is shorter)

ARTIFACTS = HERE / "artifacts"
PAGE_TIMEOUT = 90.0  # page load + frontend start; the 2-core CI machine may be busy

# Written to the test server's user settings before the page loads: skip the first-run
# templates dialog and keep dialogs/minimap from covering the canvas in screenshots.
FRONTEND_SETTINGS = {
    "Comfy.TutorialCompleted": True,
    "Comfy.Workflow.ShowMissingModelsWarning": False,
    "Comfy.Minimap.Visible": False,
}
# localStorage keys set before the app's scripts run (the "Nodes 2.0" banner).
LOCAL_STORAGE = {"vueNodesBannerDismissed": "true"}

READY_JS = ("!!(window.app?.graph && window.app?.canvas && window.LiteGraph"
            " && LiteGraph.registered_node_types?.KSampler)")
# ``window.app`` is set before the frontend loads its start-up workflow (the default graph, or
# the one restored from the last session): that load runs asynchronously after READY_JS is true
# (frontend 1.49 reliably so) and replaces the graph, wiping whatever a test built meanwhile.
# The workflow store gets its active workflow at the end of that load (afterLoadNewGraph, after
# graph.configure), and the start-up spinner goes off after it (1.49) or before it (1.32).
STARTUP_LOADED_JS = ("!!(window.app?.extensionManager?.workflow?.activeWorkflow"
                     " && !app.extensionManager.spinner)")


def pytest_configure(config):
    config.addinivalue_line("markers", "browser: drives headless Chromium against the real frontend")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.browser)
            item.add_marker(pytest.mark.host)


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def chromium_path():
    """Chromium's path. Missing Chromium (or websocket-client): fail under CI, skip elsewhere."""
    path = find_chromium()
    if path and cdp.websocket is not None:
        return path
    if cdp.websocket is None:
        msg = "websocket-client is not installed: pip install -c constraints.txt -r requirements-dev.txt"
    else:
        msg = ("Chromium not found (looked for $TCS_CHROMIUM, /usr/bin/chromium, chromium on PATH). "
               "Install it with: bash scripts/install_system_deps.sh")
    if _in_ci():
        pytest.fail(f"the browser tests cannot run in CI: {msg}", pytrace=False)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def browser(chromium_path, tmp_path_factory):
    """One headless Chromium for the session, with a fresh profile; killed at teardown."""
    root = tmp_path_factory.mktemp("chromium")
    chrome = Chromium(root / "profile", executable=chromium_path, log_path=root / "chromium.log")
    with chrome:
        yield chrome


@pytest.fixture(scope="session")
def ui_host(tmp_path_factory, tiny_wan_path):
    """A fresh ComfyUI server for the browser tests (its own base dir, so a cold compile cache
    and its own user settings)."""
    host = ComfyHost(tmp_path_factory.mktemp("comfy_browser"), models=[tiny_wan_path])
    settings = host.base_dir / "user" / "default" / "comfy.settings.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps(FRONTEND_SETTINGS))
    with host:
        yield host


class ComfyPage:
    """A tab on the ComfyUI frontend, with helpers for the ComfyUI JS API."""

    def __init__(self, page, host, tmp_path):
        self.page = page
        self.host = host
        self.tmp_path = tmp_path

    def __getattr__(self, name):  # evaluate, wait_for, errors, console, ...
        return getattr(self.page, name)

    def open(self):
        t0 = time.monotonic()
        self.page.navigate(self.host.url + "/", timeout=PAGE_TIMEOUT)
        self.page.wait_for(READY_JS, timeout=PAGE_TIMEOUT, what="the ComfyUI frontend to start")
        self.page.wait_for(STARTUP_LOADED_JS, timeout=PAGE_TIMEOUT,
                           what="the frontend's start-up workflow to finish loading")
        # Record the server's answer to each queued prompt (app.queuePrompt hides the prompt id).
        self.page.evaluate("""(() => {
            const api = window.comfyAPI.api.api;
            if (api.__tcsWrapped) return;
            const orig = api.queuePrompt.bind(api);
            window.__tcsQueued = [];
            api.queuePrompt = async (...args) => {
                try { const r = await orig(...args); window.__tcsQueued.push(r); return r; }
                catch (e) { window.__tcsQueued.push({error: String(e), node_errors: e?.response?.node_errors});
                            throw e; }
            };
            api.__tcsWrapped = true;
        })()""")
        self.load_seconds = time.monotonic() - t0
        return self

    def queue_and_wait(self, timeout=300.0) -> dict:
        """``app.queuePrompt(0, 1)`` (what the Run button does), then wait for the server to
        finish it; returns its /history entry (raises harness.PromptError if it failed)."""
        res = self.page.evaluate("""(async () => {
            const n = window.__tcsQueued.length;
            await app.queuePrompt(0, 1);
            return window.__tcsQueued.slice(n);
        })()""", timeout=60)
        assert res and res[0].get("prompt_id"), f"the frontend did not queue a prompt: {res}"
        return self.host.wait(res[0]["prompt_id"], timeout=timeout)

    def node(self, node_id, expr="n"):
        """Evaluate ``expr`` with ``n`` = the graph node ``node_id``."""
        return self.page.evaluate(
            f"(() => {{ const n = app.graph.getNodeById({json.dumps(node_id)}); "
            f"if (!n) throw new Error('no node ' + {json.dumps(str(node_id))}); return ({expr}); }})()")

    def widgets(self, node_id):
        """``[{name, value, disabled}]`` of a node's widgets, in order."""
        return self.node(node_id, "n.widgets.map(w => ({name: w.name, value: w.value, "
                                  "disabled: !!w.disabled, type: w.type}))")

    def links(self):
        """``[[origin_id, target_id, type]]`` of the root graph's links, the ids as strings: node
        ids are numbers in frontend 1.32 but strings after ``loadGraphData`` in 1.49, so compare
        them with ``str(id)`` (``getNodeById`` finds a node by either)."""
        return self.page.evaluate("[...app.graph.links.values()]"
                                  ".map(l => [String(l.origin_id), String(l.target_id), l.type])")

    def frame(self, node_ids, zoom=0.9):
        """Fit the canvas view to these nodes (for readable screenshots) and redraw."""
        self.page.evaluate(f"""(() => {{
            const ns = {json.dumps(list(node_ids))}.map(id => app.graph.getNodeById(id)).filter(Boolean);
            const x0 = Math.min(...ns.map(n => n.pos[0])), y0 = Math.min(...ns.map(n => n.pos[1] - 40));
            const x1 = Math.max(...ns.map(n => n.pos[0] + n.size[0]));
            const y1 = Math.max(...ns.map(n => n.pos[1] + n.size[1]));
            app.canvas.ds.fitToBounds([x0 - 20, y0 - 20, x1 - x0 + 40, y1 - y0 + 40], {{zoom: {zoom}}});
            app.canvas.setDirty(true, true);
            app.canvas.draw(true, true);
        }})()""")

    def screenshot(self, name) -> Path:
        """Screenshot into the test's tmp dir, copied to tests/browser/artifacts/."""
        self.page.evaluate("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
        path = self.page.screenshot(self.tmp_path / name)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, ARTIFACTS / name)
        return path


@pytest.fixture
def comfy_page(browser, ui_host, tmp_path):
    """A fresh tab on the test server's frontend, ready to use; closed after the test."""
    page = browser.new_page()
    try:
        for key, value in LOCAL_STORAGE.items():
            page.send("Page.addScriptToEvaluateOnNewDocument",
                      {"source": f"localStorage.setItem({json.dumps(key)}, {json.dumps(value)})"})
        yield ComfyPage(page, ui_host, tmp_path).open()
    finally:
        browser.close_page(page)
