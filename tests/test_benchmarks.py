"""benchmarks/: the serving benchmark's arithmetic and one --quick run of it, the agentic benchmark's workload, the
realistic-shape MTP benchmark's logic."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import serve_bench as SB  # noqa: E402


def _result(path: str, tokens: int, ttft: float, total: float) -> SB.Result:
    return SB.Result(path=path, ok=True, tokens=tokens, ttft=ttft, total=total)


def test_summary_and_ratios() -> None:
    res = [_result("text", 11, 0.1, 1.1), _result("text", 21, 0.2, 2.2), SB.Result("text", ok=False, error="x")]
    s = SB.summarize(res, wall=2.0)
    assert s["completion_tokens"] == 32 and s["errors"] == 1
    assert s["aggregate_tok_s"] == pytest.approx(16.0)
    assert s["decode_tok_s_per_request_mean"] == pytest.approx(10.0)  # (11-1)/1.0 and (21-1)/2.0
    assert s["ttft_p50_s"] == pytest.approx(0.15)
    host = {"text": {"1": s}}
    plugin = {"text": {"1": {**s, "aggregate_tok_s": 32.0, "decode_tok_s_per_request_mean": 25.0}}}
    r = SB.ratios(host, plugin)["text"]["1"]
    assert r["aggregate_tok_s"] == pytest.approx(2.0) and r["decode_tok_s_per_request"] == pytest.approx(2.5)


def test_find_acceptance_nested() -> None:
    status = {"mtp": {"enabled": False}, "plugins": {"mtp-routing": {"text_engine": {"mtp_acceptance": 0.8}}}}
    assert SB.find_acceptance(status) == {"plugins.mtp-routing.text_engine.mtp_acceptance": 0.8}


@pytest.mark.server
@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path: Path, tiny_vlm_bf16: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The one-command benchmark against the real server, host and plugin, on the tiny random model it would build
    (the suite's bf16 build: the same sizes, seed and tokenizer, built once)."""
    (marked := tmp_path / "marked").mkdir()
    for f in tiny_vlm_bf16.iterdir():  # the suite's model, with the marker the benchmarks' random builders write
        (marked / f.name).symlink_to(f)
    (marked / "RANDOM_WEIGHTS").write_text("random\n")
    rc = SB.main(["--quick", "--model", str(marked), "--out-dir", str(tmp_path), "--concurrency", "1,2",
                  "--max-tokens", "8"])
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "serve_bench_quick.json").read_text())
    assert rc == 0
    # the terminal gets the table, the files' names and what a random model means
    assert "| plugin | 2 |" in out and f"wrote {tmp_path / 'serve_bench_quick.json'}" in out
    assert "random weights: acceptance 0 expected" in out
    assert [c["name"] for c in report["configs"]] == ["host", "plugin"]
    for cfg in report["configs"]:
        assert all(s["errors"] == 0 and s["completion_tokens"] > 0 for s in cfg["text"].values())
        assert cfg["mixed"]["media"]["requests"] >= 1
    assert set(report["ratios"]["text"]) == {"1", "2"}
    assert (tmp_path / "serve_bench_quick.md").read_text().count("| plugin |") >= 2


def test_agentic_bench_workload_and_summary() -> None:
    import agentic_bench as AB

    turns = AB.conversation_turns(1, 4, "SYS")
    assert [len(t) for t in turns] == [2, 4, 6, 8]
    assert [t[-1]["role"] for t in turns] == ["user", "tool", "user", "tool"]  # tool results and user messages alternate
    assert all(t[: len(prev)] == prev for prev, t in zip(turns, turns[1:]))  # each turn extends the one before
    rec = lambda ttft, p, c: {"ttft_s": ttft, "total_s": ttft, "error": None, "prompt_tokens": p, "cached_tokens": c}  # noqa: E731
    results = {
        "host": [[rec(10.0, 100, 0)], [rec(12.0, 150, 0)]],
        "plugin": [[rec(8.0, 100, 0)], [rec(3.0, 150, 98)]],
        "mlx-lm": [[rec(9.0, 100, 0)], [rec(6.0, 150, 99)]],
    }
    s = AB.summarize(results, 2, changed=[[100], [52]])
    p = s["plugin"][1]
    assert p["prefilled_tokens"] == [52] and p["new_tokens"] == [50] and p["changed_tokens"] == [52]
    assert p["prefilled_vs_changed"] == [1.0]
    assert p["ttft_vs_host"] == 0.25 and p["ttft_vs_mlx_lm"] == 0.5



