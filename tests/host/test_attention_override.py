"""An attention override (what SageAttention-style patch nodes set:
``model_options["transformer_options"]["optimized_attention_override"]``) placed before and
after Apply, changed between runs and after a restart, on the settings node's defaults.

Every compiled output must match an eager run with the same override (rel L2 < 1e-3), the
regions must really be compiled or loaded (never the eager fallback), and the overrides must
give clearly different outputs, so a compiled graph or saved region that kept using the
previous override (a stale fast path) fails the comparison with eager."""
import itertools

import pytest

from harness import FOREGROUND, ComfyHost, fallback_lines, pack_lines, rel_l2, wan_t2v_prompt

SETTINGS = FOREGROUND  # the node's defaults, compiling in the prompt (what each override compiles)
DISTINCT = 1e-2  # two overrides' eager outputs differ by at least this (rel L2)


def override_prompt(model, override, where, prefix):
    """``where``: "eager" (loader -> override -> sampler), "before" (override -> Apply) or
    "after" (Apply -> override). Node ``ovr`` is TCSTestAttentionOverride."""
    p = wan_t2v_prompt(model, apply=where != "eager", compile_settings=SETTINGS, prefix=prefix)
    p["ovr"] = {"class_type": "TCSTestAttentionOverride",
                "inputs": {"model": ["loader", 0], "override": override}}
    if where == "before":
        p["apply"]["inputs"]["model"] = ["ovr", 0]
        return p
    if where == "after":
        p["ovr"]["inputs"]["model"] = ["apply", 0]
    p["sampler"]["inputs"]["model"] = ["ovr", 0]
    p["probe"]["inputs"]["model"] = ["ovr", 0]
    return p


def check_compiled_run(host, model, override, where, eager, tag):
    """Run one compiled prompt; return (latent, what the pack logged about the blocks)."""
    offset = host.log_offset()
    hist = host.run(override_prompt(model, override, where, f"c{tag}"))
    log = host.log_text(since=offset)
    out = host.latent(hist)
    err = rel_l2(out, eager)
    assert err < 1e-3, (override, where, err, log[-4000:])
    assert not fallback_lines(log), (override, where, log[-4000:])
    assert not pack_lines(log, "compile failed"), (override, where, log[-4000:])
    done = [ln for ln in pack_lines(log, "WanAttentionBlock")
            if "compiled" in ln.split("WanAttentionBlock")[0] or "loaded" in ln]
    assert done, (override, where, log[-4000:])
    print(f"{tag}: {override} {where} Apply: rel L2 {err:.2e}; {done[-1].split('[TorchCompileSpeed]')[-1]}")
    return out, log


@pytest.mark.slow
def test_attention_override_before_after_apply_changed_and_restarted(tmp_path, tiny_wan_path):
    model = tiny_wan_path.name
    base = tmp_path / "server"
    eager = {}

    def eager_run(host, override):
        if override not in eager:
            eager[override] = host.latent(host.run(override_prompt(model, override, "eager", f"e{override}")))
        return eager[override]

    # server 1: compile without an override first (the saved region is traced without one),
    # then an override after Apply, then another one before Apply
    with ComfyHost(base, models=[tiny_wan_path]) as host:
        first = [("none", "before"), ("negate_v", "after"), ("scale_q_0.5", "before")]
        for i, (override, where) in enumerate(first):
            _, log = check_compiled_run(host, model, override, where,
                                        eager_run(host, override), f"s1r{i}")
            if i == 0:  # the no-override trace was saved for the restart
                assert "saved region WanAttentionBlock-" in log, log[-4000:]
    # server 2, same base directory: server 1's saved variants are on disk (traced without an
    # override, with negate_v, with scale_q_0.5); no override, yet another override (none of
    # them may run it), then an earlier one. server 3: the variants of both are on disk; the
    # override of server 1's last run, after Apply this time, then negate_v after Apply. A saved
    # variant that accepted a call with another override would give that override's output.
    restarts = [[("none", "after"), ("scale_q_2", "after"), ("negate_v", "before")],
                [("scale_q_0.5", "after"), ("negate_v", "after")]]
    for n, runs in enumerate(restarts, 2):
        with ComfyHost(base, models=[tiny_wan_path]) as host:
            for i, (override, where) in enumerate(runs):
                _, log = check_compiled_run(host, model, override, where,
                                            eager_run(host, override), f"s{n}r{i}")
                for ln in pack_lines(log, "saved region", "not used"):
                    print("   ", ln.split("[TorchCompileSpeed]")[-1][:300])
    # the overrides really change the output (else a stale one would go unnoticed)
    for a, b in itertools.combinations(sorted(eager), 2):
        assert rel_l2(eager[a], eager[b]) > DISTINCT, (a, b, rel_l2(eager[a], eager[b]))
