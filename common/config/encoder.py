"""The encoder stage (`encoder:`): what one item may be, what one request may hold, batch sizes."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.common.config.checks import ConfigError, batch_sizes, positive, positive_fields


@dataclass(frozen=True)
class EncoderConfig:
    """Encoder service limits: what one item may be, what one request may hold, how batches are sized."""

    # Smallest / largest pixels of an image after smart_resize (the model's 4·32·32 and 16384·32·32).
    image_min_pixels: int = 4096
    image_max_pixels: int = 16_777_216
    # Largest decoded image or video frame accepted (width × height, checked before decoding).
    max_input_image_pixels: int = 67_108_864
    # Video: smallest pixels of a frame and the pixel budget of all sampled frames (128·32·32, 96·128·32·32).
    video_min_pixels: int = 131_072
    video_total_pixels: int = 12_582_912
    # Video: most frames sampled (or given as frames) per video; an even number.
    max_video_frames: int = 256
    # Longest video accepted, in seconds.
    max_video_seconds: float = 600.0
    # Longest audio clip accepted, in seconds (also capped by the checkpoint: 2·n_ctx / 100 s).
    max_audio_seconds: float = 300.0
    # Items one Encode request may carry.
    max_items_per_request: int = 16
    # Batch sizes (items per forward, per modality) the start-up stress tries, largest first; the
    # largest that fits at the largest item size is the cap.
    stress_batch_sizes: tuple[int, ...] = (8, 4, 2, 1)
    # Mel frames one audio forward may hold, padded (clips × the longest; 100 a second); 0: what the
    # stress proved (its audio cap × the frames of a max_audio_seconds clip). A lower value keeps each
    # forward short beside a thinker on the same GPU; a clip longer than it runs alone (never refused).
    audio_batch_frames: int = 0
    # How long an item waits for a batch slot before RESOURCE_EXHAUSTED, in seconds.
    queue_timeout_s: float = 30.0
    # Threads decoding and preprocessing media.
    preprocess_workers: int = 2
    # Bytes of the producer-owned shared-memory pool (POSIX shm; also the CUDA IPC pool on a GPU).
    transport_pool_bytes: int = 1 << 30
    # Seconds a consumer has to decode an embedding ref before its slice may be reused.
    lease_ttl_s: float = 60.0
    # Embeddings smaller than this many bytes travel inline in the response; larger ones through shm.
    inline_max_bytes: int = 64 * 1024

    def validate(self, path: str) -> None:
        positive_fields(
            self,
            path,
            (
                "image_min_pixels",
                "image_max_pixels",
                "max_input_image_pixels",
                "video_min_pixels",
                "video_total_pixels",
                "max_video_frames",
                "max_video_seconds",
                "max_audio_seconds",
                "max_items_per_request",
                "queue_timeout_s",
                "preprocess_workers",
                "transport_pool_bytes",
                "lease_ttl_s",
            ),
        )
        positive(f"{path}.inline_max_bytes", self.inline_max_bytes, allow_zero=True)
        positive(f"{path}.audio_batch_frames", self.audio_batch_frames, allow_zero=True)
        if self.image_min_pixels > self.image_max_pixels:
            raise ConfigError(
                f"{path}.image_min_pixels: {self.image_min_pixels} exceeds image_max_pixels {self.image_max_pixels}"
            )
        if self.max_video_frames % 2:
            raise ConfigError(
                f"{path}.max_video_frames: expected an even number, got {self.max_video_frames}"
            )
        batch_sizes(f"{path}.stress_batch_sizes", self.stress_batch_sizes)
