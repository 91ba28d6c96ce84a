"""A compiled TPU program's time with each while loop's body counted as often as it runs.

libtpu's cost analysis counts a loop body once (tests/trainer/test_fit.py), in FLOPs and in optimal_seconds alike.
It also writes `estimated_cycles` on every instruction of the compiled HLO, loop bodies included, and a loop's trip
count is in its condition (the counter compared LT with a constant). Weighting each body's cycles by its trip count
gives the share of the program's time the count-once figure leaves out, loop by loop, where scaling the whole
program by its FLOPs shortfall would multiply what lies outside the loops too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_WHILE = re.compile(r"\swhile\(.*condition=%([\w.\-]+), body=%([\w.\-]+)")
_CALLED = re.compile(r"(?:calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_LIMIT = re.compile(r"s32\[\]\S* constant\((\d+)\)")


@dataclass
class _Computation:
    own: int = 0  # cycles of its own instructions
    whiles: list[tuple[str, str]] = field(default_factory=list)  # (condition, body)
    calls: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def _parse(hlo: str) -> tuple[dict[str, _Computation], str | None]:
    comps: dict[str, _Computation] = {}
    entry, cur = None, None
    for line in hlo.splitlines():
        if cur is None:  # between computations: a header opens one
            if m := _HEADER.match(line):
                cur = comps.setdefault(m.group(1), _Computation())
                entry = m.group(1) if line.startswith("ENTRY") else entry
            continue
        if line.rstrip() == "}":  # a custom call's backend config can span lines: only a bare brace closes
            cur = None
            continue
        cur.lines.append(line)
        if c := _CYCLES.search(line):
            cur.own += int(c.group(1))
        if w := _WHILE.search(line):
            cur.whiles.append((w.group(1), w.group(2)))
            continue
        cur.calls += _CALLED.findall(line)
        for b in _BRANCHES.findall(line):
            cur.calls += [n.strip().lstrip("%") for n in b.split(",") if n.strip()]
    return comps, entry


def trip_count(condition: list[str]) -> int | None:
    """A counted loop's trips from its condition's lines: `counter < constant` (the counter starting at 0, as
    lax.scan and fori_loop lower); None for any other condition (a data-dependent loop)."""
    limits = [int(m.group(1)) for line in condition if (m := _LIMIT.search(line))]
    compares = [line for line in condition if " compare(" in line]
    if len(limits) != 1 or len(compares) != 1 or "direction=LT" not in compares[0]:
        return None
    return limits[0]


def loop_factor(hlo: str) -> float | None:
    """The program's estimated cycles with every loop body counted once per trip, over the cycles with each counted
    once (1.0 with no loops); None where a loop's trip count cannot be read, or libtpu wrote no cycles."""
    comps, entry = _parse(hlo)
    if entry is None:
        return None
    memo: dict[str, float | None] = {}

    def full(name: str, depth: int = 0) -> float | None:
        if name in memo:
            return memo[name]
        if name not in comps:
            return 0.0
        if depth > 64:  # deeper than any program nests: a cycle, not a count
            return None
        c = comps[name]
        total: float | None = float(c.own)
        for cond, body in c.whiles:
            trips = trip_count(comps[cond].lines) if cond in comps else None
            inner = full(body, depth + 1)
            if trips is None or inner is None or total is None:
                total = None
                break
            total += trips * inner
        for called in c.calls:
            inner = full(called, depth + 1)
            total = None if total is None or inner is None else total + inner
        memo[name] = total
        return total

    counted_once = sum(c.own for c in comps.values())
    weighted = full(entry)
    if weighted is None or counted_once <= 0:
        return None
    return weighted / counted_once
