"""Real-ComfyUI test harness: a tiny WAN model, a ComfyUI server process, workflow builders.

No pytest here; ``conftest.py`` wraps it in fixtures. The server is a ComfyUI copy made by
``scripts/bootstrap.sh``, run on CPU with this pack and the test-only node pack
``tcs_test_nodes`` symlinked into its ``custom_nodes``.

Which ComfyUI: ``TCS_COMFY_HOST`` names a host that bootstrap made (``0.33.0``, the default,
or ``0.3.75``: ``.host/comfyui-<name>``) or any ComfyUI folder. A ``tcs_host.json`` in that
folder may give its ``version`` and a ``front_end_root`` (0.3.75 runs its own frontend).
"""
from __future__ import annotations

import ctypes
import itertools
import json
import os
import signal
import socket
import shutil
import subprocess
import sys
import time
import tempfile
import uuid
import weakref
from pathlib import Path

import requests

REPO_ROOT = Path(__file__).resolve().parents[2]
HOST_ENV = "TCS_COMFY_HOST"
DEFAULT_HOST = "0.33.0"


def resolve_host(name: str | None = None) -> Path:
    """The ComfyUI folder for a host name (``0.33.0``, ``0.3.75``) or a folder path."""
    name = name or os.environ.get(HOST_ENV, "").strip() or DEFAULT_HOST
    path = Path(name).expanduser()
    if not path.is_dir():
        path = REPO_ROOT / ".host" / f"comfyui-{name}"
    return path.resolve()


