"""compile_core.plan.regions: which modules of a diffusion model get compiled.

Toy classes named like the real ComfyUI ones (the real classes are covered by the host tests).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from compile_core.plan.regions import WHOLE_MODEL, family_of, plan_regions


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


# --------------------------------------------------------------------------- discovery

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.mlp(self.attn(x))


class OtherBlock(Block):
    pass


def _blocks(n, cls=Block):
    return nn.ModuleList(cls() for _ in range(n))


class TwoStreamDiT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.double_layers = _blocks(2, OtherBlock)
        self.single_layers = _blocks(3)
        self.unused_layers = _blocks(2)
        self.head = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # a list of leaves, not blocks

    def forward(self, x):
        x = self.embed(x)
        for b in self.double_layers:
            x = b(x)
        for b in self.single_layers:
            x = b(x)
        return self.head(x)


def test_discovers_two_block_lists_of_different_classes_and_skips_an_unused_one(pack_log):
    model = TwoStreamDiT()
    plan = plan_regions(model, True)
    assert plan.regional and plan.family == "TwoStreamDiT"
    assert plan.paths == ("double_layers.0", "double_layers.1",
                          "single_layers.0", "single_layers.1", "single_layers.2")
    assert plan.describe(model) == "OtherBlock x2, Block x3"
    assert pack_log.infos() == []


class OnlyUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.spare = _blocks(2)
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)


def test_a_list_forward_never_uses_is_not_compiled(pack_log):
    plan = plan_regions(OnlyUnused(), True)
    assert plan.paths == (WHOLE_MODEL,) and plan.family == ""
    (line,) = pack_log.infos()
    assert "OnlyUnused" in line and "spare" in line and "not used" in line and "whole" in line


class SingleBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = _blocks(1)

    def forward(self, x):
        return self.blocks[0](x)


def test_a_single_block_is_not_a_repeated_block(pack_log):
    plan = plan_regions(SingleBlock(), True)
    assert plan.paths == (WHOLE_MODEL,)
    (line,) = pack_log.infos()
    assert "SingleBlock" in line and "at least 2 blocks" in line


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = _blocks(2)
        self.deeper = nn.Module()
        self.deeper.layers = _blocks(2, OtherBlock)  # two levels down: not looked at

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = Inner()

    def forward(self, x):
        return self.transformer(x)


def test_nested_one_level_is_found_two_levels_is_not():
    model = Nested()
    plan = plan_regions(model, True)
    assert plan.paths == ("transformer.blocks.0", "transformer.blocks.1")
    assert plan.modules(model) == list(model.transformer.blocks)


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), OtherBlock()])

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return x


def test_a_list_of_mixed_classes_is_not_a_block_list():
    assert plan_regions(Mixed(), True).paths == (WHOLE_MODEL,)


def test_declared_family_is_not_rediscovered():
    """BLOCK_ATTRS overrides discovery: a WanModel's other lists are not added."""
    WanModel = make_family("WanModel", blocks=lambda: _blocks(2), extra=lambda: _blocks(2))
    plan = plan_regions(WanModel(), True)
    assert plan.family == "WanModel" and plan.paths == ("blocks.0", "blocks.1")


def test_discovered_plan_fingerprint_is_stable_and_names_the_blocks():
    from compile_core.plan.fingerprint import fingerprint
    from compile_core.plan.settings import CompileSettings, build_compile_args
    settings = CompileSettings.from_args(build_compile_args(backend="aot_eager", mode="default",
                                                           background_compile=False))
    a, b = TwoStreamDiT(), TwoStreamDiT()
    assert fingerprint(a, plan_regions(a, True), settings) == fingerprint(b, plan_regions(b, True), settings)
    whole = CompileSettings.from_args(build_compile_args(backend="aot_eager", mode="default",
                                                         compile_transformer_blocks_only=False))
    assert fingerprint(a, plan_regions(a, True), settings) != fingerprint(a, plan_regions(a, False), whole)


# --------------------------------------------------------------------------- shapes of discovered blocks

def test_generic_dims_follow_token_counts_in_every_input():
    import torch
    from compile_core.plan.shapes import generic_layout_dims, tensor_slots
    x, txt = torch.randn(1, 60, 64), torch.randn(1, 8, 64)
    vec, t = torch.randn(1, 64), torch.randn(1)
    cos = torch.randn(60, 32)                     # rope over the image tokens, no batch
    pe = torch.randn(1, 1, 68, 16, 2, 2)          # rope over text + image tokens
    mask = torch.ones(1, 8)
    dims = generic_layout_dims(tensor_slots((x, txt, vec, (cos, cos)), {"pe": pe, "mask": mask, "t": t}))
    assert dims == {0: (0, 1), 1: (0, 1), 2: (0,), (3, 0): (0,), (3, 1): (0,),
                    "pe": (0, 2), "mask": (0, 1), "t": (0,)}


def test_generic_dims_for_image_blocks():
    import torch
    from compile_core.plan.shapes import generic_layout_dims, tensor_slots
    dims = generic_layout_dims(tensor_slots((torch.randn(2, 8, 6, 10), torch.randn(2, 32)), {}))
    assert dims == {0: (0, 2, 3), 1: (0,)}


