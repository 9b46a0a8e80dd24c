"""A small Chrome DevTools Protocol client: headless Chromium driven from Python.

No pytest here (``conftest.py`` wraps it). One ``Chromium`` process per test session, started
with ``CHROMIUM_FLAGS`` plus a remote-debugging port and a fresh ``--user-data-dir``, and
always killed (its whole process group) at teardown. ``Page`` talks to one tab over its
DevTools websocket (``websocket-client``): ``evaluate`` runs JS and returns its JSON value,
``wait_for`` polls a JS expression, and console errors and uncaught exceptions are collected.
"""
from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import threading
import time
import weakref
from pathlib import Path

import requests
from harness import die_with_parent, free_port, kill_group  # tests/host (conftest puts it on the path)

try:  # websocket-client (requirements-dev.txt); conftest turns its absence into a clear message
    import websocket
except ImportError:  # pragma: no cover
    websocket = None

# The flags that run Debian's Chromium headless in a container: no sandbox (it needs privileges a
# container lacks), no GPU, and none of its background network services.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")


def find_chromium() -> str | None:
    env = os.environ.get("TCS_CHROMIUM")
    if env:
        return env if Path(env).exists() else None
    for path in CHROMIUM_CANDIDATES:
        if Path(path).exists():
            return path
    return shutil.which("chromium")


class CDPError(RuntimeError):
    """A DevTools command failed (protocol error)."""


class JSError(RuntimeError):
    """JS evaluated in the page threw."""


