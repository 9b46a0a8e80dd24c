"""The GPU matrix (``benchmarks/gpu_matrix.py``) at toy dims on the CPU, so that its code runs the
first time a GPU is there: every built row builds, runs eager, the pack and core, and writes its
row in the results' schema. The figures say nothing about speed (toy dims, ``aot_eager``)."""
import json
import subprocess
import sys
from pathlib import Path

from harness import REPO_ROOT, host_env

SCRIPT = REPO_ROOT / "benchmarks" / "gpu_matrix.py"
SCHEMA = {"row", "format", "tokens", "eager_ms", "pack_ms", "core_ms", "floor_ms", "pack_rel_l2",
          "eager_peak_gb", "pack_peak_gb", "pack_compile_s", "core_compile_s", "pack_restart_s",
          "core_restart_s"}


def test_every_built_row_runs_eager_pack_and_core_and_writes_its_row(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--backend", "aot_eager",
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env=host_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_matrix.json").read_text())
    assert {"card", "torch", "date", "command", "rows"} <= set(data) and data["tiny"] is True
    rows = {r["row"]: r for r in data["rows"]}
    assert set(rows) == {"A1", "B", "F", "L", "C1", "C2", "G8", "P"}, rows
    for r in rows.values():
        assert SCHEMA <= set(r) and not r.get("error"), r
    assert rows["A1"]["sdpa_rate"] > 0 and rows["A1"]["gemm_rate"] > 0
    for name in ("B", "F"):
        r = rows[name]
        assert all(r[k] > 0 for k in ("eager_ms", "pack_ms", "core_ms", "floor_ms", "pack_compile_s",
                                      "core_compile_s")), r
        assert r["pack_rel_l2"] < 1e-3 and r["core_rel_l2"] < 1e-3 and not r["pack_failed"], r
        assert r["pack_graphs"] >= 1, r  # compiled, not eager
        assert r["format"] == "bf16" and r["tokens"] == 32
        assert r["pack_verdict"] is None  # made on CUDA only
    for name, fmt, n in (("C1", "fp8_manual", 32), ("C2", "fp8_fast", 16)):  # fp8_e4m3fn Linear weights
        r = rows[name]
        assert r["format"] == fmt and r["tokens"] == n and r["fp8_weights"] >= 10, r
        assert all(r[k] > 0 for k in ("eager_ms", "pack_ms", "pack_compile_s")), r
        assert r["pack_rel_l2"] < 1e-2 and not r["pack_failed"] and r["pack_graphs"] >= 1, r
        assert r.get("core_ms") or r.get("core_error"), r
    g8 = rows["G8"]  # GGUF Q8_0 through ComfyUI-GGUF's ops, image size
    assert g8["format"] == "gguf_q8_0" and g8["tokens"] == 16 and g8["floor_ms"] is None, g8
    assert all(g8[k] > 0 for k in ("eager_ms", "pack_ms", "pack_compile_s")), g8
    assert g8["pack_rel_l2"] < 1e-3 and not g8["pack_failed"] and g8["quantized_weights"] >= 8, g8
    assert g8["pack_graphs"] >= 1, g8
    assert g8.get("core_ms") or g8.get("core_error"), g8
    lora = rows["L"]  # a LoRA on every block Linear, partially loaded: some of it unmerged
    assert lora["format"] == "bf16_lora" and lora["tokens"] == 32 and lora["lowvram_patches"] >= 1, lora
    assert all(lora[k] > 0 for k in ("eager_ms", "pack_ms", "pack_compile_s", "floor_ms")), lora
    assert lora["pack_rel_l2"] < 1e-3 and not lora["pack_failed"] and lora["pack_graphs"] >= 1, lora
    assert lora.get("core_ms") or lora.get("core_error"), lora
    assert rows["B"]["pack_restart_s"] > 0 and rows["B"]["core_restart_s"] > 0
    for variant in ("eager", "pack", "core"):
        assert rows["P"]["classes"][variant]["gemm"] > 0, rows["P"]
    assert {"K", "D"} <= set(data["not_built"]) and not {"G8", "L"} & set(data["not_built"])
    assert "| B | bf16 | 32 |" in Path(tmp_path / "gpu_matrix.md").read_text()
