"""SpecPrefill through the real server on loopback with the openai client: the host's flags on the
text path, per-request opt-out and keep, the threshold, stats in /v1/status, no routing fallback,
and start-up refusals (exit 2 naming the flag) for a draft whose tokenizer differs and bad values."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import openai
import pytest

from support import launcher
from support.server import VLLM_MLX, serve

BASE = ("--plugins", "mtp-routing", "--continuous-batching", "--mllm", "--max-num-seqs", "4", "--prefill-step-size", "64")
LONG = "Summarize the following log. " + " ".join(f"step {i} wrote file_{i % 17}.txt and read cfg_{i % 5}.yaml;" for i in range(40))


def _status(server) -> dict:
    with server.client() as c:
        return c.get("/v1/status").json()["plugins"]["mtp-routing"]


def test_server_sparse_prefills_long_prompts_only_as_asked(tiny_vlm_fp32, tiny_draft_dir, tmp_path):
    flags = ("--enable-mtp", "--specprefill", "--specprefill-draft-model", str(tiny_draft_dir), "--specprefill-threshold", "200",
             "--specprefill-keep-pct", "0.3")
    with serve(tiny_vlm_fp32, *BASE, *flags, log_dir=tmp_path) as server:
        client = server.openai()

        def chat(content: str, **extra) -> openai.types.chat.ChatCompletion:
            return client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": content}],
                                                  max_tokens=8, temperature=0.0, extra_body=extra or None)

        sparse = chat(LONG)
        assert sparse.usage.prompt_tokens > 200 and sparse.choices[0].finish_reason == "length"
        meta = (sparse.model_extra or {})["generation_metadata"]  # the host's per-response diagnostics
        assert meta["specprefill_engaged"] is True and meta["specprefill_reason"] == "engaged"
        assert meta["specprefill_route"] == "text" and 0 < meta["specprefill_selected_tokens"] < meta["specprefill_original_tokens"]
        s = _status(server)
        sp = s["specprefill"]
        assert sp["requests"] == 1 and sp["tokens_scored"] == sparse.usage.prompt_tokens - 1
        assert 0.3 * sp["tokens_scored"] <= sp["tokens_kept"] < sp["tokens_scored"] and sp["fallbacks"] == 0
        opted_out = chat(LONG, specprefill=False)
        assert opted_out.model_extra["generation_metadata"]["specprefill_reason"] == "disabled_by_request"
        short = chat("hello there")  # under the threshold
        assert short.model_extra["generation_metadata"]["specprefill_reason"] == "below_threshold"
        forced = chat("hello there, a short prompt the request asks to prefill sparsely", specprefill=True, specprefill_keep_pct=0.5)
        assert forced.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError, match="specprefill_keep_pct"):
            chat(LONG, specprefill_keep_pct=1.5)
        s = _status(server)
        sp = s["specprefill"]
        assert sp["requests"] == 2 and sp["dense"] == {"below_threshold": 1, "opted_out": 1}
        assert s["routing"]["fallback"] == 0 and s["routing"]["text"] == 5
        assert s["mtp"]["drafted"] > 0
        # A sparse prompt's state is never a prefix-cache entry: the dense repeat found nothing to reuse.
        assert opted_out.usage.prompt_tokens_details is None or not opted_out.usage.prompt_tokens_details.cached_tokens
        log = server.log()
        assert "SpecPrefill on the text path" in log and log.count("SpecPrefill text-") == 2


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return launcher.run([VLLM_MLX, *args], timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_a_draft_with_another_tokenizer_is_refused_at_start(tiny_vlm_fp32, tiny_draft_dir, tmp_path):
    other = tmp_path / "other-draft"
    shutil.copytree(tiny_draft_dir, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: the same strings, other ids
    (other / "tokenizer.json").write_text(json.dumps(spec))
    result = _cli("serve", str(tiny_vlm_fp32), *BASE, "--specprefill", "--specprefill-draft-model", str(other))
    assert result.returncode == 2
    assert "argument --specprefill-draft-model" in result.stderr and "different tokenizer" in result.stderr


@pytest.mark.parametrize("flags, named", [
    (("--specprefill",), "--specprefill-draft-model"),
    (("--specprefill", "--specprefill-keep-pct", "0", "--specprefill-draft-model", "DRAFT"), "--specprefill-keep-pct"),
    (("--specprefill", "--specprefill-threshold", "-1", "--specprefill-draft-model", "DRAFT"), "--specprefill-threshold"),
])
def test_bad_values_exit_2_naming_the_flag(tiny_vlm_fp32, tiny_draft_dir, flags, named):
    flags = tuple(str(tiny_draft_dir) if f == "DRAFT" else f for f in flags)
    result = _cli("serve", str(tiny_vlm_fp32), *BASE, *flags)
    assert result.returncode == 2 and f"argument {named}" in result.stderr


def test_flags_are_the_hosts_alone_where_the_text_path_does_not_run():
    from types import SimpleNamespace

    from vllm_mlx_mtp_routing.host.specprefill_flags import from_args

    args = SimpleNamespace(specprefill=True, specprefill_draft_model=None, continuous_batching=False)
    assert from_args(args) is None  # SimpleEngine: the host's own SpecPrefill decides
    assert from_args(SimpleNamespace(specprefill=True, continuous_batching=True, mtp_routing_disable=True)) is None
