"""Warm start, part two: warm torch's compiler stack in the background after a restart.

Loading cached graphs is quick; what a restarted process pays on its first compiled run is
mostly torch's one-time work: importing the compiler modules, dynamo indexing the source of
every file it traces (it tokenizes whole files such as ``torch/nn/functional.py`` to name
functions in its logs), torch's hash of its own sources, and the CPU ISA probe (small C++
builds loaded in child processes). None of it depends on the model, so it can run while the
server idles.

Two parts. What every first compile needs, whatever the model, is warmed on every server
start: first the pack's feature probes (``warm_probes``), then torch's compile entry
(``warm_base``). The probes compile tiny functions; dynamo's compile lock, held by the probe,
against the logging module's lock, held by a thread that meets a frame dynamo has not seen
under its eval-frame callback, can deadlock two threads (seen: a server whose first prompt
used core's TorchCompileModel hung at start-up). So nothing may run compiled code beside them:
a prompt posted meanwhile waits for them (``probes_done``, called where ComfyUI takes a prompt,
``nodes/comfy_prewarm.py``). The rest is learned, not guessed: after a compile, the modules it
imported and the files dynamo indexed (and, on CPU, the cache dir where torch's ISA probe
builds are) are recorded in ``prewarm.json`` at the persistent cache root; when that manifest
exists (this server has compiled before), the same daemon thread replays it after the base; a
new fleet worker fetches the manifest another worker published (and the entries it names). A
compile that starts meanwhile stops the thread at its next module and waits for it, so the two
never race. Only modules of the compiler's own packages are imported; source files are only read.
Then, while no model is loaded yet (``quiet``), the objects alive then (ComfyUI's and torch's
compiler modules: several hundred thousand, never garbage) are frozen out of the garbage
collector's reach (``gc.freeze``): ComfyUI's full collection after a prompt walked them all
(0.4-0.5 s on a 2-core CPU, with the server silent). ``TORCH_COMPILE_SPEED_PREWARM=0``: off.
"""
from __future__ import annotations

import gc
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from ..report import log
from ..torch_support import compile_threads, cpu_isa, hooks, scoped, torch_compat
from ..plan import switches
from .persist import io_failed, shared_object_problem, write_atomic

ENV = "TORCH_COMPILE_SPEED_PREWARM"
MANIFEST = "prewarm.json"
# a manifest may name modules of these packages only (it is a file on disk, so it is not trusted)
MODULE_PREFIXES = ("torch.", "sympy", "mpmath", "triton", "functorch")
MAX_MODULES = 4000
MAX_FILES = 400
MAX_FINGERPRINTS = 8
LISTS = ("modules", "files", "fingerprints")

_thread: threading.Thread | None = None
_stop = threading.Event()
_probed = threading.Event()  # the warm-up thread's feature probes are over
_lock = threading.Lock()


def enabled() -> bool:
    return switches.switch(ENV, True)


def allowed_module(name: str) -> bool:
    return isinstance(name, str) and name.startswith(MODULE_PREFIXES) and all(
        part.isidentifier() for part in name.split("."))


def traced_files() -> list[str]:
    """Source files dynamo has indexed in this process (its function-name cache)."""
    try:
        from torch._dynamo import funcname_cache
    except ImportError:
        return []
    return [f for f in list(funcname_cache.cache) if isinstance(f, str) and f.endswith(".py")]


def read_manifest(root: Path) -> dict:
    """The manifest at ``root``, cleaned; {} when there is none. A malformed one (it is read in
    the server's start-up handler) gets one warning and is replaced after the next compile."""
    path = Path(root) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        data, problem = None, f"{type(exc).__name__}: {str(exc)[:200]}"
    else:
        problem = malformed(data)
    if problem:
        log.warn_once(f"prewarm-manifest:{path}", "ignoring the prewarm manifest %s (%s); the "
                      "next compile writes a new one", path, problem)
    return clean(data)


