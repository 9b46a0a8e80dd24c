#!/usr/bin/env bash
# The test command (README, CI): builds the environment if needed, then runs
#  1. every test on the default host, ComfyUI 0.33.0, with the main venv's torch 2.13.0: unit
#     tests of compile_core, integration tests against a real ComfyUI server, fleet tests against
#     a real Redis, and browser tests against the real ComfyUI frontend;
#  2. an older-torch job: tests/unit and tests/host/test_foundation.py on ComfyUI 0.33.0 with
#     torch 2.8.0 (the oldest torch users run; the CUDA build from PyPI, which runs on the CPU),
#     in .venv-torch/2.8.0/ (scripts/torch_env.sh: ~3 GB, a few minutes once);
#  3. on ComfyUI 0.3.75, a subset of the host tests that depends on the host's version, plus
#     the browser tests (0.3.75 has its own frontend, 1.32.9):
#       tests/host/test_foundation.py        the nodes as users see them, compile, reuse, contract
#       tests/host/test_persistent_cache.py  restart: saved regions / FX cache on this host's classes
#       tests/host/test_gguf.py              ComfyUI-GGUF's loader and tensors on this host
#       tests/host/test_regions_real_models.py  region plans on this host's real model classes
#       tests/host/test_code_change.py::test_a_restart_after_an_update_runs_the_new_code
#                                            never the old code's output after an update
#       tests/browser                        the pack in 0.3.75's frontend
#  4. on ComfyUI 0.33.0 with the post-0.33 overlay (host "next", reports 0.38.1: WAN's
#     comfy_attention submodules, modulate(), the memory compiler, comfy-aimdo 0.6.0), the host
#     tests that matter for a compile pack there:
#       tests/host/test_foundation.py, test_persistent_cache.py (restart without a trace),
#       test_code_change.py (never stale after a code edit), test_background_compile.py,
#       test_gguf.py (GGUF + LoRA), test_kjnodes.py, test_dynamic_vram.py (its ModelPatcherDynamic
#       takes fast_disk; a custom loader without cached_patcher_init), test_next_host.py
#     The rest of tests/host (input validation, fallbacks, LoRA/offload, shape policy, cancel,
#     attention override, diagnostics, fleet, ...) exercises the pack's own logic, which step 1
#     covers; it ran on 0.3.75 too (~20 min) until the older-torch job needed the time (CI:
#     2 cores, aiming at 20 minutes). TCS_SECOND_HOST_TESTS="tests/host tests/browser" runs it.
# Each pytest run uses two worker processes (pytest-xdist, a test file per worker at a time, so a
# file's module-scoped servers start once): a test spends most of its time in one thread (dynamo's
# trace, a server starting), so two workers keep both cores of a CI machine busy. Files go out in
# collection order (host tests, the long ones, first; xdist's own order, most tests first, left
# one-test files of two minutes for the end). The older-torch environment is built in the
# background while step 1 runs.
# Knobs (environment variables):
#   TCS_TEST_HOSTS="0.33.0"        hosts to run, space-separated (the first gets every test)
#   TCS_SECOND_HOST_TESTS="..."    what 0.3.75 runs (e.g. "tests/host tests/browser": all)
#   TCS_NEXT_HOST_TESTS="..."      what the overlay host runs
#   TCS_TEST_OLD_TORCH="2.9.1"     the older-torch job's version ("none": skip it)
#   TCS_TEST_WORKERS=4             pytest worker processes per run (default 2; 0: no workers)
# Extra arguments pass through to pytest (for every run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
if ! bash scripts/install_system_deps.sh; then
  echo "[test] chromium/redis-server could not be installed; their tests will fail or skip" >&2
  [ -z "${CI:-}" ] || exit 1
fi
SECOND_HOST_TESTS=${TCS_SECOND_HOST_TESTS:-tests/host/test_foundation.py \
tests/host/test_persistent_cache.py tests/host/test_gguf.py tests/host/test_regions_real_models.py \
tests/host/test_code_change.py::test_a_restart_after_an_update_runs_the_new_code tests/browser}
NEXT_HOST_TESTS=${TCS_NEXT_HOST_TESTS:-tests/host/test_foundation.py \
tests/host/test_persistent_cache.py tests/host/test_code_change.py \
tests/host/test_background_compile.py tests/host/test_gguf.py tests/host/test_kjnodes.py \
tests/host/test_dynamic_vram.py tests/host/test_next_host.py}
OLD_TORCH=${TCS_TEST_OLD_TORCH:-2.8.0}
WORKERS=(-n "${TCS_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
status=0
if [ "$OLD_TORCH" != none ]; then
  old_torch_log=$PWD/.host/torch_env-$OLD_TORCH.log
  bash scripts/torch_env.sh "$OLD_TORCH" > "$old_torch_log" 2>&1 &
  old_torch_env=$!
  trap 'kill "$old_torch_env" 2>/dev/null || true' EXIT
fi
first=1
for host in ${TCS_TEST_HOSTS:-0.33.0 0.3.75 next}; do
  if [ $first = 1 ]; then paths=(tests)
  elif [ "$host" = next ]; then read -r -a paths <<< "$NEXT_HOST_TESTS"
  else read -r -a paths <<< "$SECOND_HOST_TESTS"; fi
  echo "[test] ComfyUI $host: ${paths[*]}"
  # a private basetemp per host: pytest prunes /tmp/pytest-of-$USER across concurrent runs
  TCS_COMFY_HOST=$host .venv/bin/python -m pytest "${paths[@]}" "${WORKERS[@]}" \
    --basetemp="$PWD/.host/pytest-tmp-$host" "$@" || status=1
  if [ $first = 1 ] && [ "$OLD_TORCH" != none ]; then
    # the older-torch job, right after the default host (same host, the venv's own torch)
    echo "[test] torch $OLD_TORCH, ComfyUI 0.33.0: tests/unit tests/host/test_foundation.py"
    env_ok=0
    wait "$old_torch_env" || env_ok=$?
    cat "$old_torch_log"
    if [ "$env_ok" = 0 ] && py=$(tail -n 1 "$old_torch_log") && [ -x "$py" ]; then
      t0=$SECONDS
      TCS_COMFY_HOST=0.33.0 "$py" -m pytest tests/unit tests/host/test_foundation.py "${WORKERS[@]}" \
        --continue-on-collection-errors --basetemp="$PWD/.host/pytest-tmp-torch-$OLD_TORCH" "$@" || status=1
      echo "[test] torch $OLD_TORCH job took $((SECONDS - t0))s"
    else
      echo "[test] torch $OLD_TORCH environment could not be built" >&2
      status=1
    fi
  fi
  first=0
done
exit $status
