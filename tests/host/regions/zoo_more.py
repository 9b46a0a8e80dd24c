"""More tiny zoo cases (``zoo_cases.CASES`` adds ``MORE``): WAN variants, LongCat, Hunyuan refiner,
Anima, Z-Image pixel space, Hunyuan3D, Stable Audio, Stable Cascade, SVD.

Same contract as ``zoo_cases``: ``build(device)`` and ``inputs(device, h, w)`` per case.
"""
from __future__ import annotations

from build_tiny_models import _host_params, _ops

WAN_TINY = dict(dim=64, ffn_dim=128, num_layers=2, num_heads=2, out_dim=16, text_dim=32)


def _t(*shape):
    import torch
    return torch.randn(*shape)


def _ts(v=0.5):
    import torch
    return torch.tensor([v])


def _wan_inputs(channels):
    def inputs(device, h, w):
        return dict(x=_t(1, channels, 2, h, w), timestep=_ts(500.0), context=_t(1, 8, 32))
    return inputs


def _wan(module, cls, **kw):
    def build(device):
        import importlib
        model_cls = getattr(importlib.import_module(module), cls)
        return model_cls(**{**WAN_TINY, **kw}, device=device, operations=_ops())
    return build


def build_longcat(device):
    from comfy.ldm.flux.model import Flux, FluxParams
    return Flux(in_channels=16, out_channels=16, vec_in_dim=None, context_in_dim=32, hidden_size=64,
                mlp_ratio=2.0, num_heads=2, depth=2, depth_single_blocks=2, axes_dim=[8, 12, 12],
                theta=10000, patch_size=2, qkv_bias=True, guidance_embed=False,
                **_host_params(FluxParams, txt_ids_dims=[1, 2]), device=device, operations=_ops())


def in_longcat(device, h, w):
    return dict(x=_t(1, 16, h, w), timestep=_ts(), context=_t(1, 8, 32))


def build_hunyuan_refiner(device):
    from comfy.ldm.hunyuan_video.model import HunyuanVideo, HunyuanVideoParams
    return HunyuanVideo(in_channels=64, out_channels=32, vec_in_dim=None, context_in_dim=32, hidden_size=64,
                        mlp_ratio=2.0, num_heads=2, depth=2, depth_single_blocks=2, axes_dim=[8, 12, 12],
                        theta=256, patch_size=[1, 1, 1], qkv_bias=True, guidance_embed=False, byt5=False,
                        meanflow=False, use_cond_type_embedding=False, vision_in_dim=None,
                        **_host_params(HunyuanVideoParams, meanflow_sum=False), device=device, operations=_ops())


