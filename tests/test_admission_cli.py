"""The --scheduler-* flags: parsing on the host's real serve parser, defaults, impossible values."""

from __future__ import annotations

import argparse

import pytest

from vllm_mlx_mtp_routing.admission import AdmissionController, add_arguments, check_budget_after_load, validate
from vllm_mlx_mtp_routing.admission.device_memory import GiB, default_headroom_bytes
from vllm_mlx_mtp_routing.plugin_api.errors import FlagError

CPU_16G = (16 * GiB, "physical-ram")


def serve_parser() -> argparse.ArgumentParser:
    """The host's own `serve` subparser with our flags added, as the plugin's CLI hook does."""
    from vllm_mlx.cli import create_parser

    parser = create_parser()
    serve = next(
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)  # argparse internals (3.11)
    ).choices["serve"]
    add_arguments(serve.add_argument_group("admission"))
    return parser


def parse(*flags: str) -> argparse.Namespace:
    return serve_parser().parse_args(["serve", "some/model", *flags])


def test_defaults():
    s = validate(parse(), device=CPU_16G)
    assert (s.policy, s.max_queue, s.queue_timeout_s, s.max_running) == ("fifo", 128, 300.0, 256)
    assert s.headroom_bytes == default_headroom_bytes(*CPU_16G) == int(16 * GiB * 0.15)
    assert s.budget_bytes == 16 * GiB - s.headroom_bytes


def test_values_are_read_including_the_hosts_max_num_seqs():
    args = parse("--scheduler-policy", "priority", "--scheduler-headroom-gb", "1.5", "--scheduler-max-queue", "0",
                 "--scheduler-queue-timeout", "inf", "--max-num-seqs", "4")
    s = validate(args, device=CPU_16G)
    assert (s.policy, s.headroom_bytes, s.max_queue, s.queue_timeout_s, s.max_running) == (
        "priority", int(1.5 * GiB), 0, None, 4)
    ctl = AdmissionController.from_settings(s, active_memory=lambda: 0)
    assert ctl.stats()["budget_bytes"] == s.budget_bytes and ctl.stats()["headroom_gb"] == 1.5


@pytest.mark.parametrize(
    "flags, bad_flag",
    [
        (["--scheduler-headroom-gb", "16"], "--scheduler-headroom-gb"),  # all of the device
        (["--scheduler-headroom-gb", "20"], "--scheduler-headroom-gb"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
    ],
)
def test_impossible_values_name_the_flag(flags, bad_flag):
    with pytest.raises(FlagError) as err:
        validate(parse(*flags), device=CPU_16G)
    assert err.value.flag == bad_flag and str(err.value).startswith(f"argument {bad_flag}: ")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--scheduler-headroom-gb=-1"], "argument --scheduler-headroom-gb: must be a finite number >= 0, got '-1'"),
        (["--scheduler-headroom-gb", "nan"], "argument --scheduler-headroom-gb: must be a finite number >= 0"),
        (["--scheduler-max-queue=-1"], "argument --scheduler-max-queue: must be an integer >= 0, got -1"),
        (["--scheduler-max-queue", "many"], "argument --scheduler-max-queue: must be an integer >= 0, got 'many'"),
        (["--scheduler-queue-timeout", "0"], "argument --scheduler-queue-timeout: must be a number of seconds > 0"),
        (["--scheduler-queue-timeout=-5"], "argument --scheduler-queue-timeout: must be a number of seconds > 0"),
    ],
)
def test_out_of_range_values_are_refused_at_parse_time_naming_flag_and_rule(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(*flags)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_validate_still_checks_a_programmatic_namespace():
    import argparse

    for name, value, flag in (("scheduler_headroom_gb", -1.0, "--scheduler-headroom-gb"),
                              ("scheduler_max_queue", -1, "--scheduler-max-queue"),
                              ("scheduler_queue_timeout", 0.0, "--scheduler-queue-timeout")):
        with pytest.raises(FlagError) as err:
            validate(argparse.Namespace(**{name: value}), device=CPU_16G)
        assert err.value.flag == flag


def test_bad_policy_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse("--scheduler-policy", "random")
    assert exit_.value.code == 2 and "--scheduler-policy" in capsys.readouterr().err


def test_default_headroom_per_device():
    assert default_headroom_bytes(64 * GiB, "metal-recommended") == int(6.4 * GiB)
    assert default_headroom_bytes(8 * GiB, "metal-recommended") == GiB
    assert default_headroom_bytes(80 * GiB, "cuda") == 8 * GiB
    assert default_headroom_bytes(8 * GiB, "physical-ram") == 2 * GiB
    assert default_headroom_bytes(3 * GiB, "physical-ram") == int(1.5 * GiB)  # capped at half


def test_budget_must_exceed_the_loaded_model():
    s = validate(parse("--scheduler-headroom-gb", "10"), device=CPU_16G)
    check_budget_after_load(s, 5 * GiB)
    with pytest.raises(FlagError) as err:
        check_budget_after_load(s, 6 * GiB)
    assert err.value.flag == "--scheduler-headroom-gb"
