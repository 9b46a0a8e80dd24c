"""compile_core.torch_support.scoped: global torch knobs change only inside the ``with`` block."""
from __future__ import annotations

import os
import uuid

import pytest
import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config

from compile_core.plan.knobs import knobs_for
from compile_core.torch_support import scoped
from compile_core.plan.settings import CompileSettings, build_compile_args


def _fresh_values():
    """Knob values that differ from whatever is set now, so the test can see them applied."""
    return {
        "dynamo": {"recompile_limit": dynamo_config.recompile_limit + 3,
                   "accumulated_recompile_limit": dynamo_config.accumulated_recompile_limit + 5,
                   "force_parameter_static_shapes": not dynamo_config.force_parameter_static_shapes},
        "inductor": {"coordinate_descent_tuning": not inductor_config.coordinate_descent_tuning},
    }


def test_knobs_and_env_apply_inside_and_restore_after(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")      # existed before: restored
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)         # did not exist: removed again
    before = scoped.snapshot()
    knobs = _fresh_values()
    env = {"TRITON_CACHE_DIR": str(tmp_path), "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
    with scoped.scoped_state(**knobs, env=env):
        for name, value in knobs["dynamo"].items():
            assert getattr(dynamo_config, name) == value, name
        for name, value in knobs["inductor"].items():
            assert getattr(inductor_config, name) == value, name
        assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path)
        assert os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "0"
        assert scoped.snapshot() != before
    assert scoped.snapshot() == before
    assert "TRITON_CACHE_DIR" not in os.environ
    assert os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "1"


def test_state_is_restored_after_an_exception(tmp_path):
    before = scoped.snapshot()
    with pytest.raises(RuntimeError, match="inside the scope"):
        with scoped.scoped_state(**_fresh_values(), env={"TRITON_CACHE_DIR": str(tmp_path)}):
            assert scoped.snapshot() != before
            raise RuntimeError("inside the scope")
    assert scoped.snapshot() == before


