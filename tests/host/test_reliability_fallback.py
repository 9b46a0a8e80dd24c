"""On a real ComfyUI server: compile never breaks a workflow and leaks nothing.

- Real faults fall back to eager with the same output and one clear warning: a broken C++
  compiler (caught by preflight), a backend that fails while compiling (caught at run time),
  a backend whose package fails to import inside ``torch.compile()`` (caught at wrap time).
- The server's global torch state (dynamo/inductor/fx config, the pack's env vars, TF32 and
  matmul precision, the whole environment) is the same before and after compiled runs.
- A damaged persistent cache is found, discarded and rebuilt after a restart.

Test-only pieces live in ``tcs_test_nodes``: the two failing backends are registered when
that module is imported, so they appear in the settings node's backend choices.
"""
import json
import os
import re
import time

import pytest
import torch

from harness import ComfyHost, counters_delta, new_graphs, pack_lines, rel_l2, wan_t2v_prompt

RAISING = "tcs_test_raising_backend"
UNLOADABLE = "tcs_test_unloadable_backend"
INDUCTOR = {"backend": "inductor", "mode": "default"}


def write_failing_compiler(path):
    path.write_text("#!/bin/sh\necho 'tcs test: this compiler is broken' >&2\nexit 1\n")
    path.chmod(0o755)
    return path


# --------------------------------------------------------------------------- faults -> eager

@pytest.fixture(scope="module")
def broken_cxx_host(tmp_path_factory, tiny_wan_path):
    """A server whose CXX and CC are a script that exits 1 (as with a broken toolchain)."""
    d = tmp_path_factory.mktemp("broken_cxx")
    script = write_failing_compiler(d / "broken-g++")
    host = ComfyHost(d / "server", models=[tiny_wan_path], env={"CXX": str(script), "CC": str(script)})
    with host:
        yield host


def test_broken_cpp_compiler_runs_eagerly_with_one_clear_warning(broken_cxx_host, tiny_wan):
    host = broken_cxx_host
    eager_hist = host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="eager"))
    eager, before = host.latent(eager_hist), host.probe(eager_hist)
    offset = host.log_offset()
    # the second run re-executes the Apply node (a setting outside the fingerprint changed)
    for i, limit in enumerate((128, 127)):
        hist = host.run(wan_t2v_prompt(
            tiny_wan, compile_settings={**INDUCTOR, "dynamo_recompile_limit": limit}, prefix=f"cxx{i}"))
        assert torch.equal(host.latent(hist), eager)
        probe = host.probe(hist)
        assert "torch_compile_speed" not in probe["apply_model_wrapper_keys"]  # the input model, eager
        assert new_graphs(counters_delta(before["counters"], probe["counters"])) == 0
    log = host.log_text(since=offset)
    warnings = pack_lines(log, "preflight:")
    assert len(warnings) == 1, log
    assert "C++ compiler" in warnings[0] and "g++" in warnings[0] and "CXX" in warnings[0], warnings
    assert "eager" in warnings[0]
    assert not pack_lines(log, "torch.compile failed") and not pack_lines(log, "will compile")


def test_broken_cpp_compiler_does_not_stop_other_backends(broken_cxx_host, tiny_wan):
    """Preflight is per backend: aot_eager needs no C++ compiler and still compiles."""
    host = broken_cxx_host
    eager_hist = host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="eager2"))
    hist = host.run(wan_t2v_prompt(tiny_wan, compile_settings={"backend": "aot_eager"}, prefix="aot"))
    assert new_graphs(counters_delta(host.probe(eager_hist)["counters"], host.probe(hist)["counters"])) >= 1
    assert rel_l2(host.latent(hist), host.latent(eager_hist)) < 1e-6


def test_test_backends_are_offered_by_the_settings_node(comfy_host):
    choices = comfy_host.object_info("TorchCompileSpeedSettings")["input"]["required"]["backend"][0]
    assert RAISING in choices and UNLOADABLE in choices


