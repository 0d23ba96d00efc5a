"""What the text engine uses of a VLM for media rows: its vision tower, M-RoPE positions and rotary modules.

A Qwen3.5 VLM places an image's tokens on a 2-D grid of (temporal, height, width) positions: its attention rotates
each token by three position components, one per frequency section (M-RoPE). The TextModel's attention is mlx-lm's,
with one position per token. A media chunk's attention layers are called (``rotated_layer``, from
``layered_forward.run_layers``) with the VLM's own rotary module of the same layer (``apply_rotary`` of mlx-vlm's
``MRoPERotaryEmbedding``), so the rotation is exactly the VLM's; projections, norms, the gate and the KV cache are the
TextModel's, which shares its weights with the VLM. The gated-delta layers have no positions. The keys land in the
row's own single-sequence ``KVCache``, as a text prefill's do, so after the prompt the row decodes in the text batch
with one position per token, shifted by the prompt's M-RoPE delta (text tokens after the media sit at equal
(t, h, w), where M-RoPE is plain RoPE).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx


@dataclass
class VisionProgress:
    """An image's vision tower run in pieces of its blocks: the hidden states after ``next_block`` blocks, and what
    every block reads (its rotary embedding, the image's sequence bounds)."""

    hidden: mx.array
    rotary: mx.array
    cu_seqlens: mx.array
    next_block: int = 0


def rotaries_of(vlm_language_model: Any) -> list[Any]:
    """The VLM's rotary module per decoder layer (None for its gated-delta layers), in layer order."""
    layers = vlm_language_model.model.layers
    return [getattr(getattr(layer, "self_attn", None), "rotary_emb", None) for layer in layers]


class VisionParts:
    """What the text engine uses of the loaded VLM for media rows: its vision tower, its M-RoPE positions and rotary
    modules, its image token. The language weights are the TextModel's own (shared with the VLM)."""

    def __init__(self, vlm: Any, config: dict) -> None:
        self.vlm = vlm
        self.language_model = vlm.language_model
        self.rotaries = rotaries_of(vlm.language_model)
        self.image_token_id = int(config.get("image_token_id", config.get("image_token_index", -1)))
        vision = config.get("vision_config") or {}
        self.merge = int(vision.get("spatial_merge_size", 2))

    def encode(self, pixel_values: mx.array, grid_thw: tuple[int, int, int]) -> mx.array:
        """One image's token embeddings, [tokens, hidden]."""
        tower = self.vlm.vision_tower
        pixels = pixel_values.astype(tower.patch_embed.proj.weight.dtype)
        features, _ = tower(pixels, mx.array([list(grid_thw)], dtype=mx.int32))
        return features

    @property
    def blocks(self) -> int:
        """The vision tower's blocks where it can run in pieces of them (``begin_encode``), else 0."""
        tower = self.vlm.vision_tower
        staged = all(hasattr(tower, a) for a in ("patch_embed", "fast_pos_embed_interpolate", "rot_pos_emb", "merger"))
        return len(tower.blocks) if staged and not getattr(tower, "deepstack_visual_indexes", None) else 0

    # mlx-vlm 0.7.10's qwen3_vl ``VisionModel.__call__`` (Qwen3.5's tower) in stages, op for op, so that an image
    # encoded in pieces of blocks, each evaluated in its own engine step, has the features one call gives.
    def begin_encode(self, pixel_values: mx.array, grid_thw: tuple[int, int, int]) -> VisionProgress:
        """The tower's input stage for one image: patches embedded, positions added; no block run yet."""
        tower = self.vlm.vision_tower
        grid = mx.array([list(grid_thw)], dtype=mx.int32)
        hidden = tower.patch_embed(pixel_values.astype(tower.patch_embed.proj.weight.dtype))
        hidden = hidden + tower.fast_pos_embed_interpolate(grid)
        rotary = tower.rot_pos_emb(grid)
        n = hidden.shape[0]
        cu_seqlens = mx.cumsum(mx.repeat(grid[0, 1] * grid[0, 2], int(grid_thw[0])).astype(mx.int32), axis=0)
        cu_seqlens = mx.pad(cu_seqlens, (1, 0), mode="constant", constant_values=0)
        return VisionProgress(hidden.reshape(n, -1), rotary.reshape(n, -1), cu_seqlens)

    def run_blocks(self, progress: VisionProgress, stop: int) -> None:
        """The tower's blocks from ``progress.next_block`` up to ``stop`` (lazy)."""
        blocks = self.vlm.vision_tower.blocks
        for i in range(progress.next_block, min(stop, len(blocks))):
            progress.hidden = blocks[i](progress.hidden, cu_seqlens=progress.cu_seqlens, rotary_pos_emb=progress.rotary)
        progress.next_block = max(progress.next_block, min(stop, len(blocks)))

    def finish_encode(self, progress: VisionProgress) -> mx.array:
        """The image's token embeddings once every block ran: the patch merger's output, [tokens, hidden]."""
        if progress.next_block < len(self.vlm.vision_tower.blocks):
            raise RuntimeError(f"the vision tower's block {progress.next_block} has not run")
        return self.vlm.vision_tower.merger(progress.hidden)

    def positions(self, prompt_ids: Sequence[int], grid_thw: Sequence[tuple[int, int, int]]) -> tuple[mx.array, int]:
        """The prompt's M-RoPE positions [3, 1, L] and its decode delta, as the VLM computes them."""
        ids = mx.array([list(prompt_ids)], dtype=mx.int32)
        grid = mx.array([list(g) for g in grid_thw], dtype=mx.int32)
        position_ids, delta = self.language_model.get_rope_index(ids, grid, None, None)
        return position_ids, int(mx.array(delta).reshape(-1).astype(mx.int32).max().item())  # type: ignore[arg-type]
