"""How the h2 transport sends: a ModelInfer request goes out as its encoded pieces (a tensor's
own buffer, not a joined copy), and calls cancelled in the middle of sending a large message
leave the connection carrying every other call's bytes intact (real grpclib server on a
loopback port, asyncio and trio)."""

from __future__ import annotations

import random
import socket
import threading

import anyio
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import numpy as np
import pytest

from kserve_trio.client.errors import RpcError
from kserve_trio.client.h2_transport import H2Transport, _message_pieces
from kserve_trio.client.transport import Endpoint
from kserve_trio.core.errors import StatusCode
from kserve_trio.core.protocol.infer_wire import InferInputTensor, InferRequestMessage
from kserve_trio.core.protocol.wire import byte_view
from tests.client.echo_server import GRPC_OK_HEADERS, EchoServer, Raw, grpc_frame

ECHO = "/test.Echo/Echo"


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture(scope="module")
def echo():
    with EchoServer() as server:
        yield server


def _request(arr: np.ndarray) -> InferRequestMessage:
    return InferRequestMessage(
        model_name="m",
        inputs=[InferInputTensor("x", "FP32", arr.shape)],
        raw_input_contents=[byte_view(arr)],
    )


def test_a_modelinfer_request_is_sent_from_its_tensors_memory():
    arr = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)
    request = _request(arr)
    pieces, nbytes = _message_pieces(request)
    assert nbytes == len(bytes(request))
    shared = [p for p in pieces if np.shares_memory(np.frombuffer(p, np.uint8), arr)]
    assert len(shared) == 1 and len(shared[0]) == arr.nbytes
    assert _message_pieces(b"abc") == ([b"abc"], 3)


@pytest.mark.anyio
async def test_a_modelinfer_request_arrives_as_its_encoding(echo):
    arr = np.random.default_rng(0).standard_normal((64, 3, 32, 32)).astype(np.float32)
    request = _request(arr)
    async with H2Transport(Endpoint("127.0.0.1", echo.port)) as t:
        assert await t.unary(ECHO, request, Raw, timeout=30) == bytes(request)


@pytest.mark.anyio
async def test_calls_cancelled_while_sending_leave_the_connection_intact(echo):
    big = np.random.default_rng(1).integers(0, 255, 12 << 20, dtype=np.uint8)
    rng = random.Random(2)
    outcomes: list[str] = []
    async with H2Transport(Endpoint("127.0.0.1", echo.port)) as t:

        async def large(delay: float) -> None:
            try:
                reply = await t.unary(ECHO, memoryview(big), Raw, timeout=delay)
            except RpcError as exc:
                assert exc.status is StatusCode.DEADLINE_EXCEEDED
                outcomes.append("cancelled")
            else:
                assert reply == big.tobytes()
                outcomes.append("sent")

        async def small(i: int) -> None:
            payload = bytes([i % 256]) * (1 + i * 131)
            assert await t.unary(ECHO, payload, Raw, timeout=30) == payload

        async with anyio.create_task_group() as tg:
            for i in range(24):
                tg.start_soon(large, rng.choice([0.002, 0.01, 0.05, 0.2, 30.0]))
                tg.start_soon(small, i)
        assert "cancelled" in outcomes
        assert await t.unary(ECHO, memoryview(big), Raw, timeout=60) == big.tobytes()


class _PausedReader:
    """An h2 server on a plain socket thread that advertises windows of 2 GiB, then reads
    nothing until the test sets ``resume`` (the client's writes back up in its buffers), then
    echoes every stream that ends and records resets and protocol errors."""

    PAUSE_BOUND_SECONDS = 60.0
    """The longest it waits for ``resume``: a bound for a test that fails before setting it."""

    def __init__(self) -> None:
        self.resume = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.resets: list[int] = []
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        sock, _ = self.listener.accept()
        h = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding=None)
        )
        big = (1 << 31) - 1
        h.local_settings = h2.settings.Settings(
            client=False, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: big}
        )
        h.initiate_connection()
        h.increment_flow_control_window(big - 65535)
        sock.sendall(h.data_to_send())
        self.resume.wait(self.PAUSE_BOUND_SECONDS)
        bodies: dict[int, bytearray] = {}
        try:
            while data := sock.recv(1 << 20):
                for event in h.receive_data(data):
                    if isinstance(event, h2.events.DataReceived):
                        bodies.setdefault(event.stream_id, bytearray()).extend(event.data)
                    elif isinstance(event, h2.events.StreamEnded):
                        sid = event.stream_id
                        message = bytes(bodies.pop(sid, b""))[5:]  # past the gRPC prefix
                        reply = grpc_frame(message)
                        step = h.max_outbound_frame_size
                        try:
                            h.send_headers(sid, GRPC_OK_HEADERS)
                            for i in range(0, len(reply), step):
                                h.send_data(sid, reply[i : i + step])
                            h.send_headers(sid, [(b"grpc-status", b"0")], end_stream=True)
                        except (
                            h2.exceptions.StreamClosedError,
                            h2.exceptions.StreamIDTooLowError,
                        ):
                            pass  # reset by the client in the same batch of frames
                    elif isinstance(event, h2.events.StreamReset):
                        self.resets.append(event.stream_id)
                sock.sendall(h.data_to_send())
        except Exception as exc:  # a protocol error, or anything else that ends the server
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            sock.close()
            self.listener.close()


@pytest.mark.anyio
async def test_a_call_cancelled_while_its_writes_back_up_leaves_the_stream_whole():
    server = _PausedReader()
    big = bytes(range(256)) * (128 << 10)  # 32 MiB: more than the socket buffers hold
    cut_off = anyio_backend_name() == "asyncio"
    if not cut_off:  # writes are shielded there: the server reads once the deadline has passed
        threading.Timer(0.5, server.resume.set).start()
    async with H2Transport(Endpoint("127.0.0.1", server.port)) as t:
        with pytest.raises(RpcError) as info:
            await t.unary(ECHO, big, Raw, timeout=0.3)
        assert info.value.status is StatusCode.DEADLINE_EXCEEDED
        server.resume.set()  # on asyncio only now: the deadline struck while nothing was read
        # the next call follows the cut-off one on the same connection, after its RST_STREAM
        assert await t.unary(ECHO, b"after", Raw, timeout=30) == b"after"
    server.thread.join(10)
    assert server.errors == []
    if cut_off:  # the deadline struck while the writes waited: the message was cut off, reset
        assert server.resets == [1]
    # elsewhere writes are shielded: the whole message went out before the deadline applied


def anyio_backend_name() -> str:
    import sniffio

    return sniffio.current_async_library()
