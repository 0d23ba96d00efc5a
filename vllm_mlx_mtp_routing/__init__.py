"""vllm-mlx-mtp-routing: serve Qwen3.5-family VLMs with MTP on text requests and intact media requests."""

__version__ = "0.1.0"