def test_backend_failing_while_compiling_falls_back_eagerly_once(comfy_host, tiny_wan):
    host = comfy_host
    eager_hist = host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="eager_rb"))
    eager = host.latent(eager_hist)
    offset = host.log_offset()
    hist = host.run(wan_t2v_prompt(tiny_wan, compile_settings={"backend": RAISING}, prefix="rb0"))
    assert torch.equal(host.latent(hist), eager)
    log = host.log_text(since=offset)
    warnings = pack_lines(log, "eagerly")
    assert len(warnings) == 1, log
    assert "boom" in warnings[0] and RAISING in warnings[0] and "fix:" in warnings[0], warnings
    # a later run with the Apply node cached (same inputs): no retry, no new warning, same output
    probe = host.probe(hist)
    offset = host.log_offset()
    hist = host.run(wan_t2v_prompt(tiny_wan, compile_settings={"backend": RAISING}, prefix="rb1"))
    assert torch.equal(host.latent(hist), eager)
    delta = counters_delta(probe["counters"], host.probe(hist)["counters"])
    assert new_graphs(delta) == 0 and delta.get("stats", {}).get("calls_captured", 0) == 0, delta
    log = host.log_text(since=offset)
    assert not pack_lines(log, "eagerly") and not pack_lines(log, "failed"), log
    # the Apply node run again (another input): it retries once (a failure may be transient),
    # fails the same way here, says so once, and the output is still eager's
    offset = host.log_offset()
    hist = host.run(wan_t2v_prompt(tiny_wan, compile_settings={"backend": RAISING,
                                                               "dynamo_recompile_limit": 100},
                                   prefix="rb2"))
    assert torch.equal(host.latent(hist), eager)
    warnings = pack_lines(host.log_text(since=offset), "eagerly")
    assert len(warnings) == 1 and "boom" in warnings[0], warnings


def test_backend_failing_inside_torch_compile_leaves_the_model_eager(comfy_host, tiny_wan):
    """Wrap-time failure: ``torch.compile(backend=...)`` itself raises (a third-party backend
    whose package is broken), before anything runs."""
    host = comfy_host
    eager = host.latent(host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="eager_ub")))
    offset = host.log_offset()
    hist = host.run(wan_t2v_prompt(tiny_wan, compile_settings={"backend": UNLOADABLE}, prefix="ub"))
    assert torch.equal(host.latent(hist), eager)
    assert "torch_compile_speed" not in host.probe(hist)["apply_model_wrapper_keys"]
    warnings = pack_lines(host.log_text(since=offset), "could not be set up")
    assert len(warnings) == 1, host.log_text(since=offset)
    assert UNLOADABLE in warnings[0] and "ImportError" in warnings[0] and "eager" in warnings[0]
    assert "fix:" in warnings[0]
    # the server keeps serving compiled work
    hist = host.run(wan_t2v_prompt(tiny_wan, compile_settings={"backend": "aot_eager"}, prefix="ub_after"))
    assert rel_l2(host.latent(hist), eager) < 1e-6


# --------------------------------------------------------------------------- leaks nothing

def state_diff(a, b) -> dict:
    """{section: {key: (a, b)}} for every value that differs."""
    out = {}
    for section in set(a) | set(b):
        va, vb = a.get(section), b.get(section)
        if isinstance(va, dict) and isinstance(vb, dict):
            d = {k: (va.get(k), vb.get(k)) for k in set(va) | set(vb) if va.get(k) != vb.get(k)}
            if d:
                out[section] = d
        elif va != vb:
            out[section] = (va, vb)
    return out


def with_snapshots(prompt):
    """Snapshot nodes before the sampler (its latent comes through them) and after it."""
    prompt["snap_before"] = {"class_type": "TCSTestStateSnapshot",
                             "inputs": {"samples": ["latent", 0], "label": "before"}}
    prompt["sampler"]["inputs"]["latent_image"] = ["snap_before", 0]
    prompt["snap_after"] = {"class_type": "TCSTestStateSnapshot",
                            "inputs": {"samples": ["sampler", 0], "label": "after"}}
    return prompt


class Holder:
    """A module-scoped server that a test may replace (restart on the same base dir)."""
    host: ComfyHost


@pytest.fixture(scope="module")
def inductor_server(tmp_path_factory, tiny_wan_path):
    """A fresh server (nothing compiled yet) with its own persistent cache, and its global
    state digest taken by an eager prompt before any compile."""
    holder = Holder()
    holder.base = tmp_path_factory.mktemp("inductor_server") / "server"
    holder.host = ComfyHost(holder.base, models=[tiny_wan_path]).start()
    hist = holder.host.run(with_snapshots(wan_t2v_prompt(tiny_wan_path.name, apply=False, prefix="e")))
    holder.baseline = holder.host.state(hist, "snap_before")
    holder.eager = holder.host.latent(hist)
    assert holder.host.state(hist, "snap_after") == holder.baseline
    yield holder
    holder.host.stop()


def test_torch_imports_set_the_inductor_cache_dir_before_any_compile(inductor_server):
    """What the server's environment holds before the pack ever runs: ``import torch._dynamo``
    (torch 2.13) already writes TORCHINDUCTOR_CACHE_DIR into os.environ. Our runs set it to the
    persistent cache dir only inside their scope and restore this value afterwards."""
    env = inductor_server.baseline["env"]
    assert env["TORCHINDUCTOR_CACHE_DIR"] and "torch_compile_speed" not in env["TORCHINDUCTOR_CACHE_DIR"]
    assert env["TRITON_CACHE_DIR"] is None


