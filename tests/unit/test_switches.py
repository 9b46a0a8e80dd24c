"""The operator's on/off environment switches (``compile_core.plan.switches``): one parser for
every switch, a bad value keeps the default with one warning naming the variable."""
import pytest

from compile_core.cache import precompiled

from compile_core.plan import switches


@pytest.mark.parametrize("value, default, on", [
    ("1", False, True), ("ON", False, True), (" true ", False, True), ("yes", False, True),
    ("0", True, False), ("Off", True, False), ("false", True, False), ("no", True, False),
    ("", True, True), ("", False, False)])
def test_a_switch_reads_the_usual_spellings(monkeypatch, value, default, on, pack_log):
    monkeypatch.setenv("TCS_TEST_SWITCH", value)
    assert switches.switch("TCS_TEST_SWITCH", default) is on
    assert not pack_log.warnings()


@pytest.mark.parametrize("default", [True, False])
def test_a_bad_value_keeps_the_default_with_one_warning(monkeypatch, default, pack_log):
    monkeypatch.setenv("TCS_TEST_SWITCH_BAD", f"sometimes {default}")  # (each bad value warns once)
    assert switches.switch("TCS_TEST_SWITCH_BAD", default) is default
    assert switches.switch("TCS_TEST_SWITCH_BAD", default) is default
    warnings = pack_log.warnings()
    assert len(warnings) == 1 and f"TCS_TEST_SWITCH_BAD='sometimes {default}'" in warnings[0]
    assert f"it stays {'on' if default else 'off'}" in warnings[0]


@pytest.mark.parametrize("name, default", [(precompiled.OFF_ENV, True)])
def test_the_packs_switches_share_the_parser(monkeypatch, name, default, pack_log):
    monkeypatch.setenv(name, "maybe")
    assert switches.switch(name, default) is default
    assert name in pack_log.warnings()[0]
