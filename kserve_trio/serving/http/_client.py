"""Reading an HTTP/1.1 response with the same parser library the server uses (httptools).

``parse_response`` reads one whole response that was received to the end of its connection:
the status and the body, de-chunked under ``Transfer-Encoding: chunked``, cut to
``Content-Length``, or everything after the head when neither frames it. Anything after the
first complete response is ignored. A response that ends inside its head, or bytes that are not
an HTTP response, are a ``ValueError`` saying so.
"""

from __future__ import annotations

import httptools


class _Collector:
    """httptools' callbacks for one response."""

    def __init__(self) -> None:
        self.body: list[bytes] = []
        self.head_done = False
        self.complete = False

    def on_headers_complete(self) -> None:
        self.head_done = True

    def on_body(self, data: bytes) -> None:
        if not self.complete:
            self.body.append(data)

    def on_message_complete(self) -> None:
        self.complete = True


def parse_response(raw: bytes) -> tuple[int, bytes]:
    """``(status, body)`` of the response in ``raw`` (see the module docstring)."""
    collected = _Collector()
    parser = httptools.HttpResponseParser(collected)
    try:
        parser.feed_data(raw)
    except httptools.HttpParserError as exc:
        if not collected.complete:
            raise ValueError(f"not an HTTP response: {raw[:80]!r} ({exc})") from None
    if not collected.head_done:
        raise ValueError("the response ended inside its headers")
    return parser.get_status_code(), b"".join(collected.body)


__all__ = ["parse_response"]