def test_decode_variants_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode-option A/B at the tiny shape: every option and batch measured (no error), paired ratios
    recorded with the commit and device."""
    import decode_variants as DV

    out = tmp_path / "variants.json"
    assert DV.main(["--smoke", "--batches", "2", "--out", str(out)]) == 0
    # a switch the compiled steps bake in makes them trace again (else both sides would run one way); the device sets
    # the switches change are this test's copies
    from vllm_mlx_mtp_routing.model.kernels import causal_conv

    monkeypatch.setattr(causal_conv, "conv_step_devices", set(causal_conv.conv_step_devices))
    layer = SimpleNamespace()
    model = SimpleNamespace(model=SimpleNamespace(layers=[layer]))
    for option in ("fused_projections", "conv_step"):
        layer._step, layer._verify_steps = "traced", {}
        DV.switch(option, model, None, on=True)
        assert not {"_step", "_verify_steps"} & set(vars(layer)), option
    res = json.loads(out.read_text())
    assert res["commit"] and res["device"] and [r["option"] for r in res["rows"]] == list(DV.OPTIONS)
    for row in res["rows"]:
        assert "error" not in row and row["on_over_off_cpu"] > 0 and row["off_ms"] > 0 and row["on_ms"] > 0
    # fused projections are exact: both sides decoded the same tokens
    assert all(r["tokens_equal"] for r in res["rows"] if r["option"] == "fused_projections")


def test_mtp_step_phases_smoke(tmp_path: Path) -> None:
    """Where a step's time goes, at the tiny MoE shape on the CPU: each side's phases are timed and add up to no more
    than its step; MTP's phases are the speculative ones, plain's the launch and read."""
    import mtp_step_phases as MSP

    out = tmp_path / "phases.json"
    assert MSP.main(["--shape", "small-moe", "--batches", "2", "--steps", "2", "--rounds", "1", "--prompt-tokens", "8",
                     "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["commit"] and res["versions"]["mlx_lm"] and res["layers"] > 0
    [row] = res["rows"]
    assert row["batch"] == 2 and row["mtp_over_plain"] > 0 and row["mtp_pieces0_over_plain"] > 0
    assert {"launch", "read_wait", "read"} <= set(row["plain"]) and row["plain"]["tokens_per_step"] == 2
    for side in ("mtp", "mtp_pieces0"):
        phases = row[side]
        assert {"propose", "verify_build", "verify_wait", "accept", "rollback", "after_verify"} <= set(phases)
        assert all(phases[k] >= 0 for k in phases if k != "other") and phases["other"] > -0.5  # rounding of the sums
        assert 2 <= phases["tokens_per_step"] <= 4


def test_mtp_shapes_bench_smoke(tmp_path: Path) -> None:
    """The realistic-shape GPU benchmark's logic at the tiny shape: forced acceptance reaches the
    engine, every configuration and step cost is recorded with the commit, device and versions."""
    import mtp_shapes_bench as MSB

    out = tmp_path / "shapes.json"
    assert MSB.main(["--smoke", "--batches", "2", "--prefill-tokens", "16", "--prefill-repeats", "1", "--iters", "1",
                     "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["commit"] and res["device"] and res["versions"]["mlx"] and res["versions"]["mlx_lm"]
    assert res["prefill"]["mtp_over_plain"] > 0 and res["prefill"]["chunk_tokens"] >= 16
    [row] = res["rows"]
    assert row["batch"] == 2 and row["t1_ms"] > 0 and row["tm_ms"] > 0
    assert {"t1_loop_ms", "t2_loop_ms", "t2_fused_ms", "t2_compiled_ms", "t2_compiled_layer_ms", "t2_nocapture_ms"} <= set(row)
    assert {"gdn_layers_T1_loop_ms", "gdn_layers_T2_fused_ms", "attention_layers_T2_ms", "recurrence_compiled_T2_ms"} <= set(row["breakdown"])
    assert not [k for k in row if k.endswith("_error")]
    for name in ("mtp_a0.8", "aon_a0.8"):
        r = row[name]
        assert 0 < r["acceptance"] <= 1 and r["efficiency"] == pytest.approx(r["speedup"] / r["ideal_speedup"], rel=0.02)
    assert row["aon_a0.8"]["acceptance"] <= row["mtp_a0.8"]["acceptance"]


def test_decode_loops_smoke(tmp_path: Path) -> None:
    """The decode-loop benchmark at the tiny MoE shape on the CPU: every loop times its steps on the same model, the
    bound counts the experts a step touched, MTP runs against plain at forced acceptance."""
    import decode_loops as DL

    out = tmp_path / "loops.json"
    assert DL.main(["--shapes", "small-moe", "--batches", "1,2", "--steps", "2", "--repeats", "1", "--warmup", "1",
                    "--prompt-tokens", "8", "--mtp-batches", "2", "--mtp-steps", "2", "--mtp-rounds", "1",
                    "--mtp-launch-layers", "0", "--mtp-ks", "2", "--mtp-auto", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["commit"] and res["versions"]["mlx_lm"] and res["device_busy"].startswith("n/a: MLX runs on the CPU")
    [shape] = res["shapes"]
    one, two = shape["rows"]
    assert (one["batch"], two["batch"]) == (1, 2) and "generate_step" in one and "generate_step" not in two
    for row in (one, two):
        assert all(row[n]["step_ms"] > 0 and row[n]["cpu_ms"] > 0 for n in ("engine", "engine_stock", "batch_generator"))
        b = row["bytes_per_step"]
        assert 0 < b["moe_experts_touched"] < b["weights"] < b["total"] and row["bandwidth_bound_ms"] > 0
    # 2 experts of 8 per token: one row touches 2 per layer, two rows 2-4
    assert one["moe_distinct_experts_per_layer"] == 2 and 2 <= two["moe_distinct_experts_per_layer"] <= 4
    # MTP against plain under the dispatch the build measured and under mlx-lm's rule
    assert [m["dispatch"] for m in shape["mtp"]] == ["measured", "mlx-lm"] and shape["moe_dispatch"]["way_at"]
    for mtp in shape["mtp"]:
        assert mtp["batch"] == 2 and mtp["speedup"] > 0 and 0 < mtp["acceptance"] <= 1
        # what a step of each side costs (no device busy time on the CPU)
        assert all(mtp[f"{side}_{key}"] > 0 for side in ("plain", "mtp", "mtp_pieces0") for key in ("step_ms", "cpu_ms"))
        assert mtp["speedup_pieces0"] > 0  # MTP with its verify launched at once, beside the engine's own
        assert mtp["speedup_k2"] > 0 and mtp["mtp_k2_step_ms"] > 0  # two drafts a step
        # the server's schedule, choosing 0-2 drafts: what it chose and measured is reported
        assert mtp["speedup_auto"] > 0 and set(mtp["auto_policy"]["draft_cost_by_count"]) == {"1", "2"}
        assert "plain_device_busy_ms" not in mtp


def test_vision_stall_smoke(tmp_path: Path) -> None:
    """The vision-stall benchmark on a 3-block tower: its rounds alternate between the tower in pieces of blocks while
    streams decode and the tower in one call (no timing asserted)."""
    import vision_stall as VS

    out = tmp_path / "vision_stall.json"
    assert VS.main(["--model", str(tmp_path / "vlm"), "--depth", "3", "--vision-hidden", "64", "--streams", "1",
                    "--rounds", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["vision_blocks"] == 3
    pieced, whole = res["rounds"]
    assert pieced["pieces"] and not whole["pieces"] and whole["vision_pieces"] == 0
    # the input stage, one block (it measures them), then as many as fit a step
    assert 3 <= pieced["vision_pieces"] <= 4
    assert all(r["image_ttft_s"] > 0 and r["steps"] >= 1 for r in res["rounds"])
    assert res["tokens_equal"] and pieced["image_first_token"] == whole["image_first_token"]


def test_mixed_round_cpu_smoke(tmp_path: Path) -> None:
    """The mixed round's CPU accounting on the committed trained model: every request of the round has a first token
    and a decode span, the prefill inside a span is part of it, and the image rows' prefills are counted (no timing
    asserted)."""
    import mixed_round_cpu as MR

    out = tmp_path / "mixed_round_cpu.json"
    assert MR.main(["--rounds", "1", "--max-tokens", "6", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    (rnd,) = res["rounds"]
    assert [r["kind"] for r in rnd["requests"]] == ["text", "image", "text", "image"]
    for r in rnd["requests"]:
        assert r["first_token_cpu_s"] > 0 and r["span_cpu_s"] > 0
        assert 0 <= r["prefill_in_span_cpu_s"] <= r["span_cpu_s"] and 0 < r["own_share"] <= 1
    # the round prefilled four prompts, two of them through the vision tower; alone it prefills the same four
    assert 0 < rnd["prefill_cpu_s"] <= rnd["cpu_s"] and res["prefill_alone_cpu_s"][0] > 0
    assert set(res["summary"]) == {"text", "image", "prefill_in_round_over_alone"}


def test_device_busy_is_the_union_of_the_windows_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """lib/device_busy.py over a stand-in for cupti-python: records outside a window are dropped, overlapping work
    counts once, work crossing the window's edges counts inside it only, and kernels are counted, by name too."""
    import types

    from lib import device_busy

    from vllm_mlx_mtp_routing.model.kernels import device

    class Kind:
        CONCURRENT_KERNEL, MEMCPY, MEMSET = 10, 1, 2

    pending: list[types.SimpleNamespace] = []
    clock = [0]
    fake = types.SimpleNamespace(ActivityKind=Kind, callbacks=None)
    fake.activity_register_callbacks = lambda requested, completed: setattr(fake, "callbacks", (requested, completed))
    fake.activity_enable = lambda kind: None
    fake.get_timestamp = lambda: clock[0]

    def flush(flag: int) -> None:
        fake.callbacks[1](list(pending))
        pending.clear()

    fake.activity_flush_all = flush
    monkeypatch.setitem(sys.modules, "cupti", types.SimpleNamespace(cupti=fake))
    monkeypatch.setattr(device, "kind", lambda: "cuda")
    busy = device_busy.DeviceBusy()
    assert busy.available() and busy.why is None

    def run(kind: int, start: int, end: int, name: str = "gemv") -> None:
        pending.append(types.SimpleNamespace(kind=kind, start=start, end=end, name=name))

    run(Kind.CONCURRENT_KERNEL, 0, 50)  # before the window: dropped by the flush in start()
    clock[0] = 100
    busy.start()
    run(Kind.CONCURRENT_KERNEL, 90, 120)  # crosses the start: 20 inside
    run(Kind.CONCURRENT_KERNEL, 130, 170, "rms_norm")
    run(Kind.MEMCPY, 150, 180)  # overlaps the kernel: +10
    run(Kind.CONCURRENT_KERNEL, 190, 260)  # crosses the end: 10 inside
    clock[0] = 200
    seconds, kernels = busy.stop()
    assert seconds == pytest.approx((20 + 40 + 10 + 10) / 1e9) and kernels == 3
    assert busy.kernel_names == {"gemv": 2, "rms_norm": 1}  # by name, the window's kernels only (no memcpy)
    run(Kind.CONCURRENT_KERNEL, 210, 220)  # after the window: never counted
    busy.quiesce()
    assert busy.available()
