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

from . import discovery, shapes
from ..report import log

# Diffusion-model class name (matched anywhere in the MRO) -> attributes holding its blocks.
BLOCK_ATTRS: dict[str, tuple[str, ...]] = {
    "WanModel": ("blocks", "vace_blocks"),           # WAN 2.1/2.2 (+ VACE, camera, S2V)
    "Flux": ("double_blocks", "single_blocks"),
    "Chroma": ("double_blocks", "single_blocks"),
    "HunyuanVideo": ("double_blocks", "single_blocks"),
    "LTXVModel": ("transformer_blocks",),
    "QwenImageTransformer2DModel": ("transformer_blocks",),
    "UNetModel": ("input_blocks", "middle_block", "output_blocks"),  # SD 1.x / SDXL
    # Cosmos Predict2's MiniTrainDIT with an LLM adapter, whose blocks (llm_adapter.blocks)
    # discovery would plan too; ComfyUI runs the adapter in extra_conds, on the text
    # conditioning, not in the sampling forward
    "Anima": ("blocks",),
    # Stable Cascade: one list of blocks (ResBlock / AttnBlock / TimestepBlock) per level
    "StageC": ("down_blocks", "up_blocks"),
    "StageB": ("down_blocks", "up_blocks"),
}
WHOLE_MODEL = ""  # region path meaning "the diffusion model itself"

# Family (``RegionPlan.family``) -> dynamo config knobs set while its regions run. HiDream's and
# Hunyuan3D 2.1's mixture-of-experts layers route tokens by boolean indexing (a data-dependent
# shape): without these, dynamo breaks the graph inside the expert loop and the frames it resumes
# in get unmarked inputs, so a new latent size compiles new graphs. With them the routing stays
# in the graph as unbacked sizes. Hunyuan3D 2.1's expert loop still breaks (``if start_idx ==
# end_idx`` on tensors), so there the resumed frames also start with dynamic sizes.
MOE_KNOBS = {"capture_dynamic_output_shape_ops": True, "capture_scalar_outputs": True}
FAMILY_DYNAMO_KNOBS: dict[str, dict[str, object]] = {
    "HiDreamImageTransformer2DModel": MOE_KNOBS,  # HiDream
    "HunYuanDiTPlain": {**MOE_KNOBS, "assume_static_by_default": False},  # Hunyuan3D 2.1
}

# UNet layers (by class name) compiled as their inner blocks, or left eager; see _layer_paths.
UNET_INNER = {"SpatialTransformer": "transformer_blocks", "SpatialVideoTransformer": "transformer_blocks"}
UNET_EAGER = ("Upsample",)

# Block class -> its submodules compiled instead of it (the rest of the block runs eagerly):
# - WanAnimate2Block: WAN Animate 2 runs its blocks through other methods (``block.forward_gen`` /
#   ``block.forward_pose``), never through ``__call__``, where the compiled callable attaches;
#   those methods call these through ``__call__`` (the self-attention, run through methods too,
#   stays eager).
# - PiTBlock (PixelDiT's pixel blocks): its forward loops over ``range(0, B * L, chunk)`` (MLP
#   chunks), which pins the token count, so every latent size would compile the block again.
# - Stable Cascade's AttnBlock: each builds its own LayerNorm2d class (``LayerNorm2d_op(operations)``)
#   and dynamo guards on the norm's class, so every block would compile its own graph; its
#   attention has no such norm (one graph per width). Its ResBlocks have the same norm, but their
#   MLP is an ``nn.Sequential``, which dynamo does not trace as a region of its own (it compiles
#   each layer as a separate frame), so ResBlocks stay whole: one graph per ResBlock.
BLOCK_INNER = {
    "WanAnimate2Block": ("cross_attn", "ffn"),
    "PiTBlock": ("attn", "mlp"),
    "comfy.ldm.cascade.common.AttnBlock": ("attention",),  # keyed by module: not other AttnBlocks
}


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
        """The region modules, looked up afresh (runs before every model call)."""
        return [_submodule(diffusion_model, p) if p else diffusion_model for p in self.paths]

    def describe(self, diffusion_model: nn.Module) -> str:
        if not self.regional:
            return f"whole model ({type(diffusion_model).__name__})"
        counts: dict[str, int] = {}
        for m in self.modules(diffusion_model):
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
        return ", ".join(f"{n} x{c}" for n, c in counts.items())


def _submodule(root: nn.Module, path: str) -> nn.Module:
    """``root.get_submodule(path)`` through the ``_modules`` dicts (a fifth of its time), and
    through ``get_submodule`` itself for anything else (its errors included)."""
    m = root
    try:
        for name in path.split("."):
            m = m._modules[name]
    except (KeyError, AttributeError):
        return root.get_submodule(path)
    if m is None:
        return root.get_submodule(path)
    return m


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
    """The paths to compile for one block: the block itself, or, for a Sequential block, its layers
    (for a block in ``BLOCK_INNER``, the submodules listed there; for a plain ModuleList, the
    paths of each of its blocks).

    ComfyUI's UNet runs a TimestepEmbedSequential through ``forward_timestep_embed(block, ...)``,
    which loops over the layers and never calls the block, so the block's ``__call__`` (where the
    compiled callable is attached) would be bypassed and nothing compiled. Its layers are always
    entered through ``__call__``."""
    if _is_block(block):
        return [p for name, layer in block.named_children() for p in _layer_paths(f"{path}.{name}", layer)]
    if type(block) is nn.ModuleList:  # a level of a list of lists (Stable Cascade): its blocks
        return [p for name, b in block.named_children() for p in _block_paths(f"{path}.{name}", b)]
    return [f"{path}.{name}" for name in _inner_names(block)] or [path]


def _inner_names(block: nn.Module) -> tuple[str, ...]:
    """``BLOCK_INNER``'s entry for the block's class (by module-qualified name, then by name)."""
    cls = type(block)
    return BLOCK_INNER.get(f"{cls.__module__}.{cls.__qualname__}") or BLOCK_INNER.get(cls.__name__, ())


def _layer_paths(path: str, layer: nn.Module) -> list[str]:
    """One UNet layer's paths. A SpatialTransformer writes ``transformer_options['activations_shape']``,
    and dynamo replays a mutated input dict by rebuilding it whole, guarding every value, among them
    ``original_shape`` (the latent's size): one graph per latent size. Its transformer blocks only
    read the dict, so they are compiled instead (the norm/projections around them stay eager). An
    Upsample takes the skip's size as Python ints (``output_shape``), which pin the size: eager."""
    name = type(layer).__name__
    if name in UNET_EAGER:
        return []
    inner = getattr(layer, UNET_INNER.get(name, ""), None)
    if isinstance(inner, nn.ModuleList) and len(inner):
        return [f"{path}.{UNET_INNER[name]}.{i}" for i in range(len(inner))]
    return [path]
