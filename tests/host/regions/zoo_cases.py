"""Tiny configs and inputs for the diffusion model classes of ComfyUI 0.33 (``model_zoo.py``).

One entry per diffusion model class (``comfy/model_base.py``'s ``unet_model=``), named after the
``comfy/supported_models.py`` entries that use it. ``build(device)`` makes the model (random
weights come later); ``inputs(device, h, w)`` the model call's keyword arguments for a latent of
``h`` x ``w`` (a multiple of 4). Models that need something this script cannot give on CPU are
listed in ``NOT_BUILT`` with the reason.
"""
from __future__ import annotations

import build_tiny_models as tiny
import zoo_more
import zoo_newer
from build_tiny_models import _host_params, _ops


def _t(*shape, device="cpu"):
    import torch
    return torch.randn(*shape, device=device)


def _ts(device, v=0.5):
    import torch
    return torch.tensor([v], device=device)


# --------------------------------------------------------------------------- already covered

def in_wan(device, h, w):
    return dict(x=_t(1, 16, 2, h, w), timestep=_ts(device, 500.0), context=_t(1, 8, 32))


def in_vace_wan(device, h, w):
    d = in_wan(device, h, w)
    d.update(vace_context=_t(1, 1, 32, 2, h, w), vace_strength=[1.0])
    return d


def in_flux(device, h, w):
    return dict(x=_t(1, 16, h, w), timestep=_ts(device), context=_t(1, 8, 32), y=_t(1, 32))


def in_chroma(device, h, w):
    import torch
    return dict(x=_t(1, 16, h, w), timestep=_ts(device), context=_t(1, 8, 32),
                guidance=torch.tensor([0.0]))


def in_hunyuan_video(device, h, w):
    import torch
    return dict(x=_t(1, 16, 2, h, w), timestep=_ts(device), context=_t(1, 8, 32), y=_t(1, 32),
                attention_mask=torch.ones(1, 8, dtype=torch.long))


