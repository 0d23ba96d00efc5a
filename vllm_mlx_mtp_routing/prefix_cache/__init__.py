"""Prefix cache for the text path: a token-prefix tree of model-state snapshots (hybrid models)."""

from .cache import Hit, PrefixCache
from .tree import KINDS, Entry, PrefixTree

__all__ = ["KINDS", "Entry", "Hit", "PrefixCache", "PrefixTree"]
