"""A transparent decorator around a host engine: everything it does not override reaches the host's.

Reads of attributes the decorator does not own go to the wrapped engine: the host reads private state
back (``_loaded``, ``_model_load_executor``, ...). Writes are deliberate: the decorator's own
attributes stay on it; the flags the host sets on its engine after building it (vllm-mlx 0.6.0
server: ``preserve_native_tool_format``, ``use_harmony_rendering``) and attributes the wrapped
engine already has go to the wrapped engine, their owner; a write of any other name is an
AttributeError instead of silently creating state on the host's engine.
"""

from __future__ import annotations

from typing import Any


class EngineDecorator:
    # Attributes that live on the decorator itself; every other name is the wrapped engine's.
    _own_attrs: frozenset[str] = frozenset({"wrapped"})
    # Attributes the host writes on whatever engine object it holds; they belong to the host's engine.
    _forwarded_writes: frozenset[str] = frozenset({"preserve_native_tool_format", "use_harmony_rendering"})

    def __init__(self, wrapped: Any) -> None:
        object.__setattr__(self, "wrapped", wrapped)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "wrapped"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in type(self)._own_attrs or name.startswith("_dec_"):
            object.__setattr__(self, name, value)
        elif name in type(self)._forwarded_writes or hasattr(self.wrapped, name):
            setattr(self.wrapped, name, value)
        else:
            raise AttributeError(
                f"{type(self).__name__} does not own {name!r} and does not forward writes of it; "
                f"set it on .wrapped if the host engine is meant"
            )

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
