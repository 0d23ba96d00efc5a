"""The text engine: continuous batching of text requests, exact under batching, with MTP speculative decoding.

``engine`` (the asyncio face, the step loop), ``scheduler`` (plans each step), ``runner`` (executes it on the
model), ``step_plan`` (the typed work between them), ``state`` / ``row`` / ``decode_batch`` (requests and rows),
``spec/`` (MTP: proposer, verify and rollback, acceptance, draft policy). Import the submodules: this package
imports nothing, so the prefix cache and SpecPrefill can import ``state`` without importing the engine.
"""
