"""Validation of client-supplied shared-memory region names and POSIX object keys.

Every string a client sends to the shared-memory RPCs (``SystemSharedMemoryRegister``,
``Unregister``, ``Status``, ``IsSameIPCNamespace``) passes through here before it reaches
``posix_ipc`` or the OS: ``posix_ipc`` crashes the process on an embedded NUL byte, and a name
with a further ``/``, ``.`` or ``..`` would address something other than an object in the
shared-memory directory. The rules:

- a **key** is an optional single leading ``/`` followed by one non-empty path component of at
  most ``NAME_MAX`` (255) UTF-8 bytes, with no ``/``, not ``.`` or ``..``, and no control
  character (Unicode category Cc: U+0000-U+001F and U+007F-U+009F);
- a **region name** is the client's own label: at most 255 UTF-8 bytes and no control
  character; it may be empty only where the RPC gives ``""`` a meaning (all regions);
- both must be strings at all: a malformed protobuf body can decode to ``None`` or an integer.

The checks are pure (strings in, a problem description or ``None`` out); ``check_key`` and
``check_region_name`` raise ``InvalidArgument`` naming the field, and ``shown`` renders a hostile
value safely (escaped, truncated) for error messages and logs.
"""

from __future__ import annotations

import unicodedata

from kserve_trio.core.errors import InvalidArgument

NAME_MAX = 255
"""Longest key component in bytes (Linux ``NAME_MAX``: a file name in ``/dev/shm``)."""

REGION_NAME_MAX = 255
"""Longest region name in UTF-8 bytes (a label, bounded so that it fits logs and messages)."""

SHOWN_MAX = 64
"""Characters of a rejected value quoted back in an error message."""


def shown(value: object) -> str:
    """``value`` quoted for a message: non-printable characters escaped, at most ``SHOWN_MAX``
    characters, so a hostile string never puts control bytes or megabytes into a gRPC
    status message or a log line. A non-string (a malformed message can decode to one) is
    shown as its ``repr``."""
    if not isinstance(value, str):
        value = repr(value)
    out: list[str] = []
    for ch in value[:SHOWN_MAX]:
        if ch == "'" or ch == "\\":
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
    more = f"... ({len(value)} characters)" if len(value) > SHOWN_MAX else ""
    return "'" + "".join(out) + "'" + more


def _utf8_len(value: str) -> int | None:
    """UTF-8 length of ``value``, or ``None`` when it holds a lone surrogate."""
    try:
        return len(value.encode("utf-8"))
    except UnicodeEncodeError:
        return None


def _control_problem(value: str) -> str | None:
    for i, ch in enumerate(value):
        if unicodedata.category(ch) == "Cc":
            return f"contains the control character U+{ord(ch):04X} at index {i}"
    return None


NOT_A_STRING = "is not a string (malformed request)"


def region_name_problem(name: str, *, allow_empty: bool = False) -> str | None:
    """Why ``name`` is not an acceptable region name (``None`` when it is)."""
    if not isinstance(name, str):
        return NOT_A_STRING
    if not name:
        return None if allow_empty else "must not be empty"
    size = _utf8_len(name)
    if size is None:
        return "is not valid UTF-8 (lone surrogate)"
    if size > REGION_NAME_MAX:
        return f"is {size} bytes long (at most {REGION_NAME_MAX})"
    return _control_problem(name)


def key_problem(key: str) -> str | None:
    """Why ``key`` does not name a POSIX shared-memory object (``None`` when it does)."""
    if not isinstance(key, str):
        return NOT_A_STRING
    if not key:
        return "must not be empty"
    bare = key[1:] if key.startswith("/") else key
    if not bare:
        return "names no object (only '/')"
    problem = _control_problem(key)
    if problem is not None:
        return problem
    if "/" in bare:
        return "may contain '/' only as its first character"
    if bare in (".", ".."):
        return f"must not be '{bare}'"
    size = _utf8_len(bare)
    if size is None:
        return "is not valid UTF-8 (lone surrogate)"
    if size > NAME_MAX:
        return f"is {size} bytes long without its leading '/' (at most {NAME_MAX})"
    return None


def check_region_name(name: str, *, rpc: str, allow_empty: bool = False) -> None:
    """Raise ``InvalidArgument`` naming ``rpc`` and the ``name`` field unless ``name`` is valid."""
    problem = region_name_problem(name, allow_empty=allow_empty)
    if problem is not None:
        raise InvalidArgument(f"{rpc}: shared memory region name {shown(name)} {problem}")


def check_key(key: str, *, rpc: str, field: str = "key") -> str:
    """The ``posix_ipc`` name (leading ``/``) for a valid ``key``; ``InvalidArgument`` naming
    ``rpc`` and ``field`` otherwise."""
    problem = key_problem(key)
    if problem is not None:
        raise InvalidArgument(f"{rpc}: shared memory {field} {shown(key)} {problem}")
    return key if key.startswith("/") else "/" + key


__all__ = [
    "NAME_MAX",
    "REGION_NAME_MAX",
    "check_key",
    "check_region_name",
    "key_problem",
    "region_name_problem",
    "shown",
]