def test_cache_dirs_torch_sets_inside_a_scope_do_not_outlive_it(monkeypatch, tmp_path):
    """Torch sets ``TORCHINDUCTOR_CACHE_DIR`` (inductor's ``cache_dir()``) and, on GPU,
    ``TRITON_CACHE_DIR`` (Triton's autotuner) when they are unset. Set during one of our runs,
    they would pin later compiles, ours and other packs', to that run's cache dir."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    with scoped.scoped_state(dynamo={"recompile_limit": 11}):
        cache_dir()  # torch's own call
        assert "TORCHINDUCTOR_CACHE_DIR" in os.environ
        os.environ["TRITON_CACHE_DIR"] = str(tmp_path / "triton")  # as Triton's autotuner does
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert "TRITON_CACHE_DIR" not in os.environ


def test_nested_scopes_restore_in_order():
    before = scoped.snapshot()
    with scoped.scoped_state(dynamo={"recompile_limit": 11}):
        with scoped.scoped_state(dynamo={"recompile_limit": 22}):
            assert dynamo_config.recompile_limit == 22
        assert dynamo_config.recompile_limit == 11
    assert scoped.snapshot() == before


def test_freezing_is_forced_off_inside_and_restored_after():
    saved = inductor_config.freezing
    inductor_config.freezing = True
    try:
        with scoped.scoped_state():
            assert inductor_config.freezing is False
        with scoped.scoped_state(inductor={"freezing": True}):  # cannot be asked for either
            assert inductor_config.freezing is False
        assert inductor_config.freezing is True
    finally:
        inductor_config.freezing = saved


def test_unknown_knob_warns_once_and_is_ignored(pack_log):
    name = f"tcs_no_such_knob_{uuid.uuid4().hex[:8]}"  # warn_once is per process: a new name
    before = scoped.snapshot()
    for _ in range(2):
        with scoped.scoped_state(dynamo={name: 1, "recompile_limit": 5}):
            assert not hasattr(dynamo_config, name)
            assert dynamo_config.recompile_limit == 5  # the known knob still applies
    warnings = pack_log.warnings()
    assert len(warnings) == 1, warnings
    assert name in warnings[0] and "torch._dynamo.config" in warnings[0]
    assert warnings[0].startswith("[TorchCompileSpeed]")
    assert scoped.snapshot() == before


def test_unknown_inductor_knob_warns_once(pack_log):
    name = f"tcs_no_such_knob_{uuid.uuid4().hex[:8]}"
    for _ in range(2):
        with scoped.scoped_state(inductor={name: True}):
            assert not hasattr(inductor_config, name)
    assert len(pack_log.warnings()) == 1 and "torch._inductor.config" in pack_log.warnings()[0]


def _speed():
    return CompileSettings.from_args(build_compile_args(mode="speed", dynamo_cache_size_limit=32,
                                                        dynamo_recompile_limit=16))


def test_knobs_for_speed_on_cuda_and_cpu():
    s = _speed()
    assert s.shape_policy == "auto" and s.force_parameter_static_shapes is False
    cuda, cpu = knobs_for(s, on_cuda=True), knobs_for(s, on_cuda=False)
    # auto marks exactly the latent dims dynamic, so weights stay static under it
    expected_dynamo = {"recompile_limit": 32, "accumulated_recompile_limit": 32,
                       "force_parameter_static_shapes": True}
    assert cuda["dynamo"] == expected_dynamo and cpu["dynamo"] == expected_dynamo
    # the speed preset autotunes nothing (no coordinate-descent tuning on CUDA either)
    assert cuda["inductor"] == {} and cpu["inductor"] == {}


def test_knobs_for_default_mode_and_ptx():
    s = CompileSettings.from_args(build_compile_args(
        mode="default", dynamo_cache_size_limit=8, dynamo_recompile_limit=100,
        force_parameter_static_shapes=True, experimental_ptx=True, ptx_fast_math=True))
    k = knobs_for(s, on_cuda=True)
    assert k["dynamo"] == {"recompile_limit": 8, "accumulated_recompile_limit": 100,
                           "force_parameter_static_shapes": True}
    assert k["inductor"] == {"use_fast_math": True}
    assert knobs_for(s, on_cuda=False)["inductor"] == {}
    no_fast = CompileSettings.from_args(build_compile_args(
        mode="default", experimental_ptx=True, ptx_fast_math=False))
    assert knobs_for(no_fast, on_cuda=True)["inductor"] == {}


@pytest.mark.parametrize("policy, asked, expected", [
    ("auto", False, True), ("auto", True, True), ("static", False, False), ("static", True, True),
    ("dynamic", False, False),
])
def test_force_parameter_static_shapes_per_policy(policy, asked, expected):
    s = CompileSettings.from_args(build_compile_args(
        mode="default", shape_policy=policy, force_parameter_static_shapes=asked))
    assert knobs_for(s, on_cuda=False)["dynamo"]["force_parameter_static_shapes"] is expected


@pytest.mark.parametrize("policy", ["auto", "static", "dynamic"])
def test_fx_knobs_only_under_auto(policy):
    s = CompileSettings.from_args(build_compile_args(mode="default", shape_policy=policy))
    fx = knobs_for(s, on_cuda=False)["fx"]
    assert bool(fx) is (policy == "auto")
    import torch.fx.experimental._config as fx_config
    assert set(fx) <= set(fx_config.get_config_copy())
    before = scoped.snapshot()
    with scoped.scoped_state(fx=fx):
        for name, value in fx.items():
            assert getattr(fx_config, name) == value
    assert scoped.snapshot() == before


@pytest.mark.parametrize("on_cuda", [True, False])
def test_every_knob_the_pack_asks_for_exists_in_this_torch(on_cuda, pack_log):
    s = CompileSettings.from_args(build_compile_args(mode="speed", experimental_ptx=True))
    k = knobs_for(s, on_cuda)
    assert set(k["dynamo"]) <= set(dynamo_config.get_config_copy())
    assert set(k["inductor"]) <= set(inductor_config.get_config_copy())
    with scoped.scoped_state(**k):
        for name, value in k["dynamo"].items():
            assert getattr(dynamo_config, name) == value
    assert pack_log.warnings() == []


def test_snapshot_sees_tf32_and_pack_env_changes(monkeypatch, tmp_path):
    before = scoped.snapshot()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert scoped.snapshot() != before
    monkeypatch.undo()
    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium" if saved != "medium" else "high")
        assert scoped.snapshot() != before
    finally:
        torch.set_float32_matmul_precision(saved)
    assert scoped.snapshot() == before


def test_graph_break_trace_restores_the_cache_dir_torch_sets_during_it(monkeypatch, tmp_path):
    """torch 2.9 sets TORCHINDUCTOR_CACHE_DIR while compiling; ``find_graph_breaks`` runs in a
    scope of its own, so that does not outlive the trace (simulated: set during the trace)."""
    from compile_core.diagnose import graph_breaks
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    original = graph_breaks._break_counts

    def counts_and_set_env():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "set-by-torch")
        return original()

    monkeypatch.setattr(graph_breaks, "_break_counts", counts_and_set_env)
    assert graph_breaks.find_graph_breaks(torch.nn.Linear(4, 4), (torch.randn(2, 4),), {}) == []
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