def malformed(data) -> str:
    """What is wrong with the shape of a manifest, or ''."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    bad = [k for k in LISTS if not isinstance(data.get(k, []), list)]
    if not isinstance(data.get("isa_dir"), (str, type(None))):
        bad.append("isa_dir")
    return f"wrong type for {', '.join(bad)}" if bad else ""


def _strings(data: dict, key: str) -> list[str]:
    items = data.get(key)
    return [x for x in items if isinstance(x, str)] if isinstance(items, list) else []


def clean(data) -> dict:
    """A manifest as read from disk or a shared store, reduced to what may be replayed
    (whatever its shape: {} when nothing is left)."""
    if not isinstance(data, dict):
        return {}
    out = {"modules": [m for m in _strings(data, "modules") if allowed_module(m)][:MAX_MODULES],
           "files": _strings(data, "files")[:MAX_FILES],
           "isa_dir": data["isa_dir"] if isinstance(data.get("isa_dir"), str) else None,
           "fingerprints": [f for f in _strings(data, "fingerprints")
                            if re.fullmatch(r"[0-9a-f]{8,64}", f)][:MAX_FINGERPRINTS]}
    return out if any(out.values()) else {}


def _merged(old: list[str], new: list[str], cap: int) -> list[str]:
    return list(dict.fromkeys([*old, *new]))[:cap]


def record(root: Path, modules: list[str], files: list[str], isa_dir: str | None = None,
           fingerprint: str | None = None) -> dict | None:
    """Add what one compile imported and indexed to the manifest (in import order); ``isa_dir``:
    the inductor cache dir of a compile that built C++ kernels (``warm_cpu_isa``); ``fingerprint``:
    the compiled entry, newest first (a new fleet worker prefetches those). Returns the new
    manifest when it changed, else None."""
    root = Path(root)
    old = read_manifest(root)
    data = {"modules": _merged(old.get("modules", []), [m for m in modules if allowed_module(m)],
                               MAX_MODULES),
            "files": _merged(old.get("files", []), files, MAX_FILES),
            "isa_dir": isa_dir or old.get("isa_dir"),
            "fingerprints": _merged([fingerprint] if fingerprint else [], old.get("fingerprints", []),
                                    MAX_FINGERPRINTS)}
    if data == old:
        return None
    try:
        root.mkdir(parents=True, exist_ok=True)
        write_atomic(root / MANIFEST, json.dumps(data, indent=0))
    except OSError as exc:  # the same one warning as the cache's own entries
        io_failed(root, f"save {MANIFEST}", exc)
    return data


class ImportRecorder:
    """Which modules a block of work imported: ``new()`` after it, in import order."""

    def __init__(self):
        self.before = set(sys.modules)

    def new(self) -> list[str]:
        return [m for m in list(sys.modules) if m not in self.before and installed_module(m)]


def installed_module(name: str) -> bool:
    """A module that lives in its package's directory (not a compiled graph that torch loads
    from its cache dir under a module name of its own)."""
    if not allowed_module(name):
        return False
    mod, top = sys.modules.get(name), sys.modules.get(name.split(".")[0])
    path, top_path = getattr(mod, "__file__", None), getattr(top, "__file__", None)
    if not path or not top_path:
        return False
    return os.path.abspath(path).startswith(os.path.dirname(os.path.abspath(top_path)) + os.sep)


def warm_cpu_isa(inductor_dir: str | None) -> bool:
    """Run torch's CPU ISA probe (it caches the result for the process) in the inductor cache
    dir of the last compile, where its small C++ builds already are: then it only loads them
    (in child processes, about a second). In a dir without them it would build them first,
    so nothing is done unless that dir still exists and its ``.so`` files look whole."""
    if not inductor_dir or not os.path.isdir(inductor_dir):
        return False
    try:
        if any(shared_object_problem(so) for so in Path(inductor_dir).rglob("*.so")):
            # a damaged probe .so would answer "no AVX" for the whole process (silently slow
            # kernels); the compile discards that entry first and probes in a fresh dir
            return False
        with scoped.scoped_state(env={"TORCHINDUCTOR_CACHE_DIR": inductor_dir}):
            return cpu_isa.probe()
    except Exception:  # noqa: BLE001 - only an optimisation
        return False


def warm(manifest: dict) -> dict:
    """Replay a manifest in this thread; returns what was done (never raises)."""
    start = time.perf_counter()
    imported = indexed = 0
    isa_result: list[bool] = []
    isa = None
    if manifest.get("isa_dir"):
        try:  # the probe mostly waits on child processes: run it beside the imports, after
            # importing what it needs itself (two threads never import the same module)
            import torch._inductor.codecache  # noqa: F401
            import torch._inductor.cpp_builder  # noqa: F401
            import torch._inductor.cpu_vec_isa  # noqa: F401
            isa = threading.Thread(target=lambda: isa_result.append(warm_cpu_isa(manifest["isa_dir"])),
                                   name="torch-compile-speed-isa-probe", daemon=True)
            isa.start()
        except Exception:  # noqa: BLE001 - only an optimisation
            isa = None
    try:
        indexed += index_sources(manifest.get("files", []))
    except Exception as exc:  # noqa: BLE001 - only an optimisation
        log.info("compiler prewarm stopped early: %s", exc)
    for name in manifest.get("modules", []):  # in import order: what a cache hit needs comes
        # first, what only lowering a new graph needs comes later, so stopping early is cheap
        if _stop.is_set():
            break
        if name in sys.modules:
            continue
        try:
            __import__(name)
            imported += 1
        except BaseException:  # noqa: BLE001 - a module of another torch build: skip it
            pass
    if isa is not None:
        isa.join()
    return {"imported": imported, "indexed": indexed, "cpu_isa": bool(isa_result and isa_result[0]),
            "seconds": round(time.perf_counter() - start, 2)}


def warm_probes(device=None) -> float:
    """The pack's probes of what this torch can do (``torch_compat.features``: tiny compiles,
    about 1.5 s here) where this torch lets a thread that compiled end (``compile_threads``),
    then inductor's graph-pass set-up for ``device`` (``hooks.warm_inductor_passes``). Returns
    the seconds (never raises); sets ``_probed`` however it ends."""
    start = time.perf_counter()
    probed = False
    try:
        if compile_threads.after_a_thread_ends():  # (else this thread must not compile: it ends)
            torch_compat.features()
            probed = True
            if device is not None:
                hooks.warm_inductor_passes(device)
    except Exception as exc:  # noqa: BLE001 - only an optimisation: the first compile probes
        log.info("feature probes at start-up stopped early: %s", exc)
    finally:
        _probed.set()
    secs = time.perf_counter() - start
    if probed:
        log.info("probed this torch's compile features at start-up in %.1f s", secs)
    return secs


def warm_base() -> float:
    """Torch's compile entry, what any first compile in a new process pays before its own work:
    importing ``torch._inductor.compile_fx`` (0.7-1.3 s here), torch's hash of its sources,
    dynamo's index of the torch.nn sources most models run through, and the imports of a first
    C++ build and a first sympy simplification (0.13 s; a compile cannot pause in an import).
    It compiles nothing, so it may run beside a prompt. Returns the seconds."""
    start = time.perf_counter()
    try:
        import torch._inductor.compile_fx  # noqa: F401
        from torch._inductor.codecache import torch_key
        torch_key()  # torch's hash of its own sources (every inductor cache key has it)
        nn = torch.nn.modules
        index_sources([m.__file__ for m in (nn.module, torch.nn.functional, nn.linear, nn.normalization, nn.conv)])
        import sympy  # last: a missing setuptools must not cost the rest
        import torch.utils.cpp_extension  # noqa: F401
        sympy.simplify(sympy.Symbol("x") + 1)
    except Exception as exc:  # noqa: BLE001 - only an optimisation: the compile does it itself
        log.info("compiler prewarm stopped early: %s", exc)
    return time.perf_counter() - start


def index_sources(paths: list[str]) -> int:
    """Dynamo's index of each source file (``funcname_cache``: it tokenizes whole files, and
    runs nothing) not indexed yet; stops when a compile starts. Returns how many it indexed.
    Done by a compile's first trace otherwise, in one stretch without a pause point."""
    from torch._dynamo import funcname_cache
    indexed = 0
    for path in paths:
        if _stop.is_set():
            break
        if path not in funcname_cache.cache and os.path.isfile(path):
            funcname_cache.get_funcname(path, 0)
            indexed += 1
    return indexed


