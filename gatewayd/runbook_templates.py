"""Runbook templates: the parameters a template declares, checked and filled in to make the script that runs.

A runbook is a text file whose actions ``{{ ... }}`` are pipelines in the style of Go's text/template, as
hoop.dev's runbooks write them::

    SELECT * FROM customers WHERE id = {{ .customer_id | description "the customer" | required "say which"
                                          | type "number" | squote }}

Each pipeline starts with a parameter (``.name``) and passes its value through functions, the value being the
last argument of each (``required "msg"`` is ``required("msg", value)``). The functions that describe the
parameter (``description``, ``type``, ``default``, ``required``, ``options``, ``placeholder``, ``order``,
``pattern``) make its form field; the others change the value (``squote``, ``dquote``, ``quotechar``,
``encodeb64``, ``decodeb64``). Nothing else of Go's language is read: a template that uses it (``if``,
``range``, variables, another function) is reported as not renderable, never guessed at.

Rendering checks every value against its declaration first (types, options, patterns, required values), so
a script is made from valid values or not at all. Quoting follows the language of the connection the script
runs on: SQL doubles a quote inside a quoted value, the POSIX shell closes and reopens its quotes; a value
cannot leave its quotes. ``password`` parameters are secrets: ``Rendered.secrets`` lists their values so that
the gateway keeps them out of recordings, audit entries and AI prompts.
"""

from __future__ import annotations

import base64
import binascii
import functools
import re
from dataclasses import dataclass, field
from datetime import date
from typing import Any
from urllib.parse import urlsplit

import re2

from gatewayd.models import email_problem

INPUT_TYPES = ("text", "number", "tel", "time", "date", "url", "email", "select", "textarea", "password")
SECRET_TYPES = frozenset({"password"})
MAX_VALUE_CHARS = 65536  # one parameter's value
DESCRIBING = frozenset({"description", "type", "default", "required", "options", "placeholder", "order", "pattern"})
CHANGING = frozenset({"squote", "dquote", "quotechar", "encodeb64", "decodeb64"})
SQL, SHELL = "sql", "shell"
LANGUAGES = {"postgres": SQL, "ssh": SHELL}  # how a connection subtype's scripts quote values

_ACTION = re.compile(r"{{(-?)(.*?)(-?)}}", re.S)
_NAME = re.compile(r"^\.([A-Za-z_][A-Za-z0-9_]*)$")
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
_TIME = re.compile(r"^([01]\d|2[0-3]):[0-5]\d(:[0-5]\d)?$")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_TEL = re.compile(r"^\+?[0-9][0-9 ().-]{2,30}$")
_TOKEN = re.compile(r'\s*("(?:[^"\\\n]|\\.)*"|`[^`]*`|[^\s"`|]+|\|)')
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a bad pattern is the template's error, not a line on the daemon's stderr
_GO_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "a": "\a", "b": "\b",
               "f": "\f", "v": "\v", "0": "\0"}


class TemplateError(ValueError):
    """A template gatewayd does not render (the message says where and why)."""


class ParameterError(ValueError):
    """Values that do not fit the template's declarations; ``problems`` names each, by parameter."""

    def __init__(self, problems: dict[str, str]) -> None:
        super().__init__("; ".join(f"{name}: {text}" for name, text in problems.items()))
        self.problems = problems


@dataclass(slots=True)
class Call:
    """One function of a pipeline with its literal arguments (the piped value comes last)."""

    name: str
    args: tuple[str, ...]


@dataclass(slots=True)
class Action:
    """``{{ .name | f ... | g ... }}``."""

    parameter: str
    calls: tuple[Call, ...]