def in_ltxv(device, h, w):
    return dict(x=_t(1, 32, 2, h // 2, w // 2), timestep=_ts(device), context=_t(1, 8, 32),
                attention_mask=None)


def in_qwen_image(device, h, w):
    return dict(x=_t(1, 16, 1, h, w), timestep=_ts(device), context=_t(1, 8, 32))


def in_unet(device, h, w):
    return dict(x=_t(1, 4, h, w), timesteps=_ts(device, 500.0), context=_t(1, 8, 32))


def in_unet_sdxl(device, h, w):
    return dict(in_unet(device, h, w), y=_t(1, 48))


# --------------------------------------------------------------------------- new families

def build_aura(device):
    from comfy.ldm.aura.mmdit import MMDiT
    return MMDiT(in_channels=4, out_channels=4, patch_size=2, dim=64, n_layers=4, n_double_layers=2,
                 n_heads=2, global_conddim=64, cond_seq_dim=32, max_seq=256, device=device, operations=_ops())


def in_aura(device, h, w):
    return dict(x=_t(1, 4, h, w), timestep=_ts(device), context=_t(1, 8, 32))


def build_sd3(device):
    from comfy.ldm.modules.diffusionmodules.mmdit import OpenAISignatureMMDITWrapper
    return OpenAISignatureMMDITWrapper(input_size=None, patch_size=2, in_channels=16, depth=2,
                                       num_patches=64 * 64, adm_in_channels=32, context_embedder_config={
                                           "target": "torch.nn.Linear",
                                           "params": {"in_features": 32, "out_features": 128}},
                                       pos_embed_max_size=64, device=device, operations=_ops())


def in_sd3(device, h, w):
    return dict(x=_t(1, 16, h, w), timesteps=_ts(device), context=_t(1, 8, 32), y=_t(1, 32))


def build_lumina2(device):
    from comfy.ldm.lumina.model import NextDiT
    return NextDiT(patch_size=2, in_channels=4, dim=64, n_layers=2, n_refiner_layers=1, n_heads=2,
                   n_kv_heads=2, multiple_of=16, ffn_dim_multiplier=2.0, cap_feat_dim=32,
                   axes_dims=[8, 12, 12], axes_lens=[300, 64, 64], qk_norm=True, device=device,
                   operations=_ops())


def in_lumina2(device, h, w):
    import torch
    return dict(x=_t(1, 4, h, w), timesteps=_ts(device), context=_t(1, 8, 32), num_tokens=8,
                attention_mask=torch.ones(1, 8))


def build_zimage(device):
    from comfy.ldm.lumina.model import NextDiT
    # z_image_modulation feeds a 256-wide timestep embedding to min(dim, 256): dim >= 256
    return NextDiT(patch_size=2, in_channels=16, dim=256, n_layers=2, n_refiner_layers=1, n_heads=2,
                   n_kv_heads=2, multiple_of=16, ffn_dim_multiplier=1.0, cap_feat_dim=32,
                   axes_dims=[32, 48, 48], axes_lens=[300, 64, 64], qk_norm=True, z_image_modulation=True,
                   time_scale=1000.0, pad_tokens_multiple=32, device=device, operations=_ops())


def in_zimage(device, h, w):
    return dict(x=_t(1, 16, h, w), timesteps=_ts(device), context=_t(1, 8, 32), num_tokens=8)


def build_pixart(device):
    from comfy.ldm.pixart.pixartms import PixArtMS
    return PixArtMS(input_size=16, patch_size=2, in_channels=4, hidden_size=64, depth=2, num_heads=2,
                    caption_channels=32, model_max_length=8, micro_condition=False, pe_interpolation=1.0,
                    device=device, operations=_ops())


def in_pixart(device, h, w):
    # PixArt's pos-embed base size is round((H + W) / 128) * 64: 0 (a division by zero) below 64
    return dict(x=_t(1, 4, 8 * h, 8 * w), timesteps=_ts(device, 500.0), context=_t(1, 8, 32))


def build_hydit(device):
    from comfy.ldm.hydit.models import HunYuanDiT
    return HunYuanDiT(input_size=(16, 16), patch_size=2, in_channels=4, hidden_size=64, depth=4, num_heads=2,
                      text_states_dim=32, text_states_dim_t5=48, text_len=8, text_len_t5=8,
                      size_cond=False, use_style_cond=False, learn_sigma=True, device=device,
                      operations=_ops())


def in_hydit(device, h, w):
    import torch
    return dict(x=_t(1, 4, h, w), t=_ts(device, 500.0), context=_t(1, 8, 32),
                text_embedding_mask=torch.ones(1, 8), encoder_hidden_states_t5=_t(1, 8, 48),
                text_embedding_mask_t5=torch.ones(1, 8))


def build_mochi(device):
    from comfy.ldm.genmo.joint_model.asymm_models_joint import AsymmDiTJoint
    return AsymmDiTJoint(patch_size=2, in_channels=12, hidden_size_x=64, hidden_size_y=32, depth=2,
                         num_heads=2, use_t5=True, mlp_ratio_x=192.0, mlp_ratio_y=2.0,  # Mochi asserts a 12288-wide MLP t5_feat_dim=32, t5_token_length=8,
                         learn_sigma=False, qk_norm=True, qkv_bias=False,
                         out_bias=True, patch_embed_bias=True, timestep_mlp_bias=True,
                         use_extended_posenc=False, posenc_preserve_area=True, rope_theta=10000.0,
                         device=device, operations=_ops())


def in_mochi(device, h, w):
    import torch
    return dict(x=_t(1, 12, 2, h, w), timestep=_ts(device), context=_t(1, 8, 4096),  # T5 width is fixed
                attention_mask=torch.ones(1, 8))


def build_hidream(device):
    from comfy.ldm.hidream.model import HiDreamImageTransformer2DModel
    return HiDreamImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=16, num_layers=2,
                                          num_single_layers=2, attention_head_dim=32, num_attention_heads=2,
                                          caption_channels=[32, 32], text_emb_dim=32, num_routed_experts=2,
                                          num_activated_experts=1, axes_dims_rope=(8, 12, 12), max_resolution=(64, 64),
                                          llama_layers=[0, 1, 2, 3], device=device, operations=_ops())


def in_hidream(device, h, w):
    return dict(x=_t(1, 16, h, w), t=_ts(device), y=_t(1, 32), context=_t(1, 8, 32),
                encoder_hidden_states_llama3=_t(1, 4, 8, 32))  # [B, layer, S, D]


