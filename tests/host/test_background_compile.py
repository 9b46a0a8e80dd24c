"""Background compile on a real ComfyUI server. The first run goes on eagerly while a
worker compiles; the compiled regions swap in at a step boundary; a cancel during the compile
and a failing background compile leave eager sampling working."""
import re
import time

import pytest
import requests
import torch

from harness import (NODE_DEFAULTS, ComfyHost, PromptError, counters_delta, make_tiny_wan, new_graphs,
                     pack_lines, rel_l2, wan_t2v_prompt)

BG = {"backend": "aot_eager", "background_compile": True}  # real dynamo tracing, no C++ build
STEPS = 6
CALL_LINE = re.compile(r"TCSTest: call (\d+) regions compiled (\d+)")
CALL_LINE_K = re.compile(r"TCSTest: call \d+ regions compiled (\d+)")


@pytest.fixture(scope="module")
def host(tmp_path_factory, tiny_wan_path):
    h = ComfyHost(tmp_path_factory.mktemp("background"), models=[tiny_wan_path], env={"TCS_TEST_WATCH": "1"})
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


def _badge_messages(host):
    """The status messages the server sends the node badge (web/js listens for the same event),
    collected on a thread from ComfyUI's websocket: (the list, the socket to close)."""
    import json
    import threading
    import websocket  # websocket-client, requirements-dev.txt
    got = []
    ws = websocket.create_connection(host.url.replace("http://", "ws://") + "/ws?clientId=tcs-badge",
                                     timeout=10)
    ws.settimeout(None)

    def read():
        while True:
            try:
                msg = ws.recv()
            except Exception:  # noqa: BLE001 - closed by the test
                return
            if not msg:  # what recv returns once the test has closed the socket
                return
            data = json.loads(msg) if isinstance(msg, str) else {}
            if data.get("type") == "torch_compile_speed.status":
                got.append(data["data"])
    threading.Thread(target=read, daemon=True).start()
    return got, ws


def test_a_cpu_models_compile_waits_for_the_end_of_the_run_and_the_next_run_is_compiled(
        host, tiny_wan, eager_ref):
    """No waiter: on the CPU the first run stays eager from its first step to its last (a
    compile beside it would share its cores), the compile starts once the prompt is done and
    the server idle, and the next run is compiled from its first step. The worker itself tells
    the badge (no model call comes)."""
    settings = {**BG, "reuse_if_similar": False}  # not the graphs an earlier test compiled
    offset = host.log_offset()
    badge, ws = _badge_messages(host)
    hist = host.run(_with_waiter(wan_t2v_prompt(tiny_wan, compile_settings=settings, steps=STEPS,
                                                prefix="held"), call=1000))
    deadline = time.monotonic() + 300
    while not pack_lines(host.log_text(since=offset), "in the background: ") and time.monotonic() < deadline:
        time.sleep(0.2)
    log = host.log_text(since=offset)
    deadline = time.monotonic() + 30
    while badge[-1]["state"] == "background-after-run" and time.monotonic() < deadline:
        time.sleep(0.1)
    ws.close()
    states = [m["state"] for m in badge]  # the worker itself told the badge: no model call came
    assert "background-after-run" in states and states[-1] == "cold", states
    assert rel_l2(host.latent(hist), eager_ref) < 1e-3
    assert _calls(log) == {n: 0 for n in range(1, STEPS + 1)}, log  # eager throughout
    assert len(pack_lines(log, "its background compile starts once the server is idle")) == 1, log
    assert len(pack_lines(log, "compiles in the background once the server is idle")) == 1, log
    # it compiled once the prompt was done (its last step came before any compile)
    assert log.index(f"TCSTest: call {STEPS} ") < log.index("compiled WanAttentionBlock x2 in the background: "), log

    offset = host.log_offset()
    hist2 = host.run(_with_waiter(wan_t2v_prompt(tiny_wan, compile_settings=settings, steps=STEPS,
                                                 prefix="held_next"), call=1000))
    log2 = host.log_text(since=offset)
    assert _calls(log2) == {n: 2 for n in range(1, STEPS + 1)}, log2  # compiled from the first step
    assert len(pack_lines(log2, f"swapped in at model call {STEPS + 1} ({STEPS} call(s) ran eagerly")) == 1, log2
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


