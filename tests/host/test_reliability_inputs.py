"""On a real ComfyUI server: bad input is refused clearly, and the server keeps serving.

- A malformed WANCOMPILEARGS from another node (``TCSTestRawCompileArgs`` emits any JSON value)
  fails the Apply node with an error that names the key; the next prompt works.
- Out-of-range values in API prompts for the settings node are refused by /prompt (400) with
  ``node_errors`` naming the input; wrong types that pass ComfyUI's validation are refused by
  the node, naming the key.
- ``ptx_cache_dir`` from a workflow can only name a folder under the pack's own
  ``user/torch_compile_speed/`` or the operator's ``TORCH_COMPILE_SPEED_ALLOWED_ROOTS``: never
  ``temp/``, ``input/`` or ``output/``, which uploads write (Triton loads any ``.so`` there).
"""
import json

import pytest
import torch

from harness import ComfyHost, PromptError, rel_l2, wan_t2v_prompt

FAST = {"backend": "aot_eager"}
# What WanVideoWrapper's own settings node emits (a valid dict to break one key at a time).
VALID = {"backend": "aot_eager", "fullgraph": False, "mode": "default", "dynamic": False,
         "dynamo_cache_size_limit": 64, "dynamo_recompile_limit": 128,
         "compile_transformer_blocks_only": True, "force_parameter_static_shapes": False,
         "allow_unmerged_lora_compile": False}
REQUIRED = ["dynamo_cache_size_limit", "force_parameter_static_shapes", "compile_transformer_blocks_only",
            "fullgraph", "dynamic", "backend", "mode"]


def raw_args_prompt(model, value, prefix="raw"):
    """UNETLoader -> ApplyTorchCompile(compile_args = json.loads(value)) -> KSampler ..."""
    prompt = wan_t2v_prompt(model, compile_settings=FAST, prefix=prefix)
    prompt["raw"] = {"class_type": "TCSTestRawCompileArgs", "inputs": {"value": value}}
    prompt["apply"]["inputs"]["compile_args"] = ["raw", 0]
    del prompt["settings"]
    return prompt


def broken(**changes):
    args = dict(VALID)
    for k, v in changes.items():
        if v is KeyError:
            del args[k]
        else:
            args[k] = v
    return json.dumps(args)


# (case id, JSON value sent as WANCOMPILEARGS, words the error must contain)
MALFORMED = [
    ("list", "[1, 2]", ["WANCOMPILEARGS dict", "list"]),
    ("string", '"inductor"', ["WANCOMPILEARGS dict", "str"]),
    ("number", "42", ["WANCOMPILEARGS dict", "int"]),
    ("null", "null", ["WANCOMPILEARGS dict", "NoneType"]),
    ("empty", "{}", ["missing key(s)", *REQUIRED]),
    *[(f"missing-{k}", broken(**{k: KeyError}), ["missing key(s)", k]) for k in REQUIRED],
    ("fullgraph-str", broken(fullgraph="yes"), ["'fullgraph'", "true or false"]),
    ("dynamic-int", broken(dynamic=1), ["'dynamic'", "true or false"]),
    ("blocks_only-null", broken(compile_transformer_blocks_only=None), ["'compile_transformer_blocks_only'"]),
    ("static-str", broken(force_parameter_static_shapes="false"), ["'force_parameter_static_shapes'"]),
    ("cache-str", broken(dynamo_cache_size_limit="64"), ["'dynamo_cache_size_limit'", "integer"]),
    ("cache-float", broken(dynamo_cache_size_limit=64.0), ["'dynamo_cache_size_limit'", "integer"]),
    ("cache-bool", broken(dynamo_cache_size_limit=True), ["'dynamo_cache_size_limit'", "integer"]),
    ("backend-int", broken(backend=5), ["'backend'"]),
    ("mode-null", broken(mode=None), ["'mode'"]),
    ("reuse-str", broken(reuse_if_similar="true"), ["'reuse_if_similar'"]),
    ("ptx-dir-list", broken(ptx_cache_dir=["a"]), ["'ptx_cache_dir'", "string"]),
    ("warmup-str", broken(warmup_runs="1"), ["'warmup_runs'", "integer"]),
    ("mode-unknown", broken(mode="fastest"), ["'mode'", "fastest", "max-autotune"]),
    ("mode-speed-typo", broken(mode="Speed"), ["'mode'", "Speed"]),
    ("backend-unknown", broken(backend="nope"), ["'backend'", "nope", "inductor"]),
    ("policy-unknown", broken(shape_policy="wild"), ["'shape_policy'", "auto"]),
    ("cache-negative", broken(dynamo_cache_size_limit=-1), ["'dynamo_cache_size_limit'", "between 0 and 1024"]),
    ("cache-huge", broken(dynamo_cache_size_limit=10 ** 9), ["'dynamo_cache_size_limit'", "between"]),
    ("recompile-negative", broken(dynamo_recompile_limit=-5), ["'dynamo_recompile_limit'", "between"]),
    ("warmup-negative", broken(warmup_runs=-1), ["'warmup_runs'", "between 0 and 5"]),
    ("warmup-9", broken(warmup_runs=9), ["'warmup_runs'", "between 0 and 5"]),
    ("shapes-garbage", broken(declared_shapes="wide"), ["declared_shapes", "WIDTHxHEIGHTxFRAMES"]),
    ("shapes-min-over-max", broken(declared_shapes="512x512x9-256x256x9"), ["declared_shapes", "min exceeds max"]),
]