class Chromium:
    """A headless Chromium process with a DevTools port; ``new_page()`` opens a tab."""

    def __init__(self, user_data_dir, executable=None, log_path=None):
        self.executable = executable or find_chromium()
        if not self.executable:
            raise FileNotFoundError("Chromium not found (run scripts/install_system_deps.sh)")
        self.user_data_dir = Path(user_data_dir)
        self.log_path = Path(log_path) if log_path else self.user_data_dir.with_suffix(".log")
        self.port = None
        self.proc = None
        self._finalizer = None
        self._pages = []

    def start(self, timeout=60.0):
        self.user_data_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        args = [self.executable, *CHROMIUM_FLAGS, f"--user-data-dir={self.user_data_dir}",
                f"--remote-debugging-port={self.port}", "about:blank"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=die_with_parent)
        self._finalizer = weakref.finalize(self, kill_group, self.proc)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Chromium exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = requests.get(f"http://127.0.0.1:{self.port}/json/version", timeout=2)
                if r.ok:
                    self.version = r.json().get("Browser", "?")
                    return self
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"Chromium DevTools not up after {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self, chars=4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _targets(self):
        return requests.get(f"http://127.0.0.1:{self.port}/json/list", timeout=10).json()

    def new_page(self, width=1600, height=1000) -> "Page":
        """A fresh tab (about:blank) with a fixed viewport."""
        r = requests.put(f"http://127.0.0.1:{self.port}/json/new?about:blank", timeout=10)
        r.raise_for_status()
        page = Page(r.json()["webSocketDebuggerUrl"], target_id=r.json()["id"], browser=self)
        self._pages.append(page)
        page.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                          "deviceScaleFactor": 1, "mobile": False})
        return page

    def close_page(self, page):
        page.close()
        try:
            requests.get(f"http://127.0.0.1:{self.port}/json/close/{page.target_id}", timeout=10)
        except requests.RequestException:
            pass

    def stop(self):
        for page in self._pages:
            page.close()
        self._pages.clear()
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class Page:
    """One DevTools session on a tab: commands, JS evaluation, collected console/exceptions."""

    def __init__(self, ws_url, target_id=None, browser=None):
        self.target_id = target_id
        self.browser = browser
        self.ws = websocket.create_connection(ws_url, timeout=10, suppress_origin=True,
                                              enable_multithread=True)
        self.ws.settimeout(None)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._waiting: dict[int, dict] = {}
        self._cond = threading.Condition(self._lock)
        self.console: list[dict] = []     # {"level", "text", "url"}
        self.exceptions: list[str] = []   # uncaught exceptions / unhandled rejections
        self.closed = False
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="cdp-reader")
        self._reader.start()
        self.send("Runtime.enable")
        self.send("Log.enable")
        self.send("Page.enable")

    # -- transport
    def _read_loop(self):
        while True:
            try:
                raw = self.ws.recv()
            except Exception:  # noqa: BLE001 - socket closed
                break
            if not raw:
                continue
            msg = json.loads(raw)
            if "id" in msg:
                with self._cond:
                    self._waiting[msg["id"]] = msg
                    self._cond.notify_all()
            else:
                self._on_event(msg.get("method"), msg.get("params", {}))
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def _on_event(self, method, params):
        if method == "Runtime.consoleAPICalled":
            args = params.get("args", [])
            text = " ".join(str(a.get("value", a.get("description", a.get("type")))) for a in args)
            frame = (params.get("stackTrace") or {}).get("callFrames") or [{}]
            self.console.append({"level": params.get("type"), "text": text,
                                 "url": frame[0].get("url", "")})
        elif method == "Runtime.exceptionThrown":
            d = params.get("exceptionDetails", {})
            exc = d.get("exception", {})
            self.exceptions.append(f"{d.get('text', '')} {exc.get('description', '')} "
                                   f"({d.get('url', '')}:{d.get('lineNumber', '')})")
        elif method == "Log.entryAdded":
            e = params.get("entry", {})
            self.console.append({"level": e.get("level"), "text": e.get("text", ""),
                                 "url": e.get("url", "")})

    def send(self, method, params=None, timeout=60.0):
        """Send one DevTools command and wait for its result."""
        params = params or {}
        if self.closed:
            raise CDPError("DevTools connection is closed")
        mid = next(self._ids)
        self.ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        with self._cond:
            while mid not in self._waiting:
                left = deadline - time.monotonic()
                if self.closed or left <= 0:
                    raise CDPError(f"{method}: no answer after {timeout:.0f}s"
                                   + (" (connection closed)" if self.closed else ""))
                self._cond.wait(min(left, 1.0))
            msg = self._waiting.pop(mid)
        if "error" in msg:
            raise CDPError(f"{method}: {msg['error']}")
        return msg.get("result", {})

    def close(self):
        if not self.closed:
            try:
                self.ws.close()
            except Exception:  # noqa: BLE001
                pass
            self.closed = True

    # -- JS
    def evaluate(self, expression, timeout=60.0, await_promise=True):
        """Run ``expression`` in the page; return its value (JSON round trip) or raise JSError."""
        res = self.send("Runtime.evaluate", {
            "expression": expression, "awaitPromise": await_promise, "returnByValue": True,
            "userGesture": True, "timeout": int(timeout * 1000)}, timeout=timeout + 5)
        if "exceptionDetails" in res:
            d = res["exceptionDetails"]
            desc = d.get("exception", {}).get("description") or d.get("text")
            raise JSError(f"{desc}\n--- in ---\n{expression[:2000]}")
        return res.get("result", {}).get("value")

    def call(self, fn_source, *args, timeout=60.0):
        """Evaluate ``(fn_source)(...args)`` with JSON-encoded Python args."""
        return self.evaluate(f"({fn_source})(...{json.dumps(list(args))})", timeout=timeout)

    def wait_for(self, expression, timeout=60.0, interval=0.1, what=None):
        """Poll ``expression`` until it is truthy; return its value or raise TimeoutError."""
        deadline = time.monotonic() + timeout
        last_err = None
        while True:
            try:
                value = self.evaluate(expression, timeout=max(5.0, timeout))
                if value:
                    return value
            except JSError as exc:
                last_err = exc
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:.0f}s for {what or expression!r}"
                                   + (f"; last error: {last_err}" if last_err else ""))
            time.sleep(interval)

    # -- navigation / capture
    def navigate(self, url, timeout=60.0):
        res = self.send("Page.navigate", {"url": url}, timeout=timeout)
        if res.get("errorText"):
            raise CDPError(f"navigate {url}: {res['errorText']}")
        self.wait_for("document.readyState === 'complete'", timeout=timeout, what=f"load of {url}")

    def screenshot(self, path) -> Path:
        data = self.send("Page.captureScreenshot", {"format": "png"}, timeout=60)["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def errors(self, url_contains=None) -> list[str]:
        """Console errors and uncaught exceptions (optionally only those whose text/url match)."""
        out = [f"console.{c['level']}: {c['text']} ({c['url']})" for c in self.console
               if c["level"] in ("error", "assert")]
        out += [f"exception: {e}" for e in self.exceptions]
        if url_contains:
            out = [e for e in out if url_contains in e]
        return out