def test_a_new_input_size_after_the_swap_compiles_once_and_matches_eager(host, tiny_wan):
    """Static shapes, so a new latent size needs new graphs: after the background compile took
    over, the new size compiles in its first model call (on the sampling thread, as without
    background compile), and the output matches eager; the same size again compiles nothing."""
    settings = {**BG, "shape_policy": "static"}
    size = {"width": 160, "height": 96}
    eager_new = host.latent(host.run(wan_t2v_prompt(tiny_wan, apply=False, steps=STEPS,
                                                     prefix="eager_new", **size)))
    host.run(_with_waiter(wan_t2v_prompt(tiny_wan, compile_settings=settings, steps=STEPS,
                                         prefix="static_first"), call=2))
    offset = host.log_offset()
    hist = host.run(_with_waiter(wan_t2v_prompt(tiny_wan, compile_settings=settings, steps=STEPS,
                                                prefix="static_new", **size), call=1))
    log = host.log_text(since=offset)
    assert rel_l2(host.latent(hist), eager_new) < 1e-3
    calls = _calls(log)
    assert all(calls[n] == 2 for n in range(1, STEPS + 1)), log  # compiled from its first call
    compiles = pack_lines(log, "graph(s) in")
    assert len(compiles) == 1 and "in the background" not in compiles[0], log

    offset = host.log_offset()
    hist2 = host.run(_with_waiter(wan_t2v_prompt(tiny_wan, compile_settings=settings, steps=STEPS,
                                                 prefix="static_again", **size), call=1))
    log2 = host.log_text(since=offset)
    assert not pack_lines(log2, "eagerly") and not pack_lines(log2, "graph(s) in"), log2
    assert new_graphs(counters_delta(host.probe(hist)["counters"], host.probe(hist2)["counters"])) == 0
    assert rel_l2(host.latent(hist2), eager_new) < 1e-3


def _tagged(p, tag):
    """``p`` with every node id (and every link to one) suffixed by ``tag``."""
    def link(v):
        return [v[0] + tag, v[1]] if isinstance(v, list) and len(v) == 2 and v[0] in p else v
    return {k + tag: {**node, "inputs": {n: link(v) for n, v in node["inputs"].items()}}
            for k, node in p.items()}


def test_two_models_in_one_workflow_each_compile_in_the_background(host):
    """Two different models, each with its own Apply node in background mode, in one prompt:
    each runs eagerly first, its compile runs on the one worker, and each swaps in at its own
    model call 3; both outputs match eager, and the next prompt compiles nothing."""
    # two models no other test here compiled, with blocks of different widths (no shared graph)
    models = {"A": host.add_model(make_tiny_wan(num_layers=2, dim=384, seed=2)),
              "B": host.add_model(make_tiny_wan(num_layers=3, dim=512, seed=1))}
    eager = {t: host.latent(host.run(wan_t2v_prompt(m, apply=False, steps=STEPS, prefix=f"two_eager{t}")))
             for t, m in models.items()}

    def prompt(prefix):
        p = {}
        for t, m in models.items():
            p.update(_tagged(_with_waiter(wan_t2v_prompt(m, compile_settings=BG, steps=STEPS,
                                                         prefix=f"{prefix}{t}"), call=2), t))
        return p
    offset = host.log_offset()
    hist = host.run(prompt("two"))
    log = host.log_text(since=offset)
    for t in models:
        assert rel_l2(host.latent(hist, node_id=f"save{t}"), eager[t]) < 1e-3
    swaps = pack_lines(log, "swapped in at model call 3 (2 call(s) ran eagerly")
    assert len(swaps) == 2 and {"x2" in swaps[0] or "x2" in swaps[1], "x3" in swaps[0] or "x3" in swaps[1]} == {True}, log
    regions = [int(k) for k in CALL_LINE_K.findall(log)]
    assert regions.count(2) == STEPS - 2 and regions.count(3) == STEPS - 2, log  # compiled after each swap
    compiles = pack_lines(log, "graph(s) in")
    assert len(compiles) == 2 and all("in the background" in line for line in compiles), log

    offset = host.log_offset()
    hist2 = host.run(prompt("two_again"))
    log2 = host.log_text(since=offset)
    assert not pack_lines(log2, "graph(s) in") and not pack_lines(log2, "eagerly"), log2
    # the process-wide counters at the end of each prompt: its later probe's
    last = [max((host.probe(h, f"probe{t}")["counters"] for t in models),
                key=lambda c: c["stats"]["unique_graphs"]) for h in (hist, hist2)]
    assert new_graphs(counters_delta(*last)) == 0
    for t in models:
        assert rel_l2(host.latent(hist2, node_id=f"save{t}"), eager[t]) < 1e-3