@pytest.mark.parametrize("value,words", [pytest.param(v, w, id=i) for i, v, w in MALFORMED])
def test_malformed_compile_args_are_refused_naming_the_key(comfy_host, tiny_wan, value, words):
    with pytest.raises(PromptError) as info:
        comfy_host.run(raw_args_prompt(tiny_wan, value))
    err = ComfyHost.execution_error(info.value)
    assert err["node_id"] == "apply" and err["exception_type"].endswith("CompileArgsError"), err
    for word in words:
        assert word in err["exception_message"], (word, err["exception_message"])
    assert "\n" not in err["exception_message"].strip()  # one line, not a traceback


def test_server_keeps_serving_after_malformed_input(comfy_host, tiny_wan):
    for value in ("null", broken(mode="fastest"), broken(backend=KeyError)):
        with pytest.raises(PromptError):
            comfy_host.run(raw_args_prompt(tiny_wan, value))
    eager = comfy_host.latent(comfy_host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="ok_e")))
    hist = comfy_host.run(raw_args_prompt(tiny_wan, json.dumps(VALID), prefix="ok_c"))
    assert rel_l2(comfy_host.latent(hist), eager) < 1e-6
    assert comfy_host.probe(hist)["apply_model_wrapper_keys"] == ["torch_compile_speed"]


def test_extra_keys_from_other_packs_are_ignored(comfy_host, tiny_wan):
    """Only what we know is read: unknown keys do not fail, and do not reach torch.compile."""
    value = json.dumps({**VALID, "compile_dynamo_cache": 1, "options": {"max_autotune": True},
                        "unknown": [1, 2]})
    eager = comfy_host.latent(comfy_host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="x_e")))
    hist = comfy_host.run(raw_args_prompt(tiny_wan, value, prefix="x_c"))
    assert rel_l2(comfy_host.latent(hist), eager) < 1e-6


# --------------------------------------------------------------------------- API prompt values

OUT_OF_RANGE = [
    ("warmup_runs", 9, "value_bigger_than_max"),
    ("warmup_runs", -1, "value_smaller_than_min"),
    ("dynamo_cache_size_limit", -1, "value_smaller_than_min"),
    ("dynamo_cache_size_limit", 1025, "value_bigger_than_max"),
    ("dynamo_recompile_limit", -1, "value_smaller_than_min"),
    ("mode", "fastest", "value_not_in_list"),
    ("backend", "nope", "value_not_in_list"),
    ("shape_policy", "wild", "value_not_in_list"),
    ("dynamo_cache_size_limit", "lots", "invalid_input_type"),
    ("warmup_runs", "1.5", "invalid_input_type"),
]


