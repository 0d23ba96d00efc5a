"""The served model's path, checked before the host tries to fetch it.

vllm-mlx 0.6.0 (``utils.download.ensure_model_downloaded``) takes any model argument that is not an existing path for a
Hugging Face repo id and tries to download it three times, with back-off, ending in a traceback: a mistyped local
folder costs seconds and a screenful. Here such an argument ends in one line instead.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path

_TRUE = ("1", "true", "yes", "on")


def problem(model: str | None, environ: Mapping[str, str], *, offline_flag: bool = False) -> str | None:
    """Why ``model`` cannot be served as given, in one sentence; None when it exists or may be fetched."""
    if not model or Path(model).expanduser().exists():
        return None
    if looks_local(model):
        return f"no such folder: {model!r}{_near_miss(model)}"
    offline = offline_flag or environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE
    if offline and not _in_hub_cache(model):
        how = "--offline" if offline_flag else "HF_HUB_OFFLINE=1"
        return (f"{model!r} is neither a local folder nor in the Hugging Face cache, and {how} forbids downloading it "
                f"(a local folder: check the path; a hub model: download it first)")
    return None


def looks_local(model: str) -> bool:
    """A path rather than a repo id (``owner/name``, or a bare legacy name): absolute, relative to ``.``/``..``/``~``,
    more than one ``/``, or a first part that is a local folder."""
    if model.startswith(("/", "./", "../", "~", ".\\")) or "\\" in model or model.count("/") > 1 or model.endswith("/"):
        return True
    head, sep, _ = model.partition("/")
    return bool(sep) and Path(head).is_dir()


def _near_miss(model: str) -> str:
    path = Path(model).expanduser()
    parent = path.parent
    if not parent.is_dir():
        return f" ({parent}/ does not exist either)" if str(parent) not in ("", ".") else ""
    try:
        names = [p.name for p in parent.iterdir() if p.is_dir()]
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=1)
    return f" (did you mean {os.path.join(str(parent), close[0])}?)" if close else ""


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # not a valid repo id: nothing of it can be cached
        return False
    return isinstance(found, str)
