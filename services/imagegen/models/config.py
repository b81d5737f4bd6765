"""Image-generation shapes read from the checkpoint's subfolders (ming.md §6.4)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omnistage.common.checkpoint.config_files import read_json
from omnistage.common.checkpoint.shards import CheckpointError

SUBFOLDERS = ("mlp", "connector", "transformer", "vae", "scheduler")


def _pick(cls: type, data: dict[str, Any], path: Path, renames: dict[str, str] | None = None) -> Any:
    """Build `cls` from the keys it knows (JSON lists become tuples); other keys are ignored."""
    renames = renames or {}
    known = {f.name for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        name = renames.get(key, key)
        if name in known:
            kwargs[name] = tuple(value) if isinstance(value, list) else value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None


@dataclass(frozen=True)
class MlpConfig:
    """`mlp/config.json`: how thinker hidden states become DiT conditioning (ming.md §6.1)."""

    dit_type: str = "zimage"
    img_gen_scales: tuple[int, ...] = (16,)
    diffusion_c_input_dim: int = 2560
    text_encoder_norm: bool = True
    use_identity_mlp: bool = True

    def __post_init__(self) -> None:
        if "zimage" not in self.dit_type:
            raise ValueError(f"dit_type {self.dit_type!r}: only Z-Image ('zimage') is served")
        if not self.img_gen_scales:
            raise ValueError("img_gen_scales: at least one scale")

    @property
    def num_queries(self) -> int:
        """Query slots whose hidden states condition the DiT: the last scale squared (256 for 16)."""
        return self.img_gen_scales[-1] ** 2

    @property
    def query_key(self) -> str:
        """Key of the query embeddings in `mlp/model.safetensors` (the thinker reads it)."""
        s = self.img_gen_scales[-1]
        return f"query_tokens_dict.{s}x{s}"


@dataclass(frozen=True)
class ConnectorConfig:
    """`connector/config.json`: a Qwen2 LM run as a bidirectional encoder (ming.md §6.1 step 4)."""

    hidden_size: int = 1536
    num_hidden_layers: int = 28
    num_attention_heads: int = 12
    num_key_value_heads: int = 2
    intermediate_size: int = 8960
    vocab_size: int = 151936
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    hidden_act: str = "silu"
    tie_word_embeddings: bool = True
    head_dim: int = 0  # 0: hidden_size / num_attention_heads

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r}: only silu")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class DiTConfig:
    """`transformer/config.json`: diffusers `ZImageTransformer2DModel` (ming.md §6.2)."""

    all_patch_size: tuple[int, ...] = (2,)
    all_f_patch_size: tuple[int, ...] = (1,)
    in_channels: int = 16
    dim: int = 3840
    n_layers: int = 30
    n_refiner_layers: int = 2
    n_heads: int = 30
    n_kv_heads: int = 30
    norm_eps: float = 1e-5
    qk_norm: bool = True
    cap_feat_dim: int = 2560
    rope_theta: float = 256.0
    t_scale: float = 1000.0
    axes_dims: tuple[int, ...] = (32, 48, 48)
    axes_lens: tuple[int, ...] = (1024, 512, 512)
    siglip_feat_dim: int | None = None

    def __post_init__(self) -> None:
        if self.all_patch_size != (2,) or self.all_f_patch_size != (1,):
            raise ValueError("all_patch_size / all_f_patch_size: only (2,) / (1,) (the release's)")
        if self.n_kv_heads != self.n_heads:
            raise ValueError("n_kv_heads: must equal n_heads (Z-Image has no GQA)")
        if not self.qk_norm:
            raise ValueError("qk_norm: must be true (Z-Image)")
        if self.siglip_feat_dim is not None:
            raise ValueError("siglip_feat_dim: the Omni variant is not served")
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        if len(self.axes_dims) != 3 or len(self.axes_lens) != 3:
            raise ValueError("axes_dims / axes_lens: three axes (frame/caption, row, column)")
        if sum(self.axes_dims) != self.head_dim or any(d % 2 for d in self.axes_dims):
            raise ValueError(
                f"axes_dims {list(self.axes_dims)}: even sizes summing to head_dim {self.head_dim}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def adaln_dim(self) -> int:
        return min(self.dim, 256)

    @property
    def ffn_dim(self) -> int:
        return int(self.dim / 3 * 8)

    @property
    def patch_dim(self) -> int:
        return 2 * 2 * self.in_channels


@dataclass(frozen=True)
class VaeConfig:
    """`vae/config.json`: diffusers `AutoencoderKL` (16 latent channels for Z-Image/Flux)."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 16
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    norm_num_groups: int = 32
    act_fn: str = "silu"
    down_block_types: tuple[str, ...] = ("DownEncoderBlock2D",) * 4
    up_block_types: tuple[str, ...] = ("UpDecoderBlock2D",) * 4
    mid_block_add_attention: bool = True
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    scaling_factor: float = 0.18215
    shift_factor: float | None = None

    def __post_init__(self) -> None:
        if self.act_fn != "silu":
            raise ValueError(f"act_fn {self.act_fn!r}: only silu")
        if set(self.down_block_types) != {"DownEncoderBlock2D"} or set(self.up_block_types) != {
            "UpDecoderBlock2D"
        }:
            raise ValueError("down/up_block_types: only DownEncoderBlock2D / UpDecoderBlock2D")
        n = len(self.block_out_channels)
        if len(self.down_block_types) != n or len(self.up_block_types) != n:
            raise ValueError("down_block_types / up_block_types: one per block_out_channels entry")
        if any(c % self.norm_num_groups for c in self.block_out_channels):
            raise ValueError(
                f"block_out_channels must be multiples of norm_num_groups {self.norm_num_groups}"
            )

    @property
    def scale_factor(self) -> int:
        """Pixels per latent cell along a side (8 for four blocks)."""
        return 2 ** (len(self.block_out_channels) - 1)

    @property
    def shift(self) -> float:
        return self.shift_factor or 0.0