LEAK_CASES = {
    "aot_eager": {"backend": "aot_eager"},
    "inductor": INDUCTOR,
    # speed preset: inductor, mode default, dynamic. experimental_ptx + fast math: TRITON_CACHE_DIR and
    # use_fast_math on a GPU; here its CPU skip path runs.
    "speed+ptx": {"mode": "speed", "experimental_ptx": True, "ptx_fast_math": True, "warmup_runs": 2,
                  "ptx_cache_dir": "tcs_ptx_leak_test"},
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c != "aot_eager" else [])
                                  for c in LEAK_CASES])
def test_compiled_runs_leak_no_global_state(inductor_server, tiny_wan, case):
    host = inductor_server.host
    probes = [host.probe(host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix=f"leak_e{case}")))]
    for i in range(2):  # the compiling run, then a steady run
        hist = host.run(with_snapshots(wan_t2v_prompt(tiny_wan, compile_settings=LEAK_CASES[case],
                                                      prefix=f"leak_{case}{i}")))
        before, after = host.state(hist, "snap_before"), host.state(hist, "snap_after")
        assert state_diff(inductor_server.baseline, before) == {}, "changed before the sampler"
        assert state_diff(before, after) == {}, f"{case} run {i} leaked global state"
        assert rel_l2(host.latent(hist), inductor_server.eager) < 1e-3
        probes.append(host.probe(hist))
    # the compile really happened inside the first window (this fresh server had not compiled
    # this fingerprint yet), and the model that ran was the compiled clone
    assert new_graphs(counters_delta(probes[0]["counters"], probes[1]["counters"])) >= 1
    assert probes[-1]["apply_model_wrapper_keys"] == ["torch_compile_speed"]


# --------------------------------------------------------------------------- damaged cache

def _garble(entry):
    """Every file of the entry replaced with garbage (as after a disk error or a copy cut
    short), left there long enough ago that no process can still be writing it."""
    old = time.time() - 3600
    files = [p for p in entry.rglob("*") if p.is_file()]
    for p in files:
        p.write_bytes(os.urandom(max(16, min(p.stat().st_size, 4096)) if p.stat().st_size else 16))
        os.utime(p, (old, old))
    return files


def _kernel_sources(entry):
    """The compiled graphs' C++ sources (``<hash>.main.cpp``); not the CPU ISA probe's sources,
    which land in whichever cache dir the process probed in first."""
    return sorted(p.name for p in (entry / "inductor").rglob("*.main.cpp"))


@pytest.mark.slow
def test_damaged_persistent_cache_is_rebuilt_after_a_restart(inductor_server, tiny_wan_path):
    holder = inductor_server
    host = holder.host
    settings = {**INDUCTOR, "dynamo_recompile_limit": 127}  # outside the fingerprint: re-applies
    offset = host.log_offset()
    hist = host.run(wan_t2v_prompt(tiny_wan_path.name, compile_settings=settings, prefix="fill"))
    assert rel_l2(host.latent(hist), holder.eager) < 1e-3
    fp = re.search(r"fingerprint ([0-9a-f]{12})", host.log_text(since=offset)).group(1)
    root = holder.base / "user" / "torch_compile_speed" / "cache"
    entry = next(p for p in root.iterdir() if p.name.startswith(fp))
    assert json.loads((entry / "meta.json").read_text())["fingerprint"].startswith(entry.name)
    good = _kernel_sources(entry)
    assert good
    host.stop()

    garbled = _garble(entry)  # a restart finds every file of it garbage
    assert any(f.suffix == ".so" for f in garbled) and any(f.name == "meta.json" for f in garbled)

    holder.host = host = ComfyHost(holder.base, models=[tiny_wan_path]).start()
    eager_hist = host.run(wan_t2v_prompt(tiny_wan_path.name, apply=False, prefix="e2"))
    assert torch.equal(host.latent(eager_hist), holder.eager)
    offset = host.log_offset()
    hist = host.run(wan_t2v_prompt(tiny_wan_path.name, compile_settings=settings, prefix="after"))
    log = host.log_text(since=offset)
    assert rel_l2(host.latent(hist), holder.eager) < 1e-3
    assert new_graphs(counters_delta(host.probe(eager_hist)["counters"], host.probe(hist)["counters"])) >= 1
    assert not pack_lines(log, "torch.compile failed"), log  # compiled, not an eager fallback
    damaged = pack_lines(log, "was damaged")
    assert len(damaged) == 1 and "discarded" in damaged[0] and entry.name in damaged[0], log
    assert "persistent cache miss" in log
    # the rebuilt entry is whole and holds the same kernels as the first one: a damaged CPU
    # feature probe would have turned vectorisation off (other kernel sources, silently slow)
    assert json.loads((entry / "meta.json").read_text())["fingerprint"].startswith(entry.name)
    assert _kernel_sources(entry) == good