def test_generic_dims_never_mark_a_broadcast_dim_of_size_one():
    """LTXV's [B, 1, C] modulation: a size-1 dim marked dynamic stops broadcasting (backed size
    oblivious), and the compile fails."""
    import torch
    from compile_core.plan.shapes import generic_layout_dims, tensor_slots
    x, gate, pe = torch.randn(1, 60, 64), torch.randn(1, 1, 64), torch.randn(1, 1, 60, 16)
    dims = generic_layout_dims(tensor_slots((x, gate, pe), {}))
    assert dims == {0: (0, 1), 1: (0,), 2: (0, 2)}


def test_generic_dims_mark_both_sides_of_a_square_attention_mask():
    import torch
    from compile_core.plan.shapes import generic_layout_dims, tensor_slots
    x, txt, mask = torch.randn(1, 68, 64), torch.randn(1, 8, 64), torch.ones(1, 1, 76, 76)
    assert generic_layout_dims(tensor_slots((x, txt, mask), {}))[2] == (0, 2, 3)


def test_generic_dims_mark_the_last_dim_of_a_key_mask():
    """HunyuanVideo's [B, 1, L] mask over text + image tokens: a static L pinned the block's token
    count (one new graph per latent size)."""
    import torch
    from compile_core.plan.shapes import generic_layout_dims, tensor_slots
    img, txt, mask = torch.randn(1, 60, 64), torch.randn(1, 8, 64), torch.zeros(1, 1, 68)
    assert generic_layout_dims(tensor_slots((img, txt), {"attn_mask": mask}))["attn_mask"] == (0, 2)


def test_unet_spatial_transformer_is_planned_as_its_blocks_and_upsample_stays_eager():
    """A SpatialTransformer mutates transformer_options (dynamo then guards the latent's size in it)
    and an Upsample takes the skip's size as ints: their blocks / nothing are compiled instead."""
    class TimestepEmbedSequential(nn.Sequential):
        pass

    class SpatialTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj_in, self.transformer_blocks = _blk(), nn.ModuleList([Block(), Block()])

    class Upsample(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = _blk()

    UNetModel = make_family("UNetModel",
                            input_blocks=lambda: nn.ModuleList([TimestepEmbedSequential(_blk(), SpatialTransformer())]),
                            middle_block=lambda: TimestepEmbedSequential(_blk()),
                            output_blocks=lambda: nn.ModuleList([TimestepEmbedSequential(_blk(), Upsample())]))
    plan = plan_regions(UNetModel(), True)
    assert plan.paths == ("input_blocks.0.0", "input_blocks.0.1.transformer_blocks.0",
                          "input_blocks.0.1.transformer_blocks.1", "middle_block.0", "output_blocks.0.0")


class DictBlocks(nn.Module):
    """Cosmos keeps its blocks in an nn.ModuleDict (block0, block1, ...)."""
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({f"block{i}": Block() for i in range(2)})

    def forward(self, x):
        for _, block in self.blocks.items():
            x = block(x)
        return x


def test_a_module_dict_of_blocks_is_found():
    assert plan_regions(DictBlocks(), True).paths == ("blocks.block0", "blocks.block1")


# --------------------------------------------------------------------------- overrides

def test_nested_block_lists_are_planned_as_their_blocks():
    """Stable Cascade: ``down_blocks[i]`` is a ModuleList of one level's blocks."""
    StageC = make_family("StageC", down_blocks=lambda: nn.ModuleList(
        [nn.ModuleList([_blk(), _blk()]), nn.ModuleList([_blk()])]))
    plan = plan_regions(StageC(), True)
    assert (plan.family, plan.paths) == ("StageC", ("down_blocks.0.0", "down_blocks.0.1", "down_blocks.1.0"))


def test_a_block_run_through_other_methods_is_planned_as_its_inner_modules():
    """WAN Animate 2 calls ``block.forward_gen``: its cross attention and FFN are compiled."""
    Block = make_family("WanAnimate2Block", self_attn=_blk, cross_attn=_blk, ffn=_blk)
    WanModel = make_family("WanModel", blocks=lambda: nn.ModuleList(Block() for _ in range(2)))
    plan = plan_regions(WanModel(), True)
    assert plan.paths == ("blocks.0.cross_attn", "blocks.0.ffn", "blocks.1.cross_attn", "blocks.1.ffn")


def test_anima_plans_its_blocks_not_its_text_adapters():
    Adapter = make_family("LLMAdapter", blocks=lambda: nn.ModuleList(Block() for _ in range(3)))
    Anima = make_family("Anima", blocks=lambda: nn.ModuleList(Block() for _ in range(2)), llm_adapter=Adapter)
    plan = plan_regions(Anima(), True)
    assert (plan.family, plan.paths) == ("Anima", ("blocks.0", "blocks.1"))


def test_family_dynamo_knobs_reach_the_run_scope_of_that_family_only():
    from tcs_engine_helpers import settings

    from compile_core.run import engine
    from compile_core.plan.regions import FAMILY_DYNAMO_KNOBS, RegionPlan
    model = make_family("M", blocks=lambda: nn.ModuleList(_blk() for _ in range(2)))()
    for family in ("HiDreamImageTransformer2DModel", "NextDiT"):
        cm = engine.prepare(model, settings(), plan=RegionPlan(("blocks.0", "blocks.1"), family))
        dynamo = {name: value for module, name, value in cm.state.scope(False)[0].knobs
                  if module is torch._dynamo.config}  # (what the scope sets)
        want = FAMILY_DYNAMO_KNOBS.get(family, {"capture_scalar_outputs": None})
        assert all(dynamo.get(k) == v for k, v in want.items()), dynamo
