"""Tiny zoo cases for the newest image families of the host (``zoo_cases.CASES`` adds ``NEWER``):
Krea 2, Ideogram 4, JoyImage, MageFlow, Boogu, Lens, PixelDiT. Same contract as ``zoo_cases``.
"""
from __future__ import annotations

from build_tiny_models import _ops


def _t(*shape):
    import torch
    return torch.randn(*shape)


def _ts(v=0.5):
    import torch
    return torch.tensor([v])


def _image_inputs(channels, text_dim, scale=1, frames=0, x_name="x", t_name="timesteps"):
    """Inputs of a model called (x, timesteps, context): ``scale`` x the latent, ``frames`` > 0: 5-D."""
    def inputs(device, h, w):
        shape = (1, channels, frames, scale * h, scale * w) if frames else (1, channels, scale * h, scale * w)
        return {x_name: _t(*shape), t_name: _ts(), "context": _t(1, 8, text_dim)}
    return inputs


def _build(module, cls, **kw):
    def build(device):
        import importlib
        return getattr(importlib.import_module(module), cls)(**kw, device=device, operations=_ops())
    return build


NEWER = {
    "krea2": ("Krea2", _build("comfy.ldm.krea2.model", "SingleStreamDiT", features=64, tdim=32, txtdim=32, heads=2,
                              kvheads=2, multiplier=2, layers=2, patch=2, channels=16, txtlayers=1, txtheads=2,
                              txtkvheads=2), _image_inputs(16, 32)),
    "ideogram4": ("Ideogram4", _build("comfy.ldm.ideogram4.model", "Ideogram4Transformer2DModel", in_channels=16,
                                      num_layers=2, num_attention_heads=2, attention_head_dim=32,
                                      intermediate_size=128, adaln_dim=32, llm_features_dim=32,
                                      mrope_section=(4, 6, 6)), _image_inputs(16, 32)),
    "joyimage": ("JoyImage", _build("comfy.ldm.joyimage.model", "JoyImageTransformer3DModel", in_channels=16,
                                    hidden_size=64, num_attention_heads=2, text_dim=32, num_layers=2,
                                    rope_dim_list=[8, 12, 12]),
                 _image_inputs(16, 32, frames=1, x_name="hidden_states", t_name="timestep")),
    "mageflow": ("MageFlow", _build("comfy.ldm.mage_flow.model", "MageFlowTransformer2DModel", in_channels=16,
                                    out_channels=16, num_layers=2, attention_head_dim=32, num_attention_heads=2,
                                    joint_attention_dim=32, axes_dims_rope=(8, 12, 12)),
                 _image_inputs(16, 32, t_name="timestep")),
    "boogu": ("Boogu", _build("comfy.ldm.boogu.model", "BooguTransformer2DModel", in_channels=16, hidden_size=64,
                              num_layers=3, num_double_stream_layers=2, num_refiner_layers=1, num_attention_heads=2,
                              num_kv_heads=2, multiple_of=16, axes_dim_rope=(8, 12, 12), axes_lens=(300, 64, 64),
                              instruction_feat_dim=32), None),
    "lens": ("Lens", _build("comfy.ldm.lens.model", "LensTransformer2DModel", in_channels=64, out_channels=16,
                            num_layers=2, attention_head_dim=32, num_attention_heads=2, enc_hidden_dim=32,
                            axes_dims_rope=(8, 12, 12), multi_layer_encoder_feature=False),
             _image_inputs(64, 32, t_name="timestep")),
    "pixeldit": ("PixelDiTT2I", _build("comfy.ldm.pixeldit.model", "PixDiT_T2I", in_channels=3, num_groups=2,
                                       hidden_size=64, pixel_hidden_size=8, pixel_attn_hidden_size=32,
                                       pixel_num_groups=2, patch_depth=2, pixel_depth=2, patch_size=4,
                                       txt_embed_dim=32, txt_max_length=8), _image_inputs(3, 32, scale=2)),
}


def _boogu_inputs(device, h, w):
    d = _image_inputs(16, 32)(device, h, w)
    d["num_tokens"] = 8
    return d


NEWER["boogu"] = (*NEWER["boogu"][:2], _boogu_inputs)

