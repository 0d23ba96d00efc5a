"""Known-harmless third-party lines dropped from a plugin server's start-up log.

Only records that say nothing actionable to the operator of this server: transformers 5.x warns at import that
PyTorch is missing, which an MLX server never needs (it uses transformers for tokenizers and configs only).
"""

from __future__ import annotations

import logging

# (logger name, a fragment of the message)
HARMLESS = (("transformers", "PyTorch was not found"),)


class _DropHarmless(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


def install() -> None:
    """Before the libraries are imported: a logger's filters apply to the records logged on it."""
    for name, fragment in HARMLESS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropHarmless) for f in logger.filters):
            logger.addFilter(_DropHarmless((fragment,)))