def test_with_the_node_defaults_the_first_run_does_not_wait_for_the_compile(host, tiny_wan, eager_ref):
    """The settings node as it comes (background_compile left to the node's default, as in a
    workflow saved before it existed): the first run is eager from its first step to its last,
    the compile comes after it, and the next run is compiled from its first step."""
    settings = {**NODE_DEFAULTS, "reuse_if_similar": False}  # its own compile, whatever ran before

    def defaults_prompt(prefix):
        p = _with_waiter(wan_t2v_prompt(tiny_wan, compile_settings=settings, steps=STEPS, prefix=prefix),
                         call=1000)
        del p["settings"]["inputs"]["background_compile"]
        return p
    offset = host.log_offset()
    hist = host.run(defaults_prompt("defaults_first"))
    host.wait_for_pack_line("background compile of WanAttentionBlock x2 finished", since=offset)
    log = host.log_text(since=offset)
    assert _calls(log) == {n: 0 for n in range(1, STEPS + 1)}, log  # nothing waited for a compile
    assert log.index(f"TCSTest: call {STEPS} ") < log.index("compiled WanAttentionBlock x2 in the background: "), log
    assert rel_l2(host.latent(hist), eager_ref) < 1e-3
    offset = host.log_offset()
    hist2 = host.run(defaults_prompt("defaults_next"))
    log2 = host.log_text(since=offset)
    assert _calls(log2) == {n: 2 for n in range(1, STEPS + 1)}, log2
    assert rel_l2(host.latent(hist2), eager_ref) < 1e-3


def test_the_bridge_tells_a_background_compile_whether_a_prompt_runs(host, tiny_wan):
    """A CPU model's background compile asks the pack's bridge whether the server is idle:
    inside a prompt it is busy."""
    reports = [host.probe(host.run(wan_t2v_prompt(tiny_wan, apply=False, steps=1, prefix=f"count{i}")))
               for i in range(2)]
    servers = [r["server"] for r in reports]
    assert servers and not any(s["idle"] for s in servers), servers


def test_a_prompt_that_comes_during_the_compile_runs_beside_it_untouched(host, tiny_wan, eager_ref):
    """A CPU model's compile starts once the server is idle; a prompt that comes meanwhile runs
    (eagerly) beside it with nothing paused, signalled or patched (the test nodes' process
    watch: a FAKE of nothing, it only looks), and the compile finishes."""
    settings = {**BG, "backend": "tcs_test_pausable_backend"}  # 3 s of fx interpretations
    offset = host.log_offset()
    host.run(_with_waiter(wan_t2v_prompt(tiny_wan, compile_settings=settings, steps=STEPS,
                                         prefix="beside_first"), call=1000))
    time.sleep(0.5)  # the compile starts once the server is idle; a prompt comes 0.5 s into it
    hist = host.run(_with_waiter(wan_t2v_prompt(tiny_wan, compile_settings=settings, steps=10 * STEPS,
                                                prefix="beside_during"), call=1000))
    host.wait_for_pack_line("background compile of WanAttentionBlock x2 finished", since=offset)
    log = host.log_text(since=offset)
    assert "pause" not in log.lower(), log
    assert all(v == 0 for v in _calls(log).values()), log  # both prompts ran eagerly
    assert hist["status"]["status_str"] == "success"
    hist3 = host.run(_with_waiter(wan_t2v_prompt(tiny_wan, compile_settings=settings, steps=STEPS,
                                                 prefix="beside_after"), call=1000))
    assert rel_l2(host.latent(hist3), eager_ref) < 1e-3
    watch = host.probe(hist3)["watch"]
    assert watch["samples"] > 10, watch
    assert watch["job_control_signals"] == [] and watch["replaced"] == [], watch
    assert watch["switch_intervals"] == [watch["switch_interval_at_start"]], watch
    assert watch["niced"] == [], watch
