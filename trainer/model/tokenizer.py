"""Tokenizers: a built-in character tokenizer and a local Hugging Face `tokenizer.json` wrapper.

`encode` never adds special tokens (prompt text -> ids only); callers that want a BOS prepend `bos_id`
themselves when it is not None. `decode` drops special tokens; callers trim at EOS before decoding.
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    eos_id: int
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


# Printable ASCII without the vertical whitespace that `string.printable` also contains.
_CHARS = "\n" + "".join(c for c in string.printable if c not in "\t\n\r\x0b\x0c")


class CharTokenizer:
    """pad=0, bos=1, eos=2, unk=3, then newline and the 95 printable ASCII characters (vocab 100)."""

    PAD, BOS, EOS, UNK = 0, 1, 2, 3
    _N_SPECIAL = 4

    def __init__(self) -> None:
        self.pad_id: int = self.PAD
        self.bos_id: int | None = self.BOS
        self.eos_id: int = self.EOS
        self.unk_id: int = self.UNK
        self._to_id = {c: i + self._N_SPECIAL for i, c in enumerate(_CHARS)}
        self.vocab_size: int = self._N_SPECIAL + len(_CHARS)

    def encode(self, text: str) -> list[int]:
        return [self._to_id.get(c, self.UNK) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        for i in ids:
            i = int(i)
            if i == self.UNK:
                out.append("\ufffd")
            elif self._N_SPECIAL <= i < self.vocab_size:
                out.append(_CHARS[i - self._N_SPECIAL])
            # pad/bos/eos (and ids past the vocab, which a padded model head can emit) decode to nothing
        return "".join(out)


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _first_id(value: Any) -> int | None:
    """config.json ids may be an int or a list of ints (several EOS ids); the first is canonical."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, list) and value and isinstance(value[0], int):
        return value[0]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


_EOS_FALLBACKS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


class HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from a local directory; nothing is downloaded."""

    def __init__(self, tok: Any, eos_id: int, pad_id: int, bos_id: int | None) -> None:
        self._tok = tok
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.bos_id = bos_id
        self.vocab_size: int = int(tok.get_vocab_size(with_added_tokens=True))

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        from tokenizers import Tokenizer as RawTokenizer

        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {root}")
        tok = RawTokenizer.from_file(str(tok_file))
        tcfg = _read_json(root / "tokenizer_config.json")
        mcfg = _read_json(root / "config.json")
        gcfg = _read_json(root / "generation_config.json")

        def resolve(name: str) -> int | None:
            # Token strings in tokenizer_config.json win: they describe this tokenizer, while
            # config.json ids can belong to a base model whose chat EOS differs.
            content = _token_content(tcfg.get(f"{name}_token"))
            if content is not None and (tid := tok.token_to_id(content)) is not None:
                return int(tid)
            for cfg in (mcfg, gcfg):
                tid = _first_id(cfg.get(f"{name}_token_id"))
                if tid is not None:
                    return tid
            return None

        eos = resolve("eos")
        if eos is None:
            for cand in _EOS_FALLBACKS:
                if (tid := tok.token_to_id(cand)) is not None:
                    eos = int(tid)
                    break
        if eos is None:
            raise ValueError(
                f"cannot determine the EOS token for {root}: set eos_token in tokenizer_config.json "
                "or eos_token_id in config.json"
            )
        pad = resolve("pad")
        return cls(tok, eos_id=eos, pad_id=eos if pad is None else pad, bos_id=resolve("bos"))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=True))


def load_tokenizer(spec: str | Path) -> CharTokenizer | HFTokenizer:
    """`"char"` for the built-in tokenizer, else a local directory holding tokenizer.json."""
    if str(spec) == "char":
        return CharTokenizer()
    path = Path(spec)
    if not path.is_dir():
        raise ValueError(f"tokenizer must be 'char' or a local directory with tokenizer.json, got {spec!r}")
    return HFTokenizer.from_dir(path)
