"""The KServe V2 REST inference body, with Triton's binary tensor extension, both directions.

A REST request is parsed into the same ``InferRequestMessage`` a gRPC request is parsed into,
so the inference core decodes and validates both the same way (one message per fault); a
response is written from the output tensors and payloads every encoder starts from
(``codec.response_outputs``, or a parsed gRPC reply on the gateway). Pure: bytes and values in,
values out.

Request rules (``parse_infer_request``; every violation is ``InvalidArgument``):

1. The body is JSON, or, with ``Inference-Header-Content-Length: N``, N bytes of JSON followed
   by the binary section (N larger than the body is an error). The JSON is an object.
2. ``id`` is a string; ``parameters`` an object of scalar values (bool, number, string);
   ``binary_data_output: true`` asks for every output in binary (it is not passed on).
3. Each input has ``name`` (string), ``shape`` (list of non-negative integers), ``datatype``
   (string) and ``parameters``; its data comes from, by priority: the shared-memory parameters
   (passed on as they are, decoded by the codec), ``binary_data_size`` (the next that many bytes
   of the binary section, in input order), or ``data`` (nested or flat JSON list, row-major).
   JSON data goes into the datatype's typed contents field (so a wrong element count reads as
   it does over gRPC); a datatype without one (FP16, BF16) is converted to its raw bytes. The
   elements must be JSON booleans for BOOL, integers for integer types, numbers for float
   types, strings for BYTES. An input with none of the three is "no data".
4. The binary sizes must add up to the binary section exactly.
5. ``outputs`` (optional) lists ``name`` and ``parameters``: shared-memory parameters are passed
   on; ``binary_data`` (default: the request's ``binary_data_output``) says whether that output
   comes back binary; other parameters (``classification``) are passed on like gRPC's.

Response rules (``encode_infer_response``): every output is a JSON object with ``name``,
``datatype``, ``shape`` and either ``parameters.binary_data_size`` (its payload appended to the
binary section, in output order), the shared-memory parameters (its data is in the region), or
``data`` (a flat JSON list). With a binary section the reply carries the JSON's length as
``Inference-Header-Content-Length`` and is ``application/octet-stream``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.process import EdgeLimits
from kserve_trio.core.protocol.bytes_tensor import decode_bytes_tensor
from kserve_trio.core.protocol.codec._tensors import checked_nbytes, shape_str
from kserve_trio.core.protocol.infer_wire import (
    Buffer,
    InferInputTensor,
    InferOutputTensor,
    InferRequestedOutput,
    InferRequestMessage,
)
from kserve_trio.core.protocol.json_depth import JsonTooDeep, check_json_depth
from kserve_trio.core.protocol.json_numbers import LiftedJson, NumberArray, lift_number_arrays
from kserve_trio.core.protocol.wire import Params, TensorContents
from kserve_trio.core.tensors import DType, dtype_from_wire

HEADER_LENGTH = "inference-header-content-length"
"""The header naming the JSON part's length (lower-case, as ``serving.http`` gives headers)."""
BINARY_DATA_SIZE = "binary_data_size"
BINARY_DATA = "binary_data"
BINARY_DATA_OUTPUT = "binary_data_output"
JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"

DEFAULT_JSON_DEPTH: int = EdgeLimits.max_json_depth
"""``limits.max_json_depth``'s default (the servers pass their configured value)."""

_INT_KINDS = ("INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64")


@dataclass
class RestInferRequest:
    """A parsed REST inference request: the message the core takes, and which outputs the
    client wants back binary (``binary_all``: every output unless it said otherwise)."""

    message: InferRequestMessage
    binary_all: bool = False
    binary: dict[str, bool] = field(default_factory=dict)

    def wants_binary(self, name: str) -> bool:
        return self.binary.get(name, self.binary_all)


@dataclass
class RestReply:
    """An encoded REST inference response: ``pieces`` (JSON first, then each binary payload),
    ``header_length`` (the JSON's length when there is a binary section, else None)."""

    pieces: list[Buffer]
    header_length: int | None

    @property
    def content_type(self) -> str:
        return JSON_TYPE if self.header_length is None else BINARY_TYPE

    def headers(self) -> list[tuple[str, str]]:
        if self.header_length is None:
            return []
        return [("inference-header-content-length", str(self.header_length))]


# ------------------------------------------------------------------------------------- request


def _text(data: Buffer) -> bytes | bytearray:
    return data if isinstance(data, bytes | bytearray) else bytes(data)


def _parse(text: bytes | bytearray, what: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"malformed JSON in {what}: {exc}") from None


