"""The launch's durations: --startup-timeout and the controller lease (option or
$ART_MEGA_CONTROLLER_LEASE) are numbers of seconds from a documented minimum up, or refused."""

from __future__ import annotations

import pytest

from art_mega.agent.lease import DEFAULT_CONTROLLER_LEASE_S, MIN_CONTROLLER_LEASE_S, parse_controller_lease
from art_mega.errors import UserError
from art_mega.launch.cli import MIN_STARTUP_TIMEOUT_S, seconds


def test_startup_timeout_from_one_second() -> None:
    assert MIN_STARTUP_TIMEOUT_S == 1.0
    assert seconds("1") == 1.0 and seconds("2.5") == 2.5 and seconds(120) == 120.0


@pytest.mark.parametrize("value", ["5e-324", "0.5", "1e-9", 0.999])
def test_startup_timeout_under_a_second_refused(value) -> None:
    # before: 5e-324 > 0 was taken, and the launch could only time out
    with pytest.raises(ValueError) as info:
        seconds(value)
    assert str(info.value) == f"{value!r} is under 1 s, too short for an agent to start; give e.g. 120"


def test_lease_minimum_and_default() -> None:
    assert MIN_CONTROLLER_LEASE_S == 1.0
    assert parse_controller_lease(None, {}) == DEFAULT_CONTROLLER_LEASE_S
    assert parse_controller_lease("1", {}) == 1.0
    assert parse_controller_lease(2.5, {}) == 2.5
    assert parse_controller_lease(None, {"ART_MEGA_CONTROLLER_LEASE": "4"}) == 4.0
    # an empty variable is unset (the Unix convention); the option wins over the variable
    assert parse_controller_lease(None, {"ART_MEGA_CONTROLLER_LEASE": ""}) == DEFAULT_CONTROLLER_LEASE_S
    assert parse_controller_lease("3", {"ART_MEGA_CONTROLLER_LEASE": "nan"}) == 3.0


@pytest.mark.parametrize("value", ["1e-300", "0.5", 0.25])
def test_lease_under_a_second_refused(value) -> None:
    with pytest.raises(UserError) as info:
        parse_controller_lease(value, {})
    assert str(info.value) == (
        f"--controller-lease {value!r} is under 1 s, shorter than the controller's heartbeats can "
        "hold; give e.g. 20 (the default)"
    )


@pytest.mark.parametrize("text", [" 5", "5 ", " ", "\t", "5\n"])
def test_lease_with_spaces_refused(text: str) -> None:
    # before: " 5" was read as 5 and "   " as unset; --startup-timeout, --port and
    # ART_MEGA_LAUNCH_ID take no surrounding spaces either
    with pytest.raises(UserError) as info:
        parse_controller_lease(None, {"ART_MEGA_CONTROLLER_LEASE": text})
    message = str(info.value)
    assert message.startswith(f"ART_MEGA_CONTROLLER_LEASE {text!r} is not a finite positive number")
    with pytest.raises(UserError, match="^--controller-lease"):
        parse_controller_lease(text, {})


@pytest.mark.parametrize("value", [True, "inf", "nan", "-1", "0", "\u0663"])
def test_lease_not_a_number_refused(value) -> None:
    with pytest.raises(UserError, match="is not a finite positive number of seconds written in ASCII digits"):
        parse_controller_lease(value, {})