@dataclass(slots=True)
class Parameter:
    """What a template declares of one parameter: its form field and its checks."""

    name: str
    type: str = "text"
    description: str = ""
    required: bool = False
    required_message: str = ""
    default: str | None = None
    placeholder: str = ""
    options: list[str] = field(default_factory=list)
    order: int | None = None
    patterns: list[str] = field(default_factory=list)

    @property
    def secret(self) -> bool:
        return self.type in SECRET_TYPES

    def as_json(self) -> dict[str, Any]:
        """The field as hoop's runbook ``metadata`` shows it (``description``, ``required``, ``type``, ...)."""
        data: dict[str, Any] = {"description": self.description, "required": self.required, "type": self.type}
        if self.default is not None:
            data["default"] = self.default
        if self.placeholder:
            data["placeholder"] = self.placeholder
        if self.options:
            data["options"] = list(self.options)
        if self.order is not None:
            data["order"] = self.order
        if self.patterns:
            data["pattern"] = self.patterns[0] if len(self.patterns) == 1 else list(self.patterns)
        return data


@dataclass(slots=True)
class Template:
    """A parsed runbook: literal text and actions, in order, and the parameters they declare."""

    parts: list[str | Action]
    parameters: dict[str, Parameter]


@dataclass(slots=True)
class Rendered:
    """A script made from a template: the text that runs, the values used, and the secret ones."""

    script: str
    values: dict[str, str]
    secrets: tuple[str, ...]

    def shown_parameters(self, template: Template) -> dict[str, str]:
        """The values as a record may show them: secrets as ``[REDACTED]``."""
        return {name: "[REDACTED]" if template.parameters.get(name, Parameter(name)).secret else value
                for name, value in self.values.items()}


# ---------------------------------------------------------------------------- parsing


@functools.lru_cache(maxsize=256)
def _pattern(text: str) -> Any:
    """A ``pattern`` compiled on RE2 (linear time, as Go's regexp): an unanchored search, as hoop.dev's."""
    return re2.compile(text.encode(), _RE2_OPTIONS)


def _go_string(token: str, where: str) -> str:
    """A Go string literal's value (interpreted ``"..."`` or raw ```...```)."""
    if token.startswith("`"):
        return token[1:-1]
    body, out, i = token[1:-1], [], 0
    while i < len(body):
        char = body[i]
        if char != "\\":
            out.append(char)
            i += 1
            continue
        following = body[i + 1:i + 2]
        if following in _GO_ESCAPES:
            out.append(_GO_ESCAPES[following])
            i += 2
        elif following in ("x", "u", "U"):
            width = {"x": 2, "u": 4, "U": 8}[following]
            digits = body[i + 2:i + 2 + width]
            try:
                out.append(chr(int(digits, 16)) if len(digits) == width else "")
            except ValueError:
                raise TemplateError(f"{where}: bad escape \\{following}{digits}") from None
            i += 2 + width
        else:
            raise TemplateError(f"{where}: unknown escape \\{following}")
    return "".join(out)


def _argument(token: str, where: str) -> str:
    if token.startswith(("\"", "`")):
        return _go_string(token, where)
    if _NUMBER.match(token) or token in ("true", "false"):
        return token
    raise TemplateError(f"{where}: expected a quoted string or a number, got {token!r}")


def _tokens(text: str, where: str) -> list[str]:
    tokens, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _TOKEN.match(text, pos)
        if match is None:
            raise TemplateError(f"{where}: cannot read {text[pos:].strip()[:40]!r}")
        tokens.append(match.group(1))
        pos = match.end()
    return tokens


def _action(body: str, where: str) -> Action | None:
    """The action inside ``{{ }}``, or None for a comment."""
    stripped = body.strip()
    if stripped.startswith("/*"):
        if not stripped.endswith("*/"):
            raise TemplateError(f"{where}: an unterminated comment")
        return None
    tokens = _tokens(body, where)
    if not tokens:
        raise TemplateError(f"{where}: an empty action")
    head = _NAME.match(tokens[0])
    if head is None:
        raise TemplateError(f"{where}: gatewayd renders pipelines that start with a parameter (.name); "
                            f"{tokens[0]!r} is not one")
    calls: list[Call] = []
    rest = tokens[1:]
    while rest:
        if rest[0] != "|" or len(rest) < 2:
            raise TemplateError(f"{where}: expected '| function' after {'.' + head.group(1)!r}")
        name, rest = rest[1], rest[2:]
        args: list[str] = []
        while rest and rest[0] != "|":
            args.append(_argument(rest.pop(0), where))
        if name not in DESCRIBING and name not in CHANGING:
            raise TemplateError(f"{where}: unknown function {name!r}")
        calls.append(Call(name, tuple(args)))
    return Action(head.group(1), tuple(calls))


