"""The KServe V2 protocol as it is on the wire, for the servers and the client alike.

- ``codec``: ModelInfer messages <-> boundary ``NamedTensor`` values (both sides), metadata;
- ``infer_wire``: the one module that codes ``ModelInferRequest``/``ModelInferResponse``;
- ``wire``: the protobuf wire primitives the hand-coded messages use;
- ``grpc_wire``: the gRPC-over-HTTP/2 wire rules (prefix, timeouts, metadata, trailers);
- ``compression``: ``grpc-encoding`` gzip and deflate, bounded by the message cap;
- ``rest_codec``: the REST inference body with Triton's binary extension, both directions,
  with ``json_depth`` and ``json_numbers`` (bounded JSON before it is parsed);
- ``bytes_tensor``: BYTES tensors' length-prefixed encoding;
- ``request_bounds``: names and repeated fields bounded before any per-entry work;
- ``stream_answers``: the answers of a ModelStreamInfer stream.

Stands on ``core.tensors`` and ``core.process`` (``rest_codec`` reads the edge limits); never on
the bundle format. The worker's validation of a request against its model is the worker's
(``worker/validation.py``). The face loads nothing, so a module of the domain costs its own imports only (a client
coding ModelInfer does not load the REST body's): import from the modules.
"""
