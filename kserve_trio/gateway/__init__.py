"""The gateway: one KServe V2 gRPC endpoint in front of many workers.

It never imports jax, ``kserve_trio.runtime`` or ``kserve_trio.worker``: it stands on ``core``,
``serving`` and the client transport only.
"""
