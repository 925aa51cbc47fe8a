"""Per-message CPU cost of the front-end channel's messages: build, encode a frame, decode it.

Three ways to carry the same fields, measured interleaved in one process:

- ``tuple``: the positional tuples the channel spoke before its messages were typed (a kind
  number first, the fields after, a slot as ``(position, nbytes)``), pickled as a list, as the
  channel did then (the reference, written here);
- ``pickled``: the typed messages (``serving.ipc``'s frozen dataclasses), pickled as a list;
- ``typed``: the typed messages through the channel's own encoding (``serving.ipc._framing``).

Each message kind is measured alone, in batches of 64 (a loaded channel: one frame per loop
turn's requests) and of 1 (an idle one). One sample builds the batch from its field values,
encodes it and decodes it; the time is thread CPU time per message, the best of ``--repeats``
samples, the variants alternating sample by sample so load drifts hit all three alike.

Usage:
    python tools/bench/ipc_messages.py [--repeats 7] [--messages 20000] [--only Request]
"""

from __future__ import annotations

import argparse
import os
import pickle
import time
from collections.abc import Callable

from kserve_trio.serving.ipc import (
    Cancel,
    Done,
    Free,
    InferCall,
    Request,
    RestCall,
    RestHead,
    Slot,
    StreamCall,
    StreamOrigin,
    UnaryCall,
)
from kserve_trio.serving.ipc._framing import decode, encode

# A request's strings and headers are its own objects (pickle would write an object shared by
# the messages of a batch once, which no real batch does): one per message index.
_BATCH = 64
TRACES = [f"00-0af7651916cd43dd8448eb211c8031{i:02x}-b7ad6b7169203331-01" for i in range(_BATCH)]
HEADERS = [{"content-type": "application/json", "accept": "*/*"} for _ in range(_BATCH)]
REST_HEADERS = [(("x-request-id", f"abc{i}"),) for i in range(_BATCH)]
REQUEST_IDS = [f"req-{i}" for i in range(_BATCH)]
UNARY = UnaryCall("ServerLive")
UNTRACED = InferCall()
STREAM = StreamCall()

# The tuple channel's kind numbers (its messages' first item).
_REQUEST, _CANCEL, _FREE, _DONE = 2, 3, 4, 11
_KIND_UNARY, _KIND_INFER, _KIND_STREAM, _KIND_REST = 0, 1, 2, 3

Build = Callable[[int], object]
"""One message from its index (the request id)."""

# name: (tuple message, typed message); both from the same field values
CASES: dict[str, tuple[Build, Build]] = {
    "Request infer slot": (
        lambda i: (_REQUEST, i, _KIND_INFER, None, 123456789, (i * 64, 1000)),
        lambda i: Request(i, UNTRACED, 123456789, Slot(i * 64, 1000)),
    ),
    "Request infer traced": (
        lambda i: (_REQUEST, i, _KIND_INFER, TRACES[i], 123456789, (i * 64, 1000)),
        lambda i: Request(i, InferCall(TRACES[i]), 123456789, Slot(i * 64, 1000)),
    ),
    "Request stream slot": (
        lambda i: (_REQUEST, i, _KIND_STREAM, None, 0, (i * 64, 1000)),
        lambda i: Request(i, STREAM, 0, Slot(i * 64, 1000)),
    ),
    "Request unary 16B inline": (
        lambda i: (_REQUEST, i, _KIND_UNARY, "ServerLive", 0, b"0123456789abcdef"),
        lambda i: Request(i, UNARY, 0, b"0123456789abcdef"),
    ),
    "Request REST slot": (
        lambda i: (
            _REQUEST,
            i,
            _KIND_REST,
            ("POST", "/v2/models/m/infer", "", HEADERS[i]),
            0,
            (i * 64, 500),
        ),
        lambda i: Request(
            i, RestCall("POST", "/v2/models/m/infer", "", HEADERS[i]), 0, Slot(i * 64, 500)
        ),
    ),
    "Done slot": (
        lambda i: (_DONE, i, 0, "", (i * 64, 800), None),
        lambda i: Done(i, 0, "", Slot(i * 64, 800)),
    ),
    "Done stream origin": (
        lambda i: (_DONE, i, 0, "", (i * 64, 800), ("mlp", REQUEST_IDS[i])),
        lambda i: Done(i, 0, "", Slot(i * 64, 800), StreamOrigin("mlp", REQUEST_IDS[i])),
    ),
    "Done REST head": (
        lambda i: (_DONE, i, 0, "", (i * 64, 800), (200, "application/json", REST_HEADERS[i])),
        lambda i: Done(
            i, 0, "", Slot(i * 64, 800), RestHead(200, "application/json", REST_HEADERS[i])
        ),
    ),
    "Done error inline": (
        lambda i: (_DONE, i, 5, "model 'x' is not found", b"", None),
        lambda i: Done(i, 5, "model 'x' is not found", b""),
    ),
    "Cancel": (lambda i: (_CANCEL, i), lambda i: Cancel(i)),
    "Free 4 slots": (
        lambda i: (_FREE, [i, i + 64, i + 128, i + 192]),
        lambda i: Free((i, i + 64, i + 128, i + 192)),
    ),
}


def _pickle_trip(batch: list) -> list:
    return pickle.loads(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))


def _framing_trip(batch: list) -> list:
    return decode(encode(batch))


def _sample(build: Build, trip: Callable[[list], list], batch: int, messages: int) -> float:
    """CPU microseconds per message over ``messages`` messages in batches of ``batch``."""
    ids = range(batch)
    frames = max(1, messages // batch)
    t0 = time.thread_time()
    for _ in range(frames):
        trip([build(i) for i in ids])
    return (time.thread_time() - t0) / (frames * batch) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--messages", type=int, default=20000, help="per sample")
    parser.add_argument("--only", default="", help="the messages whose name contains this")
    args = parser.parse_args()
    for tuple_build, typed_build in CASES.values():  # both ways carry the same fields
        assert _framing_trip([typed_build(3)]) == [typed_build(3)]
        assert _pickle_trip([tuple_build(3)]) == [tuple_build(3)]
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} cpus")
    print("us per message (build + encode + decode), thread CPU time, best of", args.repeats)
    head = f"{'message':<26}{'batch':>6}{'tuple':>9}{'pickled':>9}{'typed':>9}{'typed-tuple':>13}"
    print(head)
    print("-" * len(head))
    for name, (tuple_build, typed_build) in CASES.items():
        if args.only not in name:
            continue
        for batch in (_BATCH, 1):
            messages = args.messages if batch > 1 else args.messages // 4
            variants = {
                "tuple": (tuple_build, _pickle_trip),
                "pickled": (typed_build, _pickle_trip),
                "typed": (typed_build, _framing_trip),
            }
            best = dict.fromkeys(variants, float("inf"))
            for _ in range(args.repeats):
                for variant, (build, trip) in variants.items():
                    best[variant] = min(best[variant], _sample(build, trip, batch, messages))
            print(
                f"{name:<26}{batch:>6}{best['tuple']:>9.2f}{best['pickled']:>9.2f}"
                f"{best['typed']:>9.2f}{best['typed'] - best['tuple']:>+13.2f}"
            )


if __name__ == "__main__":
    main()