def build_cosmos_predict2(device):
    from comfy.ldm.cosmos.predict2 import MiniTrainDIT
    return MiniTrainDIT(max_img_h=64, max_img_w=64, max_frames=8, in_channels=16, out_channels=16,
                        patch_spatial=2, patch_temporal=1, model_channels=64, num_blocks=2, num_heads=2,
                        crossattn_emb_channels=32, pos_emb_cls="rope3d", device=device, operations=_ops())


def in_cosmos_predict2(device, h, w):
    return dict(x=_t(1, 16, 1, h, w), timesteps=_ts(device), context=_t(1, 8, 32))


def build_cosmos(device):
    from comfy.ldm.cosmos.model import GeneralDIT
    return GeneralDIT(max_img_h=64, max_img_w=64, max_frames=8, in_channels=16, out_channels=16,
                      patch_spatial=2, patch_temporal=1, model_channels=64, num_blocks=2, num_heads=2,
                      crossattn_emb_channels=32, pos_emb_cls="rope3d", block_x_format="THWBD",
                      extra_per_block_abs_pos_emb=True, extra_per_block_abs_pos_emb_type="learnable",
                      affline_emb_norm=True, use_adaln_lora=True, adaln_lora_dim=16,
                      device=device, operations=_ops())


def in_cosmos(device, h, w):
    return dict(x=_t(1, 16, 1, h, w), timesteps=_ts(device), context=_t(1, 8, 32))


def build_kandinsky5(device):
    from comfy.ldm.kandinsky5.model import Kandinsky5
    return Kandinsky5(in_visual_dim=16, out_visual_dim=16, in_text_dim=32, in_text_dim2=24, time_dim=32,
                      model_dim=64, ff_dim=128, visual_embed_dim=64, patch_size=(1, 2, 2),
                      num_text_blocks=2, num_visual_blocks=2, axes_dims=(8, 12, 12), device=device,
                      operations=_ops())


def in_kandinsky5(device, h, w):
    return dict(x=_t(1, 16, 1, h, w), timestep=_ts(device), context=_t(1, 8, 32), y=_t(1, 24))


def build_omnigen2(device):
    from comfy.ldm.omnigen.omnigen2 import OmniGen2Transformer2DModel
    return OmniGen2Transformer2DModel(patch_size=2, in_channels=16, hidden_size=64, num_layers=2,
                                      num_refiner_layers=1, num_attention_heads=2, num_kv_heads=2,
                                      multiple_of=16, axes_dim_rope=(8, 12, 12), axes_lens=(300, 64, 64),
                                      text_feat_dim=32, timestep_scale=1000.0, device=device, operations=_ops())


def in_omnigen2(device, h, w):
    return dict(x=_t(1, 16, h, w), timesteps=_ts(device), context=_t(1, 8, 32), num_tokens=8)


def build_hunyuan_image21(device):
    from comfy.ldm.hunyuan_video.model import HunyuanVideo, HunyuanVideoParams
    return HunyuanVideo(in_channels=16, out_channels=16, vec_in_dim=None, context_in_dim=32, hidden_size=64,
                        mlp_ratio=2.0, num_heads=2, depth=2, depth_single_blocks=2, axes_dim=[16, 16],
                        theta=256, patch_size=[1, 1], qkv_bias=True, guidance_embed=False, byt5=False,
                        meanflow=False, use_cond_type_embedding=False, vision_in_dim=None,
                        **_host_params(HunyuanVideoParams, meanflow_sum=False),
                        device=device, operations=_ops())


def in_hunyuan_image21(device, h, w):
    import torch
    return dict(x=_t(1, 16, h, w), timestep=_ts(device), context=_t(1, 8, 32),
                attention_mask=torch.ones(1, 8, dtype=torch.long))


def build_chroma_radiance(device):
    from comfy.ldm.chroma_radiance.model import ChromaRadiance, ChromaRadianceParams
    return ChromaRadiance(in_channels=3, out_channels=3, context_in_dim=32, hidden_size=64, mlp_ratio=2.0,
                          num_heads=2, depth=2, depth_single_blocks=2, axes_dim=[8, 12, 12], theta=10000,
                          patch_size=4, qkv_bias=True, in_dim=64, out_dim=64, hidden_dim=64, n_layers=1,
                          nerf_hidden_size=16, nerf_mlp_ratio=2, nerf_depth=2, nerf_max_freqs=4,
                          nerf_tile_size=16, nerf_final_head_type="conv", nerf_embedder_dtype=None,
                          **_host_params(ChromaRadianceParams, txt_ids_dims=[], vec_in_dim=None, use_x0=False,
                                        use_sequential_txt_ids=False),
                          device=device, operations=_ops())


