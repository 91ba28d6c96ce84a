"""The store's typed errors: the API maps each to an HTTP status (api/), the engine and the CLI catch them by kind."""

from __future__ import annotations


class StoreError(Exception):
    """Base of the store's typed errors; the API maps each to an HTTP status."""


class NotFound(StoreError, LookupError):
    """No such row for this owner (another owner's row reads the same as a missing one)."""


class Conflict(StoreError):
    """A resubmission with a different body, or a name that is already taken."""


class SessionFinished(StoreError):
    """The session was finished (the SDK expects HTTP 410 for its heartbeat)."""


class StaleClaim(StoreError):
    """The engine reported on a request it no longer holds (finished already, or recovered after a restart)."""


class DatabaseUnavailable(StoreError):
    """`retry_database` gave up: the database stayed unreachable for its whole window (the cause is chained)."""