def load_json(data: Buffer, what: str, max_depth: int = DEFAULT_JSON_DEPTH) -> Any:
    """``data`` parsed as JSON (``InvalidArgument`` naming ``what`` when it is not, and
    ``JsonTooDeep`` when it nests deeper than ``max_depth``, found before parsing)."""
    text = _text(data)
    check_json_depth(text, max_depth, what)
    return _parse(text, what)


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what} must be a JSON object")
    return value


def _params(value: Any, what: str, lifted: LiftedJson | None = None) -> Params:
    if value is None:
        return {}
    params = _object(value, f"{what} 'parameters'")
    for key, v in params.items():
        if not isinstance(v, bool | int | float | str) or (lifted and lifted.is_placeholder(v)):
            raise InvalidArgument(
                f"{what} parameter '{key}' must be a boolean, a number or a string"
            )
    return dict(params)


def _flatten(data: Any, what: str) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    if not data or not isinstance(data[0], list):
        flat = data
    else:
        flat = []
        stack = [iter(data)]
        while stack:
            for item in stack[-1]:
                if isinstance(item, list):
                    stack.append(iter(item))
                    break
                flat.append(item)
            else:
                stack.pop()
    for item in flat:
        if isinstance(item, list | dict):
            raise InvalidArgument(f"{what} 'data' mixes lists and values")
    return flat


def _kind(dtype: DType) -> str:
    """What JSON values a tensor of ``dtype`` holds, as the type faults name them."""
    wire = dtype.wire
    if wire == "BOOL":
        return "booleans"
    if wire in _INT_KINDS:
        return "integers"
    return "strings" if wire == "BYTES" else "numbers"


def _check_elements(values: list[Any], dtype: DType, what: str) -> None:
    wire = dtype.wire
    if wire == "BOOL":
        ok = all(v.__class__ is bool for v in values)
        kind = "booleans"
    elif wire in _INT_KINDS:
        ok = all(v.__class__ is int for v in values)
        kind = "integers"
    elif wire == "BYTES":
        ok = all(isinstance(v, str) for v in values)
        kind = "strings"
    else:
        ok = all(v.__class__ is float or v.__class__ is int for v in values)
        kind = "numbers"
    if not ok:
        raise InvalidArgument(f"{what} has datatype {wire}: its 'data' must hold JSON {kind}")


def _json_data(
    tensor: InferInputTensor, data: Any, what: str, raw: list[Buffer]
) -> TensorContents | None:
    """JSON ``data`` as the tensor's typed contents, or appended to ``raw`` as its bytes for a
    datatype without a typed field. An unknown datatype is left to the codec's message."""
    try:
        dtype = dtype_from_wire(tensor.datatype)
    except ValueError:
        return TensorContents()  # the codec names the datatype
    values = _flatten(data, what)
    _check_elements(values, dtype, what)
    field_name = dtype.contents_field
    if field_name is None:
        try:
            raw.append(np.asarray(values, dtype=dtype.numpy).tobytes())
        except (OverflowError, ValueError):
            raise InvalidArgument(f"{what} has a value out of range for {dtype.wire}") from None
        return None
    if field_name == "bytes_contents":
        values = [v.encode("utf-8") for v in values]
    return TensorContents(**{field_name: values})


def _number_data(
    tensor: InferInputTensor, array: NumberArray, what: str, raw: list[Buffer]
) -> TensorContents | None:
    """A lifted array of JSON numbers or booleans (``core.protocol.json_numbers``) as the tensor's raw
    bytes: its element count checked against the declared shape before anything is decoded,
    then decoded straight into an array of the declared dtype. The faults read as the typed-contents path
    words them (and as the gRPC codec does)."""
    try:
        dtype = dtype_from_wire(tensor.datatype)
    except ValueError:
        return TensorContents()  # the codec names the datatype
    field_name = dtype.contents_field
    count, _ = checked_nbytes(what, tensor.shape, dtype)  # the codec's own shape faults
    found = array.count()
    if found and array.booleans != (dtype.wire == "BOOL"):
        raise InvalidArgument(
            f"{what} has datatype {dtype.wire}: its 'data' must hold JSON {_kind(dtype)}"
        )
    if dtype.is_bytes:  # an empty list: no strings to take
        return TensorContents(bytes_contents=[])
    if found != count:
        raise InvalidArgument(
            f"{what} has {found} elements in {field_name or 'data'}, expected {count} "
            f"(shape {shape_str(tensor.shape)})"
        )
    if dtype.wire in _INT_KINDS and array.has_fraction():
        raise InvalidArgument(
            f"{what} has datatype {dtype.wire}: its 'data' must hold JSON integers"
        )
    where = f" in {field_name}" if field_name else ""
    out_of_range = f"{what} has a value{where} out of range for {dtype.wire}"
    values = array.decode(dtype.numpy, count, what, out_of_range)
    raw.append(values.view(np.uint8).data)
    return None