def in_hunyuan_refiner(device, h, w):
    import torch
    return dict(x=_t(1, 64, 1, h // 2, w // 2), timestep=_ts(), context=_t(1, 8, 32),
                attention_mask=torch.ones(1, 8, dtype=torch.long))


def build_anima(device):
    from comfy.ldm.anima.model import Anima
    return Anima(max_img_h=64, max_img_w=64, max_frames=8, in_channels=16, out_channels=16,
                 patch_spatial=2, patch_temporal=1, model_channels=64, num_blocks=2, num_heads=2,
                 crossattn_emb_channels=1024, pos_emb_cls="rope3d", device=device, operations=_ops())


def in_anima(device, h, w):
    return dict(x=_t(1, 16, 1, h, w), timesteps=_ts(), context=_t(1, 8, 1024))


def build_zimage_pixel(device):
    from comfy.ldm.lumina.model import NextDiTPixelSpace
    return NextDiTPixelSpace(decoder_hidden_size=32, decoder_num_res_blocks=1, decoder_max_freqs=4,
                             patch_size=4, in_channels=3, dim=256, n_layers=2, n_refiner_layers=1, n_heads=2,
                             n_kv_heads=2, multiple_of=16, ffn_dim_multiplier=1.0, cap_feat_dim=32,
                             axes_dims=[32, 48, 48], axes_lens=[300, 64, 64], qk_norm=True,
                             z_image_modulation=True, time_scale=1000.0, pad_tokens_multiple=32,
                             device=device, operations=_ops())


def in_zimage_pixel(device, h, w):
    return dict(x=_t(1, 3, 2 * h, 2 * w), timesteps=_ts(), context=_t(1, 8, 32), num_tokens=8)


def build_hunyuan3d(device):
    from comfy.ldm.hunyuan3d.model import Hunyuan3Dv2
    return Hunyuan3Dv2(in_channels=16, context_in_dim=32, hidden_size=64, mlp_ratio=2.0, num_heads=2,
                       depth=2, depth_single_blocks=2, device=device, operations=_ops())


def in_hunyuan3d(device, h, w):
    return dict(x=_t(1, 16, h * w // 4), timestep=_ts(), context=_t(1, 8, 32))


def build_hunyuan3d21(device):
    from comfy.ldm.hunyuan3dv2_1.hunyuandit import HunYuanDiTPlain
    return HunYuanDiTPlain(in_channels=16, hidden_size=64, context_dim=32, depth=4, num_heads=2,
                           num_moe_layers=1, num_experts=2, moe_top_k=1, guidance_cond_proj_dim=None,
                           device=device, operations=_ops())


def in_hunyuan3d21(device, h, w):
    return dict(x=_t(1, 16, h * w // 4), t=_ts(), context=_t(1, 8, 32))


def build_stable_audio(device):
    from comfy.ldm.audio.dit import AudioDiffusionTransformer
    return AudioDiffusionTransformer(io_channels=16, embed_dim=64, cond_token_dim=32, project_cond_tokens=False,
                                     global_cond_dim=32, depth=2, num_heads=2, device=device, operations=_ops())


def in_stable_audio(device, h, w):
    return dict(x=_t(1, 16, h * w // 4), timestep=_ts(), context=_t(1, 8, 32), global_embed=_t(1, 32))


def build_cascade_c(device):
    from comfy.ldm.cascade.stage_c import StageC
    return StageC(c_in=16, c_out=16, c_r=16, c_cond=64, c_hidden=[32, 64], nhead=[2, 2], blocks=[[1, 2], [2, 1]],
                  c_clip_text=32, c_clip_text_pooled=32, c_clip_img=32, device=device, operations=_ops())


def in_cascade_c(device, h, w):
    return dict(x=_t(1, 16, h, w), r=_ts(), clip_text=_t(1, 8, 32), clip_text_pooled=_t(1, 1, 32),
                clip_img=_t(1, 1, 32))


def build_cascade_b(device):
    from comfy.ldm.cascade.stage_b import StageB
    return StageB(c_in=4, c_out=4, c_r=16, c_cond=64, c_hidden=[16, 32, 64, 64], nhead=[-1, -1, 2, 2],
                  blocks=[[1, 1, 1, 1], [1, 1, 1, 1]], block_repeat=[[1, 1, 1, 1], [1, 1, 1, 1]], c_clip=32,
                  c_effnet=16, device=device, operations=_ops())


def in_cascade_b(device, h, w):
    # Stage B's latent is 4x the size of Stage C's output: at 2x, its deepest level would be 1 pixel
    # high at the first size (a size-1 dim, specialised), which no real image size gives
    return dict(x=_t(1, 4, 4 * h, 4 * w), r=_ts(), effnet=_t(1, 16, h // 2, w // 2), clip=_t(1, 1, 32))


def build_svd(device):
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    return UNetModel(image_size=32, in_channels=8, out_channels=4, model_channels=32, num_res_blocks=[1, 1],
                     channel_mult=[1, 2], use_spatial_transformer=True, legacy=False, context_dim=32,
                     num_head_channels=16, use_linear_in_transformer=True, adm_in_channels=32,
                     num_classes="sequential", transformer_depth=[1, 1], transformer_depth_middle=1,
                     transformer_depth_output=[1, 1, 1, 1], use_temporal_resblock=True,
                     use_temporal_attention=True, extra_ff_mix_layer=True, use_spatial_context=True,
                     merge_strategy="learned_with_images", merge_factor=0.0, video_kernel_size=[3, 1, 1],
                     disable_temporal_crossattention=False, max_ddpm_temb_period=10000, device=device,
                     operations=_ops())


def in_svd(device, h, w):
    import torch
    frames = 2
    return dict(x=_t(frames, 8, h, w), timesteps=torch.full((frames,), 500.0), context=_t(frames, 1, 32),
                y=_t(frames, 32), num_video_frames=frames, image_only_indicator=torch.zeros(1, frames))


WAN = "comfy.ldm.wan.model"
MORE = {
    "wan_fun_control": ("WAN21_FunControl2V", _wan(WAN, "WanModel", model_type="i2v", in_dim=48), _wan_inputs(48)),
    "wan_humo": ("WAN21_HuMo", _wan(WAN, "HumoWanModel", in_dim=16), _wan_inputs(16)),
    "wan_scail": ("WAN21_SCAIL", _wan(WAN, "SCAILWanModel", in_dim=16), _wan_inputs(16)),
    "wan_scail2": ("WAN21_SCAIL2", _wan(WAN, "SCAIL2WanModel", in_dim=16), _wan_inputs(16)),
    "wan_animate2": ("WAN_Animate2", _wan("comfy.ldm.wan.model_animate2", "WanAnimate2Model", in_dim=16),
                     _wan_inputs(16)),
    "wan_dancer": ("WAN22_WanDancer", _wan("comfy.ldm.wan.model_wandancer", "WanDancerModel", in_dim=16,
                                           audio_inject_layers=[0, 1], music_dim=32, music_heads=2,
                                           music_latent_dim=32), _wan_inputs(16)),
    "wan_causal_ar": ("WAN21_CausalAR_T2V", _wan("comfy.ldm.wan.ar_model", "CausalWanModel", in_dim=16),
                      _wan_inputs(16)),
    "longcat": ("LongCatImage", build_longcat, in_longcat),
    "hunyuan_image21_refiner": ("HunyuanImage21Refiner", build_hunyuan_refiner, in_hunyuan_refiner),
    "anima": ("Anima", build_anima, in_anima),
    "zimage_pixel": ("ZImagePixelSpace", build_zimage_pixel, in_zimage_pixel),
    "hunyuan3d": ("Hunyuan3Dv2, Hunyuan3Dv2mini", build_hunyuan3d, in_hunyuan3d),
    "hunyuan3d21": ("Hunyuan3Dv2_1", build_hunyuan3d21, in_hunyuan3d21),
    "stable_audio": ("StableAudio, StableAudio3", build_stable_audio, in_stable_audio),
    "cascade_c": ("Stable_Cascade_C", build_cascade_c, in_cascade_c),
    "cascade_b": ("Stable_Cascade_B", build_cascade_b, in_cascade_b),
    "svd": ("SVD_img2vid, SV3D_u, SV3D_p", build_svd, in_svd),
}
