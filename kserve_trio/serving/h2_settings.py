"""HTTP/2 tuning of our grpclib servers (worker and gateway) (measured in docs/benchmarks.md).

- Flow-control windows: grpclib's default 4 MiB windows stall large tensors; 64 MiB lets a
  request of tens of MB arrive without waiting for WINDOW_UPDATE round trips.
- SETTINGS_MAX_FRAME_SIZE: h2 advertises 16 KiB frames and grpclib has no knob for it, so a
  38 MB tensor arrives as ~2400 frames, each paying h2's pure-Python framing. We advertise
  1 MiB frames (the client may then send larger DATA frames) through grpclib's protocol hook.
- h2 logs every received frame with ``repr(frame)``, and hyperframe's DATA repr hexlifies the
  whole payload before truncating it to 20 characters (16-34% of server CPU on large tensors,
  notes/stack_probe.md). ``patch_frame_repr`` makes that repr hexlify only what it shows.

Both patches touch private internals of h2/hyperframe/grpclib; they are applied once, are
idempotent, and each is tested (tests/serving/test_h2_settings.py) so an upgrade that breaks
them is caught.
"""

from __future__ import annotations

import binascii
import os

import grpclib.config

WINDOW_BYTES = 64 << 20
MAX_FRAME_BYTES = 1 << 20

_patched: set[str] = set()


def _short_hex(data) -> str:
    if not data:
        return "None"
    head = binascii.hexlify(bytes(data[:10])).decode("ascii")
    return f"<hex:{head}{'...' if len(data) > 10 else ''}>"


def patch_frame_repr() -> bool:
    """Make hyperframe's DATA-frame repr O(1) instead of O(payload). Returns True if applied."""
    if "frame_repr" in _patched:
        return True
    try:
        import hyperframe.frame as hf
    except ImportError:  # pragma: no cover - grpclib depends on it
        return False
    if not hasattr(hf, "_raw_data_repr"):
        return False
    hf._raw_data_repr = _short_hex
    _patched.add("frame_repr")
    return True


def patch_max_frame_size(size: int = MAX_FRAME_BYTES) -> bool:
    """Advertise a larger SETTINGS_MAX_FRAME_SIZE on every new server connection."""
    if "frame_size" in _patched:
        return True
    try:
        import grpclib.protocol as gp
        from h2.settings import SettingCodes
    except ImportError:  # pragma: no cover
        return False
    original = gp.H2Protocol.connection_made

    def connection_made(self, transport):
        original(self, transport)
        try:
            h2_conn = self.connection._connection
            h2_conn.update_settings({SettingCodes.MAX_FRAME_SIZE: size})
            # Accept large frames at once, not only after the peer's SETTINGS ACK: gRPC
            # C-core may send a large DATA frame ahead of that ACK (measured: 5 of 20 fresh
            # connections were reset with FRAME_SIZE_ERROR before this line). Accepting more
            # than advertised is always safe for the receiver.
            h2_conn.max_inbound_frame_size = size
            self.connection.flush()
        except Exception:  # never break a connection over a tuning knob
            pass

    gp.H2Protocol.connection_made = connection_made
    _patched.add("frame_size")
    return True


def tuning_enabled() -> bool:
    """``KSERVE_TRIO_H2_TUNING=0`` turns every knob here off (to measure their effect)."""
    value = os.environ.get("KSERVE_TRIO_H2_TUNING", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def server_config(window_bytes: int = WINDOW_BYTES) -> grpclib.config.Configuration:
    """The grpclib configuration the worker serves with (patches applied on first use)."""
    if not tuning_enabled():
        return grpclib.config.Configuration()
    patch_frame_repr()
    patch_max_frame_size()
    return grpclib.config.Configuration(
        http2_connection_window_size=window_bytes, http2_stream_window_size=window_bytes
    )


__all__ = [
    "MAX_FRAME_BYTES",
    "WINDOW_BYTES",
    "patch_frame_repr",
    "patch_max_frame_size",
    "server_config",
]
