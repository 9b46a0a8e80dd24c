"""A cancel (POST /interrupt) stops the prompt during compile-ahead and during the
Diagnostics node's measuring loop, on every host; another pack's torch.compile wrapper on the
same model is said in the log, once per Apply (core's TorchCompileModel before or after ours)."""
import time

import pytest
import requests
import torch

from harness import (PACK_LOG_PREFIX, PromptError, add_diagnostics, rel_l2, wan_t2v_prompt)

FAST = {"backend": "aot_eager"}  # real dynamo tracing, no C++ build
WAITING = "TCSTest: waiting for an interrupt"
AFTER = "TCSTest: model call after the interrupt"


def _insert_waiter(p, source, consumer, call):
    """TCSTestWaitForInterrupt between ``source`` (a node id) and ``consumer``'s model input."""
    p["waiter"] = {"class_type": "TCSTestWaitForInterrupt",
                   "inputs": {"model": [source, 0], "call": call, "timeout_s": 300.0}}
    p[consumer]["inputs"]["model"] = ["waiter", 0]


def _cancel_when_waiting(host, prompt, timeout=300.0):
    """Queue ``prompt``, POST /interrupt once the waiter blocks, and return (error, log)."""
    offset = host.log_offset()
    pid = host.queue(prompt)
    deadline = time.monotonic() + timeout
    while WAITING not in host.log_text(since=offset):
        assert host.alive() and time.monotonic() < deadline, host.log_tail()
        time.sleep(0.05)
    requests.post(host.url + "/interrupt", json={}, timeout=10).raise_for_status()
    with pytest.raises(PromptError) as err:
        host.wait(pid, timeout=timeout)
    return str(err.value), host.log_text(since=offset)


def test_cancel_during_compile_ahead_stops_the_prompt(make_host, tiny_wan):
    host = make_host()
    settings = {**FAST, "declared_shapes": "96x96x1-192x160x13", "warmup_runs": 3}
    p = wan_t2v_prompt(tiny_wan, compile_settings=settings, prefix="cancel_ahead")
    _insert_waiter(p, "loader", "apply", call=1)  # the first compile-ahead run
    error, log = _cancel_when_waiting(host, p)
    assert "execution_interrupted" in error, error
    assert AFTER not in log, log  # neither another compile-ahead run nor any sampling step
    assert "compile-ahead skipped" not in log, log
    assert "compiled ahead for" not in log, log
    # the server still works: the same workflow, not cancelled, completes
    host.run(wan_t2v_prompt(tiny_wan, compile_settings=settings, prefix="after_cancel"))


def test_cancel_during_diagnostics_measuring_stops_the_prompt(make_host, tiny_wan):
    host = make_host()
    p = wan_t2v_prompt(tiny_wan, compile_settings=FAST, prefix="cancel_diag")
    diag = add_diagnostics(p, measure_runs=10)
    _insert_waiter(p, "apply", diag, call=4)  # capture, 2 warm-ups, then the 1st measured call
    error, log = _cancel_when_waiting(host, p)
    assert "execution_interrupted" in error, error
    assert AFTER not in log, log  # the measuring loop stopped at the next call
    assert not [ln for ln in log.splitlines() if PACK_LOG_PREFIX in ln and "diagnostics:" in ln], log


def _wrapper_lines(log, text):
    return [ln for ln in log.splitlines() if PACK_LOG_PREFIX in ln and text in ln]


REPLACED = "replaced core's TorchCompileModel wrapper: compiling twice"
ALSO = "also carries another torch.compile wrapper"


def test_core_compile_before_apply_is_replaced_and_said(make_host, tiny_wan):
    host = make_host()
    eager_ref = host.latent(host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="eager")))
    ours = host.run(wan_t2v_prompt(tiny_wan, compile_settings=FAST, prefix="ours"))
    offset = host.log_offset()
    p = wan_t2v_prompt(tiny_wan, compile_settings=FAST, prefix="core_then_ours")
    p["core"] = {"class_type": "TorchCompileModel", "inputs": {"model": ["loader", 0],
                                                               "backend": "cudagraphs"}}
    p["apply"]["inputs"]["model"] = ["core", 0]
    hist = host.run(p)
    log = host.log_text(since=offset)
    assert len(_wrapper_lines(log, REPLACED)) == 1, log
    assert not _wrapper_lines(log, ALSO), log
    out = host.latent(hist)
    assert torch.equal(out, host.latent(ours))  # exactly what ours alone gives
    assert rel_l2(out, eager_ref) < 1e-3
    probe = host.probe(hist)
    assert probe["apply_model_wrapper_keys"] == ["torch_compile_speed"], probe
    assert probe["is_optimized_module"] is False
    # our regions ran compiled: the graphs compiled for them (by the "ours" run, reused here)
    assert probe["stats"]["unique_graphs"] >= 1, probe


def test_core_compile_after_apply_is_said_once(make_host, tiny_wan):
    host = make_host()
    eager_ref = host.latent(host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="eager")))
    offset = host.log_offset()
    p = wan_t2v_prompt(tiny_wan, compile_settings=FAST, prefix="ours_then_core", steps=4)
    p["core"] = {"class_type": "TorchCompileModel", "inputs": {"model": ["apply", 0],
                                                               "backend": "cudagraphs"}}
    p["sampler"]["inputs"]["model"] = ["core", 0]
    p["probe"]["inputs"]["model"] = ["core", 0]
    hist = host.run(p)
    # the same Apply again (cached node, same wrapper): no second line
    p2 = wan_t2v_prompt(tiny_wan, compile_settings=FAST, prefix="ours_then_core2", steps=4)
    p2["core"], p2["sampler"], p2["probe"] = p["core"], p["sampler"], p["probe"]
    p2["save"]["inputs"]["filename_prefix"] = "ours_then_core2"
    host.run(p2)
    log = host.log_text(since=offset)
    assert len(_wrapper_lines(log, ALSO)) == 1, log
    also = _wrapper_lines(log, ALSO)[0]
    assert "torch.compile: core's TorchCompileModel" in also and "steps aside" in also, also
    assert not _wrapper_lines(log, REPLACED), log
    assert rel_l2(host.latent(hist), eager_ref) < 1e-3
    assert sorted(host.probe(hist)["apply_model_wrapper_keys"]) == ["torch.compile",
                                                                     "torch_compile_speed"]
