"""compile_core.regions: which modules of a diffusion model get compiled.

Toy classes named like the real ComfyUI ones (the real classes are covered by the host tests).
"""
from __future__ import annotations

import pytest
from torch import nn

from compile_core.regions import WHOLE_MODEL, family_of, plan_regions


def _blk():
    return nn.Linear(4, 4)


def make_family(name: str, **attrs):
    """A fresh class named ``name`` whose instances get ``attrs`` (built by the given callables)."""
    def __init__(self):
        nn.Module.__init__(self)
        for attr, build in attrs.items():
            setattr(self, attr, build())
    return type(name, (nn.Module,), {"__init__": __init__})


def test_wan_blocks_and_vace_blocks():
    WanModel = make_family("WanModel",
                           patch_embedding=_blk,
                           blocks=lambda: nn.ModuleList(_blk() for _ in range(3)),
                           vace_blocks=lambda: nn.ModuleList(_blk() for _ in range(2)),
                           head=_blk)
    model = WanModel()
    plan = plan_regions(model, blocks_only=True)
    assert plan.family == "WanModel"
    assert plan.paths == ("blocks.0", "blocks.1", "blocks.2", "vace_blocks.0", "vace_blocks.1")
    assert plan.regional
    mods = plan.modules(model)
    assert mods == [*model.blocks, *model.vace_blocks]
    assert plan.describe(model) == "Linear x5"


def test_wan_without_vace_blocks():
    WanModel = make_family("WanModel", blocks=lambda: nn.ModuleList(_blk() for _ in range(2)))
    assert plan_regions(WanModel(), True).paths == ("blocks.0", "blocks.1")


def test_flux_double_and_single_blocks():
    class DoubleStreamBlock(nn.Linear):
        pass

    class SingleStreamBlock(nn.Linear):
        pass

    Flux = make_family("Flux",
                       img_in=_blk,
                       double_blocks=lambda: nn.ModuleList(DoubleStreamBlock(4, 4) for _ in range(2)),
                       single_blocks=lambda: nn.ModuleList(SingleStreamBlock(4, 4) for _ in range(3)))
    model = Flux()
    plan = plan_regions(model, True)
    assert plan.family == "Flux"
    assert plan.paths == ("double_blocks.0", "double_blocks.1",
                          "single_blocks.0", "single_blocks.1", "single_blocks.2")
    assert plan.describe(model) == "DoubleStreamBlock x2, SingleStreamBlock x3"


def test_unet_input_middle_output_blocks():
    """SD's blocks are TimestepEmbedSequential (a Sequential subclass). ComfyUI runs them through
    ``forward_timestep_embed``, which loops over the layers without calling the block, so the
    regions are the layers of each block."""
    class TimestepEmbedSequential(nn.Sequential):
        pass

    def seq(n=2):
        return TimestepEmbedSequential(*[_blk() for _ in range(n)])

    UNetModel = make_family("UNetModel",
                            time_embed=lambda: nn.Sequential(_blk(), nn.SiLU(), _blk()),
                            input_blocks=lambda: nn.ModuleList([seq(1), seq(2)]),
                            middle_block=lambda: seq(3),
                            output_blocks=lambda: nn.ModuleList([seq(2), seq(1)]),
                            out=_blk)
    model = UNetModel()
    plan = plan_regions(model, True)
    assert plan.family == "UNetModel"
    assert plan.paths == ("input_blocks.0.0", "input_blocks.1.0", "input_blocks.1.1",
                          "middle_block.0", "middle_block.1", "middle_block.2",
                          "output_blocks.0.0", "output_blocks.0.1", "output_blocks.1.0")
    assert plan.modules(model)[3] is model.middle_block[0]
    assert all(type(m) is nn.Linear for m in plan.modules(model))
    assert "time_embed" not in " ".join(plan.paths) and "out" not in plan.paths


def test_single_module_block_attr_is_one_region():
    UNetModel = make_family("UNetModel",
                            input_blocks=lambda: nn.ModuleList(_blk() for _ in range(2)),
                            middle_block=_blk,
                            output_blocks=lambda: nn.ModuleList(_blk() for _ in range(1)))
    model = UNetModel()
    plan = plan_regions(model, True)
    assert plan.paths == ("input_blocks.0", "input_blocks.1", "middle_block", "output_blocks.0")
    assert plan.modules(model)[2] is model.middle_block


def test_unknown_class_compiles_whole_model_with_one_info_line(pack_log):
    Mystery = make_family("MysteryDiT", blocks=lambda: nn.ModuleList(_blk() for _ in range(2)))
    model = Mystery()
    plan = plan_regions(model, True)
    assert plan.paths == (WHOLE_MODEL,)
    assert plan.family == "" and not plan.regional
    assert plan.modules(model) == [model]
    assert plan.describe(model) == "whole model (MysteryDiT)"
    infos = pack_log.infos()
    assert len(infos) == 1 and "MysteryDiT" in infos[0] and "whole" in infos[0]


def test_known_family_without_its_block_attrs_falls_back_to_whole_model(pack_log):
    WanModel = make_family("WanModel", layers=lambda: nn.ModuleList(_blk() for _ in range(2)))
    plan = plan_regions(WanModel(), True)
    assert plan.paths == (WHOLE_MODEL,) and plan.family == ""
    assert len(pack_log.infos()) == 1


def test_blocks_only_false_compiles_whole_model(pack_log):
    WanModel = make_family("WanModel", blocks=lambda: nn.ModuleList(_blk() for _ in range(2)))
    model = WanModel()
    plan = plan_regions(model, blocks_only=False)
    assert plan.paths == (WHOLE_MODEL,) and not plan.regional
    assert plan.modules(model) == [model]
    assert pack_log.infos() == []  # a deliberate choice, nothing to report


def test_subclass_of_known_family_matches_via_mro():
    WanModel = make_family("WanModel",
                           blocks=lambda: nn.ModuleList(_blk() for _ in range(2)),
                           vace_blocks=lambda: nn.ModuleList(_blk() for _ in range(1)))

    class VaceWanModel(WanModel):
        pass

    model = VaceWanModel()
    assert family_of(model) == "WanModel"
    plan = plan_regions(model, True)
    assert plan.family == "WanModel"
    assert plan.paths == ("blocks.0", "blocks.1", "vace_blocks.0")


@pytest.mark.parametrize("name, attrs", [
    ("Chroma", ("double_blocks", "single_blocks")),
    ("HunyuanVideo", ("double_blocks", "single_blocks")),
    ("LTXVModel", ("transformer_blocks",)),
    ("QwenImageTransformer2DModel", ("transformer_blocks",)),
])
def test_other_families(name, attrs):
    Model = make_family(name, **{a: (lambda: nn.ModuleList(_blk() for _ in range(2))) for a in attrs})
    plan = plan_regions(Model(), True)
    assert plan.family == name
    assert plan.paths == tuple(f"{a}.{i}" for a in attrs for i in range(2))


def test_empty_block_list_falls_back_to_whole_model():
    WanModel = make_family("WanModel", blocks=nn.ModuleList)
    assert plan_regions(WanModel(), True).paths == (WHOLE_MODEL,)


def test_plan_paths_resolve_with_get_submodule():
    WanModel = make_family("WanModel", blocks=lambda: nn.ModuleList(_blk() for _ in range(2)))
    model = WanModel()
    for path, module in zip(plan_regions(model, True).paths, plan_regions(model, True).modules(model)):
        assert model.get_submodule(path) is module
