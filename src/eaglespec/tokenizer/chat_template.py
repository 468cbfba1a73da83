"""Chat templates rendered in the Jinja environment transformers defines
(utils/chat_template_utils.py)."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from eaglespec.errors import ChatTemplateError


def render_chat_template(
    template: str,
    messages: list[dict[str, str]],
    *,
    add_generation_prompt: bool = True,
    **variables: str,
) -> str:
    """Render a chat template in transformers' sandbox. Messages lose None-valued keys (as in
    transformers); `variables` are bos_token, eos_token, unk_token, pad_token."""
    chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
    try:
        return _compile_template(template).render(
            messages=chat,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template: {exc}") from exc


@lru_cache(maxsize=16)
def _compile_template(template: str) -> jinja2.Template:
    """transformers' environment (utils/chat_template_utils.py): immutable sandbox, trim_blocks
    and lstrip_blocks, loop controls, `{% generation %}` blocks, its `tojson`, `raise_exception`,
    `strftime_now`, and restricted `dict` / `namespace`."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # unlike Jinja's own tojson: no HTML escaping, and the json.dumps options exposed
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore-prefixed attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as Jinja's
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for key in attrs:
            _TemplateNamespace._check(key)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace: {name!r}"
            )


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it):
    renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())
