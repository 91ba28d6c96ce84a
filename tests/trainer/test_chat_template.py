"""Chat templates (trainer/model/chat_template.py) against transformers' own apply_chat_template, on the published
templates of Qwen3 and Mistral Nemo and our own Llama 3.x template (tests/fixtures/chat_templates/SOURCES.md): the
same text, and through the trainer's prompt path (task.chat_template) the same token ids, with no second BOS."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from trainer.base.config import ConfigError, config_from_dict
from trainer.model.chat_template import ChatTemplate, ChatTemplateError
from trainer.rl.task_data import load_task_data

from .conftest import tiny_train_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TEMPLATES = FIXTURES / "chat_templates"
# Each family's named tokens (as its tokenizer_config.json has them) and the control tokens its template writes.
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {"template": "qwen3.jinja", "tokens": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
              "added": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]},
    "llama3": {"template": "llama3.jinja", "tokens": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
               "added": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]},
    "mistral-nemo": {"template": "mistral-nemo.jinja", "tokens": {"bos_token": "<s>", "eos_token": "</s>",
                                                                  "unk_token": "<unk>"},
                     "added": ["<s>", "</s>", "<unk>", "[INST]", "[/INST]"]},
}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 17 * 3? Answer with a number."}],
    [{"role": "system", "content": "  You are terse.\n"},
     {"role": "user", "content": "  Sum {1, 2}: \"ok\" & <b>é</b>\n"}],
]
# A day no test run falls on, so a template that ignores strftime_now cannot pass by luck.
FROZEN_NOW = datetime(2031, 3, 5, 23, 59, 59)


class _FrozenDatetime(datetime):
    @classmethod
    def now(cls, tz: Any = None) -> _FrozenDatetime:
        return cls.fromtimestamp(FROZEN_NOW.timestamp(), tz)


@pytest.fixture
def frozen_today(monkeypatch: pytest.MonkeyPatch) -> None:
    """strftime_now reads datetime.now() from its module's global `datetime`, in transformers and in ours: both see
    FROZEN_NOW (and a run at midnight cannot render two different days)."""
    import transformers.utils.chat_template_utils as hf_chat

    import trainer.model.chat_template as ours

    monkeypatch.setattr(hf_chat, "datetime", _FrozenDatetime)
    monkeypatch.setattr(ours, "datetime", _FrozenDatetime)


def tokenizer_dir(root: Path, family: str, as_file: bool = False) -> Path:
    """The tiny Qwen-style BPE with the family's control tokens, its template in tokenizer_config.json (or, as
    transformers 5 saves it, in chat_template.jinja)."""
    from tokenizers import Tokenizer

    spec = FAMILIES[family]
    out = root / family
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(FIXTURES / "tiny_qwen3" / "tokenizer.json"))
    tok.add_special_tokens(spec["added"])
    tok.save(str(out / "tokenizer.json"))
    template = (TEMPLATES / spec["template"]).read_text()
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **spec["tokens"]}
    if as_file:
        (out / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _transformers(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize(("family", "kwargs"), [("qwen3", {}), ("qwen3", {"enable_thinking": False}),
                                                ("llama3", {}), ("llama3", {"date_string": "01 Jan 2026"}),
                                                ("mistral-nemo", {})])
def test_renders_what_transformers_renders(tmp_path: Path, family: str, kwargs: dict[str, Any],
                                           frozen_today: None) -> None:
    path = tokenizer_dir(tmp_path, family, as_file=family == "llama3")
    ours, theirs = ChatTemplate.from_dir(path), _transformers(path)
    for messages in CONVERSATIONS:
        for gen in (True, False):
            want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kwargs)
            assert ours.render(messages, add_generation_prompt=gen, **kwargs) == want
    # The templates differ, and each ends where the assistant's answer begins.
    last = ours.render(CONVERSATIONS[0], **kwargs)
    no_think = "<think>\n\n</think>\n\n" if "enable_thinking" in kwargs else ""
    assert last.endswith({"qwen3": "<|im_start|>assistant\n" + no_think,
                          "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
                          "mistral-nemo": "[/INST]"}[family])
    if family == "llama3":  # the date: date_string when given, else strftime_now's (frozen) today
        today = kwargs.get("date_string", "05 Mar 2031")
        assert last.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge "
                               f"Date: December 2023\nToday Date: {today}\n\n<|eot_id|>")


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
                   "required": ["city"]}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
TOOL_CHAT = [{"role": "system", "content": "Use the tools."},
             {"role": "user", "content": "Weather in Zürich?"},
             {"role": "assistant", "tool_calls": [CALL]},
             {"role": "tool", "content": '{"celsius": 4}'},
             {"role": "assistant", "content": "4 °C."},
             {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]}]


@pytest.mark.parametrize("in_user", [True, False])
def test_llama3_tools_and_ipython_results(tmp_path: Path, in_user: bool, frozen_today: None) -> None:
    """Our Llama 3 template's tool path: definitions as JSON in the first user turn (or the system turn), a call as
    {"name", "parameters"} JSON, the result as an ipython turn; and its refusals, which transformers raises too."""
    path = tokenizer_dir(tmp_path, "llama3")
    ours, theirs = ChatTemplate.from_dir(path), _transformers(path)
    kwargs = {"tools": TOOLS, "tools_in_user_message": in_user}
    got = ours.render(TOOL_CHAT, **kwargs)
    assert got == theirs.apply_chat_template(TOOL_CHAT, tokenize=False, add_generation_prompt=True, **kwargs)
    definition = json.dumps(TOOLS[0]["function"], indent=4, ensure_ascii=False)
    start = got.index("<|start_header_id|>user" if in_user else "<|start_header_id|>system")
    assert got.count(definition) == 1 and start < got.index(definition) < got.index("<|eot_id|>", start)
    assert "Environment: ipython\nCutting Knowledge Date" in got
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Zürich"}}'
            '<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n{"celsius": 4}<|eot_id|>') in got
    assert got.endswith("And tomorrow?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    call = {"function": {"name": "f", "arguments": {}}}
    for bad, tools, message in [
            ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], None, "may only come first"),
            ([{"role": "critic", "content": "x"}], None, "unknown role 'critic'"),
            ([{"role": "assistant", "tool_calls": [call, call]}], None, "one function per assistant turn; got 2"),
            ([{"role": "system", "content": "s"}], TOOLS, "no user message"),
            ([{"role": "user", "content": [{"type": "image"}]}], None, "text only, not a 'image' part")]:
        with pytest.raises(Exception, match=message):
            theirs.apply_chat_template(bad, tools=tools, tokenize=False)
        with pytest.raises(ChatTemplateError, match=message):
            ours.render(bad, tools=tools)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_trainers_prompt_ids_are_apply_chat_templates(tmp_path: Path, family: str, frozen_today: None) -> None:
    """task.chat_template through load_task_data: the ids the sampler gets are transformers' tokenized chat, the
    template's own BOS included once (the trainer prepends none of its own)."""
    path = tokenizer_dir(tmp_path, family)
    data_file = tmp_path / "rows.jsonl"
    data_file.write_text("".join(json.dumps({"q": m[-1]["content"], "a": "51"}) + "\n" for m in CONVERSATIONS))
    raw = tiny_train_config(tmp_path / "run", tokenizer=str(path),
                            task={"name": "dataset", "path": str(data_file), "prompt_field": "q", "answer_field": "a",
                                  "shuffle": False, "chat_template": True, "system_prompt": "Be brief."})
    raw["model"]["vocab_size"] = 1088
    raw["model"]["max_seq_len"] = 256
    raw["sampling"]["max_prompt_len"] = 200
    data = load_task_data(config_from_dict(raw))
    theirs = _transformers(path)
    for i, messages in enumerate(CONVERSATIONS):
        prompt = data.task.example(i).prompt
        assert prompt == messages[-1]["content"]
        want = theirs.apply_chat_template([{"role": "system", "content": "Be brief."}, messages[-1]],
                                          tokenize=True, add_generation_prompt=True, return_dict=False)
        assert data.prompt_ids(prompt) == list(want)
    bos = FAMILIES[family]["tokens"].get("bos_token")
    ids, bos_id = data.prompt_ids("hi"), data.tokenizer.bos_id
    if bos is not None:
        assert bos_id is not None and ids.count(bos_id) == 1 and ids[0] == bos_id


