"""What a benchmark prints when it ends: its table, the files it wrote, and a warning when its model has random
weights (MTP acceptance is then ~0 and outputs are noise: the run measures speed, not quality)."""

from __future__ import annotations

from pathlib import Path

RANDOM_NOTE = "random weights: acceptance 0 expected, outputs are noise (this run measures speed only)"
# Written into a model folder by the benchmarks' builders of random-weight checkpoints (lib/make_qwen35_2b.py).
RANDOM_MARKER = "RANDOM_WEIGHTS"


def random_weights(spec: str, path: Path | None) -> bool:
    """``spec``: what the user named ('tiny' is built random); ``path``: the model folder."""
    return spec == "tiny" or (path is not None and (Path(path) / RANDOM_MARKER).exists())


def mark_random(folder: Path) -> None:
    (Path(folder) / RANDOM_MARKER).write_text("this checkpoint's weights are random (benchmarks say so in their report)\n")


def finish(table: str, files: list[Path], *, random: bool) -> None:
    """The terminal's end of a run: the table, then one line per file written, then the random-weights warning."""
    print(table.rstrip())
    print()
    for f in files:
        print(f"wrote {f}")
    if random:
        print(f"note: {RANDOM_NOTE}")