def in_chroma_radiance(device, h, w):
    import torch
    return dict(x=_t(1, 3, 2 * h, 2 * w), timestep=_ts(device), context=_t(1, 8, 32),
                guidance=torch.tensor([0.0]))


def build_ace_step(device):
    from comfy.ldm.ace.model import ACEStepTransformer2DModel
    return ACEStepTransformer2DModel(in_channels=8, num_layers=2, inner_dim=64, attention_head_dim=32,
                                     num_attention_heads=2, mlp_ratio=2.0, out_channels=8, speaker_embedding_dim=16,
                                     text_embedding_dim=32, ssl_encoder_depths=[1, 1], ssl_latent_dims=[16, 16],
                                     ssl_names=["mert", "m-hubert"], lyric_encoder_vocab_size=64,
                                     lyric_hidden_size=1024,  # LyricEncoder's width is fixed
                                     patch_size=[16, 1], max_height=16, max_width=4096,
                                     device=device, operations=_ops())


def in_ace_step(device, h, w):
    import torch
    return dict(x=_t(1, 8, 16, 4 * w), timestep=_ts(device), context=_t(1, 8, 32),
                lyric_token_idx=torch.zeros(1, 4, dtype=torch.long), lyrics_strength=1.0,
                speaker_embeds=_t(1, 16))


def build_wan_s2v(device):
    from comfy.ldm.wan.model import WanModel_S2V
    return WanModel_S2V(dim=64, ffn_dim=128, num_layers=2, num_heads=2, in_dim=16, out_dim=16, text_dim=32,
                        audio_dim=32, cond_dim=16, audio_inject_layers=[0, 1], device=device, operations=_ops())


def build_wan_camera(device):
    from comfy.ldm.wan.model import CameraWanModel
    return CameraWanModel(dim=64, ffn_dim=128, num_layers=2, num_heads=2, in_dim=16, out_dim=16, text_dim=32,
                          device=device, operations=_ops())


def build_wan22_5b(device):
    from comfy.ldm.wan.model import WanModel
    return WanModel(model_type="t2v", dim=64, ffn_dim=128, num_layers=2, num_heads=2, in_dim=48, out_dim=48,
                    text_dim=32, device=device, operations=_ops())


def in_wan22_5b(device, h, w):
    return dict(x=_t(1, 48, 2, h, w), timestep=_ts(device, 500.0), context=_t(1, 8, 32))


def build_wan_animate(device):
    from comfy.ldm.wan.model_animate import AnimateWanModel
    return AnimateWanModel(dim=64, ffn_dim=128, num_layers=2, num_heads=2, in_dim=16, out_dim=16, text_dim=32,
                           motion_encoder_dim=32, device=device, operations=_ops())


def build_ltxav(device):
    from comfy.ldm.lightricks.av_model import LTXAVModel
    return LTXAVModel(in_channels=32, audio_in_channels=128,  # 8 audio channels x 16 bins
                      cross_attention_dim=64, audio_cross_attention_dim=32,
                      attention_head_dim=32, audio_attention_head_dim=16, num_attention_heads=2,
                      audio_num_attention_heads=2, caption_channels=32, num_layers=2, device=device,
                      operations=_ops())


def in_ltxav(device, h, w):
    d = in_ltxv(device, h, w)
    d["x"] = [d["x"], _t(1, 8, 4, 16)]  # [video latent, audio latent]
    d["context"] = _t(1, 8, 64)  # video + audio text features
    return d


def build_cogvideox(device):
    from comfy.ldm.cogvideo.model import CogVideoXTransformer3DModel
    return CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=32, in_channels=16,
                                       out_channels=16, time_embed_dim=32, text_embed_dim=32, num_layers=2,
                                       sample_width=20, sample_height=12, sample_frames=5, patch_size=2,
                                       max_text_seq_length=8, use_rotary_positional_embeddings=True,
                                       device=device, operations=_ops())


