#!/usr/bin/env bash
# The GPU runner: `bash benchmarks/gpu_run.sh JOB` on a machine with an NVIDIA GPU, from any directory, after the
# staging that benchmarks/README.md ("GPU runs") describes. Each job sources gpu_setup.sh (MLX's CUDA build and the
# host's wheels into $SITE, once per machine) and writes its results under $OUT.
#
# Jobs (benchmarks/gpu/JOB.sh; each one's header lists its environment variables):
#   serve        serve_bench.py, host alone vs host + plugin, trained model and a 2B-shaped model
#   onoff        serve_bench.py, the plugin with --enable-mtp against the plugin without it, servers interleaved
#   mixed        mixed_load.py, text + image requests: host, host + plugin and mlx-vlm's server, 2B shape
#   agentic      agentic_bench.py, multi-turn conversations sharing a prefix, host vs plugin, 2B shape
#   mtp          mtp_decode_bench.py, batched MTP in the engine on the trained model
#   mtp_shapes   mtp_shapes_bench.py, MTP at Qwen3.5-2B / 9B shapes with forced acceptance
#   stall        prefill_stall.py, running streams while a 16K-token prompt prefills
#   specprefill  specprefill_speed.py, TTFT dense vs SpecPrefill at 8K-32K tokens, 9B-shaped target
#   decode_variants  decode_variants.py, the compiled gated-delta step and the MTP early launch on vs off
#   specprefill_lc  train a long-context pair (train_long_context.py), then specprefill_retrieval.py's quality table
#   lc_probe     training recipes for the long-context target side by side (does the copy form)
#   kernels      the CUDA kernels' exactness and speed (recurrence, few-row matmul)
#   cold         cold_ttft.py, a lone long prompt (10K, 27K tokens), host alone vs host + plugin, 2B shape
#   chat_tune    the chat fine-tune of the trained model (training/chat_tune_tiny_qwen35.py), assembled and evaluated
#   loops        decode_loops.py, the engine's step beside mlx-lm's loops at 2B / 9B / 35B-A3B, MoE MTP on vs plain
#   mtp_phases   mtp_step_phases.py, where an MTP step's wall time goes, plain against MTP, phase by phase
#   cuda_graphs  decode_loops.py untraced under MLX's CUDA graph settings (graphs off, commit limits), alternated
#   cpu_step     decode_loops.py at the 2B shape, batch 1: the step's CPU, processes traced and untraced, alternated
#   vision_stall  vision_stall.py, running streams while an image's vision tower runs: in pieces of blocks vs one call
#   moe_ways     the MoE switch's dispatch ways at 35B-A3B (bits, times), the expert kernel's A/B, the MoE MTP criterion
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
job=${1:-}
if [ -z "$job" ] || [ "$job" = stage ] || [ "$job" = cupti_env ] || [ ! -e "$here/gpu/$job.sh" ]; then
  # gpu/stage.sh is not a job: it runs on the workstation, before (see benchmarks/README.md); cupti_env.sh is sourced
  echo "usage: bash benchmarks/gpu_run.sh JOB   (JOB: $(cd "$here/gpu" && ls *.sh | grep -v -e '^stage' -e '^cupti_env' | sed 's/\.sh$//' | tr '\n' ' '))" >&2
  exit 2
fi
shift
exec bash "$here/gpu/$job.sh" "$@"
