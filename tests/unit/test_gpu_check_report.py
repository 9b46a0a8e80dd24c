"""The GPU check's report, from its stages' own outputs: the JSON keys a reader checks the targets
with, and the Markdown's account of the background compile, which must say when it had not
taken over by the time the benchmark stopped calling (a CPU dry run of the check found it
printed "from model call None" then)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check(import_benchmark):
    return import_benchmark("gpu_check")


JUNIT = """<testsuites><testsuite name="pytest" tests="3" failures="1" errors="0" skipped="1">
<testcase name="test_kernels"/><testcase name="test_ptx"><failure message="assert 0 == 1"/></testcase>
<testcase name="test_skipped"><skipped/></testcase></testsuite></testsuites>"""


def cold(first_s, steady_ms, peak_gb=None, **extra):
    return {"first_call_s": first_s, "steady_ms": {"median": steady_ms}, "peak_gb_steady": peak_gb, **extra}


def bench_raw(background: dict) -> dict:
    return {"config": {"latent": [21, 60, 104], "tokens": 32760, "blocks": 4, "model_desc": "WanModel"},
            "variants": {
                "eager": {"cold": cold(0.9, 104.0, 1.9)},
                "torch-compile-whole": {"cold": cold(20.6, 110.6, 2.0), "restart": {"first_call_s": 5.8},
                                        "rel_l2_vs_eager": 8e-3},
                "ours-regional": {"cold": cold(11.3, 104.1, 1.7), "restart": {"first_call_s": 1.9},
                                  "rel_l2_vs_eager": 7e-3},
                "ours-background": {"cold": cold(0.8, 104.4, 1.7, **background)}}}


SERVER = {name: {"eager_ok": True, "eager_s": 14.6, "core_ok": True, "core_s": 15.7, "defaults_first_ok": True,
                 "defaults_first_s": 1.2, "defaults_ok": True, "defaults_s": 0.9, "defaults_compiled": True,
                 "defaults_rel_l2": 5e-4, "core_rel_l2": 5e-4, "defaults_compile_s": 22.0}
          for name in ("dynamic_vram", "dynamic_vram_fetch", "no_dynamic_vram")}


def report(gpu_check, tmp_path, background: dict) -> tuple[dict, str]:
    junit = tmp_path / "gpu_tests.xml"
    junit.write_text(JUNIT)
    res = {"date": "2026-01-01T00:00:00+00:00", "command": "bash scripts/gpu_session.sh check",
           "device": "a GPU", "torch": "2.11.0", "tests": gpu_check.test_counts(junit), "server": SERVER,
           "bench": gpu_check.bench_summary(bench_raw(background))}
    gpu_check.write_md(res, tmp_path / "gpu_check.md")
    return res, (tmp_path / "gpu_check.md").read_text()


BESIDE = {"beside_ms": {"median": 104.0, "max": 109.0, "n": 143}, "failed": ""}


def test_the_report_has_every_figure_the_targets_are_checked_with(gpu_check, tmp_path):
    res, md = report(gpu_check, tmp_path, {"compiled_from_s": 22.2, "swapped_at_call": 144,
                                           "calls_until_swapped": 144, **BESIDE})
    assert res["tests"] == {"passed": 1, "failed": 1, "skipped": 1, "failures": ["test_ptx: assert 0 == 1"]}
    bench = res["bench"]
    assert (bench["latent"], bench["blocks"]) == ([21, 60, 104], 4)
    assert {"steady_ms": 104.0, "peak_vram_gb": 1.9}.items() <= bench["eager"].items()
    assert {"cold_s": 20.6, "restart_s": 5.8, "steady_ms": 110.6}.items() <= bench["core"].items()
    assert {"cold_s": 11.3, "restart_s": 1.9, "steady_ms": 104.1, "peak_vram_gb": 1.7}.items() <= bench["defaults"].items()
    assert bench["defaults_background"]["beside_ms"]["max"] == 109.0
    assert "compiled graphs swapped in at model call 144, 22.20 s after the first call started" in md
    assert "slowest 109.00 ms (1.04x the steady compiled step)" in md


def test_a_background_compile_that_had_not_taken_over_is_reported_as_such(gpu_check, tmp_path):
    _, md = report(gpu_check, tmp_path, {"compiled_from_s": 60.3, "swapped_at_call": None,
                                         "calls_until_swapped": 143, **BESIDE})
    line = next(line for line in md.splitlines() if line.startswith("Background compile"))
    assert "compiled graphs not swapped in when the calls stopped, 60.30 s after the first call started " \
           "(143 calls)" in line
    assert "None" not in line


def test_a_dry_run_on_the_cpu_cannot_write_over_the_gpu_results():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--device cpu needs --out-dir" in proc.stderr
