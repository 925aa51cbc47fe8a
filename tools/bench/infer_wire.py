"""Per-request cost of the ModelInfer wire coding, server side and client side, for two source
trees compared in one session (before/after a change), interleaved round by round.

What one request costs, per stage (microseconds, median of the rounds):

- server ``parse``: the received message bytes -> the request object the handler gets
  (``serving.grpc``'s ``parse_message``); ``decode``: that plus ``decode_infer_request``;
- server ``encode``: ``encode_infer_response(..., zero_copy=True)`` plus what
  ``send_reply`` prepares before it writes (the joined bytes, or the segments it sends from the
  arrays' own buffers);
- client ``encode``: ``encode_infer_request`` plus one attempt's serialization (deadline
  parameter set, ``bytes()`` of the request, as the transport takes it);
- client ``parse``: the reply bytes -> the response (the transport's reply type) plus
  ``InferOutput`` of its output.

Times are thread CPU time (the best of 5 runs per round); the table gives the median of the
rounds and their range.

Two payloads: mlp (FP32 [1, 16] in, [1, 8] out) and an identity on FP32 [64, 3, 224, 224]
(38.5 MB each way). Each tree runs in its own process (``--tree``) so both import their own
``kserve_trio``; the orchestrator alternates them.

With ``--served`` each round instead starts the tree's ``tools/bench/echo_server.py`` (the
worker's transport and codec, no scheduler) and measures the server process's CPU time per
request (``/proc/<pid>/stat``) over sequential tritonclient calls: parse, decode, encode and the
HTTP/2 send together.

Usage:
    python tools/bench/infer_wire.py --compare BEFORE_DIR AFTER_DIR [--rounds 5] [--served]
    python tools/bench/infer_wire.py --tree DIR [--served]   # one round, JSON on stdout
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import subprocess
import sys
import time


def _per_call_us(fn, n: int, repeats: int = 5) -> float:
    """The fastest of ``repeats`` runs of ``n`` calls, per call, in this thread's CPU time (on a
    shared box wall time also counts the time other processes held the core)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - t0) / n)
    return best * 1e6


def _round(tree: str) -> dict:
    sys.path.insert(0, tree)
    import numpy as np
    from tritonclient.grpc import service_pb2 as sp

    from kserve_trio.client import InferInput, InferOutput
    from kserve_trio.core.protocol import (
        TIMEOUT_NS_PARAM,
        deadline_params,
        decode_infer_request,
        encode_infer_request,
        encode_infer_response,
    )
    from kserve_trio.core.tensors import NamedTensor
    from kserve_trio.proto import inference as pb

    try:  # the server layer of this tree: serving.grpc, or the older grpc_adapter
        from kserve_trio.serving.grpc._call import JOIN_BYTES

        try:  # the transport-neutral codec, or where it lived before
            from kserve_trio.serving.rpc_codec import parse_message
        except ImportError:
            from kserve_trio.serving.grpc._messages import parse_message  # type: ignore

        def segments(pieces: list) -> list:
            return pieces

    except ImportError:
        from kserve_trio.serving import grpc_adapter  # type: ignore[attr-defined]

        JOIN_BYTES = grpc_adapter._JOIN_BYTES
        parse_message = grpc_adapter._parse
        segments = grpc_adapter._segments

    assert sys.modules["kserve_trio"].__file__.startswith(tree), "imported the wrong tree"
    try:
        from kserve_trio.core.protocol import InferResponseMessage, WirePieces

        new = True
    except ImportError:
        from kserve_trio.client._wire import EncodedInferRequest, InferResponseReader

        from kserve_trio.core.protocol import wire

        new = False

    def reply_buffers(reply) -> list:
        """What send_reply hands the HTTP/2 stream for this reply (identity encoding)."""
        if new:
            assert isinstance(reply, WirePieces)
            prefix = struct.pack(">?I", False, reply.nbytes)
            if reply.nbytes <= JOIN_BYTES:
                return [b"".join([prefix, *reply.pieces])]
            return segments([prefix, *reply.pieces])
        pieces = wire.infer_response_pieces(reply)
        length = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)
        return [b"".join([struct.pack(">?I", False, length), *pieces])]

    def attempt_bytes(request) -> bytes:
        """One attempt of send_infer: the budget parameter, then the bytes the transport sends."""
        request.parameters.pop(TIMEOUT_NS_PARAM, None)
        request.parameters.update(deadline_params(9_000_000_000))
        return bytes(request) if new else bytes(EncodedInferRequest(request))

    reader = InferResponseMessage if new else InferResponseReader
    rng = np.random.default_rng(0)
    cases = {
        "mlp [1,16]": ((1, 16), (1, 8), 20_000),
        "[64,3,224,224]": ((64, 3, 224, 224), (64, 3, 224, 224), 20),
    }

    def measure(x: np.ndarray, y: np.ndarray, n: int) -> dict:
        req = sp.ModelInferRequest(model_name="m", id="r-1")
        req.inputs.add(name="input_0", datatype="FP32", shape=list(x.shape))
        req.parameters["timeout"].int64_param = 10_000_000
        req.raw_input_contents.append(x.tobytes())
        request_bytes = req.SerializeToString()
        outputs = [NamedTensor.from_array("output", y)]
        rsp = sp.ModelInferResponse(model_name="m", model_version="1", id="r-1")
        rsp.outputs.add(name="output", datatype="FP32", shape=list(y.shape))
        rsp.raw_output_contents.append(y.tobytes())
        reply_bytes = rsp.SerializeToString()
        inputs = [InferInput("input_0", x)]

        def server_parse():
            return parse_message(request_bytes, pb.ModelInferRequest)

        def server_decode():
            return decode_infer_request(server_parse())

        def server_encode():
            reply = encode_infer_response(
                "m", "r-1", outputs, [], None, model_version="1", zero_copy=True
            )
            return reply_buffers(reply)

        def client_encode():
            request = encode_infer_request(
                "m", [i.to_tensor() for i in inputs], requested_outputs=[], id=""
            )
            return attempt_bytes(request)

        def client_parse():
            return InferOutput("output", reader.FromString(reply_bytes))

        # every stage gives the same answer in both trees
        assert np.array_equal(server_decode().inputs[0].data, x)
        assert sp.ModelInferResponse.FromString(b"".join(server_encode())[5:]) == rsp
        sent = sp.ModelInferRequest.FromString(client_encode())
        assert sent.raw_input_contents[0] == x.tobytes()
        assert np.array_equal(client_parse(), y)
        return {
            "server parse": _per_call_us(server_parse, n),
            "server parse + decode": _per_call_us(server_decode, n),
            "server encode": _per_call_us(server_encode, n),
            "client encode": _per_call_us(client_encode, n),
            "client parse": _per_call_us(client_parse, n),
        }

    out: dict = {}
    for label, (in_shape, out_shape, n) in cases.items():
        x = rng.standard_normal(in_shape, dtype=np.float32)
        y = rng.standard_normal(out_shape, dtype=np.float32)
        out[label] = measure(x, y, n)
    return out


