"""Helpers several benchmark scripts share: provenance (commit, device, versions), model shapes, the terminal
report. Scripts import them as ``lib.<module>`` with ``benchmarks/`` on ``sys.path`` (where a script runs from)."""