def _declare(parameter: Parameter, call: Call, where: str) -> None:
    """What one describing function says of its parameter."""
    args, name = call.args, call.name
    wanted = {"options": None, "description": 1, "type": 1, "default": 1, "required": 1, "placeholder": 1,
              "order": 1, "pattern": 1}.get(name)
    if name in CHANGING:
        expected = 1 if name == "quotechar" else 0
        if len(args) != expected:
            raise TemplateError(f"{where}: {name} takes {expected} argument{'s' if expected != 1 else ''}")
        return
    if wanted is not None and len(args) != wanted:
        raise TemplateError(f"{where}: {name} takes one argument")
    if name == "options" and not args:
        raise TemplateError(f"{where}: options takes at least one choice")
    if name == "description":
        parameter.description = args[0]
    elif name == "type":
        if args[0] not in INPUT_TYPES:
            raise TemplateError(f"{where}: type {args[0]!r} is not one of {', '.join(INPUT_TYPES)}")
        parameter.type = args[0]
    elif name == "default":
        parameter.default = args[0]
    elif name == "required":
        parameter.required, parameter.required_message = True, args[0]
    elif name == "placeholder":
        parameter.placeholder = args[0]
    elif name == "order":
        if not args[0].lstrip("-").isdigit():
            raise TemplateError(f"{where}: order takes a whole number")
        parameter.order = int(args[0])
    elif name == "options":
        parameter.options = list(dict.fromkeys(args))
        if parameter.type == "text":
            parameter.type = "select"
    elif name == "pattern":
        try:
            _pattern(args[0])
        except re2.error as exc:
            reason = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) \
                else str(exc)
            raise TemplateError(f"{where}: pattern {args[0]!r} is not a valid regular expression: {reason}") from None
        parameter.patterns.append(args[0])


def parse(text: str) -> Template:
    """A template's parts and the parameters its actions declare (TemplateError when gatewayd cannot render it)."""
    parts: list[str | Action] = []
    parameters: dict[str, Parameter] = {}
    pos, trim_next = 0, False
    for match in _ACTION.finditer(text):
        literal = text[pos:match.start()]
        if trim_next:
            literal = literal.lstrip()
        if match.group(1):
            literal = literal.rstrip()
        parts.append(literal)
        line = text.count("\n", 0, match.start()) + 1
        action = _action(match.group(2), f"line {line}")
        if action is not None:
            parameter = parameters.setdefault(action.parameter, Parameter(action.parameter))
            for call in action.calls:
                _declare(parameter, call, f"line {line}")
            parts.append(action)
        trim_next = bool(match.group(3))
        pos = match.end()
    tail = text[pos:]
    parts.append(tail.lstrip() if trim_next else tail)
    if "{{" in tail:
        raise TemplateError(f"line {text.count(chr(10), 0, pos + tail.index('{{')) + 1}: an unterminated action")
    for parameter in parameters.values():
        if parameter.type == "select" and not parameter.options:
            raise TemplateError(f"parameter {parameter.name!r}: type select needs options")
    return Template(parts, parameters)


# ---------------------------------------------------------------------------- values


