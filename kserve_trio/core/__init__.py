"""The substrate every other layer stands on, by domain. Never imports jax or server code; a
bare client can import all of it.

- ``core.tensors``: the data model every domain shares (``DType``, ``NamedTensor``);
- ``core.bundles``: the bundle format (manifests, the files of a bundle directory);
- ``core.memory``: shared-memory regions and their names, buffer pools;
- ``core.process``: process plumbing (configuration, node files, event loops, the upstream
  environment, restricted protocols);
- ``core.protocol``: the KServe V2 protocol (the codec, the ModelInfer wire, the gRPC wire
  rules, REST bodies, compression, request bounds, stream answers).

Three leaves every domain uses stay here: ``errors`` (the status-carrying exceptions),
``logging`` and ``plain`` (predicates on values read from YAML or JSON). The domains import
down the list above: ``tensors`` nothing of core's but those leaves, ``bundles`` and ``memory``
``tensors``, ``process`` ``memory`` (the shared-memory name rules its configuration checks),
``protocol`` ``tensors`` and ``process`` (the edge limits); ``tests/core/test_proto_fresh.py``
holds each domain to it. Each domain's face (its ``__init__``) re-exports the names code outside
the domain uses, and outside code imports them from the face only (``from kserve_trio.core.memory
import ShmRegistry``; ``tests/test_import_graph.py`` checks it); a domain's modules import each
other by module path, never through their own face. A face is eager: importing any module of a
domain loads the whole domain (none of them loads anything heavy).
"""
