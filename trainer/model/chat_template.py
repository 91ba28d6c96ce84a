"""A tokenizer's own chat template (the Jinja template in its tokenizer_config.json or chat_template.jinja), rendered
as `transformers`' `apply_chat_template(..., tokenize=False)` renders it, without transformers.

What transformers does, and so what this does (transformers 5.x, utils/chat_template_utils.py
`_cached_compile_jinja_template` and `render_jinja_template`; tokenization_utils_base.py `apply_chat_template`):
- the template: chat_template.jinja beside the tokenizer wins over tokenizer_config.json's `chat_template`, which is
  a string or a list of {name, template} (then "default" is used);
- Jinja's ImmutableSandboxedEnvironment (chat templates from the Hub are untrusted code) with trim_blocks and
  lstrip_blocks, the loopcontrols extension and a `{% generation %}` block tag; a `tojson` filter that does not
  escape HTML; globals raise_exception, strftime_now, dict and a namespace that refuses underscore names;
- the variables: messages, tools and documents (None unless given; tools as JSON schemas), add_generation_prompt,
  the tokenizer's named special tokens as strings (bos_token, eos_token, unk_token, sep_token, pad_token, cls_token,
  mask_token, where set), then the caller's keyword arguments (e.g. enable_thinking), which win.
The rendered text is then encoded without adding special tokens: the template writes any BOS itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

TEMPLATE_FILE = "chat_template.jinja"
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named tokens a template sees.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers refuses older jinja2 for chat templates: earlier releases have known sandbox escapes.
MIN_JINJA = (3, 1, 6)


class ChatTemplateError(ValueError):
    """No template, a template that does not compile, or one that raised while rendering."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]  # an AddedToken as tokenizer_config.json stores it
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _pick(template: Any, where: Path) -> str:
    if isinstance(template, str):
        return template
    if isinstance(template, list):  # [{name, template}, ...], as older transformers saved several
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return str(named["default"])
        raise ChatTemplateError(f"{where}: chat_template lists templates {sorted(map(str, named))} but no 'default'")
    raise ChatTemplateError(f"{where}: chat_template is a {type(template).__name__}, not a template")


class ChatTemplate:
    """One compiled template and the special tokens it sees."""

    def __init__(self, source: str, special_tokens: Mapping[str, str], origin: str = "<string>") -> None:
        self.source = source
        self.special_tokens = dict(special_tokens)
        self.origin = origin
        self._template = _compile(source, origin)

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTemplate:
        """The chat template of a Hugging Face tokenizer directory. Raises ChatTemplateError when it has none."""
        root = Path(path)
        config_file = root / "tokenizer_config.json"
        config = _read_json(config_file)
        file = root / TEMPLATE_FILE
        if file.is_file():
            source, origin = file.read_text(encoding="utf-8"), str(file)
        elif config.get("chat_template") is not None:
            source, origin = _pick(config["chat_template"], config_file), f"{config_file} chat_template"
        else:
            raise ChatTemplateError(f"{root} has no chat template (neither {TEMPLATE_FILE} nor chat_template in "
                                    "tokenizer_config.json): a base model's tokenizer usually has none")
        # Named tokens from tokenizer_config.json, else the older special_tokens_map.json.
        fallback = _read_json(root / "special_tokens_map.json")
        tokens = {}
        for name in SPECIAL_TOKENS:
            text = _token_text(config.get(name))
            text = text if text is not None else _token_text(fallback.get(name))
            if text is not None:
                tokens[name] = text
        return cls(source, tokens, origin)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        """The conversation as text, as apply_chat_template(messages, tokenize=False, add_generation_prompt=...,
        **kwargs) gives it."""
        from jinja2.exceptions import TemplateError

        # tools and documents may come as keyword arguments, as apply_chat_template takes them (tools as JSON schemas).
        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        try:
            return str(self._template.render(messages=[dict(m) for m in messages],
                                             add_generation_prompt=add_generation_prompt, **variables))
        except TemplateError as err:
            raise ChatTemplateError(f"the chat template ({self.origin}) failed: {err}") from None


def _compile(source: str, origin: str) -> Any:
    try:
        import jinja2
    except ImportError:
        raise ChatTemplateError("chat templates need jinja2 (pip install 'gke-tpu-rl[trainer]')") from None
    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < MIN_JINJA:
        raise ChatTemplateError(f"chat templates need jinja2 >= {'.'.join(map(str, MIN_JINJA))} (sandbox fixes); "
                                f"this is {jinja2.__version__}")
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's tokens for a training mask; rendering a
        prompt needs only its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes <, >, & and ' for HTML; a prompt wants the JSON itself.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class SafeDict:
        """`dict(...)` in a template, without the class itself (its attributes) in reach."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class SafeNamespace(Namespace):
        """Jinja's namespace(), refusing underscore-prefixed names (a way toward CPython internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's own signature trick: self may be a kwarg
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                SafeNamespace._check(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            SafeNamespace._check(name)
            Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=SafeDict(),
                       namespace=SafeNamespace)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise ChatTemplateError(f"the chat template ({origin}) does not compile: {err} (line {err.lineno})") from None


def chat_messages(prompt: str, system_prompt: str | None = None) -> list[dict[str, str]]:
    """A task's prompt as the one user turn of a conversation, after the system prompt when there is one."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    return [*system, {"role": "user", "content": prompt}]
