#!/usr/bin/env python3
"""`vllm-mlx` with extra site directories, for packages installed by `pip install --target DIR`.

A --target directory on PYTHONPATH is a plain path entry: Python never runs its `.pth` files, so
the plugin's bootstrap (the import hook that gives `vllm-mlx` its `--plugins` flag) stays unarmed,
and pip's console scripts in DIR/bin name whichever interpreter ran pip. This runs the `.pth` files
of each `--site DIR` (site.addsitedir), then the same entry point as the `vllm-mlx` script.

  python benchmarks/vllm_mlx_launcher.py --site /root/site serve MODEL --mllm ... --plugins mtp-routing
  python benchmarks/serve_bench.py --server-cmd "python benchmarks/vllm_mlx_launcher.py --site /root/site"
"""

from __future__ import annotations

import site
import sys


def main(argv: list[str]) -> int:
    rest = list(argv)
    while len(rest) >= 2 and rest[0] == "--site":
        site.addsitedir(rest[1])
        rest = rest[2:]
    # imported only now: the bootstrap's hook must be armed before vllm_mlx.cli loads
    from vllm_mlx.cli import main as vllm_mlx_main

    sys.argv = ["vllm-mlx", *rest]
    return vllm_mlx_main() or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
