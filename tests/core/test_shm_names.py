"""Region-name and key validation (core/shm_names.py): the rules, the messages, and hypothesis
properties over arbitrary strings (bounded examples)."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kserve_trio.core.errors import InvalidArgument, StatusCode
from kserve_trio.core.shm_names import (
    NAME_MAX,
    REGION_NAME_MAX,
    check_key,
    check_region_name,
    key_problem,
    region_name_problem,
    shown,
)

BOUNDED = settings(max_examples=300, deadline=None)


@pytest.mark.parametrize(
    "key", ["/k", "k", "/" + "a" * NAME_MAX, "a" * NAME_MAX, "/triton_input-0.1", "/é" * 1]
)
def test_valid_keys(key):
    assert key_problem(key) is None
    assert check_key(key, rpc="R") == (key if key.startswith("/") else "/" + key)


@pytest.mark.parametrize(
    ("key", "problem"),
    [
        ("", "must not be empty"),
        ("/", "names no object (only '/')"),
        ("/ab\x00cd", "contains the control character U+0000 at index 3"),
        ("\x00", "contains the control character U+0000 at index 0"),
        ("/k\n", "contains the control character U+000A at index 2"),
        ("/k\x7f", "contains the control character U+007F at index 2"),
        ("/k\x85", "contains the control character U+0085 at index 2"),
        ("/\x1b[31mred", "contains the control character U+001B at index 1"),
        ("//k", "may contain '/' only as its first character"),
        ("/a/b", "may contain '/' only as its first character"),
        ("a/", "may contain '/' only as its first character"),
        ("/.", "must not be '.'"),
        ("..", "must not be '..'"),
        ("/" + "a" * (NAME_MAX + 1), "is 256 bytes long without its leading '/' (at most 255)"),
        ("/" + "é" * 128, "is 256 bytes long without its leading '/' (at most 255)"),
        ("/\ud800", "is not valid UTF-8 (lone surrogate)"),
    ],
)
def test_invalid_keys(key, problem):
    assert key_problem(key) == problem
    with pytest.raises(InvalidArgument) as err:
        check_key(key, rpc="SystemSharedMemoryRegister")
    assert err.value.status == StatusCode.INVALID_ARGUMENT
    assert err.value.message == (
        f"SystemSharedMemoryRegister: shared memory key {shown(key)} {problem}"
    )


def test_key_field_is_named():
    with pytest.raises(InvalidArgument) as err:
        check_key("/a\x00", rpc="IsSameIPCNamespace", field="name")
    assert err.value.message.startswith("IsSameIPCNamespace: shared memory name '/a\\x00' ")


@pytest.mark.parametrize(
    ("name", "allow_empty", "problem"),
    [
        ("r", False, None),
        ("region with spaces/and slashes", False, None),
        ("x" * REGION_NAME_MAX, False, None),
        ("", True, None),
        ("", False, "must not be empty"),
        ("r\x00", True, "contains the control character U+0000 at index 1"),
        ("\tr", False, "contains the control character U+0009 at index 0"),
        ("x" * (REGION_NAME_MAX + 1), False, "is 256 bytes long (at most 255)"),
        ("\udfff", False, "is not valid UTF-8 (lone surrogate)"),
    ],
)
def test_region_names(name, allow_empty, problem):
    assert region_name_problem(name, allow_empty=allow_empty) == problem
    if problem is None:
        check_region_name(name, rpc="R", allow_empty=allow_empty)
        return
    with pytest.raises(InvalidArgument) as err:
        check_region_name(name, rpc="SystemSharedMemoryStatus", allow_empty=allow_empty)
    assert err.value.message == (
        f"SystemSharedMemoryStatus: shared memory region name {shown(name)} {problem}"
    )


@pytest.mark.parametrize("value", [None, 7, b"/k", ["/k"]])
def test_non_strings_are_refused(value):
    """A malformed protobuf body can decode a string field to None or an integer."""
    assert key_problem(value) == "is not a string (malformed request)"
    assert region_name_problem(value, allow_empty=True) == "is not a string (malformed request)"
    with pytest.raises(InvalidArgument) as err:
        check_key(value, rpc="R")
    assert err.value.message == f"R: shared memory key {shown(repr(value))} is not a string " + (
        "(malformed request)"
    )


def test_shown_escapes_and_truncates():
    assert shown("/ok") == "'/ok'"
    assert shown("a\x00b\n'\\") == "'a\\x00b\\x0a\\'\\\\'"
    assert shown("\x85\u2028") == "'\\x85\\u2028'"
    long = "y" * 1000
    assert shown(long) == "'" + "y" * 64 + "'... (1000 characters)"


@BOUNDED
@given(st.text(max_size=300) | st.text(st.characters(max_codepoint=0xA0), max_size=12))
def test_key_rules_hold_for_any_string(key):
    """Whatever the string, the verdict is consistent with the rules and the message is
    printable and short."""
    problem = key_problem(key)
    bare = key[1:] if key.startswith("/") else key
    ok = (
        bool(bare)
        and "/" not in bare
        and bare not in (".", "..")
        and len(bare.encode("utf-8")) <= NAME_MAX
        and not any(unicodedata.category(c) == "Cc" for c in key)
    )
    assert (problem is None) == ok, (key, problem)
    if problem is not None:
        with pytest.raises(InvalidArgument) as err:
            check_key(key, rpc="R")
        msg = err.value.message
        assert msg.isprintable() and len(msg) < 300, msg


@BOUNDED
@given(st.text(max_size=300), st.booleans())
def test_region_name_rules_hold_for_any_string(name, allow_empty):
    problem = region_name_problem(name, allow_empty=allow_empty)
    ok = (
        (allow_empty or bool(name))
        and len(name.encode("utf-8")) <= REGION_NAME_MAX
        and not any(unicodedata.category(c) == "Cc" for c in name)
    )
    assert (problem is None) == ok, (name, problem)
    if problem is not None:
        with pytest.raises(InvalidArgument) as err:
            check_region_name(name, rpc="R", allow_empty=allow_empty)
        assert err.value.message.isprintable()
