"""The engine's typed door to its device state: each op is a DeviceState method that, on process 0 of several, sends
itself (name and arguments) to the followers before it runs; a follower runs the same op by that name."""

from __future__ import annotations

from typing import Any

import pytest

from trainer.service import device


class _Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def send(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.sent.append((op, args, kwargs))


def test_an_op_is_sent_to_the_followers_before_it_runs_and_they_find_it_by_name() -> None:
    state = object.__new__(device.DeviceState)  # no programs: the op fails after it was sent
    recorder = _Recorder()
    state.leader = recorder  # type: ignore[assignment]  # a stand-in for the key-value transport
    with pytest.raises(AttributeError):
        state.read_slot(3, 8, ("q_proj",))
    assert recorder.sent == [("read_slot", (3, 8, ("q_proj",)), {})]
    assert set(device.OPS) == {"write_slot", "read_slot", "optim", "run_pass", "sample", "prompt_topk"}
    # A follower runs the op itself, not its sending wrapper (it has no followers of its own).
    assert device.OPS["read_slot"] is device.DeviceState.read_slot.__wrapped__  # type: ignore[attr-defined]
