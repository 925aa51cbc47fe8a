"""Region-name and key validation (core/memory/shm_names.py): the rules, the messages, and hypothesis
properties over arbitrary strings (bounded examples); the reserved names of the server's own
objects and the client shared-memory policy."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kserve_trio.core.errors import InvalidArgument, StatusCode, Unavailable
from kserve_trio.core.memory.shm_names import (
    NAME_MAX,
    REGION_NAME_MAX,
    RESERVED_PREFIX,
    RESERVED_RULE,
    ClientShmPolicy,
    check_key,
    check_region_name,
    is_reserved,
    key_problem,
    prefix_problem,
    region_name_problem,
    reserved_name,
    shown,
)
from kserve_trio.runtime.weight_store import lock_path, region_name

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


# --------------------------------------------------------------------------------------------
# the server's own objects and the client policy


def test_every_object_the_server_names_for_itself_is_reserved():
    """The weight regions, their lock files and the front ends' arenas take their names from
    ``reserved_name``, so the one rule covers each of them."""
    region = region_name("mlp", 0xAB)
    assert region == "/kst-w-mlp-00000000000000ab"
    for name in (region, region.lstrip("/"), lock_path(region).name, reserved_name("frontend0")):
        assert is_reserved(name), name
        assert key_problem(name) is None  # a valid key all the same: refused by the rule
    assert reserved_name("x") == RESERVED_PREFIX + "x" == "kst-x"
    for client_key in (
        "/shm-kserve_trio_client-1-ab",
        "/triton_input",
        "kst",
        "/xkst-w-a",
        "KST-w",
    ):
        assert not is_reserved(client_key), client_key


@pytest.mark.parametrize("key", ["/kst-w-mlp-00000000000000ab", "kst-w-mlp-0.lock", "/kst-"])
def test_a_reserved_key_is_refused_by_every_policy_naming_the_rule(key):
    for policy in (ClientShmPolicy(), ClientShmPolicy(prefixes=("k", "/kst"))):
        assert policy.key_refusal(key) == f"is reserved: {RESERVED_RULE}"
        assert not policy.may_register(key)
        with pytest.raises(InvalidArgument) as err:
            policy.check_key(key, rpc="SystemSharedMemoryRegister")
        assert err.value.status == StatusCode.INVALID_ARGUMENT
        assert err.value.message == (
            f"SystemSharedMemoryRegister: shared memory key {shown(key)} is reserved: "
            "keys starting with 'kst-' name the server's own shared memory (its node's shared "
            "host weights and their lock files) and are never registered"
        )


def test_the_allow_list_admits_only_its_prefixes_with_or_without_slash():
    policy = ClientShmPolicy(prefixes=("/triton_", "app-"))
    for key in ("/triton_in", "triton_in", "/app-1", "app-"):
        assert policy.key_refusal(key) is None and policy.may_register(key), key
    refusal = policy.key_refusal("/other")
    assert refusal == (
        "starts with none of the allowed prefixes 'triton_', 'app-' "
        "(endpoints.client_shared_memory_prefixes)"
    )
    with pytest.raises(InvalidArgument, match=r"endpoints\.client_shared_memory_prefixes"):
        policy.check_key("/other", rpc="R")
    assert not policy.may_register("/other")
    gateway = ClientShmPolicy(prefixes=("a",), setting="client_shared_memory")
    assert gateway.key_refusal("/b").endswith("(client_shared_memory_prefixes)")
    assert ClientShmPolicy().key_refusal("/anything") is None  # no list: any other key


def test_off_is_unavailable_naming_the_setting_and_registers_nothing():
    ClientShmPolicy().check_enabled("R")  # on by default
    off = ClientShmPolicy(enabled=False)
    with pytest.raises(Unavailable) as err:
        off.check_enabled("SystemSharedMemoryStatus")
    assert err.value.status == StatusCode.UNAVAILABLE
    assert err.value.message == (
        "SystemSharedMemoryStatus: client shared memory is off on this server "
        "(endpoints.client_shared_memory: false); send tensors inline"
    )
    assert not off.may_register("/ok")
    assert not ClientShmPolicy().may_register("/a/b")  # not a key at all


@pytest.mark.parametrize(
    ("prefix", "problem"),
    [
        ("triton_", None),
        ("/triton_", None),
        ("k", None),  # admits client keys starting with k; the reserved ones stay refused
        ("", "is empty (leave the list empty to allow every key)"),
        ("/", "is empty (leave the list empty to allow every key)"),
        ("a/b", "may contain '/' only as its first character"),
        ("a\x00", "contains the control character U+0000 at index 1"),
        ("x" * (NAME_MAX + 1), "is longer than a key (255 bytes)"),
        ("kst-w-", f"starts with 'kst-': {RESERVED_RULE}"),
        (7, "is not a string (malformed request)"),
    ],
)
def test_allow_list_entries(prefix, problem):
    assert prefix_problem(prefix) == problem


@BOUNDED
@given(
    st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=40),
    st.lists(st.text(min_size=1, max_size=5), max_size=3),
)
def test_no_policy_lets_a_reserved_name_through(suffix, prefixes):
    key = "/" + RESERVED_PREFIX + suffix.replace("/", "")
    assert not ClientShmPolicy(prefixes=tuple(prefixes)).may_register(key)
    assert not ClientShmPolicy(prefixes=tuple(prefixes)).may_register(key.lstrip("/"))
