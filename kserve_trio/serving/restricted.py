"""Restricted protocols on a server's gRPC methods (the rules: ``core.process.restricted``).

``restrict(methods, restrictions)`` wraps each method of a restricted group so that a call
without the group's header ends PERMISSION_DENIED before its message is read; methods of open
groups are left as they are (no cost). The REST apps check ``Restrictions.check`` with the
routed RPC's group and the request's headers, so both transports share the rule and message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from kserve_trio.core.process import Restrictions, group_of
from kserve_trio.serving.grpc import Call, Method


def restrict(methods: Mapping[str, Method], restrictions: Restrictions) -> dict[str, Method]:
    """``methods`` with every method of a restricted group guarded by its header."""
    out = dict(methods)
    if not restrictions:
        return out
    for path, method in methods.items():
        group = group_of(path)
        if restrictions.of(group) is None:
            continue
        run = method.run

        async def guarded(call: Call, _run=run, _group=group) -> None:
            restrictions.check(_group, call.metadata)
            await _run(call)

        out[path] = replace(method, run=guarded)
    return out


__all__ = ["restrict"]
