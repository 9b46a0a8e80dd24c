"""The WANCOMPILEARGS contract (compile_core.plan.settings) and the settings node that emits it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from compile_core.torch_support import scoped
from compile_core.plan.settings import (NEW_EXTRA_KEYS, RETIRED_KEYS, CompileArgsError, CompileSettings,
                                   backend_choices, build_compile_args, torch_modes)

WAN_KEYS = ["backend", "fullgraph", "mode", "dynamic", "dynamo_cache_size_limit",
            "dynamo_recompile_limit", "compile_transformer_blocks_only",
            "force_parameter_static_shapes", "allow_unmerged_lora_compile"]
LEGACY_KEYS = ["reuse_if_similar", "experimental_ptx", "ptx_fast_math", "warmup_runs",
               "ptx_cache_dir", "speed_preset"]
KEY_TYPES = {"backend": str, "fullgraph": bool, "mode": str, "dynamic": bool,
             "dynamo_cache_size_limit": int, "dynamo_recompile_limit": int,
             "compile_transformer_blocks_only": bool, "force_parameter_static_shapes": bool,
             "allow_unmerged_lora_compile": bool, "reuse_if_similar": bool,
             "experimental_ptx": bool, "ptx_fast_math": bool, "warmup_runs": int,
             "ptx_cache_dir": str, "speed_preset": bool, "shape_policy": str,
             "declared_shapes": str, "background_compile": bool}
# The 7 keys WanVideoWrapper's consumers index directly.
WAN_INDEXED = ["dynamo_cache_size_limit", "force_parameter_static_shapes",
               "compile_transformer_blocks_only", "fullgraph", "dynamic", "backend", "mode"]


def wan_dict(**overrides):
    """What WanVideoWrapper's own settings node emits (its UI defaults): 9 keys, no extras."""
    d = {"backend": "inductor", "fullgraph": False, "mode": "default", "dynamic": False,
         "dynamo_cache_size_limit": 64, "dynamo_recompile_limit": 128,
         "compile_transformer_blocks_only": True, "force_parameter_static_shapes": False,
         "allow_unmerged_lora_compile": False}
    d.update(overrides)
    return d


def wan_consumer(args: dict, module: nn.Module):
    """Reads the dict the way WanVideoWrapper's sampler/loaders do, then compiles like it."""
    cache_limit = args["dynamo_cache_size_limit"]
    static_params = args["force_parameter_static_shapes"]
    blocks_only = args["compile_transformer_blocks_only"]
    recompile_limit = args.get("dynamo_recompile_limit", 128)  # missing: only a warning there
    args.get("allow_unmerged_lora_compile", False)
    assert isinstance(blocks_only, bool)
    # WanVideoWrapper sets these globally and never restores them; the test scopes them.
    patch = torch._dynamo.config.patch(recompile_limit=cache_limit,
                                       accumulated_recompile_limit=max(recompile_limit, cache_limit),
                                       force_parameter_static_shapes=static_params)
    with scoped.scoped_state():  # the consumer's compile: torch 2.8/2.9 set TORCHINDUCTOR_CACHE_DIR
        compiled = torch.compile(module, fullgraph=args["fullgraph"], dynamic=args["dynamic"],
                                 backend=args["backend"], mode=args["mode"])
    return compiled, patch


# -- build_compile_args ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["speed", "default", "max-autotune"])
def test_dict_has_wan_keys_first_in_order_then_legacy_extras(mode):
    args = build_compile_args(mode=mode)
    keys = list(args)
    assert keys[:9] == WAN_KEYS
    assert keys[9:15] == LEGACY_KEYS
    assert keys[15:] == list(NEW_EXTRA_KEYS)  # this pack's own keys come last
    assert not set(NEW_EXTRA_KEYS) & set(WAN_KEYS + LEGACY_KEYS)
    for key in keys:
        assert type(args[key]) is KEY_TYPES[key], (key, args[key])


@pytest.mark.parametrize("value", [True, False])
def test_a_dict_with_a_retired_key_loads_and_ignores_it(value):
    """Dicts and workflows saved by earlier versions carry ``whole_graph``: accepted and ignored;
    the key is no longer emitted."""
    args = build_compile_args()
    assert not set(RETIRED_KEYS) & set(args)
    assert CompileSettings.from_args({**args, "whole_graph": value}) == CompileSettings.from_args(args)


def test_speed_mode_is_translated_to_a_real_torch_mode():
    args = build_compile_args(backend="cudagraphs", mode="speed", dynamic=False)
    assert args["backend"] == "inductor"
    assert args["mode"] == "max-autotune-no-cudagraphs"
    assert args["dynamic"] is True
    assert args["speed_preset"] is True
    from torch._inductor import list_mode_options
    assert args["mode"] in list_mode_options()