def _shape(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(d.__class__ is int for d in value):
        raise InvalidArgument(f"{what} 'shape' must be a list of integers")
    return value


def _string(obj: Mapping[str, Any], key: str, what: str, default: str | None = None) -> str:
    value = obj.get(key, default)
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} needs a string '{key}'")
    return value


@dataclass
class InferDocument:
    """An inference body's JSON part parsed with its numeric ``data`` arrays left unparsed
    (``lifted``), and the binary section after it."""

    doc: Any
    lifted: LiftedJson
    binary: memoryview


def infer_document(
    body: Buffer, header_length: int | None, max_json_depth: int = DEFAULT_JSON_DEPTH
) -> InferDocument:
    """The JSON part of an inference body, its depth checked before it is parsed and its
    numeric tensor data lifted out of the parse (``core.protocol.json_numbers``): the parse costs the
    text's structure, not a Python object per number."""
    text = body if isinstance(body, bytes | bytearray) else memoryview(body).cast("B").tobytes()
    if header_length is None:
        header_length = len(text)
    elif header_length < 0 or header_length > len(text):
        raise InvalidArgument(
            f"Inference-Header-Content-Length {header_length} is outside the "
            f"{len(text)}-byte request body"
        )
    what = "the inference request"
    check_json_depth(text, max_json_depth, what, header_length)
    lifted = lift_number_arrays(text, header_length)
    doc = _parse(lifted.text, what)
    return InferDocument(doc, lifted, memoryview(text)[header_length:])


def input_shape(
    body: Buffer,
    header_length: int | None,
    input_name: str,
    max_json_depth: int = DEFAULT_JSON_DEPTH,
) -> tuple[int, ...] | None:
    """The declared shape of input ``input_name`` in an inference body, ``None`` when the body
    does not say (or is malformed); no tensor data is decoded."""
    try:
        doc = infer_document(body, header_length, max_json_depth).doc
        for entry in doc.get("inputs", ()):
            if isinstance(entry, dict) and entry.get("name") == input_name:
                return tuple(int(d) for d in entry["shape"])
    except (InvalidArgument, ValueError, TypeError, KeyError, AttributeError):
        return None
    return None


def parse_infer_request(
    body: Buffer,
    header_length: int | None,
    model_name: str,
    model_version: str = "",
    *,
    max_json_depth: int = DEFAULT_JSON_DEPTH,
) -> RestInferRequest:
    """Parse a REST inference request for ``model_name`` (see the module docstring)."""
    parsed = infer_document(body, header_length, max_json_depth)
    lifted, binary = parsed.lifted, parsed.binary
    doc = _object(parsed.doc, "the request")
    what_request = f"request for model '{model_name}'"
    params = _params(doc.get("parameters"), what_request, lifted)
    binary_all = params.pop(BINARY_DATA_OUTPUT, False)
    if not isinstance(binary_all, bool):
        raise InvalidArgument(f"{what_request} parameter '{BINARY_DATA_OUTPUT}' must be a boolean")
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgument(f"{what_request} 'id' must be a string")
    inputs_doc = doc.get("inputs", [])
    if not isinstance(inputs_doc, list):
        raise InvalidArgument(f"{what_request} 'inputs' must be a list")

    inputs: list[InferInputTensor] = []
    raw: list[Buffer] = []
    pos = 0
    for i, item in enumerate(inputs_doc):
        entry = _object(item, f"{what_request} input {i}")
        name = _string(entry, "name", f"{what_request} input {i}")
        what = f"input '{name}' of model '{model_name}'"
        tensor = InferInputTensor(
            name,
            _string(entry, "datatype", what),
            _shape(entry.get("shape"), what),
            _params(entry.get("parameters"), what, lifted),
        )
        size = tensor.parameters.pop(BINARY_DATA_SIZE, None)
        if "shared_memory_region" in tensor.parameters:
            pass  # the codec reads the region
        elif size is not None:
            if type(size) is not int or size < 0:
                raise InvalidArgument(f"{what} '{BINARY_DATA_SIZE}' must be a non-negative integer")
            if pos + size > len(binary):
                raise InvalidArgument(
                    f"{what} has {BINARY_DATA_SIZE} {size} but only {len(binary) - pos} bytes "
                    "of binary data are left in the request"
                )
            raw.append(binary[pos : pos + size])
            pos += size
        elif "data" in entry:
            array = lifted.array_of(entry["data"])
            if array is not None:
                tensor.contents = _number_data(tensor, array, what, raw)
            else:
                tensor.contents = _json_data(tensor, entry["data"], what, raw)
        else:
            raise InvalidArgument(
                f"{what} has no data: no shared memory region, binary data or JSON 'data'"
            )
        inputs.append(tensor)
    if pos != len(binary):
        raise InvalidArgument(
            f"{what_request} has {len(binary)} bytes of binary data but its inputs' "
            f"{BINARY_DATA_SIZE} add up to {pos}"
        )

    outputs: list[InferRequestedOutput] = []
    flags: dict[str, bool] = {}
    outputs_doc = doc.get("outputs", [])
    if not isinstance(outputs_doc, list):
        raise InvalidArgument(f"{what_request} 'outputs' must be a list")
    for i, item in enumerate(outputs_doc):
        entry = _object(item, f"{what_request} output {i}")
        name = _string(entry, "name", f"{what_request} output {i}")
        out_params = _params(entry.get("parameters"), f"requested output '{name}'", lifted)
        flag = out_params.pop(BINARY_DATA, None)
        if flag is not None:
            if not isinstance(flag, bool):
                raise InvalidArgument(
                    f"requested output '{name}' parameter '{BINARY_DATA}' must be a boolean"
                )
            flags[name] = flag
        outputs.append(InferRequestedOutput(name, out_params))
    message = InferRequestMessage(
        model_name=model_name,
        model_version=model_version,
        id=request_id,
        parameters=params,
        inputs=inputs,
        outputs=outputs,
        raw_input_contents=raw,
    )
    return RestInferRequest(message, binary_all, flags)


