"""The shape policy on a real ComfyUI server: one compiled graph serves every latent size.

Every sweep also checks that something really compiled (new dynamo graphs on its
first size, from the probe counters, and the pack's "compiled" line for the blocks) and that
nothing fell back to eager (no "runs eagerly" line, no failed compile), so "0 new graphs at the
other sizes" cannot pass by not compiling at all."""
import pytest

from harness import counters_delta, new_graphs, pack_lines, rel_l2, wan_t2v_prompt

SIZES = [(128, 128, 5), (160, 128, 5), (128, 192, 9), (96, 96, 1), (192, 160, 13), (128, 128, 17)]


def sweep(host, model, settings, cfg=1.0, sizes=SIZES, compiles_first=True):
    """Run each size eagerly and compiled; return new dynamo graphs per compiled run and errors.

    Asserts that no compiled run fell back to eager, and (``compiles_first``: the first size is
    the first compile of this model and these settings in the server) that the first size
    compiled new graphs and the pack logged it for the transformer blocks."""
    graphs, errors = [], []
    offset = host.log_offset()
    for i, (w, h, f) in enumerate(sizes):
        eager = host.run(wan_t2v_prompt(model, apply=False, width=w, height=h, length=f,
                                        prefix=f"e{w}x{h}x{f}"))
        prompt = wan_t2v_prompt(model, compile_settings=settings, width=w, height=h, length=f,
                                prefix=f"c{w}x{h}x{f}")
        prompt["sampler"]["inputs"]["cfg"] = cfg
        eager_p = host.probe(eager)
        hist = host.run(prompt)
        delta = counters_delta(eager_p["counters"], host.probe(hist)["counters"])
        graphs.append(new_graphs(delta))
        if cfg == 1.0:
            errors.append(rel_l2(host.latent(hist), host.latent(eager)))
    log = host.log_text(since=offset)
    assert not pack_lines(log, "runs eagerly"), log[-4000:]  # a failed compile or recompile limit
    assert not pack_lines(log, "compile failed"), log[-4000:]
    if compiles_first:
        assert graphs[0] > 0, (graphs, log[-4000:])
        blocks = "WanAttentionBlock" if settings.get("compile_transformer_blocks_only", True) else ""
        assert pack_lines(log, "compiled", blocks), log[-4000:]
    return graphs, errors


@pytest.mark.slow
def test_auto_policy_one_inductor_graph_for_all_sizes(make_host, tiny_wan):
    host = make_host()
    graphs, errors = sweep(host, tiny_wan, {"backend": "inductor", "shape_policy": "auto"})
    assert graphs[0] == 1, graphs  # identical blocks share one graph, and strides don't split it
    assert graphs[1:] == [0] * (len(SIZES) - 1), graphs
    assert max(errors) < 1e-3, errors


def test_auto_policy_covers_batch_two_after_batch_one(make_host, tiny_wan):
    """cfg > 1 doubles the batch: the 0/1-specialisation trap would cost a recompile here.
    Its own server: in the session's, earlier tests compiled this model with these settings, so
    the first sweep would reuse their graphs instead of compiling."""
    host = make_host()
    settings = {"backend": "aot_eager", "shape_policy": "auto", "dynamo_recompile_limit": 11}
    g1, _ = sweep(host, tiny_wan, settings, cfg=1.0, sizes=SIZES[:2])
    g2, _ = sweep(host, tiny_wan, settings, cfg=3.0, sizes=SIZES[2:4], compiles_first=False)
    assert g1[1:] == [0] and g2 == [0, 0], (g1, g2)


def test_static_policy_compiles_per_size(comfy_host, tiny_wan):
    settings = {"backend": "aot_eager", "shape_policy": "static"}
    graphs, errors = sweep(comfy_host, tiny_wan, settings, sizes=SIZES[:3])
    assert all(g >= 1 for g in graphs), graphs
    assert max(errors) < 1e-3


@pytest.mark.slow
def test_whole_model_inductor_stays_correct_across_sizes(make_host, tiny_wan):
    """Whole-model compile keeps spatial dims static: ComfyUI's WAN rope re-specialises them, and
    torch 2.13's FX graph cache then served the first size's graph at the second (rel L2 7.6e-3)."""
    host = make_host()
    settings = {"backend": "inductor", "compile_transformer_blocks_only": False}
    graphs, errors = sweep(host, tiny_wan, settings, sizes=SIZES[:2])
    assert max(errors) < 1e-3, errors
    assert graphs[0] >= 1
