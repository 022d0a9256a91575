"""The handoff's parts without vLLM: what a producer offers, what a consumer reads from
`kv_transfer_params` (other connectors' entries ignored, a malformed one flagged), and how
long it waits."""

from __future__ import annotations

from engine_adapter.vllm.handoff import MAX_BLOCKS, HandoffWaits, offer, promised


def test_offers_and_promises() -> None:
    assert offer(0) is None and offer(6) == {"kvstrata": {"blocks": 6}}
    assert promised(offer(6)) == 6
    for nothing in (None, {}, {"remote_engine_id": "x"}, "kvstrata"):
        assert promised(nothing) is None
    for bad in ({"kvstrata": 6}, {"kvstrata": {"blocks": "6"}}, {"kvstrata": {"blocks": -1}},
                {"kvstrata": {"blocks": True}}, {"kvstrata": {"blocks": MAX_BLOCKS + 1}}):
        assert promised(bad) == -1


def test_a_consumer_waits_until_the_blocks_are_held_or_the_wait_runs_out() -> None:
    now = [100.0]
    waits = HandoffWaits(wait_s=10.0, clock=lambda: now[0])
    assert waits.should_wait("a", held=6, promised_blocks=6) is False
    assert waits.should_wait("b", held=2, promised_blocks=6) is True
    now[0] += 9.0
    assert waits.should_wait("b", held=5, promised_blocks=6) is True
    assert waits.should_wait("b", held=6, promised_blocks=6) is False  # arrived: no more waiting
    assert waits.should_wait("c", held=0, promised_blocks=6) is True
    now[0] += 10.0
    assert waits.should_wait("c", held=0, promised_blocks=6) is None  # ran out: go on, counted
    assert waits.should_wait("c", held=0, promised_blocks=6) is False  # looked up again: not waited twice
    waits.forget("c")
    assert waits.should_wait("c", held=0, promised_blocks=6) is True  # a new request of that id
