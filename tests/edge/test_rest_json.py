"""The parts of the REST body defences that need no server process: the JSON depth scanner,
numeric ``data`` lifted out of the parse and decoded into numpy, the capped inflater, the body
buffer and the read-ahead bound (on a real loopback connection). Fast; the CLI tests
(``test_rest_worker``, ``test_rest_gateway``) measure the processes."""

from __future__ import annotations

import json
import tracemalloc
import zlib

import anyio
import anyio.abc
import numpy as np
import pytest

from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.protocol import codec, json_numbers, rest_codec
from kserve_trio.core.protocol.json_depth import JsonTooDeep, check_json_depth, nesting_depth
from kserve_trio.serving.http import PayloadTooLarge, inflate_body
from kserve_trio.serving.http._body import READ_AHEAD_CHUNKS, BodyBuffer, read_ahead_bound
from kserve_trio.serving.rest_routes import RestCall, grpc_request
from tests.waiting import until


def test_depth_counts_brackets_and_braces_outside_strings_only():
    assert nesting_depth(b'{"a": [1, {"b": []}]}') == 4
    assert nesting_depth(b'{"a": "[[[[{{{{", "b": "\\"[[[["}') == 1
    assert nesting_depth(b"[" * 5000 + b"]" * 5000) == 5000
    assert nesting_depth(b"[]" * 1000) == 1
    check_json_depth(b"[" * 64 + b"]" * 64, 64, "x")
    with pytest.raises(JsonTooDeep) as err:
        check_json_depth(b"[" * 65 + b"]" * 65, 64, "the body")
    assert err.value.message == (
        "the body nests at least 65 levels deep, more than the limit of 64 (limits.max_json_depth)"
    )
    check_json_depth(b"[" * 5000, 0, "x")  # 0: no limit


@pytest.mark.timeout(30)
def test_every_rest_json_parser_refuses_depth_before_parsing():
    deep = b"[" * 100_000 + b"]" * 100_000  # far past the interpreter's recursion limit
    with pytest.raises(JsonTooDeep):
        rest_codec.load_json(deep, "the body")
    body = b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":' + deep + b"}]}"
    with pytest.raises(JsonTooDeep):
        rest_codec.parse_infer_request(body, None, "m")
    for rpc in ("RepositoryModelLoad", "SystemSharedMemoryRegister", "LogSettings"):
        with pytest.raises(JsonTooDeep):
            grpc_request(RestCall(rpc, "POST", model="m", region="r"), b'{"k":' + deep + b"}")
    assert rest_codec.input_shape(body, None, "x") is None


def parsed(doc_or_body) -> dict[str, np.ndarray]:
    body = doc_or_body if isinstance(doc_or_body, bytes) else json.dumps(doc_or_body).encode()
    message = rest_codec.parse_infer_request(body, None, "m").message
    return {t.name: np.asarray(t.data) for t in codec.decode_infer_request(message).inputs}


def fault(doc_or_body) -> str:
    with pytest.raises(InvalidArgument) as err:
        parsed(doc_or_body)
    return err.value.message


def one(data, shape, datatype="FP32", **extra):
    return {"inputs": [{"name": "x", "shape": shape, "datatype": datatype, "data": data, **extra}]}


@pytest.mark.parametrize(
    ("datatype", "dtype", "data"),
    [
        ("FP32", np.float32, [[0.5, -1e-3], [2, 3e5]]),
        ("FP64", np.float64, [[1.0000000000000002, -0.0], [1e300, 7]]),
        ("INT8", np.int8, [[-128, 127], [0, 1]]),
        ("UINT64", np.uint64, [[18446744073709551615, 0], [1, 2]]),
        ("INT64", np.int64, [[-9223372036854775808, 5], [6, 7]]),
        ("FP16", np.float16, [[0.1, 2], [3, 4]]),
        ("BOOL", np.bool_, [[True, False], [False, True]]),
    ],
)
def test_numeric_data_decodes_straight_to_the_declared_dtype(datatype, dtype, data):
    got = parsed(one(data, [2, 2], datatype))["x"]
    expect = np.array(data, dtype=dtype)
    assert got.dtype == expect.dtype
    np.testing.assert_array_equal(got, expect)