def test_non_speed_mode_passes_through_unchanged():
    args = build_compile_args(backend="aot_eager", mode="default", dynamic=False)
    assert (args["backend"], args["mode"], args["dynamic"], args["speed_preset"]) == \
        ("aot_eager", "default", False, False)


def test_build_defaults_match_the_old_pack():
    args = build_compile_args()
    assert args["dynamo_cache_size_limit"] == 64
    assert args["dynamo_recompile_limit"] == 128
    assert args["compile_transformer_blocks_only"] is True
    assert args["reuse_if_similar"] is True
    assert args["experimental_ptx"] is False
    assert args["ptx_fast_math"] is True
    assert args["warmup_runs"] == 1
    assert args["ptx_cache_dir"] == ""
    assert args["force_parameter_static_shapes"] is False
    assert args["allow_unmerged_lora_compile"] is False


def test_build_rejects_bad_values_with_the_key_named():
    with pytest.raises(CompileArgsError, match="warmup_runs"):
        build_compile_args(warmup_runs=9)
    with pytest.raises(CompileArgsError, match="dynamo_cache_size_limit"):
        build_compile_args(dynamo_cache_size_limit=-1)


def test_wan_consumer_compiles_and_runs_a_default_mode_dict():
    args = build_compile_args(backend="aot_eager", mode="default", dynamic=False)
    lin = nn.Linear(4, 4)
    compiled, patch = wan_consumer(args, lin)
    x = torch.randn(3, 4)
    with patch, torch.no_grad(), scoped.scoped_state():
        torch.testing.assert_close(compiled(x), lin(x))


def test_wan_consumer_accepts_the_speed_dict():
    args = build_compile_args(mode="speed")
    compiled, patch = wan_consumer(args, nn.Linear(4, 4))  # inductor validates mode here
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    # ...and the untranslated UI mode would not have been accepted:
    with scoped.scoped_state(), pytest.raises(RuntimeError, match="speed"):
        torch.compile(nn.Linear(4, 4), backend="inductor", mode="speed")


def test_old_pack_dict_crashes_a_wan_consumer_but_ours_does_not():
    old = build_compile_args(mode="default", backend="aot_eager")
    del old["force_parameter_static_shapes"]  # what the original pack emitted
    with pytest.raises(KeyError):
        wan_consumer(old, nn.Linear(4, 4))
    wan_consumer(build_compile_args(mode="default", backend="aot_eager"), nn.Linear(4, 4))


# -- CompileSettings.from_args --------------------------------------------------------------------

@pytest.mark.parametrize("value", [None, [], "inductor", ("backend", "inductor")])
def test_from_args_rejects_non_dicts(value):
    with pytest.raises(CompileArgsError, match="WANCOMPILEARGS"):
        CompileSettings.from_args(value)


@pytest.mark.parametrize("key", WAN_INDEXED)
def test_from_args_rejects_each_missing_required_key(key):
    d = build_compile_args(mode="default")
    del d[key]
    with pytest.raises(CompileArgsError, match=key):
        CompileSettings.from_args(d)


@pytest.mark.parametrize("key, value", [
    ("fullgraph", 1), ("fullgraph", "true"), ("dynamic", 0), ("dynamic", "False"),
    ("compile_transformer_blocks_only", 1), ("force_parameter_static_shapes", "yes"),
    ("allow_unmerged_lora_compile", 0), ("reuse_if_similar", 1), ("experimental_ptx", "false"),
    ("ptx_fast_math", None), ("speed_preset", 1),
    ("dynamo_cache_size_limit", True), ("dynamo_cache_size_limit", "64"),
    ("dynamo_cache_size_limit", 64.0), ("dynamo_recompile_limit", False), ("warmup_runs", "1"),
    ("ptx_cache_dir", 3),
])
def test_from_args_rejects_wrong_types(key, value):
    d = build_compile_args(mode="default")
    d[key] = value
    with pytest.raises(CompileArgsError, match=key):
        CompileSettings.from_args(d)


@pytest.mark.parametrize("key, value", [
    ("mode", "fastest"), ("mode", None), ("mode", "Default"),
    ("backend", "no-such-backend"), ("backend", None), ("backend", "Inductor"),
    ("dynamo_cache_size_limit", -1), ("dynamo_cache_size_limit", 1025),
    ("dynamo_recompile_limit", -1), ("dynamo_recompile_limit", 1025),
    ("warmup_runs", -1), ("warmup_runs", 6),
])
def test_from_args_rejects_bad_values(key, value):
    d = build_compile_args(mode="default")
    d[key] = value
    with pytest.raises(CompileArgsError, match=key):
        CompileSettings.from_args(d)