def host_config(comfy_dir: Path) -> dict:
    """``tcs_host.json`` of a host folder (written by bootstrap), with ``version`` always set."""
    try:
        cfg = json.loads((comfy_dir / "tcs_host.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    if "version" not in cfg:
        try:
            text = (comfy_dir / "comfyui_version.py").read_text()
            cfg["version"] = text.split('"')[1]
        except (OSError, IndexError):
            cfg["version"] = comfy_dir.name
    return cfg


COMFY_DIR = resolve_host()
HOST_CONFIG = host_config(COMFY_DIR)
HOST_VERSION = HOST_CONFIG["version"]
# models are built with the host's own classes, so each host gets its own copies
MODEL_CACHE = REPO_ROOT / ".host" / "models" / HOST_VERSION
TEST_NODES_DIR = Path(__file__).resolve().parent / "tcs_test_nodes"
PACK_NAME = "TorchCompileSpeed"
_VENV_PY = REPO_ROOT / ".venv" / "bin" / "python"


def host_env(**extra: str) -> dict:
    """The environment of a process that imports the host's ComfyUI: ``os.environ`` with the
    host's own package folder first on ``PYTHONPATH`` where it has one (the overlay host's
    newer comfy-aimdo and comfy-kitchen, ``tcs_host.json`` ``pythonpath``), and ``extra``."""
    env = {**os.environ, **extra}
    paths = [HOST_CONFIG.get("pythonpath"), env.get("PYTHONPATH")]
    if HOST_CONFIG.get("pythonpath"):
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def _server_python() -> str:
    """The python that runs the ComfyUI server (and the tiny-model generator): the one running
    this code when that is a venv (``.venv`` or a torch-matrix venv ``.venv-torch/<version>``,
    so the host runs on the same torch as the tests), else ``.venv``'s. ``TCS_PYTHON`` overrides."""
    if os.environ.get("TCS_PYTHON"):
        return os.environ["TCS_PYTHON"]
    if sys.prefix != sys.base_prefix or not _VENV_PY.exists():
        return sys.executable
    return str(_VENV_PY)


PYTHON = _server_python()


# --------------------------------------------------------------------------- tiny WAN model

def tiny_wan_name(num_layers=2, dim=256, seed=0) -> str:
    return f"tcs_tiny_wan_l{num_layers}_d{dim}_s{seed}.safetensors"


def make_tiny_wan(path=None, num_layers=2, dim=256, seed=0) -> Path:
    """Return a tiny WAN 2.1 T2V checkpoint, generated once into ``.host/models/``.

    With ``path`` the cached file is also symlinked there (``path`` is returned then).
    """
    if dim % 128:
        raise ValueError("ComfyUI detects num_heads = dim // 128, so dim must be a multiple of 128")
    cached = MODEL_CACHE / tiny_wan_name(num_layers, dim, seed)
    if not cached.exists():
        MODEL_CACHE.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        cmd = [PYTHON, str(Path(__file__).resolve()), "make-tiny-wan", str(tmp),
               str(num_layers), str(dim), str(seed)]
        proc = subprocess.run(cmd, cwd=COMFY_DIR, capture_output=True, text=True, timeout=600,
                              env=host_env(OMP_NUM_THREADS="1"))
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"tiny WAN generation failed:\n{proc.stdout}\n{proc.stderr}")
        os.replace(tmp, cached)
    if path is None:
        return cached
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.exists():
        path.unlink()
    path.symlink_to(cached)
    return path


def _make_tiny_wan_main(out, num_layers, dim, seed):
    """Subprocess body: build ComfyUI's WanModel, randomise every parameter, save, self-check."""
    sys.path.insert(0, str(COMFY_DIR))
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options
    comfy.options.enable_args_parsing()
    import torch
    import comfy.ops
    import comfy.model_detection
    from comfy.ldm.wan.model import WanModel
    import safetensors.torch

    torch.manual_seed(seed)
    model = WanModel(model_type="t2v", dim=dim, ffn_dim=2 * dim, num_layers=num_layers,
                     num_heads=dim // 128, in_dim=16, out_dim=16, text_dim=4096,
                     operations=comfy.ops.disable_weight_init)
    # disable_weight_init leaves torch.empty() memory everywhere, and the real init zeroes the
    # head: randomise all of it. Weights ~ 1/sqrt(fan_in) keep activations O(1) through the
    # residual stream; gates (modulation) are O(0.3) so every block visibly changes the output.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("modulation"):
                p.normal_(0.0, 0.3)
            elif p.ndim >= 2:
                p.normal_(0.0, 1.0 / (p[0].numel() ** 0.5))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.02)
            else:  # norm scales
                p.normal_(1.0, 0.1)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    cfg = comfy.model_detection.detect_unet_config(sd, "")
    assert cfg.get("image_model") == "wan2.1" and cfg["dim"] == dim and cfg["num_layers"] == num_layers, cfg
    with torch.no_grad():  # sanity: one forward on a [1,16,2,16,16] latent is finite and O(1)
        y = model(torch.randn(1, 16, 2, 16, 16), torch.tensor([500.0]), torch.zeros(1, 8, 4096))
    assert torch.isfinite(y).all() and 0.05 < y.std().item() < 20, y.std()
    safetensors.torch.save_file(sd, out)
    print(f"saved {out}: {len(sd)} tensors, forward std {y.std().item():.3f}")


def tiny_wan_lora_name(num_layers=2, dim=256, rank=4, seed=0) -> str:
    return f"tcs_tiny_wan_lora_l{num_layers}_d{dim}_r{rank}_s{seed}.safetensors"


def make_tiny_wan_lora(num_layers=2, dim=256, rank=4, seed=0) -> Path:
    """A LoRA for ``make_tiny_wan(num_layers, dim)`` in ComfyUI's generic LoRA format
    (``diffusion_model.<module>.lora_up.weight`` / ``.lora_down.weight`` / ``.alpha``) on every
    block's attention projections and FFN, generated once into ``.host/models/``. Its deltas are
    about 10 % of the weights, so strength visibly changes the output."""
    import torch
    import safetensors.torch

    cached = MODEL_CACHE / tiny_wan_lora_name(num_layers, dim, rank, seed)
    if cached.exists():
        return cached
    g = torch.Generator().manual_seed(1000 + seed)
    shapes = {}
    for i in range(num_layers):
        for attn in ("self_attn", "cross_attn"):
            for proj in ("q", "k", "v", "o"):
                shapes[f"blocks.{i}.{attn}.{proj}"] = (dim, dim)
        shapes[f"blocks.{i}.ffn.0"] = (2 * dim, dim)
        shapes[f"blocks.{i}.ffn.2"] = (dim, 2 * dim)
    sd = {}
    for name, (out_f, in_f) in shapes.items():
        key = f"diffusion_model.{name}"
        sd[f"{key}.lora_up.weight"] = torch.randn(out_f, rank, generator=g) * 0.08
        sd[f"{key}.lora_down.weight"] = torch.randn(rank, in_f, generator=g) * 0.08
        sd[f"{key}.alpha"] = torch.tensor(float(rank))
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".tmp{os.getpid()}")
    safetensors.torch.save_file(sd, str(tmp))
    os.replace(tmp, cached)
    return cached


