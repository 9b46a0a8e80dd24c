"""Issue #16: background compile on a real ComfyUI server. The first run goes on eagerly while a
worker compiles; the compiled regions swap in at a step boundary; a cancel during the compile
and a failing background compile leave eager sampling working."""
import re
import time

import pytest
import requests
import torch

from harness import (ComfyHost, PromptError, counters_delta, new_graphs, pack_lines, rel_l2,
                     wan_t2v_prompt)

BG = {"backend": "aot_eager", "background_compile": True}  # real dynamo tracing, no C++ build
STEPS = 6
CALL_LINE = re.compile(r"TCSTest: call (\d+) regions compiled (\d+)")


@pytest.fixture(scope="module")
def host(tmp_path_factory, tiny_wan_path):
    h = ComfyHost(tmp_path_factory.mktemp("background"), models=[tiny_wan_path])
    with h:
        yield h


@pytest.fixture(scope="module")
def eager_ref(host, tiny_wan):
    return host.latent(host.run(wan_t2v_prompt(tiny_wan, apply=False, steps=STEPS, prefix="eager")))


def _with_waiter(p, call):
    """TCSTestWaitForBackground between Apply and the sampler: its ``call``-th model call waits
    for the worker, so the swap lands at call ``call + 1``; every call logs its compiled regions."""
    p["waiter"] = {"class_type": "TCSTestWaitForBackground", "inputs": {"model": ["apply", 0],
                                                                       "call": call}}
    p["sampler"]["inputs"]["model"] = ["waiter", 0]
    p["probe"]["inputs"]["model"] = ["waiter", 0]
    return p


def _calls(log):
    """{model call: regions running compiled} from the waiter's lines."""
    return {int(a): int(b) for a, b in CALL_LINE.findall(log)}


def test_background_compile_swaps_in_mid_run(host, tiny_wan, eager_ref):
    before = host.probe(host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="before")))
    offset = host.log_offset()
    hist = host.run(_with_waiter(wan_t2v_prompt(tiny_wan, compile_settings=BG, steps=STEPS,
                                                prefix="swap"), call=2))
    log = host.log_text(since=offset)
    assert rel_l2(host.latent(hist), eager_ref) < 1e-3
    calls = _calls(log)
    assert calls[1] == 0 and calls[2] == 0, log  # eager while the worker compiles
    assert all(calls[n] == 2 for n in range(3, STEPS + 1)), log  # both blocks compiled after
    assert len(pack_lines(log, "in the background;")) == 1, log
    assert len(pack_lines(log, "swapped in at model call 3 (2 call(s) ran eagerly")) == 1, log
    assert not pack_lines(log, "failed"), log
    first = counters_delta(before["counters"], host.probe(hist)["counters"])
    assert new_graphs(first) >= 1  # the worker's graphs

    # the next run is compiled from its first step, without compiling anything
    offset = host.log_offset()
    hist2 = host.run(_with_waiter(wan_t2v_prompt(tiny_wan, compile_settings=BG, steps=STEPS,
                                                 prefix="after_swap"), call=1))
    log2 = host.log_text(since=offset)
    assert all(n == 2 for n in _calls(log2).values()) and len(_calls(log2)) == STEPS, log2
    assert new_graphs(counters_delta(host.probe(hist)["counters"], host.probe(hist2)["counters"])) == 0
    assert not pack_lines(log2, "background"), log2
    assert rel_l2(host.latent(hist2), eager_ref) < 1e-3


def test_cancel_during_background_compile_then_next_prompt_completes(host, tiny_wan, eager_ref):
    settings = {**BG, "backend": "tcs_test_slow_backend"}  # the compile takes >= 4 s
    p = wan_t2v_prompt(tiny_wan, compile_settings=settings, steps=STEPS, prefix="cancel_bg")
    p["waiter"] = {"class_type": "TCSTestWaitForInterrupt",
                   "inputs": {"model": ["apply", 0], "call": 2, "timeout_s": 120.0}}
    p["sampler"]["inputs"]["model"] = ["waiter", 0]
    offset = host.log_offset()
    pid = host.queue(p)
    deadline = time.monotonic() + 120
    while "TCSTest: waiting for an interrupt" not in host.log_text(since=offset):
        assert host.alive() and time.monotonic() < deadline, host.log_tail()
        time.sleep(0.05)
    assert not pack_lines(host.log_text(since=offset), "swapped in")  # still compiling
    requests.post(host.url + "/interrupt", json={}, timeout=10).raise_for_status()
    with pytest.raises(PromptError) as err:
        host.wait(pid, timeout=120)
    assert "execution_interrupted" in str(err.value)
    # the next prompt runs (eagerly until the compile is done, then compiled) and completes
    hist = host.run(_with_waiter(wan_t2v_prompt(tiny_wan, compile_settings=settings, steps=STEPS,
                                                prefix="after_cancel"), call=1))
    log = host.log_text(since=offset)
    assert rel_l2(host.latent(hist), eager_ref) < 1e-3
    assert len(pack_lines(log, "swapped in at model call")) == 1, log
    assert not pack_lines(log, "failed"), log


def test_failing_background_compile_keeps_eager_with_one_warning(host, tiny_wan, eager_ref):
    settings = {**BG, "backend": "tcs_test_raising_backend"}
    offset = host.log_offset()
    for i in range(2):
        hist = host.run(_with_waiter(wan_t2v_prompt(tiny_wan, compile_settings=settings,
                                                    steps=STEPS, prefix=f"bg_fail{i}"), call=2))
        assert torch.equal(host.latent(hist), eager_ref)  # every step ran eagerly
    log = host.log_text(since=offset)
    assert all(n == 0 for n in _calls(log).values()), log
    warnings = pack_lines(log, "failed in the background")
    assert len(warnings) == 1 and "boom" in warnings[0], log
