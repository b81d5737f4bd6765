"""Multimodal prompts on rank 0: the encoder's items checked against the prompt, their rows copied
out of shared memory, and the slots, router codes and 3D positions laid out (ming.md §2.2, §2.3)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from omnistage.common.runtime.errors import InvalidRequest
from omnistage.common.transport import TransportContext, TransportError, decode, from_proto_dtype
from omnistage.common.transport.release import release_quietly
from omnistage.services.thinker.engine.media import MultimodalPrompt, PromptMedia
from omnistage.services.thinker.models.config import ThinkerConfig
from omnistage.services.thinker.models.layers.moe import AUDIO, VISION
from omnistage.services.thinker.models.rope_index import get_rope_index
from omnistage.v1 import thinker_pb2

Item = thinker_pb2.MultimodalEmbedding


@dataclass(frozen=True)
class Placeholders:
    """The checkpoint's placeholder ids (never constants: the tiny checkpoint's differ from the release's)."""

    image: int
    video: int
    audio: int
    image_start: int

    @classmethod
    def of(cls, config: ThinkerConfig) -> Placeholders:
        ids = (
            config.image_patch_token_id,
            config.video_patch_token_id,
            config.audio_patch_token_id,
            config.image_start_token_id,
        )
        if any(i is None for i in ids):
            raise ValueError(
                "the checkpoint names no <imagePatch>, <framePatch>, <audioPatch> or <image> token"
            )
        return cls(*ids)  # type: ignore[arg-type]

    def name(self, token_id: int) -> str:
        return {self.image: "<imagePatch>", self.video: "<framePatch>", self.audio: "<audioPatch>"}[token_id]


@dataclass(frozen=True)
class _Run:
    start: int  # prompt index of the first slot
    length: int


def _runs(slots: torch.Tensor) -> list[_Run]:
    """Maximal runs of consecutive prompt indices in `slots` (ascending)."""
    if slots.numel() == 0:
        return []
    breaks = (torch.nonzero(slots[1:] != slots[:-1] + 1).flatten() + 1).tolist()
    bounds = [0, *breaks, slots.numel()]
    return [_Run(int(slots[a]), b - a) for a, b in zip(bounds, bounds[1:], strict=False)]


