"""A transparent decorator around a host engine: everything it does not override reaches the host's.

Reads and writes of attributes the decorator does not own go to the wrapped engine, because the host
sets flags on its engine after building it (``preserve_native_tool_format``, ...) and reads private
state back (``_loaded``, ``_model_load_executor``, ...); a decorator that kept them would split them.
"""

from __future__ import annotations

from typing import Any


class EngineDecorator:
    # Attributes that live on the decorator itself; every other name is the wrapped engine's.
    _own_attrs: frozenset[str] = frozenset({"wrapped"})

    def __init__(self, wrapped: Any) -> None:
        object.__setattr__(self, "wrapped", wrapped)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "wrapped"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in type(self)._own_attrs or name.startswith("_dec_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.wrapped, name, value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.wrapped!r})"


def innermost(engine: Any) -> Any:
    """The host's own engine under any number of decorators."""
    seen = 0
    while hasattr(engine, "__dict__") and "wrapped" in vars(engine) and seen < 32:
        engine = vars(engine)["wrapped"]
        seen += 1
    return engine


def find_decorator(engine: Any, cls: type) -> Any:
    """The first decorator of type ``cls`` in the chain from ``engine`` inwards, or None."""
    seen = 0
    while engine is not None and seen < 32:
        if isinstance(engine, cls):
            return engine
        engine = vars(engine).get("wrapped") if hasattr(engine, "__dict__") else None
        seen += 1
    return None
