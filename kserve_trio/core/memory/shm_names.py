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

These checks are pure (strings in, a problem description or ``None`` out); ``check_key`` and
``check_region_name`` raise ``InvalidArgument`` naming the field, and ``shown`` renders a hostile
value safely (escaped, truncated) for error messages and logs.

A valid key may still be one the server must not register. A server that registers any object
a client names is a confused deputy: asked for an output into "its" region, it writes into
memory the server itself owns (a node's shared host weights, which every worker then serves
from); asked for an input, it reads that memory back to the client. So:

- every shared-memory object a server or its node creates for itself is named by
  ``reserved_name`` and starts with ``RESERVED_PREFIX`` (this module is the one place that says
  so; the weight store, its lock files and the front ends' arenas all take their names here),
  and ``RESERVED_RULE`` refuses such a key, or another name (a hard link) of such an object
  (``reserved_alias``, the one check here that looks at the file system);
- ``ClientShmPolicy`` is what a server lets its clients do: client shared memory on or off, and
  an optional allow-list of key prefixes.
"""

from __future__ import annotations

import os
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from kserve_trio.core.errors import InvalidArgument, Unavailable

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


# ----------------------------------------------------------------------------------------------
# The server's own objects: one reserved prefix


SHM_DIR = Path("/dev/shm")
"""Where Linux keeps POSIX shared-memory objects, one file per name."""

RESERVED_PREFIX = "kst-"
"""The start of the name of every shared-memory object a server or its node creates for itself
(``reserved_name``); no client key may start with it."""

RESERVED_RULE = (
    f"keys starting with '{RESERVED_PREFIX}' name the server's own shared memory (its node's "
    "shared host weights and their lock files) and are never registered"
)
"""The rule a refused reserved key is told, word for word."""


def reserved_name(kind: str) -> str:
    """``kst-<kind>``: the name of an object the server creates for itself (without the
    leading ``/``), so that ``RESERVED_RULE`` keeps every client away from it."""
    return RESERVED_PREFIX + kind


def _bare(key: str) -> str:
    return key[1:] if key.startswith("/") else key


def is_reserved(key: str) -> bool:
    """Whether ``key`` (with or without its leading ``/``) is a reserved name."""
    return _bare(key).startswith(RESERVED_PREFIX)


def reserved_alias(opened: os.stat_result, shm_dir: Path = SHM_DIR) -> str | None:
    """The reserved object that ``opened`` (the ``fstat`` of an object opened under a client's
    key) is, under another name: a hard link in ``shm_dir`` gives a reserved object a name the
    prefix does not catch. ``None`` when it is no reserved object."""
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(RESERVED_PREFIX)]
    except OSError:
        return None
    for name in names:
        try:
            st = os.stat(shm_dir / name, follow_symlinks=False)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (opened.st_dev, opened.st_ino):
            return name
    return None


def prefix_problem(prefix: str) -> str | None:
    """Why ``prefix`` cannot be an entry of a key allow-list (``None`` when it can): it must
    be a key's start (an optional leading ``/``, no other ``/``, no control character) that
    can match a key the reserved rule lets through."""
    if not isinstance(prefix, str):
        return NOT_A_STRING
    bare = _bare(prefix)
    if not bare:
        return "is empty (leave the list empty to allow every key)"
    problem = _control_problem(prefix)
    if problem is not None:
        return problem
    if "/" in bare:
        return "may contain '/' only as its first character"
    if len(bare.encode("utf-8", "surrogatepass")) > NAME_MAX:
        return f"is longer than a key ({NAME_MAX} bytes)"
    if is_reserved(bare):
        return f"starts with '{RESERVED_PREFIX}': {RESERVED_RULE}"
    return None


@dataclass(frozen=True)
class ClientShmPolicy:
    """What a server lets clients do with system shared memory: ``enabled`` (the setting named
    ``setting``) and, when ``prefixes`` is not empty, which keys they may register (the setting
    ``<setting>_prefixes``). The setting names go into the messages, so an operator reading a
    refusal knows which key to change."""

    enabled: bool = True
    prefixes: tuple[str, ...] = ()
    setting: str = "endpoints.client_shared_memory"

    @property
    def prefixes_setting(self) -> str:
        return self.setting + "_prefixes"

    def check_enabled(self, rpc: str) -> None:
        """``Unavailable`` naming the setting when client shared memory is off."""
        if not self.enabled:
            raise Unavailable(
                f"{rpc}: client shared memory is off on this server ({self.setting}: false); "
                "send tensors inline"
            )

    def key_refusal(self, key: str) -> str | None:
        """Why a valid ``key`` may not be registered (``None`` when it may). Rules:

        1. a reserved name is refused (``RESERVED_RULE``), whatever the allow-list says;
        2. with an allow-list, a key that starts with none of its prefixes is refused (a
           prefix and the key are compared without their leading ``/``).
        """
        bare = _bare(key)
        if bare.startswith(RESERVED_PREFIX):
            return f"is reserved: {RESERVED_RULE}"
        if self.prefixes and not any(bare.startswith(_bare(p)) for p in self.prefixes):
            allowed = ", ".join(repr(_bare(p)) for p in self.prefixes)
            return f"starts with none of the allowed prefixes {allowed} ({self.prefixes_setting})"
        return None

    def check_key(self, key: str, *, rpc: str) -> None:
        """``InvalidArgument`` naming ``rpc`` and the rule unless the policy allows ``key``
        (a valid key: ``check_key`` first)."""
        refusal = self.key_refusal(key)
        if refusal is not None:
            raise InvalidArgument(f"{rpc}: shared memory key {shown(key)} {refusal}")

    def may_register(self, key: str) -> bool:
        """Whether a registration of ``key`` could succeed as far as the policy goes: what
        ``IsSameIPCNamespace`` answers for a key it refuses, so a client falls back to inline
        tensors instead of registering."""
        return self.enabled and key_problem(key) is None and self.key_refusal(key) is None


__all__ = [
    "NAME_MAX",
    "REGION_NAME_MAX",
    "RESERVED_PREFIX",
    "RESERVED_RULE",
    "SHM_DIR",
    "ClientShmPolicy",
    "check_key",
    "check_region_name",
    "is_reserved",
    "key_problem",
    "prefix_problem",
    "region_name_problem",
    "reserved_alias",
    "reserved_name",
    "shown",
]
