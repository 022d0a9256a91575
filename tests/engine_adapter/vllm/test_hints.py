"""Per-request hints (`engine_adapter/vllm/hints.py`): each checked on its own; a bad one is
rejected alone with the reason, never the whole request."""

from __future__ import annotations

import pytest

from engine_adapter.vllm.handoff import promised
from engine_adapter.vllm.hints import NONE, Hints, parse


def test_good_hints_are_accepted_and_reported() -> None:
    hints = parse({"kvstrata": {"store": False, "load": False, "retain_s": 600}})
    assert (hints.store, hints.load, hints.retain_s) == (False, False, 600.0)
    assert hints.report() == {"accepted": ["store", "load", "retain_s"], "rejected": {}}


@pytest.mark.parametrize("params", [None, {}, {"other_connector": {"x": 1}}, "text", {"kvstrata": {"blocks": 4}}])
def test_no_hints_change_nothing_and_report_nothing(params: object) -> None:
    assert parse(params) == NONE and parse(params).report() is None


@pytest.mark.parametrize(("entry", "name"), [
    ({"store": "false"}, "store"), ({"load": 0}, "load"), ({"retain_s": 0}, "retain_s"),
    ({"retain_s": -5}, "retain_s"), ({"retain_s": float("nan")}, "retain_s"), ({"retain_s": 10**9}, "retain_s"),
    ({"retain_s": True}, "retain_s"), ({"pin": True}, "pin"),
    ({"priority": "urgent"}, "priority"), ({"priority": "LOW"}, "priority"), ({"priority": 1}, "priority"),
    ({"priority": None}, "priority"), ({"priority": ["low"]}, "priority"),
])
def test_a_bad_hint_is_rejected_alone(entry: dict[str, object], name: str) -> None:
    hints = parse({"kvstrata": {**entry, "store": False} if name != "store" else entry})
    assert hints.rejected.get(name)
    assert hints.store is (name == "store")  # the other hint still applied (store: False) where given
    assert (hints.load, hints.retain_s, hints.priority) == (True, None, None)


@pytest.mark.parametrize("level", ["low", "normal", "high"])
def test_each_priority_is_accepted(level: str) -> None:
    hints = parse({"kvstrata": {"priority": level}})
    assert hints.priority == level and hints.report() == {"accepted": ["priority"], "rejected": {}}


def test_a_bad_priority_names_the_choices_and_the_value() -> None:
    assert parse({"kvstrata": {"priority": "urgent"}}).rejected == {
        "priority": "must be one of low, normal, high, got 'urgent'"}


def test_a_non_object_entry_is_rejected() -> None:
    assert parse({"kvstrata": [1, 2]}) == Hints(rejected={"kvstrata": "must be an object of hints, got list"})


def test_hints_are_not_a_malformed_handoff() -> None:
    assert promised({"kvstrata": {"retain_s": 60}}) is None  # hints only: no handoff, nothing rejected
    assert promised({"kvstrata": {"blocks": 3, "store": False}}) == 3
    assert promised({"kvstrata": {"blocks": "all"}}) == -1
