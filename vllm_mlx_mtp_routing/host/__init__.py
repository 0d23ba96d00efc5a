"""Everything that touches vllm-mlx internals lives here, so a host upgrade touches one place.

Written against vllm-mlx 0.6.0. Kept import-light: ``bootstrap`` runs at every interpreter start.
"""