@pytest.mark.parametrize("key, value", [
    ("dynamo_cache_size_limit", 0), ("dynamo_recompile_limit", 0),  # the original pack's minimum
    ("dynamo_cache_size_limit", 1), ("dynamo_cache_size_limit", 1024),
    ("dynamo_recompile_limit", 1), ("dynamo_recompile_limit", 1024),
    ("warmup_runs", 0), ("warmup_runs", 5), ("dynamic", None),
])
def test_from_args_accepts_boundaries(key, value):
    d = build_compile_args(mode="default")
    d[key] = value
    CompileSettings.from_args(d)


def test_compile_args_error_is_a_value_error():
    assert issubclass(CompileArgsError, ValueError)


def test_from_args_accepts_wanvideowrapper_dict_with_defaults_for_the_rest():
    s = CompileSettings.from_args(wan_dict())
    assert s == CompileSettings(backend="inductor", fullgraph=False, mode="default", dynamic=False,
                                cache_size_limit=64, recompile_limit=128, blocks_only=True,
                                force_parameter_static_shapes=False,
                                allow_unmerged_lora_compile=False)
    assert (s.reuse_if_similar, s.experimental_ptx, s.ptx_fast_math, s.warmup_runs,
            s.ptx_cache_dir, s.speed_preset) == (True, False, True, 1, "", False)


def test_from_args_without_recompile_limit_uses_default():
    d = wan_dict()
    del d["dynamo_recompile_limit"]
    del d["allow_unmerged_lora_compile"]
    s = CompileSettings.from_args(d)
    assert s.recompile_limit == 128 and s.allow_unmerged_lora_compile is False


def test_from_args_round_trips_the_node_dict():
    d = build_compile_args(backend="aot_eager", mode="default", fullgraph=True, dynamic=True,
                           dynamo_cache_size_limit=7, compile_transformer_blocks_only=False,
                           reuse_if_similar=False, experimental_ptx=True, ptx_fast_math=False,
                           warmup_runs=3, ptx_cache_dir="x/y", dynamo_recompile_limit=9,
                           force_parameter_static_shapes=True, allow_unmerged_lora_compile=True)
    s = CompileSettings.from_args(d)
    assert s == CompileSettings(
        backend="aot_eager", fullgraph=True, mode="default", dynamic=True, cache_size_limit=7,
        recompile_limit=9, blocks_only=False, force_parameter_static_shapes=True,
        allow_unmerged_lora_compile=True, reuse_if_similar=False, experimental_ptx=True,
        ptx_fast_math=False, warmup_runs=3, ptx_cache_dir="x/y", speed_preset=False)


def test_from_args_translates_a_raw_speed_mode():
    """The pack's Apply compiles the speed preset in mode default (autotuning doubled the cold
    compile on a GPU for no faster step)."""
    s = CompileSettings.from_args(wan_dict(mode="speed", backend="cudagraphs", dynamic=False))
    assert (s.backend, s.mode, s.dynamic, s.speed_preset) == ("inductor", "default", True, True)


def test_the_speed_preset_dict_compiles_in_mode_default_and_an_explicit_mode_is_kept():
    preset = CompileSettings.from_args(build_compile_args(mode="speed"))
    assert (preset.mode, preset.speed_preset) == ("default", True)
    assert preset.artifact_key() == CompileSettings.from_args(build_compile_args(mode="default")).artifact_key()
    chosen = CompileSettings.from_args(build_compile_args(mode="max-autotune-no-cudagraphs"))
    assert (chosen.mode, chosen.speed_preset) == ("max-autotune-no-cudagraphs", False)


def test_from_args_does_not_mutate_its_input():
    d = wan_dict(mode="speed")
    before = dict(d)
    CompileSettings.from_args(d)
    assert d == before


def test_torch_modes_are_the_real_ones():
    from torch._inductor import list_mode_options
    assert set(torch_modes()) == set(list_mode_options()) | {"default"}


def test_backend_choices():
    choices = backend_choices()
    assert choices[:2] == ["inductor", "cudagraphs"]
    assert {"eager", "aot_eager"} <= set(choices)
    assert len(choices) == len(set(choices))
    registered = set(torch._dynamo.list_backends(exclude_tags=()))
    # every registered backend, except torch's own failure-injection ones
    assert set(choices) == {b for b in registered if not b.endswith("_TESTING_ONLY")} | {
        "inductor", "cudagraphs"}
    assert not any(b.endswith("_TESTING_ONLY") for b in choices)


