"""The talker stage (`talker:`): voices, text, segments, sampling, streams speaking at once."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.common.config.checks import ConfigError, batch_sizes, positive_fields


@dataclass(frozen=True)
class TalkerConfig:
    """Talker service limits: voices, text, segment lengths, sampling, how many streams speak at once."""

    # Preset voice (talker/data/voice_name.json) of a stream that names none.
    default_voice: str = "DB30"
    # Most characters of text one Speak stream may send in total.
    max_text_chars: int = 4000
    # Longest / shortest custom-voice reference clip, in seconds; longest transcript, in characters.
    max_reference_seconds: float = 20.0
    max_transcript_chars: int = 500
    # Longest segment in "semantic" units (CJK characters + English words): the reference's 50.
    max_segment_length: int = 50
    # Pieces (words, CJK characters, spaces, marks) a segment needs before a mark may end it: the
    # first segment at any clause or sentence mark, later ones at sentence marks.
    first_segment_min_pieces: int = 8
    segment_min_pieces: int = 8
    # The first segment's bound, so that the first audio never waits for punctuation: it is cut at a
    # word boundary once it holds this many words (CJK characters, English words, numbers; 0: no bound)
    # or once this many seconds have passed since its first text (0: no time limit), whichever comes
    # first. Later segments keep the reference's rules.
    first_segment_max_pieces: int = 6
    first_segment_max_wait_s: float = 0.25
    # Pace each stream to real time plus this lead, in seconds of audio, instead of racing ahead of
    # its listener (a talker sharing a GPU then leaves the thinker its time); 0: as fast as it goes.
    realtime_lead_s: float = 0.0
    # Longest audio of one segment, in seconds (bounds the VAE cache; the reference also caps each
    # segment at max(2 s, 0.36 s per character)).
    max_segment_seconds: float = 60.0
    # Talker steps before the stop head may end a segment (the reference's 10).
    min_steps: int = 10
    # Positions of the talker LM's KV cache per stream: prompt + one per step (the reference's 2048).
    max_lm_tokens: int = 2048
    # Flow-matching noise temperature; 0 is the reference's pure Euler sampling.
    temperature: float = 0.0
    # Scale of that noise (σ, the reference's 0.25).
    sigma: float = 0.25
    # Hold back trailing silence of each segment (keep at most 0.3 s), as the reference does.
    trim_silence: bool = True
    # Seed of the preset voices' latent samples (computed once at start-up).
    voice_seed: int = 0
    # Step batches (streams advanced by one talker step) that the start-up stress tries, largest first;
    # the largest that fits is the step batch (a paced stream needs a step only when its audio runs
    # short, so a step serves many more streams than it holds rows).
    stress_batch_sizes: tuple[int, ...] = (16, 8, 4, 2, 1)
    # Most streams speaking at once. Each holds its caches (LM, CFM, VAE) for its whole audio; the
    # talker serves as many as fit its memory budget beside the step batch's peak, at most this many
    # (without a budget: this many).
    max_streams: int = 128
    # How long a new stream waits for a free slot before RESOURCE_EXHAUSTED, in seconds (0: at once).
    queue_timeout_s: float = 0.0
    # onnxruntime threads of the CAM++ speaker model.
    speaker_threads: int = 2
    # Run the LM decode, the CFM sample and the VAE backbone of each step as CUDA graphs at padded sizes, captured
    # at start-up (the stress counts their memory); ignored off CUDA.
    cuda_graphs: bool = True
    # With cuda_graphs: prompt lengths (tokens) at which the prefill of new segments (a step's new
    # prompts together, rows padded as the step's) also runs as CUDA graphs, a prompt padded to the
    # next of them; a longer prompt is prefilled eagerly. Empty: every prefill eager.
    prefill_graph_tokens: tuple[int, ...] = ()

    def validate(self, path: str) -> None:
        positive_fields(
            self,
            path,
            (
                "max_text_chars",
                "max_reference_seconds",
                "max_transcript_chars",
                "max_segment_length",
                "first_segment_min_pieces",
                "segment_min_pieces",
                "max_segment_seconds",
                "max_lm_tokens",
                "speaker_threads",
                "max_streams",
            ),
        )
        positive_fields(
            self,
            path,
            (
                "min_steps",
                "temperature",
                "sigma",
                "queue_timeout_s",
                "voice_seed",
                "first_segment_max_pieces",
                "first_segment_max_wait_s",
                "realtime_lead_s",
            ),
            allow_zero=True,
        )
        if not self.default_voice.strip():
            raise ConfigError(f"{path}.default_voice: expected a preset voice name, got ''")
        batch_sizes(f"{path}.stress_batch_sizes", self.stress_batch_sizes)
        if any(n < 1 or n > self.max_lm_tokens for n in self.prefill_graph_tokens):
            raise ConfigError(
                f"{path}.prefill_graph_tokens: expected prompt lengths from 1 to max_lm_tokens "
                f"({self.max_lm_tokens}), got {list(self.prefill_graph_tokens)}"
            )
