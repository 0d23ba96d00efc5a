"""Text-model shapes the engine micro-benchmarks build with random weights (mlx-lm qwen3_5 TextModel config)."""

from __future__ import annotations

import time
from collections.abc import Callable

# Qwen3.5-2B's text shape (hidden 2048, 24 layers, [GDN x3, attention] x6, tied embeddings). Values
# other than hidden/layers/vocab follow the published 0.8B config scaled to 2B; random weights.
PRESETS = {
    "qwen35-2b": {
        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 16,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "vocab_size": 248320, "tie_word_embeddings": True, "full_attention_interval": 4,
    },
    # Qwen3.5-9B's text shape (its published config: 32 layers, [GDN x3, attention] x8, untied lm_head)
    "qwen35-9b": {
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "vocab_size": 248320, "tie_word_embeddings": False, "full_attention_interval": 4,
    },
    # Qwen3.5-35B-A3B's text shape (its published config): 40 layers, every MLP a sparse MoE block of 256
    # experts, 8 routed per token plus a shared expert; ~35B parameters, ~3B active per token. In bf16 ~70 GB.
    "qwen35-35b-a3b": {
        "hidden_size": 2048, "num_hidden_layers": 40,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "vocab_size": 248320, "tie_word_embeddings": False, "full_attention_interval": 4,
        "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
    },
    # the trained tiny model's shape (models/tiny-qwen35-trained)
    "tiny": {
        "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
        "vocab_size": 4096, "tie_word_embeddings": False, "full_attention_interval": 4,
    },
}
# the tiny shape with Qwen3.5-MoE blocks (a CPU check of the MoE paths): 8 experts, 2 routed + a shared one
PRESETS["tiny-moe"] = {**{k: v for k, v in PRESETS["tiny"].items() if k != "intermediate_size"},
                       "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                       "shared_expert_intermediate_size": 256, "norm_topk_prob": True}
COMMON = {
    "model_type": "qwen3_5_text", "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "attention_bias": False, "mtp_num_hidden_layers": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}


def time_steps(fn: Callable[[], object], warmup: int, iters: int) -> list[float]:
    """Milliseconds of each of ``iters`` calls of ``fn`` after ``warmup`` untimed ones (``fn`` ends in its own eval)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append(1000 * (time.perf_counter() - t))
    return out
