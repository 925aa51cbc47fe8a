"""What the memory tests read of a server process and send it: /proc figures (RSS, its peak,
open descriptors), deadline loops, and the mlp request of the demo repository."""

from __future__ import annotations

import os

import numpy as np
import tritonclient.grpc as grpcclient

from kserve_trio.proto import inference as pb
from tests.gateway.procs import Proc
from tests.sockets import tcp_sockets
from tests.waiting import wait_until

MiB = 1 << 20

RETURNED_BYTES = 64 * MiB
"""How near its resident size before an attack a process comes back once the attack is over
(its idle trim gives the freed heap back; without it the peak stays for good)."""
RETURN_SECONDS = 30.0
"""The bound on that: the idle trim's quiet time and tick, with room for a loaded machine."""


def status_kib(pid: int, field: str) -> int:
    """A ``/proc/<pid>/status`` figure in KiB (``VmRSS``, ``VmHWM``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss(pid: int) -> int:
    """Resident bytes now."""
    return status_kib(pid, "VmRSS") << 10


def peak_rss(pid: int) -> int:
    """The most resident bytes the process has had (VmHWM)."""
    return status_kib(pid, "VmHWM") << 10


def reset_peak(pid: int) -> int:
    """Reset the process's peak resident size (VmHWM) to its resident size now, so what a test
    reads next is its own peak and not an earlier test's; returns that size in bytes."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    return rss(pid)


def peak_growth_mib(pid: int, before: int) -> float:
    """How far the peak resident size rose above ``before`` bytes (``reset_peak``'s figure),
    in MiB."""
    return (peak_rss(pid) - before) / MiB


def rss_comes_back(pid: int, start: int, what: str, within: int = RETURNED_BYTES) -> int:
    """Wait until the process's resident size is within ``within`` bytes of ``start`` bytes;
    the resident bytes then."""
    try:
        wait_until(lambda: rss(pid) - start < within, RETURN_SECONDS, what)
    except AssertionError:
        raise AssertionError(
            f"{what}: RSS {rss(pid) // MiB} MiB not back within {within // MiB} MiB "
            f"of {start // MiB} MiB in {RETURN_SECONDS} s"
        ) from None
    return rss(pid)


def trimmed_rss(server: Proc, since: int, what: str) -> int:
    """The resident bytes right after the first idle trim ``server`` logged past character
    ``since`` of its log (its ``heap_trimmed`` event: the process must log at debug level).
    Unlike the resident size read at any moment, which keeps the allocator's high-water mark
    until the trim and so moves with how a round's frees happened to fragment the heap, this
    is what the process still holds."""
    trims = wait_until(
        lambda: server.events("heap_trimmed", since), RETURN_SECONDS, f"{what}: an idle trim logged"
    )
    return int(trims[0]["resident_after"])


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def accepted_on(pid: int, port: int) -> int:
    """How many connections the process holds open on its listening ``port`` (its sockets
    whose local port that is, the listener left out): one its server has closed is gone."""
    return sum(1 for s in tcp_sockets(pid) if s.local_port == port and not s.listening)


def mlp_input(rows: int = 1, value: float = 1.0) -> grpcclient.InferInput:
    x = np.full((rows, 16), value, np.float32)
    inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def mlp_request_bytes(rows: int = 1, request_id: str = "") -> bytes:
    """A serialized ModelInferRequest for ``mlp`` (raw HTTP/2 clients send it as it is)."""
    x = np.ones((rows, 16), np.float32)
    return bytes(
        pb.ModelInferRequest(
            model_name="mlp",
            id=request_id,
            inputs=[
                pb.ModelInferRequestInferInputTensor(
                    name="input_0", datatype="FP32", shape=[rows, 16]
                )
            ],
            raw_input_contents=[x.tobytes()],
        )
    )


def served_ok(client: grpcclient.InferenceServerClient) -> bool:
    """A well-behaved client is served: one mlp inference answers the right shape."""
    result = client.infer("mlp", [mlp_input()], client_timeout=30)
    output = None if result is None else result.as_numpy("output")
    return output is not None and output.shape == (1, 8)
