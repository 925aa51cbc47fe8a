"""Triton's LogSettings RPC in our terms: the request's settings as plain values, the reply
listing every setting in force, and the RPC itself (``answer``), which the worker and the
gateway both serve for their own process.

The RPC itself is one call for both directions: tritonclient's ``get_log_settings`` sends no
settings and reads the reply; ``update_log_settings`` sends the ones to change. The values are
applied by ``core.logging.update_log_settings`` (Triton's vocabulary, all or nothing;
``log_file`` other than ``""`` is INVALID_ARGUMENT: the worker logs to its stderr).
"""

from __future__ import annotations

from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.logging import (
    LogSettings,
    current_log_settings,
    get_logger,
    update_log_settings,
)
from kserve_trio.proto import inference as pb


def requested_changes(request: pb.LogSettingsRequest) -> dict[str, bool | int | str]:
    """The settings a request changes, as plain values (``bool_param`` -> bool,
    ``uint32_param`` -> int, ``string_param`` -> str); a value with none of the three set is
    ``InvalidArgument`` naming the setting. Which keys and values are valid is
    ``update_log_settings``'s to say."""
    changes: dict[str, bool | int | str] = {}
    for key, value in request.settings.items():
        if value.bool_param is not None:
            changes[key] = bool(value.bool_param)
        elif value.uint32_param is not None:
            changes[key] = int(value.uint32_param)
        elif value.string_param is not None:
            changes[key] = str(value.string_param)
        else:
            raise InvalidArgument(f"log setting '{key}' has no value")
    return changes


def settings_reply(settings: LogSettings) -> pb.LogSettingsResponse:
    """Every setting in force, each with Triton's parameter kind."""
    value = pb.LogSettingsResponseSettingValue
    return pb.LogSettingsResponse(
        settings={
            "log_file": value(string_param=settings.log_file),
            "log_info": value(bool_param=settings.log_info),
            "log_warning": value(bool_param=settings.log_warning),
            "log_error": value(bool_param=settings.log_error),
            "log_verbose_level": value(uint32_param=settings.log_verbose_level),
            "log_format": value(string_param=settings.log_format),
        }
    )


def answer(request: pb.LogSettingsRequest) -> pb.LogSettingsResponse:
    """The RPC: change the settings the request names (all or nothing, logged) and answer with
    every setting in force; a request without settings only reads them."""
    changes = requested_changes(request)
    if not changes:
        return settings_reply(current_log_settings())
    settings = update_log_settings(changes)
    get_logger("kserve_trio.logging").info(
        "log_settings_updated", **{k: str(v) for k, v in changes.items()}
    )
    return settings_reply(settings)


__all__ = ["answer", "requested_changes", "settings_reply"]
