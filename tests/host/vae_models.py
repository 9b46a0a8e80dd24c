"""Tiny random-weight VAEs that ComfyUI's own VAELoader recognises (host tests, benchmarks).

Built with the host's classes in a subprocess (as ``harness.make_tiny_wan``), cached in
``MODEL_CACHE``, and checked by loading them back through ``comfy.sd.VAE``, which detects the
type from the keys:

- ``wan``: a WAN 2.1 VAE (``decoder.middle.0.residual.0.gamma``; the width comes from
  ``decoder.head.0.gamma``), base width ``dim`` instead of 96.
- ``image``: an SD-style AutoencoderKL (``decoder.conv_in.weight``, ``post_quant_conv``,
  ``decoder.up.3.upsample``), decoder width ``ch`` instead of 128 where the host allows it. Decoder keys only: ComfyUI
  builds the encoder at the stock width and warns that its keys are missing (decode only).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness import COMFY_DIR, MODEL_CACHE, PYTHON, host_env


def vae_name(kind: str, width: int, seed: int = 0) -> str:
    return f"tcs_tiny_{kind}_vae_w{width}_s{seed}.safetensors"


def default_width(kind: str) -> int:
    """WAN: 8. Image: 32 where the host sizes the decoder from its weights (``decoder_ch`` in
    ``comfy/sd.py``, ComfyUI 0.33); older hosts (0.3.75) build the stock 128-wide decoder."""
    if kind == "wan":
        return 8
    return 32 if "decoder_ch" in (COMFY_DIR / "comfy" / "sd.py").read_text() else 128


def make_tiny_vae(kind: str, width: int | None = None, seed: int = 0) -> Path:
    """The cached file for ``kind`` (``wan`` or ``image``), generated once."""
    width = width or default_width(kind)
    cached = MODEL_CACHE / vae_name(kind, width, seed)
    if not cached.exists():
        MODEL_CACHE.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        cmd = [PYTHON, str(Path(__file__).resolve()), "make", kind, str(tmp), str(width), str(seed)]
        proc = subprocess.run(cmd, cwd=COMFY_DIR, capture_output=True, text=True, timeout=600,
                              env=host_env(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parent)))
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"tiny {kind} VAE generation failed:\n{proc.stdout}\n{proc.stderr}")
        os.replace(tmp, cached)
    return cached


def _randomise(model, seed):
    import torch
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 1.0 / (p[0].numel() ** 0.5))
            elif name.endswith("gamma") or (".norm" in name and name.endswith("weight")):
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.02)


def _wan_sd(width, seed):
    from comfy.ldm.wan.vae import WanVAE
    model = WanVAE(dim=width, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                   temperal_downsample=[False, True, True])
    _randomise(model, seed)
    return model.state_dict(), (1, 16, 2, 4, 4)


def _image_sd(width, seed):
    from comfy.ldm.models.autoencoder import AutoencoderKL
    dd = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3,
          "ch": width, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    model = AutoencoderKL(ddconfig=dd, embed_dim=4)
    _randomise(model, seed)
    sd = {k: v for k, v in model.state_dict().items() if k.startswith(("decoder.", "post_quant_conv."))}
    return sd, (1, 4, 4, 4)


def _main(kind, out, width, seed):
    """Subprocess body: build, randomise, save, and load back through ComfyUI's VAE detection."""
    sys.path.insert(0, str(COMFY_DIR))
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options
    comfy.options.enable_args_parsing()
    import safetensors.torch
    import torch
    import comfy.sd

    sd, latent = {"wan": _wan_sd, "image": _image_sd}[kind](width, seed)
    sd = {k: v.contiguous() for k, v in sd.items()}
    vae = comfy.sd.VAE(sd=dict(sd))
    expected = {"wan": "WanVAE", "image": "AutoencoderKL"}[kind]
    assert type(vae.first_stage_model).__name__ == expected, type(vae.first_stage_model)
    with torch.no_grad():
        img = vae.decode(torch.randn(latent))
    assert torch.isfinite(img).all() and img.std() > 0.01, img.std()
    safetensors.torch.save_file(sd, out)
    print(f"saved {out}: {len(sd)} tensors, decode {tuple(img.shape)} std {img.std().item():.3f}")


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "make":
    _main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
