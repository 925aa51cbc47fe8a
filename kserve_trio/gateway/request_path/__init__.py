"""The request path: what the gateway does with one client call, from the bytes it receives to
the worker that answers.

The rest of the gateway uses this package through the names below only (the composition root,
``gateway/server.py``, builds them). Its parts, by what they decide:

- ``peek``: the few routing fields of a raw request, read without decoding it;
- ``admission``: the inbound cap (per known worker) and the drain;
- ``forward``: one ModelInfer routed, forwarded as raw bytes, failed over and accounted
  (``Forwarder``);
- ``stream``: ModelStreamInfer, the shared stream engine over the forwarder;
- ``fanout`` and ``aggregate``: the RPCs answered by asking every ready worker (``Fleet``),
  and the pure merges of their answers;
- ``shm_fanout``: shared-memory Register/Unregister fanned out to the workers, and the
  registrations replayed to a worker that comes back;
- ``service``: the gRPC surface (``GatewayService``);
- ``rest_forward`` and ``rest``: the REST surface (model requests forwarded to a replica's REST
  port; the rest through the gRPC service's fleet RPCs).

It stands on the fleet (``gateway/fleet/``: the pool, the routing table and policies, the
route refresher), on ``caller_headers`` (set here for each call, read by the pool) and on
``metrics``; nothing in the fleet or in ``placement`` imports it. ``shm_record`` (the
registrations shared by several gateway processes, in a file) stays at the gateway's top: it
keeps this package's registrations in the processes' layout, so this package never imports
``processes/``.
"""

from kserve_trio.gateway.request_path.admission import Admission
from kserve_trio.gateway.request_path.fanout import Fleet
from kserve_trio.gateway.request_path.forward import Forwarder, RegisterGates
from kserve_trio.gateway.request_path.rest import serve_rest
from kserve_trio.gateway.request_path.service import GatewayService
from kserve_trio.gateway.request_path.shm_fanout import ShmFanout, ShmRegistrations

__all__ = [
    "Admission",
    "Fleet",
    "Forwarder",
    "GatewayService",
    "RegisterGates",
    "ShmFanout",
    "ShmRegistrations",
    "serve_rest",
]