def test_backend_choices_include_a_newly_registered_backend(raising_backend):
    assert raising_backend.name in backend_choices()
    d = build_compile_args(backend=raising_backend.name, mode="default")
    assert CompileSettings.from_args(d).backend == raising_backend.name


@pytest.mark.parametrize("backend, mode, expected_mode", [
    ("inductor", "max-autotune", "max-autotune"),
    ("inductor", "default", None),
    ("aot_eager", "max-autotune", None),
    ("eager", "reduce-overhead", None),
    ("cudagraphs", "max-autotune-no-cudagraphs", None),
])
def test_compile_kwargs_mode_only_for_inductor(backend, mode, expected_mode):
    s = CompileSettings(backend=backend, mode=mode, fullgraph=True, dynamic=None)
    assert s.compile_kwargs() == {"backend": backend, "mode": expected_mode, "fullgraph": True,
                                  "dynamic": None}


def test_compile_kwargs_are_accepted_by_torch_compile():
    s = CompileSettings.from_args(build_compile_args(backend="aot_eager", mode="max-autotune"))
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.no_grad(), scoped.scoped_state():  # torch 2.8/2.9 set TORCHINDUCTOR_CACHE_DIR
        f = torch.compile(lin, **s.compile_kwargs())
        torch.testing.assert_close(f(x), lin(x))


@pytest.mark.parametrize("policy", ["auto", "static", "dynamic"])
def test_shape_policy_is_validated_and_kept(policy):
    d = build_compile_args(mode="default", shape_policy=policy)
    assert CompileSettings.from_args(d).shape_policy == policy


@pytest.mark.parametrize("value", ["fast", "", None, "Auto", 1])
def test_bad_shape_policy_is_rejected_by_name(value):
    d = build_compile_args(mode="default")
    d["shape_policy"] = value
    with pytest.raises(CompileArgsError, match="shape_policy"):
        CompileSettings.from_args(d)


@pytest.mark.parametrize("policy, expected", [("auto", None), ("static", False), ("dynamic", True)])
@pytest.mark.parametrize("dynamic", [False, None, True])
def test_compile_kwargs_dynamic_follows_the_shape_policy(policy, expected, dynamic):
    """The ``dynamic`` key is for WanVideoWrapper; the pack's own compile follows shape_policy."""
    assert CompileSettings(shape_policy=policy, dynamic=dynamic).compile_kwargs()["dynamic"] is expected


@pytest.mark.parametrize("text, expected", [
    ("", None), ("  ", None),
    ("832x480x81", ((832, 480, 81), (832, 480, 81))),
    ("512x512x1-1280x720x81", ((512, 512, 1), (1280, 720, 81))),
    (" 512 X 512 x 1 - 1280x720x81 ", ((512, 512, 1), (1280, 720, 81))),
])
def test_declared_shapes_parse(text, expected):
    d = build_compile_args(mode="default", declared_shapes=text)
    assert CompileSettings.from_args(d).declared_shapes == expected


@pytest.mark.parametrize("text", ["abc", "832x480", "832x480x81x2", "0x480x81", "832x480x-1",
                                  "1280x720x81-512x512x1", "1x1x1-2x2x2-3x3x3", "8.5x8x8"])
def test_bad_declared_shapes_are_rejected_by_name(text):
    d = build_compile_args(mode="default")
    d["declared_shapes"] = text
    with pytest.raises(CompileArgsError, match="declared_shapes"):
        CompileSettings.from_args(d)


def test_artifact_key_tracks_what_changes_compiled_code():
    base = CompileSettings()
    same = CompileSettings(reuse_if_similar=False, warmup_runs=3, ptx_cache_dir="elsewhere",
                           cache_size_limit=8, recompile_limit=9, dynamic=True, speed_preset=True)
    assert base.artifact_key() == same.artifact_key()
    for change in [dict(backend="aot_eager"), dict(mode="max-autotune"), dict(fullgraph=True),
                   dict(blocks_only=False),
                   dict(force_parameter_static_shapes=True),
                   dict(experimental_ptx=True), dict(shape_policy="static")]:
        assert CompileSettings(**change).artifact_key() != base.artifact_key(), change


# -- the settings node ----------------------------------------------------------------------------

REQUIRED_ORDER = ["backend", "fullgraph", "mode", "dynamic", "dynamo_cache_size_limit",
                  "compile_transformer_blocks_only", "reuse_if_similar", "experimental_ptx",
                  "ptx_fast_math", "warmup_runs"]
OPTIONAL_ORDER = ["ptx_cache_dir", "dynamo_recompile_limit", "force_parameter_static_shapes",
                  "allow_unmerged_lora_compile"]


