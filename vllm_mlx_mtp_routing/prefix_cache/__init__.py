"""Prefix cache for the text path: a token-prefix tree of model-state snapshots (hybrid models).

``tree`` (pure bookkeeping), ``snapshot`` (copies of a request's caches and their restore),
``cache`` (``PrefixCache``: lookup, save, stats), ``plan`` (the scheduler's call sites),
``boundaries`` (snapshot positions from the chat template), ``settings`` (the host's flags).
Import the submodules; this package imports nothing heavy (the text engine imports ``plan``).
"""
