"""The pod contract (envspec/pod.py): what a pod and its builder share is defined there once, and both sides use it."""

from __future__ import annotations

from envspec import pod


def test_the_restart_codes_are_the_transient_code_and_every_death_by_a_signal() -> None:
    restart = set(pod.RESTART_EXIT_CODES)
    assert {pod.EXIT_TRANSIENT, pod.EXIT_STOPPED, pod.EXIT_INTERRUPTED, 137, 134} <= restart
    assert not {0, 1, pod.EXIT_CONFIG} & restart  # a traceback (1) or a bad config (2) is a bug: fail fast
    assert list(pod.RESTART_EXIT_CODES) == sorted(restart) and len(restart) <= 255  # Kubernetes' limits
