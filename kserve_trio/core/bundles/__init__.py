"""The bundle format: what a compiled model is on disk.

- ``manifest``: ``manifest.yaml`` parsed into a ``Manifest``, with no filesystem access;
- ``bundle``: every file name of a bundle directory and every rule about it (loading and
  validating a bundle's manifest against its files).

Stands on ``core.tensors`` (manifests name dtypes); the protocol, memory and process domains are
not its business. The face loads nothing: import from the modules.
"""