class MediaInputs:
    """The servicer's multimodal half: cheap checks, then (in the tokenize pool) the prompt layout."""

    def __init__(
        self,
        config: ThinkerConfig,
        dtype: torch.dtype,
        transport: TransportContext,
        queries: torch.Tensor | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.transport = transport
        self.ids = Placeholders.of(config)
        # [N, hidden] image-generation query rows (image_queries.py); None: no hidden-state mode.
        if queries is not None and (queries.dim() != 2 or queries.shape[1] != config.hidden_size):
            raise ValueError(
                f"image queries {list(queries.shape)}: expected [N, hidden_size {config.hidden_size}]"
            )
        if queries is not None and config.image_end_token_id is None:
            raise ValueError("the checkpoint's tokenizer names no </image> token: no image query block")
        self.queries = queries.to(dtype) if queries is not None else None

    @property
    def query_block_tokens(self) -> int:
        """Tokens the image query block adds to a hidden-state prompt: `<image>` + N + `</image>`."""
        return 0 if self.queries is None else self.queries.shape[0] + 2

    def close(self) -> None:
        self.transport.close()

    # --- before tokenizing (event loop) -----------------------------------------------------------

    def check_items(self, items: Sequence[Item]) -> int:
        """What the items say of themselves (ids, shapes, grids); returns their total rows."""
        total = 0
        for i, item in enumerate(items):
            where = f"multimodal[{i}]"
            p = item.placeholder_token_id
            if p not in (self.ids.image, self.ids.video, self.ids.audio):
                raise InvalidRequest(
                    f"{where}.placeholder_token_id: {p} is not the checkpoint's <imagePatch> ({self.ids.image}), "
                    f"<framePatch> ({self.ids.video}) or <audioPatch> ({self.ids.audio})"
                )
            rows = self._check_embeddings(where, item)
            grids = [(g.t, g.h, g.w) for g in item.merged_grids]
            if p == self.ids.audio:
                if grids:
                    raise InvalidRequest(f"{where}.merged_grids: an audio item has none")
            else:
                if not grids:
                    raise InvalidRequest(f"{where}.merged_grids: a vision item needs its merged grid rows")
                if p == self.ids.image and len(grids) != 1:
                    raise InvalidRequest(f"{where}.merged_grids: an image has one row, got {len(grids)}")
                if any(min(g) < 1 for g in grids):
                    raise InvalidRequest(f"{where}.merged_grids: t, h and w must be >= 1, got {grids}")
                if sum(t * h * w for t, h, w in grids) != rows:
                    raise InvalidRequest(
                        f"{where}: {rows} embedding rows but merged_grids {grids} hold "
                        f"{sum(t * h * w for t, h, w in grids)} tokens"
                    )
            total += rows
        return total

    def _check_embeddings(self, where: str, item: Item) -> int:
        if not item.HasField("embeddings"):
            raise InvalidRequest(f"{where}.embeddings: required")
        ref = item.embeddings
        try:
            dtype = from_proto_dtype(ref.dtype)
        except TypeError as exc:
            raise InvalidRequest(f"{where}.embeddings: {exc}") from None
        if not dtype.is_floating_point:
            raise InvalidRequest(f"{where}.embeddings: float rows expected, got {dtype}")
        shape = list(ref.shape)
        hidden = self.config.hidden_size
        if len(shape) != 2 or shape[0] < 1 or shape[1] != hidden:
            raise InvalidRequest(
                f"{where}.embeddings: shape {shape}, expected [rows >= 1, hidden_size {hidden}]"
            )
        return shape[0]

    # --- after tokenizing (tokenize pool) ---------------------------------------------------------

    def build(self, ids: list[int], items: Sequence[Item], image_queries: bool = False) -> MultimodalPrompt:
        """Match the items to the prompt's slots, copy their rows, make the router codes and positions.

        `image_queries`: a hidden-state request — the image query block is appended after `ids`, its
        slots take the query rows, and the prompt's `hidden_slots` are those slots."""
        ids_t = torch.tensor(ids, dtype=torch.long)
        item_slots: dict[int, torch.Tensor] = {}
        for p in (self.ids.image, self.ids.video, self.ids.audio):
            item_slots.update(self._layout(ids, ids_t, p, items))
        slots = torch.cat([item_slots[i] for i in range(len(items))] or [torch.zeros(0, dtype=torch.long)])
        slots = slots.sort().values
        rows = torch.empty(slots.numel(), self.config.hidden_size, dtype=self.dtype)
        modality = torch.empty(slots.numel(), dtype=torch.long)
        for i, item in enumerate(items):
            dst = torch.searchsorted(slots, item_slots[i])
            rows[dst] = self._copy_rows(i, item)
            modality[dst] = AUDIO if item.placeholder_token_id == self.ids.audio else VISION
        ids, query_grid, hidden_slots = list(ids), [], None
        if image_queries:
            if self.queries is None:
                raise ValueError("image_queries: this thinker has no image query embeddings")
            n = self.queries.shape[0]
            hidden_slots = torch.arange(len(ids) + 1, len(ids) + 1 + n)
            ids += [self.ids.image_start, *[self.ids.image] * n, self.config.image_end_token_id]
            slots = torch.cat([slots, hidden_slots])
            rows = torch.cat([rows, self.queries])
            modality = torch.cat([modality, torch.full((n,), VISION, dtype=torch.long)])
            query_grid = [(1, 1, n)]  # merged: (1, 2, 2n) in patch units, ming.md §2.3
        positions, delta = self._positions(ids, items, query_grid)
        return MultimodalPrompt(ids, PromptMedia(rows, slots, modality), positions, delta, hidden_slots)

    def _layout(
        self, ids: list[int], ids_t: torch.Tensor, p: int, items: Sequence[Item]
    ) -> dict[int, torch.Tensor]:
        """Slots of each item with placeholder `p`: whole runs, in request order, all of them used."""
        name = self.ids.name(p)
        slots = torch.nonzero(ids_t == p).flatten()
        runs = _runs(slots)
        out, used_runs, used_slots = {}, 0, 0
        for i, item in enumerate(items):
            if item.placeholder_token_id != p:
                continue
            for length in self._run_lengths(item):
                if used_runs == len(runs):
                    raise InvalidRequest(
                        f"multimodal[{i}]: the prompt has no {name} run left for it "
                        f"(it needs a run of {length} slots)"
                    )
                run = runs[used_runs]
                if run.length != length:
                    raise InvalidRequest(
                        f"multimodal[{i}]: its {name} run at token {run.start} has {run.length} slots, "
                        f"the item needs {length}"
                    )
                if p != self.ids.audio and (run.start == 0 or ids[run.start - 1] != self.ids.image_start):
                    raise InvalidRequest(
                        f"multimodal[{i}]: its {name} run at token {run.start} does not follow <image>"
                    )
                used_runs += 1
            rows = int(item.embeddings.shape[0])
            out[i] = slots[used_slots : used_slots + rows]
            used_slots += rows
        if used_runs < len(runs):
            left = sum(r.length for r in runs[used_runs:])
            raise InvalidRequest(
                f"multimodal: {left} {name} slot(s) from token {runs[used_runs].start} on are filled by no item"
            )
        return out

    def _run_lengths(self, item: Item) -> list[int]:
        if item.placeholder_token_id == self.ids.audio:
            return [int(item.embeddings.shape[0])]
        if item.placeholder_token_id == self.ids.image:
            return [g.t * g.h * g.w for g in item.merged_grids]
        return [g.h * g.w for g in item.merged_grids for _ in range(g.t)]  # video: a run per temporal slice

    def _copy_rows(self, i: int, item: Item) -> torch.Tensor:
        """The item's rows in host memory (copying out of shm releases the lease)."""
        try:
            rows = decode(
                item.embeddings,
                transport=self.transport,
                device="cpu",
                copy=True,
                release=not item.caller_keeps_lease,
            )
        except (TransportError, OSError, ValueError) as exc:
            raise InvalidRequest(f"multimodal[{i}].embeddings: {exc}") from None
        return rows.to(self.dtype)

    def _positions(
        self, ids: list[int], items: Sequence[Item], query_grid: list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor | None, int]:
        """video_rope positions of a prompt with vision items or the query block (None: 1D positions do)."""
        vision = [it for it in items if it.placeholder_token_id != self.ids.audio]
        if self.config.rope_type != "video_rope" or not (vision or query_grid):
            return None, 0
        grids = {
            p: [(g.t, g.h, g.w) for it in vision if it.placeholder_token_id == p for g in it.merged_grids]
            for p in (self.ids.image, self.ids.video)
        }
        grids[self.ids.image] += query_grid  # the block is the prompt's last <image> run
        try:
            return get_rope_index(
                ids,
                image_start_token_id=self.ids.image_start,
                image_patch_token_id=self.ids.image,
                video_patch_token_id=self.ids.video,
                image_grid_thw=grids[self.ids.image],
                video_grid_thw=grids[self.ids.video],
                spatial_merge_size=1,  # the grids are merged already
            )
        except ValueError as exc:  # the layout checks above should have caught it
            raise InvalidRequest(f"multimodal: {exc}") from None

    # --- the end of the submit path -------------------------------------------------------------

    def release(self, items: Sequence[Item]) -> None:
        """End every lease behind `items` (copied ones were released already: a no-op for them)."""
        release_refs(self.transport, items)


def release_refs(transport: TransportContext, items: Sequence[Item]) -> None:
    """Release the shm / CUDA IPC lease of every item's ref whose caller did not keep it; idempotent,
    never raises."""
    for i, item in enumerate(items):
        if not item.HasField("embeddings") or item.caller_keeps_lease:
            continue
        release_quietly(transport, item.embeddings, f"multimodal[{i}]: lease")  # its producer may be gone
