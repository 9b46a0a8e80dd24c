"""Compile-ahead: with declared shapes and warmup_runs, the Apply node compiles before
sampling, so the sampler's first step pays nothing, for every size in the declared range."""
import re

from harness import counters_delta, wan_t2v_prompt


def test_declared_shapes_compile_before_the_first_step(make_host, tiny_wan):
    host = make_host()
    settings = {"backend": "aot_eager", "declared_shapes": "96x96x1-192x160x13", "warmup_runs": 1}
    before = host.probe(host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="e")))
    offset = host.log_offset()
    hist = host.run(wan_t2v_prompt(tiny_wan, compile_settings=settings, prefix="c0"))
    log = host.log_text(since=offset)
    assert "compiled ahead for 192x160x13 (1 run(s))" in log, log
    # the only compile happened during the Apply node, before the sampler started
    compile_lines = [l for l in log.splitlines() if re.search(r"\] (re)?compiled WanAttention", l)]
    assert len(compile_lines) == 1, compile_lines
    assert log.index(compile_lines[0]) < log.index("compiled ahead for")
    total = counters_delta(before["counters"], host.probe(hist)["counters"])
    assert total["stats"]["unique_graphs"] == 1, total
    # other sizes inside the range: still nothing new
    probe = host.probe(hist)
    for w, h, f in ((128, 128, 5), (160, 96, 9)):
        hist = host.run(wan_t2v_prompt(tiny_wan, compile_settings=settings, width=w, height=h,
                                       length=f, prefix=f"c{w}"))
        assert counters_delta(probe["counters"], host.probe(hist)["counters"]).get(
            "stats", {}).get("unique_graphs", 0) == 0
        probe = host.probe(hist)


def test_bad_declared_shapes_rejected_with_key(comfy_host, tiny_wan):
    import pytest
    from harness import PromptError
    settings = {"backend": "aot_eager", "declared_shapes": "wide"}
    with pytest.raises(PromptError, match="declared_shapes"):
        comfy_host.run(wan_t2v_prompt(tiny_wan, compile_settings=settings, prefix="bad"))
