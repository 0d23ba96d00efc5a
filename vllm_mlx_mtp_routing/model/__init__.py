"""The text model taken from the loaded VLM: the mlx-lm text model over its weights, the backbone forward, the MTP
head, the checkpoint layouts the head comes in, and the kernels they run (kernels/)."""