def test_only_real_data_keys_are_lifted_and_placeholders_cannot_be_forged():
    # "data" inside a string, and a key that merely ends in data, are no tensor data
    body = (
        b'{"id": "\\"data\\": [9, 9]", "parameters": {"x\\"data": 1},'
        b' "inputs": [{"name": "x", "shape": [2], "datatype": "INT32", "data": [1, 2]}]}'
    )
    lifted = json_numbers.lift_number_arrays(body)
    assert len(lifted.arrays) == 1
    np.testing.assert_array_equal(parsed(body)["x"], [1, 2])
    # a body that spells \u0000 has nothing lifted, so a client string is never a placeholder
    forged = b'{"inputs": [{"name": "x", "shape": [1], "datatype": "BYTES", "data": "\\u00000"}]}'
    assert json_numbers.lift_number_arrays(forged).arrays == []
    assert parsed(forged)["x"].tolist() == [b"\x000"]
    # an array where only scalars may stand stays the fault it was
    assert fault(one([1.0, 2.0], [2], parameters={"data": [1, 2]})) == (
        "input 'x' of model 'm' parameter 'data' must be a boolean, a number or a string"
    )


def test_count_type_and_structure_faults_read_as_before():
    assert fault(one([1.0, 2.0, 3.0], [2])) == (
        "input 'x' of model 'm' has 3 elements in fp32_contents, expected 2 (shape [2])"
    )
    assert fault(one([1.5, 2], [2], "INT32")) == (
        "input 'x' of model 'm' has datatype INT32: its 'data' must hold JSON integers"
    )
    assert fault(one([1, 0], [2], "BOOL")) == (
        "input 'x' of model 'm' has datatype BOOL: its 'data' must hold JSON booleans"
    )
    assert fault(one([True, False], [2], "INT8")) == (
        "input 'x' of model 'm' has datatype INT8: its 'data' must hold JSON integers"
    )
    assert fault(one([True, False, True], [2], "BOOL")) == (
        "input 'x' of model 'm' has 3 elements in bool_contents, expected 2 (shape [2])"
    )
    assert fault(one([300, 1], [2], "INT8")) == (
        "input 'x' of model 'm' has a value in int_contents out of range for INT8"
    )
    assert fault(one([1.0, [2.0]], [2])) == "input 'x' of model 'm' 'data' mixes lists and values"
    assert fault(one([[1.0], [[2.0]]], [2])) == (
        "input 'x' of model 'm' 'data' mixes lists and values"
    )
    early = b'{"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1], [2]}]}'
    assert fault(early).startswith("malformed JSON in input 'x' of model 'm' 'data'")
    assert fault(one([1.0, 2.0], [-2])) == (
        "input 'x' of model 'm' has a negative dimension in shape [-2]"
    )
    assert parsed(one([[], []], [2, 0]))["x"].shape == (2, 0)
    assert parsed(one([], [0], "BYTES"))["x"].shape == (0,)