PACK_LOG_PREFIX = "[TorchCompileSpeed]"


def pack_lines(log_text, *needles) -> list[str]:
    """The pack's log lines that contain every one of ``needles``."""
    return [ln for ln in log_text.splitlines()
            if PACK_LOG_PREFIX in ln and all(n in ln for n in needles)]


# The pack's lines when a model falls back to eager for good (a compile failure, a failed entry),
# unlike a call that runs eagerly beside a background compile.
FALLBACK = ("now runs eagerly", "keeps running eagerly", "stays eager")


# a background compile was queued (of the first input)
BACKGROUND_QUEUED = ("in the background; the model runs eagerly until it is ready",)
BACKGROUND_DONE = "background compile of "  # "... finished in N s" (the worker is done)


def fallback_lines(log_text) -> list[str]:
    """The pack's log lines that say a model fell back to eager (``FALLBACK``)."""
    return [ln for n in FALLBACK for ln in pack_lines(log_text, n)]


# --------------------------------------------------------------------------- server process

class PromptError(RuntimeError):
    """A prompt was rejected by /prompt or failed while executing."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_group(proc, grace=10.0):
    """SIGTERM the server's process group, then SIGKILL it (also reaps inductor compile workers)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass


def die_with_parent():
    """In the child before exec: SIGKILL it when the test process dies (Linux prctl)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _empty_dirs(base: Path, names) -> dict[str, str]:
    """``{name: a new empty folder under base}``: a new one every call."""
    out = {}
    base.parent.mkdir(parents=True, exist_ok=True)
    for name in names:
        out[name] = tempfile.mkdtemp(prefix=f"{name.lower()}-", dir=base.parent)
    return out


# ComfyUI's API nodes (its paid cloud-service nodes) load at every start: a server as users
# start it (benchmarks, the demo). The test suites turn them off (their conftest): no test uses
# them, and each start is ~2 s shorter.
API_NODES = True


class ComfyHost:
    """One ComfyUI server (``main.py --cpu`` unless told) under ``base_dir``; always killed at exit."""

    def __init__(self, base_dir, *, models=(), cross_attention=True, extra_args=(), env=None,
                 port=None, omp_threads=1, with_pack=True, with_test_nodes=True, new_container=False,
                 cpu=True, comfy_dir=None):
        """``new_container``: TMPDIR and HOME are new empty folders, as in a freshly started
        container that kept only ComfyUI's folder (torch's default caches live under them).
        ``cpu=False``: ComfyUI picks its device itself (``tests/gpu``, on a GPU).
        ``comfy_dir``: another ComfyUI folder than the host's (``host_copy``)."""
        self.comfy_dir = Path(comfy_dir or COMFY_DIR)
        self.base_dir = Path(base_dir)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.client_id = uuid.uuid4().hex
        self.log_path = self.base_dir / "comfyui.log"
        self.proc = None
        self._finalizer = None
        self.args = [PYTHON, "main.py", *(["--cpu"] if cpu else []),
                     "--listen", "127.0.0.1", "--port", str(self.port),
                     "--base-directory", str(self.base_dir),
                     "--database-url", f"sqlite:///{self.base_dir}/user/comfyui.db",
                     "--disable-auto-launch"]
        if not API_NODES:
            self.args.append("--disable-api-nodes")
        if cross_attention:
            self.args.append("--use-pytorch-cross-attention")
        if HOST_CONFIG.get("front_end_root"):
            self.args += ["--front-end-root", HOST_CONFIG["front_end_root"]]
        self.args += list(extra_args)
        self.env = host_env(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(omp_threads))
        if omp_threads is None:  # torch's own choice (one thread per core), as a user's server
            del self.env["OMP_NUM_THREADS"]
        self.env.update(env or {})
        if new_container:
            self.env.update(_empty_dirs(self.base_dir, ("TMPDIR", "HOME")))
        for sub in ("custom_nodes", "models/diffusion_models", "input", "output", "user", "temp"):
            (self.base_dir / sub).mkdir(parents=True, exist_ok=True)
        if with_pack:
            self._link(REPO_ROOT, self.base_dir / "custom_nodes" / PACK_NAME)
        if with_test_nodes:
            self._link(TEST_NODES_DIR, self.base_dir / "custom_nodes" / "tcs_test_nodes")
        for m in models:
            self.add_model(m)

    @staticmethod
    def _link(target, link):
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target, target_is_directory=Path(target).is_dir())

    def add_model(self, path) -> str:
        """Link a model file into ``models/diffusion_models``; returns its UNETLoader name."""
        path = Path(path).resolve()
        self._link(path, self.base_dir / "models" / "diffusion_models" / path.name)
        return path.name

    def add_lora(self, path) -> str:
        """Link a LoRA file into ``models/loras``; returns its LoraLoaderModelOnly name."""
        path = Path(path).resolve()
        (self.base_dir / "models" / "loras").mkdir(parents=True, exist_ok=True)
        self._link(path, self.base_dir / "models" / "loras" / path.name)
        return path.name

    # -- lifecycle
    def start(self, timeout=120.0):
        if self.proc is not None:
            raise RuntimeError("already started")
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.args, cwd=self.comfy_dir, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=die_with_parent)
        finally:
            log.close()
        # weakref.finalize also runs at interpreter exit; PDEATHSIG covers a killed test runner.
        self._finalizer = weakref.finalize(self, kill_group, self.proc)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/system_stats", timeout=2).ok:
                    return self
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"ComfyUI not up after {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.25)

    def stop(self):
        if self._finalizer is not None:
            self._finalizer()  # runs kill_group once; later calls are no-ops

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- log
    def log_offset(self) -> int:
        """Current log size: pass to ``log_text(since=...)`` to read only what came after."""
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def wait_for_pack_line(self, needle, since=0, timeout=600.0) -> list[str]:
        """The pack's log lines since ``since`` that contain ``needle``, once there is one."""
        deadline = time.monotonic() + timeout
        while True:
            found = pack_lines(self.log_text(since=since), needle)
            if found:
                return found
            if time.monotonic() > deadline or not self.alive():
                raise TimeoutError(f"no pack line with {needle!r} after {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.1)

    def run_compiled(self, make_prompt, timeout=600.0) -> tuple[dict, str]:
        """``(history, log)`` of a prompt that ran on compiled graphs. With background compile
        (the node's defaults) the first prompt runs eagerly and queues the compile; then the
        compile is waited for (on the CPU it runs once the server is idle) and the prompt runs
        again. ``make_prompt()`` gives a fresh prompt each time; ``log`` covers both runs."""
        offset = self.log_offset()
        hist = self.run(make_prompt(), timeout=timeout)
        if any(pack_lines(self.log_text(since=offset), needle) for needle in BACKGROUND_QUEUED):
            self.wait_for_pack_line(BACKGROUND_DONE, since=offset, timeout=timeout)
            hist = self.run(make_prompt(), timeout=timeout)
        return hist, self.log_text(since=offset)

    def log_text(self, since=0) -> str:
        if not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(since)
            return f.read().decode("utf-8", "replace")

    def log_tail(self, chars=6000) -> str:
        return self.log_text()[-chars:]

    # -- HTTP API
    def get(self, route, **kw):
        r = requests.get(self.url + route, timeout=kw.pop("timeout", 30), **kw)
        r.raise_for_status()
        return r.json()

    def object_info(self, node_class=None) -> dict:
        """All node definitions, or one node's definition (KeyError if not registered)."""
        if node_class is None:
            return self.get("/object_info")
        return self.get(f"/object_info/{node_class}")[node_class]

    def post_prompt_raw(self, prompt):
        """POST /prompt without checks: ``(status_code, json)``."""
        r = requests.post(self.url + "/prompt", json={"prompt": prompt, "client_id": self.client_id},
                          timeout=60)
        try:
            body = r.json()
        except ValueError:
            body = {"text": r.text}
        return r.status_code, body

    def queue(self, prompt) -> str:
        code, body = self.post_prompt_raw(prompt)
        if code != 200:
            raise PromptError(f"/prompt returned {code}:\n{json.dumps(body, indent=1)}")
        return body["prompt_id"]

    def wait(self, prompt_id, timeout=600.0) -> dict:
        """Poll /history until the prompt is done; return its history entry or raise."""
        deadline = time.monotonic() + timeout
        while True:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None:
                break
            if not self.alive():
                raise RuntimeError(f"ComfyUI died while running {prompt_id}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                requests.post(self.url + "/interrupt", json={"prompt_id": prompt_id}, timeout=10)
                raise TimeoutError(f"prompt {prompt_id} not done after {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.02)
        status = entry["status"]
        if status.get("status_str") != "success":
            errors = [m for m in status.get("messages", []) if m[0] in ("execution_error",
                                                                       "execution_interrupted")]
            detail = json.dumps(errors or status, indent=1)
            raise PromptError(f"prompt {prompt_id} failed: {detail}")
        return entry

    def run(self, prompt, timeout=600.0) -> dict:
        return self.wait(self.queue(prompt), timeout)

    def free(self, unload_models=True, free_memory=False):
        """POST /free (ComfyUI applies it after its next queue poll, not at once)."""
        requests.post(self.url + "/free", json={"unload_models": unload_models,
                                                "free_memory": free_memory}, timeout=10).raise_for_status()

    # -- results
    @staticmethod
    def outputs(history, node_id) -> dict:
        """The ui output dict of one node in a history entry."""
        return history["outputs"][str(node_id)]

    def load_latent(self, filename, subfolder=""):
        """Read a SaveLatent ``.latent`` file (safetensors, key ``latent_tensor``) from output/."""
        import safetensors.torch
        return safetensors.torch.load_file(str(self.base_dir / "output" / subfolder / filename))["latent_tensor"]

    def latent(self, history, node_id="save"):
        """The tensor saved by the SaveLatent node ``node_id`` in this history entry."""
        item = self.outputs(history, node_id)["latents"][0]
        return self.load_latent(item["filename"], item.get("subfolder", ""))

    def probe(self, history, node_id="probe") -> dict:
        """The report of a TCSTestProbe node."""
        return self.outputs(history, node_id)["probe"][0]

    def state(self, history, node_id) -> dict:
        """The global-state digest of a TCSTestStateSnapshot node."""
        return self.outputs(history, node_id)["state"][0]["state"]

    @staticmethod
    def execution_error(exc) -> dict:
        """The ``execution_error`` message data inside a ``PromptError`` from ``wait``/``run``."""
        text = str(exc)
        body = json.loads(text.split(" failed: ", 1)[1]) if " failed: " in text else None
        for item in body if isinstance(body, list) else []:
            if item[0] == "execution_error":
                return item[1]
        raise AssertionError(f"no execution_error in: {text}")


def host_copy(dest, relative: str) -> Path:
    """A copy of the host's ComfyUI folder at ``dest`` in which the file ``relative`` is a file
    of its own, for a test to change (what a ComfyUI update does to a model file). Folders off
    that file's path are links to the host's; files beside it are copies (a script's folder is
    its real path, so ``main.py`` must be a file here)."""
    dest = Path(dest)
    target = COMFY_DIR / relative
    on_path = {COMFY_DIR, *target.parents}
    for src in [COMFY_DIR, *(p for p in reversed(target.parents) if COMFY_DIR in p.parents)]:
        here = dest / src.relative_to(COMFY_DIR)
        here.mkdir(parents=True, exist_ok=True)
        for entry in src.iterdir():
            if entry in on_path or entry.name == "__pycache__":
                continue
            if entry.is_dir():
                (here / entry.name).symlink_to(entry, target_is_directory=True)
            else:
                shutil.copy2(entry, here / entry.name)
    return dest


def replace_in_file(path, old: str, new: str) -> None:
    path = Path(path)
    text = path.read_text()
    if old not in text:
        raise ValueError(f"{old!r} is not in {path}")
    path.write_text(text.replace(old, new, 1))


# --------------------------------------------------------------------------- workflows

SETTINGS_DEFAULTS = {
    "backend": "inductor",
    "fullgraph": False,
    "mode": "default",
    "dynamic": False,
    "dynamo_cache_size_limit": 64,
    "compile_transformer_blocks_only": True,
    "reuse_if_similar": True,
    "experimental_ptx": False,
    "ptx_fast_math": True,
    "warmup_runs": 1,
    "ptx_cache_dir": "",
    "dynamo_recompile_limit": 128,
    "force_parameter_static_shapes": False,
    "allow_unmerged_lora_compile": False,
    "shape_policy": "auto",
    "declared_shapes": "",
    "background_compile": False,
}

# What a user gets: the settings node left at its defaults (``speed``: inductor, which Apply
# compiles in mode default; background compile on). Tests that show a headline feature use this
# (test_foundation checks it against the node's own defaults). FOREGROUND: the same, compiling
# in the prompt's first step (a test of what a compile does, not of when).
NODE_DEFAULTS = {"mode": "speed", "background_compile": True}
FOREGROUND = {"mode": "speed", "background_compile": False}

_nonce = itertools.count(int(time.time() * 1000) % 1_000_000_000)


def settings_inputs(**overrides) -> dict:
    """Full TorchCompileSpeedSettings inputs (tests default to mode "default") with overrides."""
    unknown = set(overrides) - set(SETTINGS_DEFAULTS)
    if unknown:
        raise KeyError(f"unknown settings inputs: {sorted(unknown)}")
    return {**SETTINGS_DEFAULTS, **overrides}


def _sampler_branch(p, tag, model_ref, *, steps, seed, prefix, latent_ref=("latent", 0)):
    """KSampler -> SaveLatent -> TCSTestProbe, node ids ``sampler{tag}``, ``save{tag}``, ``probe{tag}``."""
    p[f"sampler{tag}"] = {"class_type": "KSampler", "inputs": {
        "model": model_ref, "seed": seed, "steps": steps, "cfg": 1.0, "sampler_name": "euler",
        "scheduler": "simple", "positive": ["cond", 0], "negative": ["cond", 0],
        "latent_image": list(latent_ref), "denoise": 1.0}}
    p[f"save{tag}"] = {"class_type": "SaveLatent", "inputs": {
        "samples": [f"sampler{tag}", 0], "filename_prefix": prefix}}
    p[f"probe{tag}"] = {"class_type": "TCSTestProbe", "inputs": {
        "samples": [f"sampler{tag}", 0], "label": prefix, "model": model_ref}}


def _base(model_name, *, width, height, length, nonce):
    """Loader, zero conditioning and empty latent. A fresh ``nonce`` makes samplers re-run
    (ComfyUI caches a KSampler whose inputs did not change); pass a fixed one to allow caching."""
    return {
        "loader": {"class_type": "UNETLoader", "inputs": {"unet_name": model_name, "weight_dtype": "default"}},
        "cond": {"class_type": "TCSTestZeroConditioning", "inputs": {
            "length": 8, "nonce": next(_nonce) if nonce is None else nonce}},
        "latent": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {
            "width": width, "height": height, "length": length, "batch_size": 1}},
    }


def _compile_nodes(p, compile_settings, tag=""):
    p[f"settings{tag}"] = {"class_type": "TorchCompileSpeedSettings",
                           "inputs": settings_inputs(**(compile_settings or {}))}
    p[f"apply{tag}"] = {"class_type": "ApplyTorchCompile", "inputs": {
        "model": ["loader", 0], "compile_args": [f"settings{tag}", 0]}}
    return [f"apply{tag}", 0]


def wan_t2v_prompt(model_name, *, compile_settings=None, apply=True, steps=4, width=128, height=128,
                   length=5, seed=0, prefix="out", extra_nodes=None, nonce=None) -> dict:
    """UNETLoader -> [Settings -> ApplyTorchCompile] -> KSampler -> SaveLatent + TCSTestProbe.

    Node ids: loader, cond, latent, [settings, apply], sampler, save, probe.
    ``extra_nodes`` (dict) is merged in last, so it can add or replace nodes.
    """
    p = _base(model_name, width=width, height=height, length=length, nonce=nonce)
    model_ref = _compile_nodes(p, compile_settings) if apply else ["loader", 0]
    _sampler_branch(p, "", model_ref, steps=steps, seed=seed, prefix=prefix)
    p.update(extra_nodes or {})
    return p


def wan_two_branch_prompt(model_name, *, compile_settings=None, steps=4, width=128, height=128,
                          length=5, seed=0, prefix_compiled="A", prefix_raw="B", extra_nodes=None,
                          nonce=None) -> dict:
    """One UNETLoader feeding a compiled branch (settingsA, applyA, samplerA, saveA, probeA) and a
    raw branch (samplerB, saveB, probeB) with the same seed and latent. ``afterA`` (a latent
    pass-through) makes samplerB run after samplerA, so a compile leaking into the shared model
    would show in branch B. Probes snapshot the process-wide dynamo counters when they run."""
    p = _base(model_name, width=width, height=height, length=length, nonce=nonce)
    compiled = _compile_nodes(p, compile_settings, "A")
    _sampler_branch(p, "A", compiled, steps=steps, seed=seed, prefix=prefix_compiled)
    p["afterA"] = {"class_type": "TCSTestLatentAfter", "inputs": {
        "samples": ["latent", 0], "after": ["samplerA", 0]}}
    _sampler_branch(p, "B", ["loader", 0], steps=steps, seed=seed, prefix=prefix_raw,
                    latent_ref=("afterA", 0))
    p.update(extra_nodes or {})
    return p


def add_diagnostics(prompt, *, tag="", node_id=None, measure_runs=3, auto_disable_if_slower=False,
                    rewire=True, latent_ref=("latent", 0)) -> str:
    """Insert a TorchCompileDiagnostics node after ``apply{tag}`` (default id ``diag{tag}``).

    With ``rewire`` the branch's sampler and probe take the Diagnostics node's model output, so
    it runs before sampling and its (possibly auto-disabled) model is what gets sampled.
    Returns the node id; its report is ``host.outputs(history, node_id)["text"][0]``."""
    node_id = node_id or f"diag{tag}"
    prompt[node_id] = {"class_type": "TorchCompileDiagnostics", "inputs": {
        "model": [f"apply{tag}", 0], "samples": list(latent_ref), "measure_runs": measure_runs,
        "auto_disable_if_slower": auto_disable_if_slower}}
    if rewire:
        for nid in (f"sampler{tag}", f"probe{tag}"):
            if nid in prompt:
                prompt[nid]["inputs"]["model"] = [node_id, 0]
    return node_id


def rel_l2(a, b) -> float:
    """Relative L2 distance of ``a`` from the reference ``b`` (compiled vs eager outputs)."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def new_graphs(delta) -> int:
    """Dynamo graphs compiled in a ``counters_delta`` (first compiles and recompiles)."""
    return delta.get("stats", {}).get("unique_graphs", 0)


def counters_delta(before, after) -> dict:
    """``after - before`` for two probe ``counters`` snapshots (zero entries dropped)."""
    out = {}
    for group, vals in after.items():
        diff = {k: v - before.get(group, {}).get(k, 0) for k, v in vals.items()}
        diff = {k: v for k, v in diff.items() if v}
        if diff:
            out[group] = diff
    return out


def wan_consumer_nodes(compile_args_ref, model_ref=("loader", 0), node_id="consumer") -> dict:
    """A TCSTestWanStyleConsumer node (merge into a prompt via ``extra_nodes``)."""
    return {node_id: {"class_type": "TCSTestWanStyleConsumer", "inputs": {
        "compile_args": list(compile_args_ref), "model": list(model_ref)}}}


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "make-tiny-wan":
    _make_tiny_wan_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
