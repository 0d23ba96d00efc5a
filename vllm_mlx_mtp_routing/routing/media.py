"""Which requests carry media (an image, video or audio part, or the host's media arguments): those go to the
host's mlx-vlm path, intact."""

from __future__ import annotations

from typing import Any

MEDIA_PART_TYPES = frozenset(
    {"image_url", "input_image", "image", "video_url", "input_video", "video", "input_audio", "audio_url", "audio"}
)
MEDIA_PART_KEYS = ("image_url", "input_image", "video_url", "input_audio", "audio_url")
MEDIA_OPTIONS = ("images", "videos", "audio")


def is_media_part(part: Any) -> bool:
    return isinstance(part, dict) and (part.get("type") in MEDIA_PART_TYPES or any(k in part for k in MEDIA_PART_KEYS))


def media_parts(messages: list[dict[str, Any]] | None) -> int:
    count = 0
    for message in messages or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            count += sum(1 for part in content if is_media_part(part))
    return count


def media_items(messages: list[dict[str, Any]] | None, options: dict[str, Any]) -> int:
    """Media parts in the messages plus the host's media arguments."""
    return sum(len(options.get(k) or ()) for k in MEDIA_OPTIONS) + media_parts(messages)


def has_media(messages: list[dict[str, Any]] | None, options: dict[str, Any]) -> bool:
    return any(options.get(k) for k in MEDIA_OPTIONS) or media_parts(messages) > 0
