"""Every code name ``docs/architecture.md`` puts in backticks resolves in the tree, so the page
cannot drift from the code unnoticed.

What counts as a code name (everything else in backticks, such as configuration keys, metric
and log event names, flags and literals, is left alone):

- a path: ends in ``.py`` or ``/``, or has a ``/`` in it: a file or folder under ``kserve_trio/``
  or the repository (a bare ``name.py`` anywhere under ``kserve_trio/``);
- a dotted module path: ``kserve_trio.x.y`` or one that starts with a subpackage (``core.``,
  ``serving.`` ...): imported, the last part possibly an attribute;
- a class, or a class and its member: ``CamelCase`` or ``CamelCase.member`` (a trailing ``()``
  allowed): defined (``class``, ``def`` or an assignment) somewhere under ``kserve_trio/``, an
  RPC of ``protos/``, or a name of the libraries the page names (``EXTERNAL``);
- a call: ``snake_name()``: a ``def`` of that name under ``kserve_trio/``;
- any other snake_case name with an underscore in it (``thread_poster``, ``max_outstanding``,
  ``worker_frontend_requests_total``): a word of the code under ``kserve_trio/`` or of
  ``protos/`` (a function, an attribute, a configuration key, a metric's name).
"""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kserve_trio"
DOC = ROOT / "docs" / "architecture.md"
SUBPACKAGES = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
SOURCES = {p: p.read_text() for p in PACKAGE.rglob("*.py")}
ALL_SOURCE = "\n".join(SOURCES.values())

PROTOS = "\n".join(p.read_text() for p in (ROOT / "protos").rglob("*.proto"))
EXTERNAL = ("trio", "trio.lowlevel", "trio.testing", "anyio", "anyio.abc", "anyio.streams.tls")
"""Libraries whose names the page uses as ours (``MockClock``, ``TLSStream``, ...)."""

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_CLASSY = re.compile(rf"^([A-Z]{_IDENT}?)(?:\.({_IDENT}))?(?:\(\))?$")
_CALL = re.compile(r"^([a-z_][a-z0-9_]*)\(\)$")
_DOTTED = re.compile(rf"^{_IDENT}(?:\.{_IDENT})+$")
_SNAKE = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)+$")


def _defined(name: str) -> bool:
    return bool(
        re.search(
            rf"^\s*(?:async\s+)?(?:class|def)\s+{re.escape(name)}\b|^\s*{re.escape(name)}\s*[:=]",
            ALL_SOURCE,
            re.MULTILINE,
        )
    )


def _path_resolves(token: str) -> bool:
    token = token.rstrip("/")
    if "/" not in token:  # a bare file name: anywhere in the package
        return any(p.name == token for p in PACKAGE.rglob(token))
    return (PACKAGE / token).exists() or (ROOT / token).exists()


def _module_path_resolves(token: str) -> bool:
    parts = token.split(".")
    if parts[0] != "kserve_trio":
        parts = ["kserve_trio", *parts]
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _external(cls: str, member: str | None) -> bool:
    for module in EXTERNAL:
        obj = getattr(importlib.import_module(module), cls, None)
        if obj is not None and (member is None or hasattr(obj, member)):
            return True
    return False


def kind_of(token: str) -> str | None:
    """Which rule of the module docstring ``token`` falls under (None: not a code name)."""
    if " " in token or token.startswith(("-", "/")) or "*" in token:
        return None
    if token.endswith((".py", "/")) or ("/" in token and re.fullmatch(r"[\w./]+", token)):
        return "path"
    if _DOTTED.match(token) and (
        token.startswith("kserve_trio.") or token.split(".")[0] in SUBPACKAGES
    ):
        return "module"
    if _CLASSY.match(token) and not token.isupper():
        return "class"
    if _CALL.match(token):
        return "call"
    if _SNAKE.match(token):
        return "word"
    return None


def resolves(token: str) -> bool:
    kind = kind_of(token)
    if kind == "path":
        return _path_resolves(token)
    if kind == "module":
        return _module_path_resolves(token)
    if kind == "class":
        match = _CLASSY.match(token)
        assert match is not None
        cls, member = match.groups()
        if _external(cls, member):
            return True
        if member is None and re.search(rf"\brpc\s+{cls}\s*\(", PROTOS):
            return True
        return _defined(cls) and (member is None or _defined(member))
    if kind == "call":
        match = _CALL.match(token)
        assert match is not None
        return _defined(match.group(1))
    if kind == "word":
        return re.search(rf"\b{re.escape(token)}\b", ALL_SOURCE + PROTOS) is not None
    return True


def code_names(text: str) -> list[str]:
    return sorted({t for t in re.findall(r"`([^`\n]+)`", text) if kind_of(t) is not None})


def unresolved(text: str) -> list[str]:
    """The code names of ``text`` that do not resolve in the tree."""
    return [name for name in code_names(text) if not resolves(name)]


def test_every_code_name_of_the_architecture_page_resolves():
    text = DOC.read_text()
    assert len(code_names(text)) > 50  # the rules above still find the page's names
    assert unresolved(text) == []


def test_the_page_check_fails_on_a_name_the_code_lost():
    """The page as it is, with one sentence naming a module, a class, a method and a function
    that do not exist: the check reports exactly those."""
    invented = [
        "`serving/grpc/_typed_stream.py`",
        "`TypedStream.open`",
        "`no_such_helper()`",
        "`no_such_setting_name`",
    ]
    text = DOC.read_text() + "\nThe stream engine is " + ", ".join(invented) + ".\n"
    assert unresolved(text) == sorted(name.strip("`") for name in invented)


@pytest.mark.parametrize(
    "invented",
    [
        "serving/no_such_module.py",
        "core.no_such_module",
        "kserve_trio.serving.admission.NoSuchThing",
        "NoSuchClass",
        "ServerConnection.no_such_method",
        "no_such_function()",
        "no_such_metric_total",
    ],
)
def test_a_name_that_does_not_resolve_is_caught(invented):
    assert kind_of(invented) is not None
    assert not resolves(invented)
    assert invented in code_names(f"prose with `{invented}` in it")