@dataclass(frozen=True)
class SchedulerConfig:
    """`scheduler/scheduler_config.json`: diffusers `FlowMatchEulerDiscreteScheduler` (ming.md §6.3)."""

    num_train_timesteps: int = 1000
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    time_shift_type: str = "exponential"
    # Options the release does not use; a checkpoint that sets one is refused (`unsupported`).
    unsupported: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.time_shift_type not in ("exponential", "linear"):
            raise ValueError(f"time_shift_type {self.time_shift_type!r}: exponential or linear")
        if self.unsupported:
            key, value = next(iter(self.unsupported.items()))
            raise ValueError(f"{key}={value!r} is not supported (the release's scheduler leaves it off)")


_SCHEDULER_OFF = {
    "invert_sigmas": False,
    "shift_terminal": None,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "stochastic_sampling": False,
}


@dataclass(frozen=True)
class ImageGenModelConfig:
    """Every part of the image-generation checkpoint; `thinker_hidden` is the conditioning width."""

    mlp: MlpConfig
    connector: ConnectorConfig
    dit: DiTConfig
    vae: VaeConfig
    scheduler: SchedulerConfig
    thinker_hidden: int

    @classmethod
    def from_checkpoint(cls, root: str | Path) -> ImageGenModelConfig:
        root = Path(root)
        mlp = _pick(MlpConfig, *_read(root / "mlp" / "config.json"))
        connector = _pick(ConnectorConfig, *_read(root / "connector" / "config.json"))
        dit = _pick(DiTConfig, *_read(root / "transformer" / "config.json"))
        vae = _pick(VaeConfig, *_read(root / "vae" / "config.json"))
        sched_data, sched_path = _read(root / "scheduler" / "scheduler_config.json")
        off = {
            k: v for k, v in sched_data.items() if k in _SCHEDULER_OFF and v not in (_SCHEDULER_OFF[k], None)
        }
        scheduler = _pick(SchedulerConfig, {**sched_data, "unsupported": off}, sched_path)
        thinker_hidden = _thinker_hidden(root)
        if mlp.diffusion_c_input_dim != dit.cap_feat_dim and mlp.use_identity_mlp:
            raise CheckpointError(
                f"{root}: mlp diffusion_c_input_dim {mlp.diffusion_c_input_dim} != transformer cap_feat_dim "
                f"{dit.cap_feat_dim} (with the identity MLP they must match)"
            )
        if vae.latent_channels != dit.in_channels:
            raise CheckpointError(
                f"{root}: vae latent_channels {vae.latent_channels} != transformer "
                f"in_channels {dit.in_channels}"
            )
        return cls(mlp, connector, dit, vae, scheduler, thinker_hidden)


def _read(path: Path) -> tuple[dict[str, Any], Path]:
    return read_json(path, "image generation"), path


def _thinker_hidden(root: Path) -> int:
    """Width of the thinker's hidden states: root `config.json` → `llm_config.hidden_size`."""
    data, _ = _read(root / "config.json")
    llm = data.get("llm_config", data)
    hidden = llm.get("hidden_size") if isinstance(llm, dict) else None
    if not isinstance(hidden, int) or hidden <= 0:
        raise CheckpointError(f"{root / 'config.json'}: llm_config.hidden_size missing")
    return hidden