@pytest.mark.parametrize("key,value,kind", OUT_OF_RANGE)
def test_out_of_range_settings_are_refused_by_prompt_validation(comfy_host, tiny_wan, key, value, kind):
    code, body = comfy_host.post_prompt_raw(
        wan_t2v_prompt(tiny_wan, compile_settings={**FAST, key: value}, prefix="v"))
    assert code == 400, body
    errors = body["node_errors"]["settings"]["errors"]
    assert [(e["type"], e["extra_info"]["input_name"]) for e in errors] == [(kind, key)], errors


ZERO_LINE = "is 0, and at 0 torch compiles nothing, so the model runs eagerly"


@pytest.mark.parametrize("key", ["dynamo_cache_size_limit", "dynamo_recompile_limit"])
def test_an_old_workflows_limit_of_0_loads_and_runs_eagerly_said_once(comfy_host, tiny_wan, key):
    """The original pack and WanVideoWrapper accept 0 for both limits (0..1024), so saved
    workflows hold it; at 0 torch compiles nothing, and the pack says so once and runs eagerly."""
    eager = comfy_host.latent(comfy_host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix=f"z_e_{key}")))
    since = comfy_host.log_offset()
    for i in range(2):
        hist = comfy_host.run(wan_t2v_prompt(tiny_wan, compile_settings={**FAST, key: 0},
                                             prefix=f"z_c{i}_{key}"))
        assert torch.equal(comfy_host.latent(hist), eager)
        assert comfy_host.probe(hist)["apply_model_wrapper_keys"] == []  # nothing compiled
    said = [ln for ln in comfy_host.log_text(since).splitlines() if ZERO_LINE in ln]
    assert len(said) == 1 and key in said[0] and "set it to 1 or more" in said[0], said


def test_api_values_comfyui_coerces_still_build_valid_args(comfy_host, tiny_wan):
    """ComfyUI converts API values before the node sees them (INT: int(v); BOOLEAN: bool(v), so
    even "no" is True); what reaches the node is then valid and runs."""
    eager = comfy_host.latent(comfy_host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="co_e")))
    settings = {**FAST, "dynamo_cache_size_limit": "64", "fullgraph": "no", "warmup_runs": 1.0}
    hist = comfy_host.run(wan_t2v_prompt(tiny_wan, compile_settings=settings, prefix="co_c"))
    assert rel_l2(comfy_host.latent(hist), eager) < 1e-6


# --------------------------------------------------------------------------- ptx_cache_dir roots

@pytest.fixture(scope="module")
def paths_host(tmp_path_factory, tiny_wan_path):
    """A server whose operator allowed one more root; plus a symlink in the user dir that
    points outside every root."""
    top = tmp_path_factory.mktemp("paths")
    operator_root, outside = top / "operator_root", top / "outside"
    operator_root.mkdir()
    outside.mkdir()
    host = ComfyHost(top / "server", models=[tiny_wan_path],
                     env={"TORCH_COMPILE_SPEED_ALLOWED_ROOTS": str(operator_root)})
    (host.base_dir / "user" / "torch_compile_speed").mkdir(parents=True, exist_ok=True)
    (host.base_dir / "user" / "torch_compile_speed" / "link_out").symlink_to(outside, target_is_directory=True)
    with host:
        host.top, host.operator_root, host.outside = top, operator_root, outside
        host.eager = host.latent(host.run(wan_t2v_prompt(tiny_wan_path.name, apply=False, prefix="e")))
        yield host


def ptx(value, on=True):
    return {**FAST, "experimental_ptx": on, "ptx_cache_dir": value}


