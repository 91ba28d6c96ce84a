"""Rewards take the prompts, the completions (text up to EOS) and the example's fields, one list entry per
completion, and return one number per completion; `**_` ignores the fields other rewards read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def first_char(prompts: Sequence[str], completions: Sequence[str], target: Sequence[str], **_: Any) -> list[float]:
    """1 when the completion starts with the answer, plus 0.5 more when it is only the answer."""
    return [(1.0 if comp[:1] == tgt else 0.0) + (0.5 if comp == tgt else 0.0)
            for comp, tgt in zip(completions, target, strict=True)]
