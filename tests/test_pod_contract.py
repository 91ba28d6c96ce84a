"""The pod contract (envspec/pod.py): what a pod and its builder share is defined there once, and both sides use it."""

from __future__ import annotations

from envspec import pod


def test_the_store_reads_the_names_the_service_pods_are_given() -> None:
    # trainer/service/store.py still spells its Cloud SQL variables itself; until it imports them from the contract,
    # they must be the very names workloads/service.py writes into the API's and the engine's pods.
    from trainer.service import store

    for name in ("CLOUDSQL_INSTANCE_ENV", "CLOUDSQL_USER_ENV", "CLOUDSQL_DATABASE_ENV", "CLOUDSQL_CREDENTIALS_ENV"):
        assert getattr(store, name) == getattr(pod, name), name


def test_the_restart_codes_are_the_transient_code_and_every_death_by_a_signal() -> None:
    restart = set(pod.RESTART_EXIT_CODES)
    assert {pod.EXIT_TRANSIENT, pod.EXIT_STOPPED, pod.EXIT_INTERRUPTED, 137, 134} <= restart
    assert not {0, 1, pod.EXIT_CONFIG} & restart  # a traceback (1) or a bad config (2) is a bug: fail fast
    assert list(pod.RESTART_EXIT_CODES) == sorted(restart) and len(restart) <= 255  # Kubernetes' limits