def _allowed_cases(h):
    return {
        "empty (default)": "",
        "relative": "tcs_ptx_rel",
        "relative with .. inside": "a/../tcs_ptx_b",
        "absolute in the pack's folder": str(h.base_dir / "user" / "torch_compile_speed" / "tcs_ptx_abs"),
        "operator root": str(h.operator_root / "tcs_ptx_op"),
    }


def _refused_cases(h):
    return {
        ".. escape": "../../tcs_ptx_escape",
        "deep .. escape": "a/b/../../../../../../tmp/tcs_ptx_escape2",
        "absolute outside": str(h.outside / "tcs_ptx_abs"),
        "absolute system dir": "/etc/tcs_ptx",
        "symlink in the pack's folder pointing outside": "link_out/tcs_ptx",
        "home": "~/tcs_ptx_home",
        "sibling with common prefix": str(h.operator_root) + "_evil/tcs_ptx",
        ".. into the temp root (uploads)": "../../temp/tcs_ptx_t",
        "absolute in temp (uploads)": str(h.base_dir / "temp" / "tcs_ptx_abs"),
        "absolute in input (uploads)": str(h.base_dir / "input" / "tcs_ptx_abs"),
        "absolute in user, outside the pack's folder": str(h.base_dir / "user" / "tcs_ptx_abs"),
    }


def test_allowed_ptx_cache_dirs_run(paths_host, tiny_wan):
    """Every allowed value runs and matches eager. On CPU experimental_ptx is skipped, so nothing
    is created (on CUDA the resolved dir holds the Triton cache)."""
    h = paths_host
    for label, value in _allowed_cases(h).items():
        hist = h.run(wan_t2v_prompt(tiny_wan, compile_settings=ptx(value), prefix="ok"))
        assert rel_l2(h.latent(hist), h.eager) < 1e-6, label
    pack = h.base_dir / "user" / "torch_compile_speed"
    for p in [pack / "tcs_ptx_rel", pack / "tcs_ptx_b", h.operator_root / "tcs_ptx_op"]:
        assert not p.exists(), p


def test_ptx_cache_dirs_outside_the_roots_are_refused(paths_host, tiny_wan):
    h = paths_host
    for label, value in _refused_cases(h).items():
        with pytest.raises(PromptError) as info:
            h.run(wan_t2v_prompt(tiny_wan, compile_settings=ptx(value), prefix="bad"))
        err = ComfyHost.execution_error(info.value)
        msg = err["exception_message"]
        assert err["node_id"] == "apply" and err["exception_type"].endswith("UnsafePathError"), (label, err)
        assert "ptx_cache_dir" in msg and "outside the allowed cache roots" in msg, (label, msg)
        assert "TORCH_COMPILE_SPEED_ALLOWED_ROOTS" in msg, msg  # how an operator allows more
    assert not any(h.outside.iterdir())
    assert not (h.top / "tcs_ptx_escape").exists()
    # and the server keeps serving
    hist = h.run(wan_t2v_prompt(tiny_wan, compile_settings=ptx(""), prefix="after_bad"))
    assert rel_l2(h.latent(hist), h.eager) < 1e-6


def test_unused_ptx_cache_dir_is_not_judged(paths_host, tiny_wan):
    """With experimental_ptx off the directory is never used (nor created), so it is ignored."""
    h = paths_host
    hist = h.run(wan_t2v_prompt(tiny_wan, compile_settings=ptx("../../tcs_ptx_unused", on=False),
                                prefix="unused"))
    assert rel_l2(h.latent(hist), h.eager) < 1e-6
    assert not (h.top / "tcs_ptx_unused").exists()


def test_outputs_identical_across_all_allowed_paths(paths_host, tiny_wan):
    """Sanity for the two tests above: the eager reference itself is deterministic here."""
    again = paths_host.latent(paths_host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="e2")))
    assert torch.equal(again, paths_host.eager)