def probes_done(timeout: float) -> bool:
    """Wait, at most ``timeout`` s, until the warm-up thread's feature probes are over (at
    once where no warm-up runs). False: they still run."""
    t = _thread
    if t is None or t is threading.current_thread():
        return True
    return _probed.wait(timeout)


def freeze_start_up_objects(quiet: Callable[[], bool]) -> bool:
    """Collect once, then freeze every object alive now (``gc.freeze``), if ``quiet()``: the host
    holds nothing that may become garbage later (no model loaded). True when it froze."""
    if not quiet():
        log.info("start-up objects not frozen: a model was already loaded")
        return False
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info("froze %d start-up objects (the compiler's modules among them) in %.2f s: the "
             "garbage collection after a prompt no longer walks them", gc.get_freeze_count(),
             time.perf_counter() - start)
    return True


def start(root: Path | None, shared: Callable[[], dict | None] | None = None,
          quiet: Callable[[], bool] | None = None, device=None) -> bool:
    """Start the background warm-up (once per process) if enabled: ``warm_probes``, ``warm_base``,
    the start-up objects frozen if ``quiet`` says so, then the manifest if this server has
    compiled before, or (a new fleet worker) the one another worker published, from ``shared``
    (which may also prefetch its entries here, one as ``isa_dir``); ``device``: models' device."""
    global _thread
    if not enabled():
        return False
    root = Path(root) if root is not None else None
    local = read_manifest(root) if root is not None else {}

    def run():
        probes = warm_probes(device)  # first: prompts posted meanwhile wait for them (probes_done)
        manifest = local
        if not manifest and shared is not None and root is not None:
            manifest = clean(shared())  # store I/O (bounded timeout) stays off the start-up path
            if manifest:
                record(root, manifest["modules"], manifest["files"], manifest["isa_dir"])
        base = probes + warm_base()
        if quiet is not None:
            freeze_start_up_objects(quiet)
        if not manifest:
            log.info("warmed torch's compile entry and this torch's feature probes in the "
                     "background in %.1f s", base)
            return
        if manifest.get("isa_dir") and not Path(manifest["isa_dir"]).resolve().is_relative_to(
                root.resolve()):
            manifest["isa_dir"] = None  # only ever a dir of this cache
        report = warm(manifest)
        log.info("warmed torch's compiler stack in the background in %.1f s (%d modules, "
                 "%d source files%s)", report["seconds"], report["imported"], report["indexed"],
                 "" if local else ", manifest from the shared cache")

    with _lock:
        if _thread is not None:
            return False
        _thread = threading.Thread(target=run, name="torch-compile-speed-prewarm", daemon=True)
        _thread.start()
    return True


def wait(finish: bool = False) -> None:
    """Called before a compile: stop a running warm-up at its next module (unless ``finish``)
    and wait for it, so that its imports and its ISA probe never race the compile. What is
    left is mostly what only a cache miss needs; the compile imports that itself."""
    t = _thread
    if t is not None and t.is_alive() and t is not threading.current_thread():
        if not finish:
            _stop.set()
        t.join(WAIT_LIMIT)
        if t.is_alive():  # one module's import hangs (a broken package, a lock): go on
            log.warn_once("prewarm-stuck", "the start-up warm-up thread did not stop within %d s "
                          "(an import of it hangs); compiling without waiting for it", WAIT_LIMIT)


WAIT_LIMIT = 300  # s: the longest a compile waits for the warm-up thread to stop
