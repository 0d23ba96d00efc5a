"""How the package's kernels reach a loaded model: a module's class swapped in place, its weights where they are."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import mlx.nn as nn


def modules_of(root: nn.Module) -> Iterator[nn.Module]:
    return (m for _, m in root.named_modules())


def retype(modules: Iterable[Any], old: type, new: type, when: Callable[[Any], bool] | None = None) -> int:
    """Give each of ``modules`` whose class is exactly ``old`` (and that passes ``when``) the class ``new``; how many."""
    n = 0
    for m in modules:
        if type(m) is old and (when is None or when(m)):
            m.__class__ = new
            n += 1
    return n
