"""'did you mean ...?' for a misspelled value or key: the nearest allowed spellings (difflib), in one place for
every check that names what it would have accepted."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(value: str, allowed: Iterable[str], *, cutoff: float = 0.75, keep_case: bool = False) -> list[str]:
    """The allowed values nearest to a misspelled one (difflib's ratio, case-insensitive): the best, and up to two
    more about as close (within 0.05 of it). In the table's spelling with keep_case, else in the case the user wrote
    (lowercase unless the value is all uppercase)."""
    by_lower = {a.lower(): a for a in allowed}
    typed = value.lower()
    matches = difflib.get_close_matches(typed, list(by_lower), n=3, cutoff=cutoff)
    if not matches:
        return []

    def ratio(m: str) -> float:
        return difflib.SequenceMatcher(None, typed, m).ratio()

    best = ratio(matches[0])
    near = [m for m in matches if ratio(m) >= best - 0.05]
    if keep_case:
        return [by_lower[m] for m in near]
    return [m.upper() if value.isupper() else m for m in near]


def did_you_mean(candidates: list[str]) -> str:
    """'; did you mean a?', '; did you mean a or b?', '; did you mean a, b or c?', or '' for none."""
    if not candidates:
        return ""
    head, last = candidates[:-1], candidates[-1]
    return f"; did you mean {', '.join(head) + ' or ' if head else ''}{last}?"