def test_bad_chat_settings_name_the_key(tmp_path: Path) -> None:
    def cfg(tokenizer: str, **task: Any) -> Any:
        raw = tiny_train_config(tmp_path / "run", tokenizer=tokenizer, task={"name": "digits", **task})
        raw["model"]["vocab_size"] = 1088
        return config_from_dict(raw)

    with pytest.raises(ConfigError, match=r"^task\.chat_template: the built-in char tokenizer has no chat template"):
        load_task_data(cfg("char", chat_template=True))
    with pytest.raises(ConfigError, match=r"^task\.system_prompt: only read with task\.chat_template: true"):
        load_task_data(cfg("char", system_prompt="hi"))
    # A base model's tokenizer: no template to apply.
    with pytest.raises(ConfigError, match=r"^task\.chat_template: .* has no chat template"):
        load_task_data(cfg(str(_without_template(tmp_path)), chat_template=True))
    # A template that raises (Mistral's refuses roles it does not know) says which template.
    mistral = tokenizer_dir(tmp_path, "mistral-nemo")
    with pytest.raises(ChatTemplateError, match=r"mistral-nemo/tokenizer_config.json chat_template\) failed: After "
                       "the optional system message, conversation roles must alternate"):
        ChatTemplate.from_dir(mistral).render([{"role": "assistant", "content": "x"}])
    # One that refuses a system turn (as Gemma's does) fails the preflight, which renders example 0, naming the key.
    gemma_like = _without_template(tmp_path)
    (gemma_like / "chat_template.jinja").write_text(
        "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}x")
    with pytest.raises(ConfigError, match=r"^task\.chat_template: .* failed: System role not supported$"):
        load_task_data(cfg(str(gemma_like), chat_template=True, system_prompt="Be brief."))
    assert load_task_data(cfg(str(gemma_like), chat_template=True)).prompt_ids("rep 7") == [87]
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% if %}", {})


