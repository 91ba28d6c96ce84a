from __future__ import annotations

import pytest

from trainer.rl.rewards import (
    REWARDS,
    char_match,
    compute_rewards,
    exact_match,
    extract_answer,
    find_numbers,
    get_reward,
    gsm8k_answer,
    gsm8k_format,
    length,
)


def test_char_match_partial_credit() -> None:
    p = [""] * 7
    comps = ["7777", "77", "7a37", "", "77778888", "3333", "xbz"]
    tgts = ["7777"] * 6 + ["abc"]
    # Per-position: "7a37" gets positions 0 and 3; a wrong digit earns nothing; chars past the target are
    # ignored; "xbz" vs "abc" matches only the middle.
    assert char_match(p, comps, target=tgts) == [1.0, 0.5, 0.5, 0.0, 1.0, 0.0, 1 / 3]
    assert char_match(["", ""], ["", "x"], target=["", ""]) == [1.0, 0.0]


def test_length_and_exact() -> None:
    p = [""] * 5
    comps = ["abc", "ab", "abcdef", "", "abcdefgh"]
    tgts = ["abc"] * 5
    assert length(p, comps, target=tgts) == pytest.approx([1.0, 2 / 3, 0.0, 0.0, 0.0])
    assert length(["", ""], ["abcd", "ab"], target=["abc", "abcd"]) == pytest.approx([2 / 3, 0.5])
    assert exact_match(p, comps, target=tgts) == [1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("text", "nums"),
    [
        ("3 + 5 = 8", [3, 5, 8]),
        ("1,234 and 12,3456", [1234, 12, 3456]),
        ("costs $1,250.50 total", [1250.5]),
        ("it fell to -6 degrees", [-6]),
        ("-$5 or $-7", [-5, -7]),
        ("5-3=2", [5, 3, 2]),
        ("x-4 (-2)", [4, -2]),
        ("about .5 or 0.25.", [0.5, 0.25]),
        ("1,2,3", [1, 2, 3]),
        ("no numbers", []),
    ],
)
def test_find_numbers(text: str, nums: list[float]) -> None:
    assert find_numbers(text) == pytest.approx(nums)


def test_extract_answer() -> None:
    assert extract_answer("so 2 + 3 = 5\n#### 1,234") == 1234
    assert extract_answer("#### $-12.5 because 3") == -12.5
    assert extract_answer("first 4 then 9") == 9
    assert extract_answer("#### none here 7 ####") is None
    assert extract_answer("nothing") is None


def test_gsm8k_answer_compares_numerically() -> None:
    comps = ["#### 1234", "the answer is 1,234.0", "#### 1233", "", "#### $1,234", "12 #### -1234"]
    gold = ["Step.\n#### 1,234"] * 6
    assert gsm8k_answer([""] * 6, comps, answer=gold) == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert gsm8k_answer(["", ""], ["-6", "4.5"], answer=["-6", "4.50"]) == [1.0, 1.0]


def test_gsm8k_format() -> None:
    comps = ["3+4 is 7\n#### 7", "it is 7", "####", "no idea", "#### -2"]
    assert gsm8k_format([""] * 5, comps) == [1.0, 0.5, 0.0, 0.0, 1.0]


def test_registry_and_compute() -> None:
    assert set(REWARDS) >= {"char_match", "length", "gsm8k_answer", "gsm8k_format"}
    assert get_reward("length") is length
    with pytest.raises(KeyError, match="unknown reward 'nope'.*char_match"):
        get_reward("nope")
    out = compute_rewards(
        ["char_match", "length"],
        ["rep 7:", "rep 7:"],
        ["7777", "7"],
        {"target": ["7777", "7777"], "extra": [1, 2]},
    )
    assert out == {"char_match": [1.0, 0.25], "length": [1.0, 0.25]}
    with pytest.raises(ValueError, match="field 'target' has 1 values for 2 prompts"):
        compute_rewards(["length"], ["a", "b"], ["x", "y"], {"target": ["x"]})
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        compute_rewards(["length"], ["a", "b"], ["x"], {"target": ["x", "y"]})
