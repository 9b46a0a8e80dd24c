"""Which modules of a diffusion model get compiled: its repeated blocks (regional) or all of it.

A family in ``BLOCK_ATTRS`` declares the attributes that hold its repeated transformer blocks
(an override, for families whose blocks discovery would get wrong, e.g. SD's UNet, whose
TimestepEmbedSequential blocks are never called). Any other model's blocks are found by
``discovery.discover``. Identical blocks run the same ``forward`` code object, so one compiled
graph serves all of them and the cold compile cost does not grow with depth.
"""
from __future__ import annotations

import dataclasses

from torch import nn

from . import discovery, log, shapes

# Diffusion-model class name (matched anywhere in the MRO) -> attributes holding its blocks.
BLOCK_ATTRS: dict[str, tuple[str, ...]] = {
    "WanModel": ("blocks", "vace_blocks"),           # WAN 2.1/2.2 (+ VACE, camera, S2V)
    "Flux": ("double_blocks", "single_blocks"),
    "Chroma": ("double_blocks", "single_blocks"),
    "HunyuanVideo": ("double_blocks", "single_blocks"),
    "LTXVModel": ("transformer_blocks",),
    "QwenImageTransformer2DModel": ("transformer_blocks",),
    "UNetModel": ("input_blocks", "middle_block", "output_blocks"),  # SD 1.x / SDXL
}
WHOLE_MODEL = ""  # region path meaning "the diffusion model itself"


@dataclasses.dataclass(frozen=True)
class RegionPlan:
    """Dotted paths (relative to the diffusion model) of the modules to compile."""
    paths: tuple[str, ...]
    # the BLOCK_ATTRS key that matched, the model's class name when its blocks were discovered,
    # or "" for a whole-model compile (shapes.FAMILY_DYNAMIC_DIMS is keyed by it)
    family: str

    @property
    def regional(self) -> bool:
        return self.paths != (WHOLE_MODEL,)

    def modules(self, diffusion_model: nn.Module) -> list[nn.Module]:
        return [diffusion_model.get_submodule(p) if p else diffusion_model for p in self.paths]

    def describe(self, diffusion_model: nn.Module) -> str:
        if not self.regional:
            return f"whole model ({type(diffusion_model).__name__})"
        counts: dict[str, int] = {}
        for m in self.modules(diffusion_model):
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
        return ", ".join(f"{n} x{c}" for n, c in counts.items())


def family_of(diffusion_model: nn.Module) -> str:
    for cls in type(diffusion_model).__mro__:
        if cls.__name__ in BLOCK_ATTRS:
            return cls.__name__
    return ""


def plan_regions(diffusion_model: nn.Module, blocks_only: bool) -> RegionPlan:
    """Regional plan (declared or discovered blocks) when ``blocks_only``; else the whole model."""
    if not blocks_only:
        return RegionPlan((WHOLE_MODEL,), "")
    family = family_of(diffusion_model)
    paths = _declared_paths(diffusion_model, family)
    why_not = f"its {family} block attributes hold no blocks"
    if not paths:
        found = discovery.discover(diffusion_model)
        family, why_not = _discovered_family(diffusion_model), found.why_not or why_not
        paths = [p for path in found.paths for p in _block_paths(path, diffusion_model.get_submodule(path))]
    if not paths:
        log.info("no repeated transformer blocks in %s (%s); compiling the whole diffusion model instead",
                 type(diffusion_model).__name__, why_not)
        return RegionPlan((WHOLE_MODEL,), "")
    return RegionPlan(tuple(paths), family)


def _discovered_family(diffusion_model: nn.Module) -> str:
    """The model's class name, or the nearest base class with its own shape policy (a subclass
    such as Anima of Cosmos' MiniTrainDIT takes the same block inputs)."""
    for cls in type(diffusion_model).__mro__:
        if cls.__name__ in shapes.FAMILY_DYNAMIC_DIMS:
            return cls.__name__
    return type(diffusion_model).__name__


def _declared_paths(diffusion_model: nn.Module, family: str) -> list[str]:
    paths: list[str] = []
    for attr in BLOCK_ATTRS.get(family, ()):
        holder = getattr(diffusion_model, attr, None)
        if isinstance(holder, (nn.ModuleList, nn.Sequential)) and not _is_block(holder):
            for i, block in enumerate(holder):
                paths += _block_paths(f"{attr}.{i}", block)
        elif isinstance(holder, nn.Module):
            paths += _block_paths(attr, holder)
    return paths


def _is_block(container: nn.Module) -> bool:
    """A Sequential that is itself a block (SD's TimestepEmbedSequential), not a list of blocks."""
    return isinstance(container, nn.Sequential) and type(container) is not nn.Sequential


def _block_paths(path: str, block: nn.Module) -> list[str]:
    """The paths to compile for one block: the block itself, or, for a Sequential block, its layers.

    ComfyUI's UNet runs a TimestepEmbedSequential through ``forward_timestep_embed(block, ...)``,
    which loops over the layers and never calls the block, so the block's ``__call__`` (where the
    compiled callable is attached) would be bypassed and nothing compiled. Its layers are always
    entered through ``__call__``."""
    if _is_block(block):
        return [f"{path}.{name}" for name, _ in block.named_children()]
    return [path]