def check_value(parameter: Parameter, value: str) -> str | None:
    """Why ``value`` does not fit ``parameter``'s type, options and patterns (None when it does)."""
    if len(value) > MAX_VALUE_CHARS:
        return f"at most {MAX_VALUE_CHARS} characters"
    if "\0" in value:
        return "must not contain a NUL character"
    kind = parameter.type
    if kind not in ("textarea",) and ("\n" in value or "\r" in value):
        return "must be one line"
    if value == "":
        return None
    if kind == "number" and not _NUMBER.match(value):
        return "expected a number"
    if kind == "email" and email_problem(value):
        return "expected an e-mail address"
    if kind == "url":
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return "expected an http or https URL"
    if kind == "date":
        try:
            if not _DATE.match(value):
                raise ValueError
            date.fromisoformat(value)
        except ValueError:
            return "expected a date (YYYY-MM-DD)"
    if kind == "time" and not _TIME.match(value):
        return "expected a time (HH:MM)"
    if kind == "tel" and not _TEL.match(value):
        return "expected a telephone number"
    if parameter.options and value not in parameter.options:
        return f"expected one of {', '.join(parameter.options)}"
    for pattern in parameter.patterns:
        if _pattern(pattern).search(value.encode()) is None:
            return f"does not match the pattern {pattern}"
    return None


def _quoted(value: str, quote: str, language: str) -> str:
    """``value`` inside ``quote`` characters, so that it cannot end the quoted text early, in ``language``."""
    if language == SQL:
        if quote == "'" and "\\" in value:  # E'...' reads the same whatever standard_conforming_strings says
            return "E'" + value.replace("\\", "\\\\").replace("'", "''") + "'"
        return quote + value.replace(quote, quote * 2) + quote
    if language == SHELL:
        if quote == "'":
            return "'" + value.replace("'", "'\\''") + "'"
        if quote == '"':
            return '"' + re.sub(r'([\\"$`])', r"\\\1", value) + '"'
    if quote in value or "\\" in value:
        raise ParameterError({"": f"a value with {quote} or a backslash cannot be quoted safely here"})
    return quote + value + quote


def _apply(call: Call, value: str, parameter: Parameter, language: str) -> str:
    name = call.name
    if name == "default":
        return value if value != "" else call.args[0]
    if name == "required":
        if value == "":
            raise ParameterError({parameter.name: call.args[0] or "required"})
        return value
    if name == "squote":
        return _quoted(value, "'", language)
    if name == "dquote":
        return _quoted(value, '"', language)
    if name == "quotechar":
        return _quoted(value, call.args[0], language)
    if name == "encodeb64":
        return base64.b64encode(value.encode()).decode()
    if name == "decodeb64":
        try:
            return base64.b64decode(value.encode(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            raise ParameterError({parameter.name: "expected base64 of UTF-8 text"}) from None
    return value  # description, type, options, placeholder, order, pattern: checked before


def render(template: Template, values: dict[str, Any], language: str = "") -> Rendered:
    """The script ``template`` makes with ``values`` (strings); ParameterError names every value that does not fit.

    Parameters the template does not declare are refused; a declared one that is missing counts as empty.
    """
    problems: dict[str, str] = {}
    for name, value in values.items():
        if name not in template.parameters:
            problems[name] = "the runbook has no such parameter"
        elif not isinstance(value, str):
            problems[name] = "expected a string"
    if problems:
        raise ParameterError(problems)
    filled: dict[str, str] = {}
    for name, parameter in template.parameters.items():
        value = values.get(name, "")
        if value == "" and parameter.default is not None:
            value = parameter.default
        if value == "" and parameter.required:
            problems[name] = parameter.required_message or "required"
            continue
        problem = check_value(parameter, value)
        if problem:
            problems[name] = problem
        filled[name] = value
    if problems:
        raise ParameterError(problems)
    out: list[str] = []
    secrets = {v for n, v in filled.items() if template.parameters[n].secret and v}
    for part in template.parts:
        if isinstance(part, str):
            out.append(part)
            continue
        parameter = template.parameters[part.parameter]
        value = filled[part.parameter]
        try:
            for call in part.calls:
                value = _apply(call, value, parameter, language)
                if parameter.secret and value:
                    secrets.add(value)  # an encoded secret is one too
        except ParameterError as exc:
            raise ParameterError({parameter.name if k == "" else k: v for k, v in exc.problems.items()}) from None
        out.append(value)
    return Rendered("".join(out), {n: v for n, v in filled.items() if n in values or v != ""},
                    tuple(sorted(secrets, key=len, reverse=True)))
