"""The whole-graph stage on a real ComfyUI server: after the regional compile settles, the whole
model compiles as one graph once the server is idle, and the next prompt runs it, with eager's
output and nothing compiled on the sampling thread; a new size runs without compiling the whole
graph again on that thread. Most tests force it on (``TORCH_COMPILE_SPEED_WHOLE_GRAPH=1``: no
trial); the last ones run the settings node's defaults, where its first calls are timed against
the regional graphs (``compile_core.stage_trial``)."""
import time

import pytest

from harness import ComfyHost, counters_delta, new_graphs, pack_lines, rel_l2, wan_t2v_prompt

SETTINGS = {"backend": "aot_eager"}  # the node's defaults otherwise (regional, foreground)
STEPS = 4


@pytest.fixture(scope="module")
def host(tmp_path_factory, tiny_wan_path):
    h = ComfyHost(tmp_path_factory.mktemp("whole_graph"), models=[tiny_wan_path],
                  env={"TORCH_COMPILE_SPEED_WHOLE_GRAPH": "1"})
    with h:
        yield h


def _prompt(tiny_wan, prefix, **kw):
    return wan_t2v_prompt(tiny_wan, compile_settings=SETTINGS, steps=STEPS, prefix=prefix, **kw)


def test_the_whole_graph_compiles_when_idle_and_runs_the_next_prompt(host, tiny_wan):
    offset = host.log_offset()
    first = host.run(_prompt(tiny_wan, "regional"))
    status = host.probe(first)["pack_status"]["whole_graph"]
    assert status["state"] == "queued" and status["taken"] == 0, status
    assert len(pack_lines(host.log_text(since=offset), "its regional compile has settled")) == 1
    host.wait_for_log("as one graph in the background: 1 graph(s)", offset)
    eager_run = host.run(wan_t2v_prompt(tiny_wan, apply=False, steps=STEPS, prefix="eager"))

    hist = host.run(_prompt(tiny_wan, "whole"))
    report = host.probe(hist)
    status = report["pack_status"]["whole_graph"]
    assert status == {"state": "ready", "taken": STEPS, "regional_calls": 0, "refusals": 0, "graph_breaks": 0,
                      "graphs": 1, "trial": None, "timing": False}, status  # (forced on: no trial)
    assert new_graphs(counters_delta(host.probe(eager_run)["counters"], report["counters"])) == 0
    eager = host.latent(eager_run)
    assert rel_l2(host.latent(hist), eager) < 1e-3
    assert report["modules_with_compiled_call_impl"] == 0  # nothing left attached after the run
    assert len(pack_lines(host.log_text(since=offset), "model calls its guards accept run it")) == 1
    assert not pack_lines(host.log_text(since=offset), "did not succeed")


def test_a_new_size_does_not_compile_the_whole_graph_on_the_sampling_thread(host, tiny_wan):
    before = host.probe(host.run(_prompt(tiny_wan, "warm")))["pack_status"]["whole_graph"]
    assert before["state"] == "ready", before
    eager = host.latent(host.run(wan_t2v_prompt(tiny_wan, apply=False, steps=STEPS, width=160,
                                                prefix="eager_160")))
    hist = host.run(_prompt(tiny_wan, "new_size", width=160))
    after = host.probe(hist)["pack_status"]["whole_graph"]
    assert after["graphs"] == 1, after  # the whole graph took it or the regional graphs did
    assert after["taken"] + after["regional_calls"] == before["taken"] + before["regional_calls"] + STEPS
    assert after["refusals"] - before["refusals"] <= 1, after  # then checked ahead, not refused per call
    assert rel_l2(host.latent(hist), eager) < 1e-3


def test_a_prompt_during_its_compile_neither_waits_for_it_nor_compiles(tmp_path, tiny_wan_path, tiny_wan):
    """A prompt that comes while the stage compiles runs beside it, on the regional graphs it
    already has (``compile_core.beside``), even when its Apply node runs again (a changed
    setting): the Apply node waits for a busy worker only when it has declared shapes to
    compile ahead."""
    slow = {"backend": "tcs_test_slow_backend"}  # (test nodes: sleeps 4 s per graph)
    with ComfyHost(tmp_path / "server", models=[tiny_wan_path],
                   env={"TORCH_COMPILE_SPEED_WHOLE_GRAPH": "1"}) as host:
        offset = host.log_offset()
        first = host.probe(host.run(wan_t2v_prompt(tiny_wan, compile_settings=slow, steps=STEPS,
                                                   prefix="first")))["pack_status"]
        host.wait_for_log("the server is idle: compiling", offset)
        changed = {**slow, "dynamo_recompile_limit": 16}  # the Apply node runs again
        hist = host.run(wan_t2v_prompt(tiny_wan, compile_settings=changed, steps=STEPS, prefix="during"))
        during = host.log_text(since=offset)
        assert not pack_lines(during, "as one graph in the background: 1 graph(s)"), during  # still compiling
        status = host.probe(hist)["pack_status"]
        assert status["state"] == "reused", status  # the same compiled entry, a new Apply
        assert status["runs"] == first["runs"] + STEPS, during  # every call on its compiled regions
        assert status["graphs"] == first["graphs"]  # and none compiled on the sampling thread
        said = pack_lines(during, "compiles in the background (")
        assert len(said) == 1 and "runs its compiled graphs while" in said[0], said
        host.wait_for_log("as one graph in the background: 1 graph(s)", offset)
        eager = host.latent(host.run(wan_t2v_prompt(tiny_wan, apply=False, steps=STEPS, prefix="eager")))
        assert rel_l2(host.latent(hist), eager) < 1e-3


