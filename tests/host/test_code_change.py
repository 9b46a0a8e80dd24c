"""A ComfyUI update that changes a line of ``WanAttentionBlock.forward`` between two server runs:
compiled work saved or shared before it (saved regions, persistent and fleet entries) must never
compute the old code's output. Both a restart on the same user folder and a fleet worker on the
changed copy, fed by a worker on the original, give the changed code's output."""
import pytest

from harness import (NODE_DEFAULTS, ComfyHost, fallback_lines, host_copy, pack_lines, rel_l2,
                     replace_in_file, wan_t2v_prompt)

MODEL_FILE = "comfy/ldm/wan/model.py"
# the block's last residual: the feed-forward's output counts twice after the "update"
OLD_LINE = "        x = torch.addcmul(x, y, repeat_e(e[5], x))\n        return x\n"
NEW_LINE = "        x = torch.addcmul(x, 2 * y, repeat_e(e[5], x))\n        return x\n"
CHANGED = "the model's code changed since it was traced"


def compiled_and_eager(host, model_name):
    """(compiled latent, eager latent, the compiled prompts' log) on one server."""
    eager = host.latent(host.run(wan_t2v_prompt(model_name, apply=False, prefix="eager")))
    hist, log = host.run_compiled(lambda: wan_t2v_prompt(model_name, compile_settings=NODE_DEFAULTS,
                                                         prefix="compiled"))
    return host.latent(hist), eager, log


@pytest.fixture
def comfy_copy(tmp_path):
    """A ComfyUI folder whose model file the test updates between two server runs (the same
    path before and after, as an update in place or a fleet of identical containers has)."""
    return host_copy(tmp_path / "ComfyUI", MODEL_FILE)


@pytest.mark.slow
def test_a_restart_after_an_update_runs_the_new_code(tmp_path, tiny_wan_path, comfy_copy):
    base = tmp_path / "server"  # one user folder (the pack's persistent cache) for both runs
    with ComfyHost(base, models=[tiny_wan_path], comfy_dir=comfy_copy) as before:
        old, old_eager, log = compiled_and_eager(before, tiny_wan_path.name)
    assert "a restart loads it" in log and rel_l2(old, old_eager) < 1e-3, log
    replace_in_file(comfy_copy / MODEL_FILE, OLD_LINE, NEW_LINE)
    with ComfyHost(base, models=[tiny_wan_path], comfy_dir=comfy_copy) as after:
        new, new_eager, log = compiled_and_eager(after, tiny_wan_path.name)
    assert rel_l2(new_eager, old_eager) > 0.05  # the update changed what the model computes
    assert rel_l2(new, new_eager) < 1e-3, log
    said = pack_lines(log, CHANGED)
    assert len(said) == 1 and "comfy.ldm.wan.model lines" in said[0], log
    assert not fallback_lines(log) and not pack_lines(log, "saved region(s), no trace"), log


@pytest.mark.slow
def test_a_fleet_worker_on_the_new_code_does_not_run_an_old_workers_entry(tmp_path, tiny_wan_path,
                                                                        comfy_copy):
    shared = tmp_path / "network_volume"

    def worker(name):
        env = {"TORCH_COMPILE_SPEED_SHARED_CACHE": str(shared),
               "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"{name}_inductor")}
        with ComfyHost(tmp_path / name, models=[tiny_wan_path], env=env, comfy_dir=comfy_copy) as host:
            return (*compiled_and_eager(host, tiny_wan_path.name), host.log_text())

    old, old_eager, log, _ = worker("original")
    assert "published" in log and rel_l2(old, old_eager) < 1e-3, log
    replace_in_file(comfy_copy / MODEL_FILE, OLD_LINE, NEW_LINE)  # the second worker's ComfyUI
    new, new_eager, log, full = worker("updated")
    assert "shared cache hit" in full, full[-3000:]  # it did get the original worker's entry
    assert rel_l2(new_eager, old_eager) > 0.05
    assert rel_l2(new, new_eager) < 1e-3, log
    assert len(pack_lines(log, CHANGED)) == 1 and not fallback_lines(log), log


@pytest.mark.slow
def test_a_fleet_worker_with_the_same_code_at_another_path_traces_nothing(tmp_path, tiny_wan_path, comfy_copy):
    """The saved regions are bound to the code, not to where it is installed: a worker whose
    ComfyUI lives in another folder loads them without a trace."""
    shared = tmp_path / "network_volume"
    logs = []
    for name, comfy_dir in (("first", None), ("second", comfy_copy)):
        env = {"TORCH_COMPILE_SPEED_SHARED_CACHE": str(shared),
               "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"{name}_inductor")}
        with ComfyHost(tmp_path / name, models=[tiny_wan_path], env=env, comfy_dir=comfy_dir) as host:
            compiled, eager, log = compiled_and_eager(host, tiny_wan_path.name)
            assert rel_l2(compiled, eager) < 1e-3, log
            logs.append(log)
    assert "published" in logs[0]
    assert pack_lines(logs[1], "saved region(s), no trace") and not pack_lines(logs[1], "not used"), logs[1]