def _cpu_seconds(pid: int) -> float:
    import os

    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _served_round(tree: str) -> dict:
    import os
    import socket

    import numpy as np
    import tritonclient.grpc as tc

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=tree)
    server = subprocess.Popen(
        [sys.executable, f"{tree}/tools/bench/echo_server.py", "--port", str(port)],
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
    )
    try:
        assert server.stdout is not None
        server.stdout.readline()  # "echo listening on ..."
        client = tc.InferenceServerClient(f"127.0.0.1:{port}")
        out: dict = {}
        for label, shape, n in (
            ("mlp [1,16]", (1, 16), 2000),
            ("[64,3,224,224]", (64, 3, 224, 224), 30),
        ):
            x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
            inp = tc.InferInput("input_0", list(shape), "FP32")
            inp.set_data_from_numpy(x)
            for _ in range(3):
                assert np.array_equal(client.infer("echo", [inp]).as_numpy("input_0"), x)
            cpu0, t0 = _cpu_seconds(server.pid), time.perf_counter()
            for _ in range(n):
                client.infer("echo", [inp])
            cpu1, t1 = _cpu_seconds(server.pid), time.perf_counter()
            out[label] = {
                "server CPU per request": 1e6 * (cpu1 - cpu0) / n,
                "wall per request": 1e6 * (t1 - t0) / n,
            }
        client.close()
        return out
    finally:
        server.terminate()
        server.wait(10)


def _compare(trees: list[str], rounds: int, served: bool) -> None:
    results: dict[str, list[dict]] = {t: [] for t in trees}
    for r in range(rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            proc = subprocess.run(
                [sys.executable, __file__, "--tree", tree, *(["--served"] if served else [])],
                check=True,
                capture_output=True,
                text=True,
                cwd=tree,
            )
            results[tree].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}/{rounds} {tree} done", file=sys.stderr, flush=True)
    first = results[trees[0]][0]
    header = "| payload | stage | " + " | ".join(trees) + " |"
    print(header)
    print("|" + "---|" * (2 + len(trees)))
    for label, stages in first.items():
        for stage in stages:
            cells = []
            for tree in trees:
                xs = [res[label][stage] for res in results[tree]]
                med = statistics.median(xs)
                cells.append(f"{med:.1f} [{min(xs):.1f}-{max(xs):.1f}]")
            print(f"| {label} | {stage} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tree", help="run one round against the kserve_trio in this directory")
    ap.add_argument("--compare", nargs="+", metavar="DIR", help="trees to compare, interleaved")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--served", action="store_true", help="server CPU through the echo server")
    args = ap.parse_args()
    if args.tree:
        print(json.dumps(_served_round(args.tree) if args.served else _round(args.tree)))
    elif args.compare:
        _compare(args.compare, args.rounds, args.served)
    else:
        ap.error("give --tree or --compare")


if __name__ == "__main__":
    main()
