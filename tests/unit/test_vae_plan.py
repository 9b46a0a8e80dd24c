"""compile_core.plan.vae: which VAE blocks are compiled, on stand-ins named like ComfyUI's classes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from compile_core.run import engine
from compile_core.plan.settings import CompileSettings
from compile_core.plan.vae import plan_vae


def _named(name, base=nn.Module):
    return type(name, (base,), {})


RMS_norm = _named("RMS_norm")
ResnetBlock = _named("ResnetBlock")
Upsample = _named("Upsample")
AttnBlock = _named("AttnBlock")


class WanVAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = nn.Sequential(nn.Sequential(RMS_norm(), nn.SiLU()), RMS_norm(), nn.Conv3d(2, 2, 1))
        self.encoder = nn.Sequential(RMS_norm(), nn.Conv3d(2, 2, 1))


class AutoencodingEngine(nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = nn.Module()
        self.decoder.mid = nn.Sequential(ResnetBlock(), AttnBlock(), ResnetBlock())
        self.decoder.up = nn.Sequential(Upsample())
        self.encoder = nn.Sequential(ResnetBlock())


class AutoencoderKL(AutoencodingEngine):  # matched through the MRO, as ComfyUI's subclass
    pass


def test_wan_vae_compiles_its_norms_only():
    plan = plan_vae(WanVAE(), "decode")
    assert plan.paths == ("decoder.0.0", "decoder.1") and plan.family == "vae:WanVAE"
    assert plan_vae(WanVAE(), "both").paths == ("decoder.0.0", "decoder.1", "encoder.0")
    # never whole: its decoder keeps a feature cache across chunks
    assert plan_vae(WanVAE(), "decode", blocks_only=False).paths == ("decoder.0.0", "decoder.1")


def test_image_vae_blocks_without_attention_or_whole():
    plan = plan_vae(AutoencoderKL(), "decode")
    assert plan.paths == ("decoder.mid.0", "decoder.mid.2", "decoder.up.0")
    assert plan_vae(AutoencoderKL(), "encode").paths == ("encoder.0",)
    assert plan_vae(AutoencoderKL(), "both", blocks_only=False).paths == ("decoder", "encoder")


def test_unknown_vae_whole_decoder_and_nothing_to_compile():
    other = nn.Module()
    other.decoder = nn.Linear(2, 2)
    assert plan_vae(other, "decode").paths == ("decoder",)
    assert plan_vae(other, "encode") is None
    with pytest.raises(ValueError, match="which"):
        plan_vae(other, "decoder")


class _Norm(nn.Module):
    def forward(self, x):
        return nn.functional.normalize(x, dim=1) * 2.0


_Norm.__name__ = _Norm.__qualname__ = "RMS_norm"


class TinyWanVAE(WanVAE):
    def __init__(self):
        nn.Module.__init__(self)
        self.decoder = nn.Sequential(_Norm(), nn.SiLU(), _Norm())


def test_engine_prepare_takes_the_vae_plan_and_runs_it():
    vae = TinyWanVAE()
    plan = plan_vae(vae, "decode")
    assert plan.paths == ("decoder.0", "decoder.2")
    compiled = engine.prepare(vae, CompileSettings(backend="eager", reuse_if_similar=False), plan=plan)
    assert compiled.plan is plan and compiled.description == "RMS_norm x2"
    x = torch.randn(1, 3, 2, 4, 4)
    out = compiled.run(vae, lambda: vae.decoder(x), torch.device("cpu"))
    assert torch.allclose(out, vae.decoder(x)) and compiled.entry.graphs >= 1
    assert not any("_compiled_call_impl" in m.__dict__ for m in vae.modules())
