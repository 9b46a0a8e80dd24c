"""Model zoo on the REAL ComfyUI classes of the selected host: a representative subset of
``regions/model_zoo.py`` (the full zoo is ``scripts/model_zoo.sh``; its table is in docs/model-zoo.md).

Each case builds a tiny random model of a family that ``regions.BLOCK_ATTRS`` does not list, so its
blocks must be *discovered*, and runs it eagerly and through ``engine.prepare(...).run(...)``
(``aot_eager``: the graph count is dynamo's, the backend does not change it) at one latent size and
then at a second one. Chosen to cover the shape rules: Lumina 2 (rope pairs, text + image tokens),
PixArt (image tokens, cross attention), OmniGen 2 (its whole-model compile failed in inductor), Cosmos
Predict2 (channels-last video: a ``FAMILY_DYNAMIC_DIMS`` override), and a Lumina 2 with one block per
list, which discovery cannot handle: it compiles whole, with one log line saying why.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from harness import COMFY_DIR, HOST_ENV, HOST_VERSION, PYTHON, host_env

SCRIPT = Path(__file__).resolve().parent / "regions" / "model_zoo.py"
DISCOVERED = {  # case -> (family, blocks described)
    "lumina2": ("NextDiT", "JointTransformerBlock x2"),
    "pixart": ("PixArtMS", "PixArtMSBlock x2"),
    "omnigen2": ("OmniGen2Transformer2DModel", "OmniGen2TransformerBlock x2"),
    "cosmos_predict2": ("MiniTrainDIT", "Block x2"),
}
WHOLE = "lumina2_shallow"


@pytest.fixture(scope="module")
def zoo():
    if not (COMFY_DIR / "comfy").is_dir():
        pytest.skip(f"ComfyUI host {HOST_VERSION} not found at {COMFY_DIR} (run scripts/bootstrap.sh)")
    env = host_env(**{HOST_ENV: str(COMFY_DIR)})
    cases = ",".join([*DISCOVERED, WHOLE])
    proc = subprocess.run([PYTHON, str(SCRIPT), "--backend", "aot_eager", "--cases", cases],
                          cwd=COMFY_DIR, env=env, capture_output=True, text=True, timeout=600)
    out = {r["case"]: r for r in map(json.loads, filter(lambda ln: ln.startswith("{"), proc.stdout.splitlines()))}
    assert proc.returncode == 0 and set(out) == {*DISCOVERED, WHOLE}, (
        f"host={HOST_VERSION} rc={proc.returncode}\n{json.dumps(out, indent=1)[-4000:]}\n{proc.stderr[-3000:]}")
    return out


@pytest.mark.parametrize("case", list(DISCOVERED))
def test_blocks_are_discovered_and_compiled_regionally(zoo, case):
    rec = zoo[case]
    assert rec["status"] == "regional", rec  # not whole, not fallen back to eager
    assert (rec["family"], rec["blocks"]) == DISCOVERED[case], rec
    assert rec["regions_called"] == rec["regions"] >= 2, rec  # every block entered through __call__
    assert rec["graphs_first"] >= 1, rec  # something really compiled


@pytest.mark.parametrize("case", list(DISCOVERED))
def test_compiled_matches_eager_at_both_sizes(zoo, case):
    rec = zoo[case]
    assert rec["status"] == "regional", rec
    assert len(rec["rel_l2"]) == 2 and max(rec["rel_l2"]) <= 1e-3, rec


@pytest.mark.parametrize("case", list(DISCOVERED))
def test_a_second_latent_size_needs_no_new_graph(zoo, case):
    rec = zoo[case]
    assert rec["status"] == "regional", rec
    assert rec["graphs_second_size"] == 0, rec  # one graph serves every size


def test_a_family_discovery_cannot_handle_compiles_whole_with_its_log_line(zoo):
    rec = zoo[WHOLE]
    assert rec["status"] == "whole", rec
    assert rec["blocks"] == "whole model (NextDiT)", rec
    assert "NextDiT" in rec["reason"] and "whole diffusion model" in rec["reason"], rec
    assert "at least 2 blocks" in rec["reason"], rec
    assert max(rec["rel_l2"]) <= 1e-3, rec