def in_cogvideox(device, h, w):
    return dict(x=_t(1, 16, 2, h, w), timestep=_ts(device, 500.0), context=_t(1, 8, 32))


def build_ernie(device):
    from comfy.ldm.ernie.model import ErnieImageModel
    return ErnieImageModel(hidden_size=64, num_attention_heads=2, num_layers=2, ffn_hidden_size=128,
                           in_channels=16, out_channels=16, patch_size=2, text_in_dim=32, rope_axes_dim=(8, 12, 12),
                           device=device, operations=_ops())


def in_ernie(device, h, w):
    return dict(x=_t(1, 16, h, w), timesteps=_ts(device), context=_t(1, 8, 32))


def build_flux2(device):
    from comfy.ldm.flux.model import Flux, FluxParams
    return Flux(in_channels=16, out_channels=16, vec_in_dim=None, context_in_dim=32, hidden_size=64,
                mlp_ratio=3.0, num_heads=2, depth=2, depth_single_blocks=2, axes_dim=[8, 8, 8, 8],
                theta=2000, patch_size=2, qkv_bias=False, guidance_embed=True,
                **_host_params(FluxParams, txt_ids_dims=[3], global_modulation=True, mlp_silu_act=True,
                               ops_bias=False, default_ref_method="index"),
                device=device, operations=_ops())


def in_flux2(device, h, w):
    import torch
    return dict(x=_t(1, 16, h, w), timestep=_ts(device), context=_t(1, 8, 32), guidance=torch.tensor([3.5]))


def build_hunyuan_video15(device):
    from comfy.ldm.hunyuan_video.model import HunyuanVideo, HunyuanVideoParams
    return HunyuanVideo(in_channels=32, out_channels=16, vec_in_dim=None, context_in_dim=32, hidden_size=64,
                        mlp_ratio=2.0, num_heads=2, depth=2, depth_single_blocks=0, axes_dim=[8, 12, 12],
                        theta=256, patch_size=[1, 1, 1], qkv_bias=True, guidance_embed=False, byt5=False,
                        meanflow=False, use_cond_type_embedding=True, vision_in_dim=None,
                        **_host_params(HunyuanVideoParams, meanflow_sum=False),
                        device=device, operations=_ops())


