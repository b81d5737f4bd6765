"""Talker shapes read from the checkpoint's `talker/` folder (ming.md §5.1): `config.json` (CFM DiT,
aggregator, patch sizes), `llm/config.json` (the Qwen2 LM) and `vae/config.json` (AudioVAE).

Everything the code needs comes from these files, never from constants: the tiny checkpoint uses
other sizes than the release. Missing required keys fail naming the file and the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistage.common.checkpoint.config_files import read_json, require_keys
from omnistage.common.checkpoint.shards import CheckpointError

TALKER_DIR = "talker"
_NEEDED_BY = "the talker, from the release's talker/ folder,"


@dataclass(frozen=True)
class Qwen2Shape:
    """A Qwen2 decoder stack as transformers' `Qwen2Config` describes it (the rules of transformers 4.57+)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # Per layer: attention window in positions (a query sees keys within the last `w` positions); 0 = full.
    windows: tuple[int, ...] = ()

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    @classmethod
    def from_hf(cls, d: dict[str, Any], where: str) -> Qwen2Shape:
        """From a Qwen2 config dict, with transformers' defaults for absent keys."""
        hidden = int(d.get("hidden_size", 4096))
        heads = int(d.get("num_attention_heads", 32))
        layers = int(d.get("num_hidden_layers", 32))
        if hidden % heads and "head_dim" not in d:
            raise CheckpointError(
                f"{where}: hidden_size {hidden} is not divisible by num_attention_heads {heads}"
            )
        rope_scaling = d.get("rope_scaling")
        if rope_scaling and (rope_scaling.get("rope_type") or rope_scaling.get("type")) not in (
            None,
            "default",
        ):
            raise CheckpointError(f"{where}: rope_scaling {rope_scaling} is not supported")
        window = int(d.get("sliding_window") or 0) if d.get("use_sliding_window", False) else 0
        types = d.get("layer_types")
        if types is None:
            first_windowed = int(d.get("max_window_layers", 28))
            types = [
                "sliding_attention" if window and i >= first_windowed else "full_attention"
                for i in range(layers)
            ]
        if len(types) != layers:
            raise CheckpointError(f"{where}: layer_types has {len(types)} entries for {layers} layers")
        windows = tuple(window if t == "sliding_attention" else 0 for t in types)
        return cls(
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads", heads)),
            head_dim=int(d.get("head_dim") or hidden // heads),
            intermediate_size=int(d.get("intermediate_size", 22016)),
            vocab_size=int(d.get("vocab_size", 151936)),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            windows=windows if any(windows) else (),
        )


RELEASE_LLM_COND_DIM = 896  # the release DiT's default condition width when flowmodel has no llm_cond_dim


@dataclass(frozen=True)
class DiTShape:
    """The CFM DiT (`flowmodel`) and the aggregator share this block shape (ming.md §5.3)."""

    hidden_size: int
    depth: int
    num_heads: int
    mlp_ratio: float = 4.0
    in_channels: int = 64

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> DiTShape:
        require_keys(d, ("hidden_size", "depth", "num_heads"), where)
        if d.get("qk_norm") or d.get("spk_dim") or d.get("pe_attn_head"):
            raise CheckpointError(
                f"{where}: qk_norm / spk_dim / pe_attn_head are not supported (the release has none)"
            )
        if d["hidden_size"] % d["num_heads"]:
            raise CheckpointError(
                f"{where}: hidden_size {d['hidden_size']} not divisible by num_heads {d['num_heads']}"
            )
        return cls(
            int(d["hidden_size"]),
            int(d["depth"]),
            int(d["num_heads"]),
            float(d.get("mlp_ratio", 4.0)),
            int(d.get("in_channels", 64)),
        )


@dataclass(frozen=True)
class VAEShape:
    """AudioVAE (ming.md §5.4): Qwen2 encoder/decoder backbones, frame sizes, ISTFT head."""

    sample_rate: int
    patch_size: int  # latent frames per VAE patch (4): one latent = patch_size decoder frames
    latent_dim: int
    enc_input_dim: int  # samples per encoder frame
    enc_hop: int  # samples between encoder frames
    dec_hop: int  # decoder output_dim: samples per decoder frame (ISTFT hop); n_fft = 4 x hop
    encoder: Qwen2Shape
    decoder: Qwen2Shape

    @property
    def n_fft(self) -> int:
        return 4 * self.dec_hop

    @property
    def samples_per_latent(self) -> int:
        return self.dec_hop * self.patch_size

    @property
    def encoder_aggregator(self) -> Qwen2Shape:
        """The encoder's 4-layer Qwen2 that pools each patch of frames into one latent."""
        return Qwen2Shape(
            **{
                **self.encoder.__dict__,
                "num_layers": 4,
                "windows": self.encoder.windows[:4] if self.encoder.windows else (),
            }
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> VAEShape:
        require_keys(d, ("sample_rate", "enc_kwargs", "dec_kwargs"), where)
        enc, dec = d["enc_kwargs"], d["dec_kwargs"]
        require_keys(enc, ("input_dim", "latent_dim", "backbone"), f"{where} enc_kwargs")
        require_keys(dec, ("output_dim", "latent_dim", "backbone"), f"{where} dec_kwargs")
        patch = int(d.get("patch_size", -1))
        if patch < 1:
            raise CheckpointError(f"{where}: patch_size {patch} is not supported (the release uses 4)")
        if enc["latent_dim"] != dec["latent_dim"]:
            raise CheckpointError(
                f"{where}: encoder latent_dim {enc['latent_dim']} != decoder {dec['latent_dim']}"
            )
        return cls(
            sample_rate=int(d["sample_rate"]),
            patch_size=patch,
            latent_dim=int(dec["latent_dim"]),
            enc_input_dim=int(enc["input_dim"]),
            enc_hop=int(enc.get("hop_size", 320)),
            dec_hop=int(dec["output_dim"]),
            encoder=Qwen2Shape.from_hf(enc["backbone"], f"{where} enc_kwargs.backbone"),
            decoder=Qwen2Shape.from_hf(dec["backbone"], f"{where} dec_kwargs.backbone"),
        )


@dataclass(frozen=True)
class TalkerModelConfig:
    """Everything the talker's models need, from `talker/{config.json, llm/config.json, vae/config.json}`."""

    llm: Qwen2Shape
    flow: DiTShape
    aggregator: DiTShape
    vae: VAEShape
    steps: int = 10  # CFM Euler steps per patch
    patch_size: int = 4  # latents per talker step
    history_patch_size: int = 32  # latents of history the DiT sees
    cfg_strength: float = 2.0
    latent_dim: int = 64
    spk_dim: int = 192

    @property
    def samples_per_step(self) -> int:
        """Audio samples one talker step makes (14112 = 0.32 s at 44.1 kHz for the release)."""
        return self.patch_size * self.vae.samples_per_latent

    @classmethod
    def from_checkpoint(cls, root: str | Path) -> TalkerModelConfig:
        """From `<root>/talker/` (root: the Ming checkpoint folder)."""
        tdir = Path(root) / TALKER_DIR
        top = read_json(tdir / "config.json", _NEEDED_BY)
        llm = read_json(tdir / "llm" / "config.json", _NEEDED_BY)
        vae = read_json(tdir / "vae" / "config.json", _NEEDED_BY)
        where = str(tdir / "config.json")
        require_keys(top, ("flowmodel", "aggregator"), where)
        cfg = cls(
            llm=Qwen2Shape.from_hf(llm, str(tdir / "llm" / "config.json")),
            flow=DiTShape.from_dict(top["flowmodel"], f"{where} flowmodel"),
            aggregator=DiTShape.from_dict(top["aggregator"], f"{where} aggregator"),
            vae=VAEShape.from_dict(vae, str(tdir / "vae" / "config.json")),
            steps=int(top.get("steps", 10)),
            patch_size=int(top.get("patch_size", 4)),
            history_patch_size=int(top.get("history_patch_size", 32)),
            cfg_strength=float(top.get("cfg_strength", 2.0)),
            latent_dim=int(top.get("latent_dim", 64)),
            spk_dim=int(top.get("spk_dim", 192)),
        )
        if cfg.latent_dim != cfg.vae.latent_dim or cfg.flow.in_channels != cfg.latent_dim:
            raise CheckpointError(
                f"{where}: latent_dim {cfg.latent_dim} disagrees with the VAE or the flow model"
            )
        # The release's DiT builds its condition layer from `flowmodel.llm_cond_dim` (default 896, the
        # release's talker LM width): a checkpoint whose LM is another width must say so.
        cond_dim = int(top["flowmodel"].get("llm_cond_dim", RELEASE_LLM_COND_DIM))
        if cond_dim != cfg.llm.hidden_size:
            raise CheckpointError(
                f"{where}: flowmodel llm_cond_dim {cond_dim} != talker LM hidden_size "
                f"{cfg.llm.hidden_size} (the DiT's condition is the LM's hidden state)"
            )
        if cfg.history_patch_size < cfg.patch_size:
            raise CheckpointError(
                f"{where}: history_patch_size {cfg.history_patch_size} < patch_size {cfg.patch_size}"
            )
        return cfg