# ------------------------------------------------------------------------------------ response


def _json_values(tensor: InferOutputTensor, payload: Buffer) -> list[Any]:
    """An output's payload as a flat JSON list (BYTES elements as UTF-8 strings)."""
    try:
        dtype = dtype_from_wire(tensor.datatype)
    except ValueError:
        return []
    if dtype.is_bytes:
        what = f"output '{tensor.name}'"
        try:
            return [
                bytes(v).decode("utf-8")
                for v in decode_bytes_tensor(payload, tensor.shape, what).reshape(-1)
            ]
        except UnicodeDecodeError:
            raise InvalidArgument(
                f"{what} holds bytes that are not UTF-8, which JSON cannot carry; "
                "request it with binary_data"
            ) from None
    return np.frombuffer(payload, dtype=dtype.numpy).tolist()


def encode_infer_response(
    model_name: str,
    model_version: str,
    request_id: str,
    outputs: Sequence[InferOutputTensor],
    payloads: Sequence[Buffer],
    wants_binary: Callable[[str], bool] | None = None,
    parameters: Mapping[str, Any] | None = None,
) -> RestReply:
    """The REST response for ``outputs`` and their ``payloads`` (one per output, empty for an
    output in shared memory, as ``codec.response_outputs`` gives them). ``wants_binary(name)``
    says which go in the binary section (None: none); ``parameters`` are the response's own
    (plain values), written when there are any."""
    doc: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request_id:
        doc["id"] = request_id
    if parameters:
        doc["parameters"] = dict(parameters)
    binary: list[Buffer] = []
    items = []
    for tensor, payload in zip(outputs, payloads, strict=True):
        item: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        params = dict(tensor.parameters) if tensor.parameters else {}
        if "shared_memory_region" in params:
            item["parameters"] = params
        elif wants_binary is not None and wants_binary(tensor.name):
            size = len(payload) if payload.__class__ is bytes else memoryview(payload).nbytes
            item["parameters"] = {**params, BINARY_DATA_SIZE: size}
            binary.append(payload)
        else:
            if params:
                item["parameters"] = params
            item["data"] = _json_values(tensor, payload)
        items.append(item)
    doc["outputs"] = items
    head = json.dumps(doc, separators=(",", ":")).encode()
    if not binary:
        return RestReply([head], None)
    return RestReply([head, *binary], len(head))


__all__ = [
    "BINARY_DATA",
    "BINARY_DATA_OUTPUT",
    "BINARY_DATA_SIZE",
    "BINARY_TYPE",
    "DEFAULT_JSON_DEPTH",
    "HEADER_LENGTH",
    "JSON_TYPE",
    "InferDocument",
    "JsonTooDeep",
    "RestInferRequest",
    "RestReply",
    "encode_infer_response",
    "infer_document",
    "input_shape",
    "load_json",
    "parse_infer_request",
]