@pytest.fixture
def node_cls(pack):
    return pack.nodes.settings_node.TorchCompileSpeedSettings


def test_node_input_order(node_cls):
    """Old workflows store widget values by position: the old inputs keep their places and
    every new input comes after them."""
    spec = node_cls.INPUT_TYPES()
    assert list(spec) == ["required", "optional"]
    assert list(spec["required"]) == REQUIRED_ORDER
    assert list(spec["optional"])[:len(OPTIONAL_ORDER)] == OPTIONAL_ORDER


def test_node_has_an_input_for_every_dict_key(node_cls):
    spec = node_cls.INPUT_TYPES()
    inputs = [*spec["required"], *spec["optional"]]
    assert set(inputs) == set(build_compile_args()) - {"speed_preset"}


def test_node_defaults_and_choices(node_cls):
    spec = node_cls.INPUT_TYPES()
    inputs = {**spec["required"], **spec["optional"]}
    defaults = {k: v[1]["default"] for k, v in inputs.items()}
    assert defaults.items() >= {
        "backend": "inductor", "fullgraph": False, "mode": "speed", "dynamic": False,
        "dynamo_cache_size_limit": 64, "compile_transformer_blocks_only": True,
        "reuse_if_similar": True, "experimental_ptx": False, "ptx_fast_math": True,
        "warmup_runs": 1, "ptx_cache_dir": "", "dynamo_recompile_limit": 128,
        "force_parameter_static_shapes": False, "allow_unmerged_lora_compile": False}.items()
    assert inputs["backend"][0][:2] == ["inductor", "cudagraphs"]
    assert inputs["mode"][0] == ["default", "max-autotune", "max-autotune-no-cudagraphs",
                                 "reduce-overhead", "speed"]
    assert set(inputs["mode"][0]) - {"speed"} <= set(torch_modes())
    for key in ("fullgraph", "dynamic", "compile_transformer_blocks_only", "reuse_if_similar",
                "experimental_ptx", "ptx_fast_math", "force_parameter_static_shapes",
                "allow_unmerged_lora_compile"):
        assert inputs[key][0] == "BOOLEAN", key
    assert inputs["ptx_cache_dir"][0] == "STRING"
    for key, lo, hi in [("dynamo_cache_size_limit", 0, 1024), ("dynamo_recompile_limit", 0, 1024),
                        ("warmup_runs", 0, 5)]:
        assert inputs[key][0] == "INT"
        assert (inputs[key][1]["min"], inputs[key][1]["max"]) == (lo, hi), key


def test_node_every_input_has_a_tooltip(node_cls):
    spec = node_cls.INPUT_TYPES()
    for section in ("required", "optional"):
        for key, value in spec[section].items():
            tip = value[1].get("tooltip")
            assert isinstance(tip, str) and tip.strip(), key


def test_node_class_attributes(node_cls):
    assert node_cls.CATEGORY == "optimization"
    assert node_cls.RETURN_TYPES == ("WANCOMPILEARGS",)
    assert node_cls.RETURN_NAMES == ("torch_compile_args",)
    assert callable(getattr(node_cls(), node_cls.FUNCTION))


def test_node_build_with_the_old_packs_inputs_only(node_cls):
    old_inputs = {"backend": "inductor", "fullgraph": False, "mode": "speed", "dynamic": False,
                  "dynamo_cache_size_limit": 64, "compile_transformer_blocks_only": True,
                  "reuse_if_similar": True, "experimental_ptx": False, "ptx_fast_math": True,
                  "warmup_runs": 1, "ptx_cache_dir": "", "dynamo_recompile_limit": 128}
    out = getattr(node_cls(), node_cls.FUNCTION)(**old_inputs)
    assert isinstance(out, tuple) and len(out) == 1
    args = out[0]
    assert list(args)[:15] == WAN_KEYS + LEGACY_KEYS
    assert args["mode"] == "max-autotune-no-cudagraphs" and args["speed_preset"] is True
    assert args["force_parameter_static_shapes"] is False
    CompileSettings.from_args(args)


def test_node_build_with_the_widget_defaults_matches_build_compile_args(node_cls):
    spec = node_cls.INPUT_TYPES()
    inputs = {k: v[1]["default"] for s in ("required", "optional") for k, v in spec[s].items()}
    (args,) = getattr(node_cls(), node_cls.FUNCTION)(**inputs)
    assert args == build_compile_args()


def test_node_build_rejects_a_bad_value_by_name(node_cls, pack):
    with pytest.raises(ValueError, match="warmup_runs"):
        node_cls().build(warmup_runs=7)
