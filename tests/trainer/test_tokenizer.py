from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from trainer.model.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer


def test_char_round_trip_and_specials() -> None:
    tok = CharTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 100  # 4 specials + newline + 95 printable ASCII
    text = "Q: 12+30=?\n#### 42 ~{}"
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert min(ids) >= 4 and max(ids) < tok.vocab_size
    assert tok.decode(ids) == text
    every = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")
    assert tok.decode(tok.encode(every)) == every
    assert len(set(tok.encode(every))) == len(every)


def test_char_specials_and_unknown() -> None:
    tok = CharTokenizer()
    ab = tok.encode("ab")
    assert tok.decode([tok.bos_id, *ab, tok.eos_id, tok.pad_id, tok.pad_id]) == "ab"
    assert tok.encode("é") == [tok.unk_id]
    assert tok.decode(tok.encode("aé")) == "a\ufffd"
    assert tok.decode([tok.vocab_size + 5]) == ""  # padded model heads can emit ids past the vocab


def _make_hf_dir(tmp_path: Path, tokenizer_config: dict | None, config: dict | None) -> Path:
    tok = RawTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_end|>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the cat sat on the mat, then the cat ate 12 rats"] * 40, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    if tokenizer_config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_hf_tokenizer_from_dir(tmp_path: Path) -> None:
    d = _make_hf_dir(
        tmp_path,
        {"eos_token": {"content": "<|im_end|>"}, "pad_token": "<|endoftext|>", "bos_token": None},
        {"eos_token_id": 0, "bos_token_id": 0},
    )
    tok = load_tokenizer(str(d))
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == 1 and tok.pad_id == 0
    assert tok.bos_id == 0  # no bos string in tokenizer_config.json -> config.json id
    text = "the cat sat on 12 mats, ü!"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode())  # BPE merged something
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_id, tok.pad_id]) == text
    raw = RawTokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    assert ids == raw.encode(text, add_special_tokens=False).ids


def test_hf_tokenizer_config_json_only(tmp_path: Path) -> None:
    d = _make_hf_dir(tmp_path, None, {"eos_token_id": [1, 0]})
    tok = HFTokenizer.from_dir(d)
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (1, 1, None)  # pad falls back to eos


def test_hf_tokenizer_name_fallback_and_errors(tmp_path: Path) -> None:
    d = _make_hf_dir(tmp_path, None, None)
    assert HFTokenizer.from_dir(d).eos_id == 0  # "<|endoftext|>" found by name
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer.from_dir(tmp_path / "missing")
    with pytest.raises(ValueError, match="'char' or a local directory"):
        load_tokenizer(str(tmp_path / "nope"))
    assert isinstance(load_tokenizer("char"), CharTokenizer)