def test_core_torch_compile_after_apply_keeps_the_stage_off(host, tiny_wan):
    """Core's TorchCompileModel after Apply compiles the model call around the pack's: it would
    trace the stage's input capture (torch's internal assert, found with the stage on: the
    prompt worker died and the server hung). The stage stays off there; prompts complete."""
    eager = host.latent(host.run(wan_t2v_prompt(tiny_wan, apply=False, steps=STEPS, prefix="eager_core")))
    fresh = {**SETTINGS, "fullgraph": True}  # an entry of its own (another fingerprint): no stage yet
    for i in range(3):  # past the point where a lone regional model would settle and capture
        p = wan_t2v_prompt(tiny_wan, compile_settings=fresh, steps=STEPS, prefix=f"ours_then_core{i}")
        p["core"] = {"class_type": "TorchCompileModel", "inputs": {"model": ["apply", 0], "backend": "cudagraphs"}}
        p["sampler"]["inputs"]["model"] = ["core", 0]
        p["probe"]["inputs"]["model"] = ["core", 0]
        hist = host.run(p, timeout=180)  # (without the fix the prompt worker died: no answer)
        assert rel_l2(host.latent(hist), eager) < 1e-3
    stage = host.probe(hist)["pack_status"]["whole_graph"]
    assert stage["state"] == "waiting" and stage["taken"] == 0, stage


def test_the_settings_nodes_whole_graph_turns_it_on_without_the_variable(tmp_path, tiny_wan_path, tiny_wan):
    with ComfyHost(tmp_path / "server", models=[tiny_wan_path]) as host:
        off = host.probe(host.run(_prompt(tiny_wan, "off")))["pack_status"]
        assert off["whole_graph"] is None, off  # whole_graph off (the harness's test settings)
        on = host.probe(host.run(wan_t2v_prompt(tiny_wan, compile_settings={**SETTINGS, "whole_graph": True},
                                                steps=STEPS, prefix="on")))["pack_status"]
        assert on["whole_graph"]["state"] in ("queued", "ready"), on  # (the same entry: it has settled)


def test_the_node_defaults_time_the_whole_graph_and_follow_the_verdict(tmp_path, tiny_wan_path, tiny_wan):
    """The settings node as it comes (mode speed, inductor, the stage on, no variable): once the
    whole graph is ready, its first calls take turns with the regional graphs', timed, and the
    verdict in the log is the one its times give. Then the graph it chose runs every call: the
    whole graph if it kept it, the regional graphs if not (on this 2-block model the two time
    within a few percent of each other, so either can come out; unit tests decide each case
    with a side made slow for real). Outputs equal eager's throughout."""
    from harness import NODE_DEFAULTS
    with ComfyHost(tmp_path / "server", models=[tiny_wan_path]) as host:
        offset = host.log_offset()
        eager = host.latent(host.run(wan_t2v_prompt(tiny_wan, apply=False, steps=STEPS, prefix="eager")))
        prompt = lambda prefix: wan_t2v_prompt(tiny_wan, compile_settings=NODE_DEFAULTS, steps=STEPS, prefix=prefix)
        host.run(prompt("regional"))
        host.wait_for_log("as one graph in the background: 1 graph(s)", offset, timeout=600)
        stages = []
        for i in range(4):  # the trial: 1 + 2 x 5 calls, 4 per prompt
            hist = host.run(prompt(f"trial{i}"))
            assert rel_l2(host.latent(hist), eager) < 1e-3, i
            stages.append(host.probe(hist)["pack_status"])
        whole = [s["whole_graph"] for s in stages]
        assert whole[0]["timing"] is True and whole[0]["trial"] is None, whole
        trial = whole[2]["trial"]
        assert trial is not None and whole[2]["timing"] is False, whole
        verdict = pack_lines(host.log_text(since=offset), "on the whole graph and")
        assert len(verdict) == 1 and f"({trial['ratio']:.2f}x)" in verdict[0], verdict
        kept = trial["ratio"] <= 1.02
        assert whole[2]["state"] == ("ready" if kept else "slower"), (trial, whole)
        last, before = stages[3], stages[2]
        if kept:
            assert "so the whole graph takes the calls its guards accept from now on" in verdict[0]
            assert last["whole_graph"]["taken"] - before["whole_graph"]["taken"] == STEPS, stages
            assert last["runs"] == before["runs"], stages  # no call on the regional graphs
        else:
            assert "the whole graph is slower here, so it is let go" in verdict[0]
            assert last["whole_graph"]["taken"] == before["whole_graph"]["taken"], stages
            assert last["runs"] - before["runs"] == STEPS, stages  # every call on the regional graphs
        print(f"\nthe stage's trial on the 2-block model: {trial}")
