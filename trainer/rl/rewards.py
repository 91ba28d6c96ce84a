"""Reward functions: `fn(prompts, completions, **example_fields) -> list[float]`.

Each example field arrives as a list aligned with `prompts`. Every reward fn takes `**_` so the
fields of other rewards (and any extras the train loop passes) are ignored. Completions are the
decoded text up to (not including) EOS.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

RewardFn = Callable[..., list[float]]


def char_match(prompts: Sequence[str], completions: Sequence[str], target: Sequence[str], **_: Any) -> list[float]:
    """Per-position credit: the fraction of target positions the completion gets right (extra chars after
    the target are ignored). Dense, so a random model gets signal. No credit for "a digit, but the wrong
    one": on the digits task that partial credit made the policy collapse onto one fixed digit."""
    out: list[float] = []
    for comp, tgt in zip(completions, target, strict=True):
        if not tgt:
            out.append(1.0 if not comp else 0.0)
            continue
        out.append(sum(1.0 for c, want in zip(comp, tgt, strict=False) if c == want) / len(tgt))
    return out


def length(prompts: Sequence[str], completions: Sequence[str], target: Sequence[str], **_: Any) -> list[float]:
    """Stop at the right place: 1 when the completion (text before EOS) has the target's length, falling
    linearly to 0 at twice / zero that length. With max_new_tokens above the target length, a completion
    that never emits EOS is too long and loses credit."""
    out: list[float] = []
    for comp, tgt in zip(completions, target, strict=True):
        n = max(len(tgt), 1)
        out.append(max(0.0, 1.0 - abs(len(comp) - len(tgt)) / n))
    return out


def exact_match(prompts: Sequence[str], completions: Sequence[str], target: Sequence[str], **_: Any) -> list[float]:
    """1 when the completion equals the target exactly (sparse; useful to log next to the dense ones)."""
    return [1.0 if comp == tgt else 0.0 for comp, tgt in zip(completions, target, strict=True)]


# A number: optional sign, optional "$", digits with optional thousands commas and decimals.
_NUMBER = re.compile(
    r"(?P<sign>-\s*)?\$?\s*(?P<sign2>-)?(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|\d+(?:\.\d+)?|\.\d+)"
)


def find_numbers(text: str) -> list[float]:
    """All numbers in `text` in order. "1,234" -> 1234, "$-5" / "-$5" -> -5; a "-" right after a letter
    or digit is a minus operator ("5-3" -> 5, 3), not a sign."""
    found: list[float] = []
    for m in _NUMBER.finditer(text):
        neg = m.group("sign2") is not None
        if m.group("sign") is not None:
            start = m.start("sign")
            prev = text[start - 1] if start > 0 else " "
            neg = neg or not (prev.isalnum() or prev in ")]")
        value = float(m.group("num").replace(",", ""))
        found.append(-value if neg else value)
    return found


def extract_answer(text: str) -> float | None:
    """The answer of a GSM8K-style text: the first number after the last "####" if there is one,
    otherwise the last number in the text; None when there is no number."""
    if "####" in text:
        after = find_numbers(text.rsplit("####", 1)[1])
        return after[0] if after else None
    nums = find_numbers(text)
    return nums[-1] if nums else None


def numbers_equal(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)


def gsm8k_answer(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], **_: Any) -> list[float]:
    """1 when the completion's extracted answer equals the gold answer numerically."""
    out: list[float] = []
    for comp, gold_text in zip(completions, answer, strict=True):
        gold, pred = extract_answer(gold_text), extract_answer(comp)
        out.append(1.0 if gold is not None and pred is not None and numbers_equal(pred, gold) else 0.0)
    return out


def numeric_match(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], **_: Any) -> list[float]:
    """1 when the completion's last number (or the first after its last "####") equals the answer's, numerically:
    gsm8k_answer under a name for any data set with numeric answers."""
    return gsm8k_answer(prompts, completions, answer)


_FINAL = re.compile(r"####\s*-?\s*\$?\s*-?[\d.]")


def gsm8k_format(prompts: Sequence[str], completions: Sequence[str], **_: Any) -> list[float]:
    """Partial credit for the answer format: 0.5 for containing a number, 1.0 for "#### <number>"."""
    out: list[float] = []
    for comp in completions:
        if _FINAL.search(comp):
            out.append(1.0)
        elif find_numbers(comp):
            out.append(0.5)
        else:
            out.append(0.0)
    return out


REWARDS: dict[str, RewardFn] = {
    "char_match": char_match,
    "length": length,
    "exact_match": exact_match,
    "gsm8k_answer": gsm8k_answer,
    "numeric_match": numeric_match,
    "gsm8k_format": gsm8k_format,
}


def get_reward(name: str) -> RewardFn:
    """A built-in reward by name, or the user's own as MODULE:FUNCTION (trainer/base/user_code.py)."""
    if ":" in name:
        from trainer.base.user_code import resolve

        return resolve(name)
    try:
        return REWARDS[name]
    except KeyError:
        raise KeyError(f"unknown reward {name!r}; known rewards: {', '.join(sorted(REWARDS))}, or MODULE:FUNCTION "
                       "of your own code") from None


def compute_rewards(
    names: Sequence[str], prompts: Sequence[str], completions: Sequence[str], fields: Mapping[str, Sequence[Any]]
) -> dict[str, list[float]]:
    """Score a batch with each named reward; the total is their sum (the caller adds them up)."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    for key, values in fields.items():
        if len(values) != len(prompts):
            raise ValueError(f"field {key!r} has {len(values)} values for {len(prompts)} prompts")
    out: dict[str, list[float]] = {}
    for name in names:
        scores = [float(s) for s in get_reward(name)(list(prompts), list(completions), **fields)]
        if len(scores) != len(prompts):
            raise ValueError(f"reward {name!r} returned {len(scores)} scores for {len(prompts)} completions")
        out[name] = scores
    return out
