"""The substrate every other layer stands on: dtypes, tensors, manifests, configuration, the
KServe V2 codec, errors, shared memory, buffer pools and logging. Never imports jax or
server code; a bare client can import all of it."""
