"""The device check (device.py), the package's CUDA kernels and the class swaps that put them into mlx-lm's modules
(swaps.py). Imports nothing: a kernel module is imported by name where it is used."""
