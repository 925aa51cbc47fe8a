"""``weights.safetensors``: reading its header, memory-mapping its tensors, and writing it.

A bundle's weights are the trailing arguments of every module, in the order of the JSON list
``__metadata__["argument_order"]``. This module owns that file format for both
directions, with numpy only (no jax):

* ``read_weights_index`` parses the header alone: names, dtypes, shapes, byte ranges and the
  footprint (``nbytes``) without reading any tensor data;
* ``WeightsIndex.host_arrays`` maps the file once and returns zero-copy read-only views in
  argument order (what ``transfer_to_device`` then copies to the device);
* ``write_weights`` writes a file any safetensors reader accepts, bf16 and fp8 included (the
  ``safetensors`` package's numpy writer has no bfloat16).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kserve_trio.core.errors import BundleError
from kserve_trio.core.tensors import DType, dtype_of

ARGUMENT_ORDER_KEY = "argument_order"
MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype string <-> DType
SAFETENSORS_DTYPES: dict[str, DType] = {
    "BOOL": DType.BOOL,
    "U8": DType.U8,
    "U16": DType.U16,
    "U32": DType.U32,
    "U64": DType.U64,
    "I8": DType.I8,
    "I16": DType.I16,
    "I32": DType.I32,
    "I64": DType.I64,
    "F16": DType.F16,
    "BF16": DType.BF16,
    "F32": DType.F32,
    "F64": DType.F64,
    "F8_E5M2": DType.F8_E5M2,
    "F8_E4M3": DType.F8_E4M3,
}
_DTYPE_STRINGS = {d: s for s, d in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True, slots=True)
class WeightEntry:
    """One tensor of the file: row-major ``shape`` and absolute byte range ``[start, end)``."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class WeightsIndex:
    """The header of a weights file: the argument-order entries and the file's tensor count.

    ``entries`` follow ``argument_order``; ``n_tensors`` counts every tensor in the file (what
    the arity report calls the file's weights). ``nbytes`` is the footprint of the argument
    entries, computed from the header only.
    """

    path: Path
    entries: tuple[WeightEntry, ...]
    n_tensors: int
    metadata: Mapping[str, str]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def host_arrays(self) -> list[np.ndarray]:
        """Read-only numpy views of every entry over one memory map of the file, in order.

        The map stays alive as long as any view does; nothing is read until a view is touched.
        """
        if not self.entries:
            return []
        with open(self.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                mm: mmap.mmap | bytes = b""
            else:
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        out: list[np.ndarray] = []
        for e in self.entries:
            count = int(np.prod(e.shape, dtype=np.int64))
            arr = np.frombuffer(mm, dtype=e.dtype.numpy, count=count, offset=e.start)
            out.append(arr.reshape(e.shape))
        return out


def _err(bundle: str, path: Path, rule: str) -> BundleError:
    return BundleError(f"bundle '{bundle}' ({path.parent}): {rule}")


def read_weights_index(path: str | os.PathLike[str], *, bundle: str | None = None) -> WeightsIndex:
    """Parse a ``weights.safetensors`` header. Rules (each a ``BundleError`` naming the bundle):

    1. the file exists and starts with an 8-byte little-endian header length and a JSON object;
    2. every tensor entry has a known ``dtype``, a non-negative integer ``shape`` and
       ``data_offsets`` inside the data section spanning exactly ``prod(shape) * itemsize``;
    3. a file with tensors has ``__metadata__.argument_order``, a JSON list of distinct names;
       a file without tensors has no weights;
    4. every name in ``argument_order`` is a tensor of the file ("weight 'x' missing from
       safetensors").
    """
    p = Path(path)
    name = bundle or p.parent.name
    try:
        with open(p, "rb") as fh:
            head = fh.read(8)
            size = os.fstat(fh.fileno()).st_size
            if len(head) < 8:
                raise _err(name, p, f"{p.name} is too short to be a safetensors file")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
                raise _err(name, p, f"{p.name} has a header length of {hlen} bytes beyond the file")
            raw = fh.read(hlen)
    except FileNotFoundError:
        raise _err(name, p, f"missing {p.name}") from None
    except OSError as exc:
        raise _err(name, p, f"cannot read {p.name}: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _err(name, p, f"{p.name} header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _err(name, p, f"{p.name} header is not a JSON object")
    data_start = 8 + hlen
    data_len = size - data_start
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise _err(name, p, f"{p.name} __metadata__ is not a JSON object")

    tensors: dict[str, WeightEntry] = {}
    for tname, info in header.items():
        if not isinstance(info, dict):
            raise _err(name, p, f"weight '{tname}' has a malformed header entry")
        dt = info.get("dtype")
        dtype = SAFETENSORS_DTYPES.get(dt) if isinstance(dt, str) else None
        if dtype is None:
            raise _err(name, p, f"weight '{tname}' has unknown dtype '{dt}' in {p.name}")
        shape = info.get("shape")
        offs = info.get("data_offsets")
        if not (
            isinstance(shape, list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise _err(name, p, f"weight '{tname}' has a malformed shape {shape!r}")
        if not (
            isinstance(offs, list)
            and len(offs) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            and 0 <= offs[0] <= offs[1] <= data_len
        ):
            raise _err(name, p, f"weight '{tname}' has data_offsets {offs!r} outside the file")
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if offs[1] - offs[0] != expected:
            raise _err(
                name,
                p,
                f"weight '{tname}' spans {offs[1] - offs[0]} bytes but {dt}{shape} needs "
                f"{expected}",
            )
        tensors[tname] = WeightEntry(
            tname, dtype, tuple(shape), data_start + offs[0], data_start + offs[1]
        )

    order_raw = meta.get(ARGUMENT_ORDER_KEY)
    if order_raw is None:
        if tensors:
            raise _err(name, p, f"{p.name} has tensors but no __metadata__ '{ARGUMENT_ORDER_KEY}'")
        order: list[str] = []
    else:
        try:
            order = json.loads(order_raw) if isinstance(order_raw, str) else order_raw
        except json.JSONDecodeError:
            order = None  # type: ignore[assignment]
        if not (isinstance(order, list) and all(isinstance(n, str) for n in order)):
            raise _err(
                name, p, f"{p.name} __metadata__ '{ARGUMENT_ORDER_KEY}' is not a JSON list of names"
            )
        dups = sorted(n for n, count in Counter(order).items() if count > 1)
        if dups:
            raise _err(name, p, f"{p.name} argument_order repeats {dups}")
    for n in order:
        if n not in tensors:
            raise _err(name, p, f"weight '{n}' missing from safetensors")
    return WeightsIndex(
        path=p,
        entries=tuple(tensors[n] for n in order),
        n_tensors=len(tensors),
        metadata={k: v for k, v in meta.items() if isinstance(v, str)},
    )


def write_weights(
    path: str | os.PathLike[str],
    weights: Sequence[tuple[str, np.ndarray]],
    *,
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write ``weights`` (ordered ``(name, array)`` pairs) as a safetensors file whose
    ``argument_order`` is that order; returns the data size in bytes.

    Tensors are stored contiguously in the given order (the format forbids holes); the header
    is padded with spaces to a multiple of 8 bytes. Names must be distinct.
    """
    names = [n for n, _ in weights]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"duplicate weight names: {dups}")
    header: dict[str, object] = {}
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    meta[ARGUMENT_ORDER_KEY] = json.dumps(names)
    header["__metadata__"] = meta
    arrays: list[np.ndarray] = []
    offset = 0
    for n, a in weights:
        arr = np.asarray(a)
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")  # (np.ascontiguousarray would turn a 0-d array into 1-d)
        try:
            dt = _DTYPE_STRINGS[dtype_of(arr.dtype)]
        except (KeyError, ValueError):
            raise ValueError(
                f"weight '{n}' has dtype {arr.dtype} with no safetensors type"
            ) from None
        header[n] = {
            "dtype": dt,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for arr in arrays:
            fh.write(arr.reshape(-1).view(np.uint8).data)
    return offset


__all__ = [
    "ARGUMENT_ORDER_KEY",
    "SAFETENSORS_DTYPES",
    "WeightEntry",
    "WeightsIndex",
    "read_weights_index",
    "write_weights",
]