def in_hunyuan_video15(device, h, w):
    import torch
    return dict(x=_t(1, 32, 2, h // 2, w // 2), timestep=_ts(device), context=_t(1, 8, 32),
                attention_mask=torch.ones(1, 8, dtype=torch.long))


def build_lumina2_shallow(device):
    """Lumina 2 with one block per list: nothing repeats, so discovery finds no blocks (test only)."""
    from comfy.ldm.lumina.model import NextDiT
    return NextDiT(patch_size=2, in_channels=4, dim=64, n_layers=1, n_refiner_layers=1, n_heads=2,
                   n_kv_heads=2, multiple_of=16, ffn_dim_multiplier=2.0, cap_feat_dim=32,
                   axes_dims=[8, 12, 12], axes_lens=[300, 64, 64], qk_norm=True, device=device,
                   operations=_ops())


# case -> (supported_models entries it stands for, build, inputs)
CASES = {
    "wan": ("WAN21_T2V, WAN22_T2V, WAN21_I2V, WAN21_FlowRVS", tiny.build_wan, in_wan),
    "vace_wan": ("WAN21_Vace", tiny.build_vace_wan, in_vace_wan),
    "flux": ("Flux, FluxSchnell, FluxInpaint", tiny.build_flux, in_flux),
    "chroma": ("Chroma", tiny.build_chroma, in_chroma),
    "hunyuan_video": ("HunyuanVideo, HunyuanVideoI2V, HunyuanVideoSkyreelsI2V", tiny.build_hunyuan_video,
                      in_hunyuan_video),
    "ltxv": ("LTXV", tiny.build_ltxv, in_ltxv),
    "qwen_image": ("QwenImage", tiny.build_qwen_image, in_qwen_image),
    "unet_sd15": ("SD15, SD20, SD21Unclip*, SD15_instructpix2pix, LotusD, SD_X4Upscaler, Stable_Zero123", tiny.build_unet_sd15,
                  in_unet),
    "unet_sdxl": ("SDXL, SDXLRefiner, SSD1B, Segmind_Vega, KOALA_*, SDXL_instructpix2pix", tiny.build_unet_sdxl,
                  in_unet_sdxl),
    "aura_flow": ("AuraFlow", build_aura, in_aura),
    "sd3": ("SD3", build_sd3, in_sd3),
    "lumina2": ("Lumina2", build_lumina2, in_lumina2),
    "z_image": ("ZImage", build_zimage, in_zimage),
    "pixart": ("PixArtAlpha, PixArtSigma", build_pixart, in_pixart),
    "hunyuan_dit": ("HunyuanDiT, HunyuanDiT1", build_hydit, in_hydit),
    "mochi": ("GenmoMochi", build_mochi, in_mochi),
    "hidream": ("HiDream", build_hidream, in_hidream),
    "cosmos": ("CosmosT2V, CosmosI2V", build_cosmos, in_cosmos),
    "cosmos_predict2": ("CosmosT2IPredict2, CosmosI2VPredict2", build_cosmos_predict2, in_cosmos_predict2),
    "kandinsky5": ("Kandinsky5, Kandinsky5Image", build_kandinsky5, in_kandinsky5),
    "omnigen2": ("Omnigen2", build_omnigen2, in_omnigen2),
    "hunyuan_image21": ("HunyuanImage21", build_hunyuan_image21, in_hunyuan_image21),
    "chroma_radiance": ("ChromaRadiance", build_chroma_radiance, in_chroma_radiance),
    "ace_step": ("ACEStep", build_ace_step, in_ace_step),
    "wan22_5b": ("WAN22_T2V (5B, 48-channel latent)", build_wan22_5b, in_wan22_5b),
    "wan_s2v": ("WAN22_S2V", build_wan_s2v, in_wan),
    "wan_camera": ("WAN21_Camera, WAN22_Camera", build_wan_camera, in_wan),
    "wan_animate": ("WAN22_Animate", build_wan_animate, in_wan),
    "ltxav": ("LTXAV (LTX-2)", build_ltxav, in_ltxav),
    "cogvideox": ("CogVideoX_T2V, CogVideoX_I2V, CogVideoX_Inpaint", build_cogvideox, in_cogvideox),
    "ernie_image": ("ErnieImage", build_ernie, in_ernie),
    "flux2": ("Flux2", build_flux2, in_flux2),
    "hunyuan_video15": ("HunyuanVideo15, HunyuanVideo15_SR_Distilled", build_hunyuan_video15, in_hunyuan_video15),
    "lumina2_shallow": ("(test only) Lumina2 with one block per list", build_lumina2_shallow, in_lumina2),
}
CASES.update(zoo_more.MORE)
CASES.update(zoo_newer.NEWER)
TEST_ONLY = ("lumina2_shallow",)  # not in the committed table

# Shape policies other than the settings default ('auto') per case: none, the zoo shows what a
# user gets (build_tiny_models runs the UNets 'static' to count one graph per layer).
POLICY: dict[str, str] = {}

# Model classes of ComfyUI 0.33's model_base without a tiny case here (class -> supported_models).
NO_CASE_YET = {
    "PidNet": "PiD; not written yet",
    "NaDiT": "SeedVR2; not written yet (a video upscaler with windowed attention over its own latent packing)",
    "MiniMaxH3Model": "MiniMaxH3; not written yet (takes a minimax_payload of audio + video conditioning)",
    "LatentSeqMMFlowModel": "TripoSplat; its token count is fixed (q_token_length), not the latent size: "
                            "no second size to test",
    "HiDreamO1Transformer": "HiDreamO1; not written yet",
    "AceStepConditionGenerationModel": "ACEStep15; not written yet",
    "MiniMaxMusic3DiT": "MiniMaxMusic3; not written yet",
    "Trellis2": "Trellis2; not written yet (3D sparse-structure model)",
}
# Not diffusion models (no sampling loop to compile for): detection, depth, segmentation.
NOT_DIFFUSION = {"RTv4": "RT_DETR_v4", "DepthAnything3Net": "DepthAnything3", "SAM3Model": "SAM3, SAM31"}