def _without_template(tmp_path: Path) -> Path:
    out = tmp_path / f"base{len(list(tmp_path.glob('base*')))}"
    out.mkdir()
    (out / "tokenizer.json").write_bytes((FIXTURES / "tiny_qwen3" / "tokenizer.json").read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return out


def test_the_sandbox_holds(tmp_path: Path) -> None:
    """A template from the Hub is untrusted code: no attribute walk to Python internals, no underscore names on a
    namespace (the protections transformers' environment has)."""
    from jinja2.exceptions import SecurityError

    for source in ("{{ ''.__class__.__mro__ }}", "{% set ns = namespace(_x=1) %}",
                   "{{ messages.append(1) }}"):
        with pytest.raises((SecurityError, ChatTemplateError)):
            ChatTemplate(source, {}).render([{"role": "user", "content": "x"}])


def test_the_helpers_templates_use_render_as_transformers_renders_them() -> None:
    """What the published templates above do not all use: the {% generation %} tag, loop controls, namespace(),
    dict(), tojson (non-ASCII and HTML characters kept, indent), strftime_now, trim_blocks/lstrip_blocks."""
    from transformers.utils.chat_template_utils import render_jinja_template

    source = """{%- set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m.role == 'skip' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    {% generation %}[{{ ns.n }}:{{ m.role }}] {{ m.content }}{% endgeneration %}
    {{ dict(role=m.role, text=m.content) | tojson }}
    {{ {'a': [1, 'é<&>']} | tojson(indent=2) }}
    {% if loop.index >= 3 %}{% break %}{% endif %}
{% endfor %}
{{ bos_token ~ strftime_now('%Y') }}{% if add_generation_prompt %}<gen>{% endif %}"""
    messages = [{"role": "system", "content": "s"}, {"role": "skip", "content": "x"},
                {"role": "user", "content": "ü \"q\" <b>"}, {"role": "assistant", "content": "a"}]
    tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    [want], _ = render_jinja_template(conversations=[messages], chat_template=source, add_generation_prompt=True,
                                      **tokens)
    assert ChatTemplate(source, tokens).render(messages) == want
    assert "é<&>" in want and "[2:user]" in want and "[3:assistant]" not in want  # the break after 3 messages
