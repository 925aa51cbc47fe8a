"""h2 as our gRPC server drives it: the configuration of its ``H2Connection`` and the two
places we change its behaviour (the stream limit it would enforce by ending the connection, and
a note of when we queue DATA or HEADERS). ``Connection`` is their one user."""

from __future__ import annotations

from typing import Any

import h2.config
import h2.connection
import h2.settings

H2_CONFIG = h2.config.H2Configuration(
    client_side=False,
    header_encoding=None,
    validate_outbound_headers=False,
    normalize_outbound_headers=False,
    validate_inbound_headers=True,
    normalize_inbound_headers=True,
)

UNBOUNDED_STREAMS = 2**32 + 1
"""h2's own value for "no SETTINGS_MAX_CONCURRENT_STREAMS"."""


class AdvertisedSettings(h2.settings.Settings):
    """Our SETTINGS as sent to the client, with h2's own check of the stream limit turned off.

    h2 answers a HEADERS frame that would open one stream more than its local
    MAX_CONCURRENT_STREAMS with TooManyStreamsError, a connection error: every call on the
    connection is lost, where RFC 9113 5.1.2 lets the server refuse just that stream. (Before
    the client has acknowledged our SETTINGS, h2's local value is its own default of 100, so
    a client's first flight of more than 100 streams would end the connection even under a
    larger advertised limit.) The value stays in the mapping, so the SETTINGS frame carries it;
    only the property h2 reads for its check (``_receive_headers_frame`` is its one reader)
    says unbounded. ``Connection._open`` enforces the advertised limit itself and refuses the
    streams beyond it with RST_STREAM(REFUSED_STREAM). h2 still decodes the refused stream's
    header block, so the HPACK state stays in step with the client's.
    """

    @property
    def max_concurrent_streams(self) -> int:
        return UNBOUNDED_STREAMS

    @max_concurrent_streams.setter
    def max_concurrent_streams(self, value: int) -> None:
        self[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = value


class ServerH2(h2.connection.H2Connection):
    """h2's connection, noting when one of our DATA or HEADERS frames is queued
    (``payload_sent``, the ping rule's "data flows", cleared by the frame guard)."""

    payload_sent = False

    def send_headers(
        self,
        stream_id: int,
        headers: Any,
        end_stream: bool = False,
        priority_weight: int | None = None,
        priority_depends_on: int | None = None,
        priority_exclusive: bool | None = None,
    ) -> None:
        self.payload_sent = True
        super().send_headers(
            stream_id, headers, end_stream, priority_weight, priority_depends_on, priority_exclusive
        )

    def send_data(
        self,
        stream_id: int,
        data: bytes | memoryview,
        end_stream: bool = False,
        pad_length: Any = None,
    ) -> None:
        self.payload_sent = True
        super().send_data(stream_id, data, end_stream, pad_length)


__all__ = ["H2_CONFIG", "UNBOUNDED_STREAMS", "AdvertisedSettings", "ServerH2"]