def test_long_arrays_are_parsed_piece_by_piece_with_the_same_result(monkeypatch):
    monkeypatch.setattr(json_numbers, "_PIECE_BYTES", 64)
    x = np.arange(-300, 300, dtype=np.int64).reshape(20, 3, 10)
    np.testing.assert_array_equal(parsed(one(x.tolist(), [20, 3, 10], "INT64"))["x"], x)
    y = (np.arange(1000, dtype=np.float32) / 7).reshape(100, 10)
    np.testing.assert_array_equal(parsed(one(y.tolist(), [100, 10]))["x"], y)
    # faults at a piece boundary are still faults
    for at in range(30, 40):  # a doubled comma, wherever the pieces are cut
        gap = b"1," * at + b"," + b"1," * (40 - at) + b"1"
        body = b'{"inputs":[{"name":"x","shape":[42],"datatype":"FP32","data":[' + gap + b"]}]}"
        assert "malformed JSON" in fault(body)
    assert "mixes lists and values" in fault(
        b'{"inputs":[{"name":"x","shape":[41],"datatype":"FP32","data":[' + b"1," * 40 + b"[1]]}]}"
    )


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_number_list_costs_its_array_not_a_python_object_per_number():
    """Bound: the decoded array plus one 1 MiB piece's Python numbers; json.loads of the same
    text holds a 32-byte float per 4-byte number (8x the body)."""
    count = 1 << 20
    body = (
        b'{"inputs":[{"name":"x","shape":[%d],"datatype":"FP32","data":[' % count
        + b",".join([b"0.5"] * count)
        + b"]}]}"
    )
    tracemalloc.start()
    try:
        request = rest_codec.parse_infer_request(body, None, "m")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * count + 24 * (1 << 20)  # the FP32 array, plus one piece's numbers
    assert len(request.message.raw_input_contents[0]) == 4 * count
    # refused on its count: nothing but the text's structure is parsed
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgument, match="expected 16"):
            rest_codec.parse_infer_request(body.replace(b"[%d]" % count, b"[16]"), None, "m")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < len(body) + (1 << 20)  # the one copy of the body the test itself makes


def test_inflation_stops_one_step_past_the_cap():
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = b"".join(packer.compress(bytes(1 << 20)) for _ in range(64)) + packer.flush()
    tracemalloc.start()
    try:
        with pytest.raises(PayloadTooLarge) as err:
            inflate_body(bomb, "gzip", 4 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.value.message == "received message larger than max (more than 4194304 vs. 4194304)"
    assert peak < (4 << 20) * 1.25 + (2 << 20)
    assert inflate_body(zlib.compress(b"hello"), "deflate", 5) == b"hello"
    raw = zlib.compressobj(6, zlib.DEFLATED, -15)
    assert inflate_body(raw.compress(b"hi") + raw.flush(), "deflate", 5) == b"hi"
    with pytest.raises(InvalidArgument, match="cannot decompress the gzip request body"):
        inflate_body(b"not gzip", "gzip", 100)


def test_a_body_is_held_under_its_cap_as_it_arrives():
    body = BodyBuffer(10)
    assert body.add(b"abcd") and body.add(b"efgh")
    assert body.take() == b"abcdefgh"
    assert body.add(b"0123456") and not body.add(b"789ab")
    assert body.received == 12 and body.take() == b""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_connection_stops_reading_once_chunks_queue_ahead_of_its_parser(loop):
    async def main() -> None:
        async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
            port = listener.extra(anyio.abc.SocketAttribute.local_port)
            accepted: list[anyio.abc.ByteStream] = []
            async with anyio.create_task_group() as tg:

                async def keep(stream: anyio.abc.ByteStream) -> None:
                    accepted.append(stream)
                    await anyio.sleep_forever()

                tg.start_soon(listener.serve, keep)
                client = await anyio.connect_tcp("127.0.0.1", port)
                await until(lambda: accepted, what="the connection accepted")
                server = accepted[0]
                transport, protocol = server._transport, server._protocol  # type: ignore[attr-defined]
                bound = read_ahead_bound(server)
                transport.resume_reading()
                protocol.read_queue.extend([b"x"] * READ_AHEAD_CHUNKS)
                bound()
                assert transport.is_reading()  # up to the bound: left alone
                protocol.read_queue.append(b"x")
                bound()
                assert not transport.is_reading()  # past it: paused until the queue drains
                await client.aclose()
                tg.cancel_scope.cancel()

    options = {"use_uvloop": True} if loop == "uvloop" else {}
    anyio.run(main, backend="asyncio", backend_options=options)
    assert read_ahead_bound(object())() is None  # any other stream: nothing to bound
