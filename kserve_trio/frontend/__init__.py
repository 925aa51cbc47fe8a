"""A worker's front-end processes (``endpoints.frontend_processes`` > 1).

A front end serves the worker's gRPC and REST ports beside its siblings (SO_REUSEPORT) and
hands every request to the worker's device process over the node-local channel
(``serving.ipc``, whose ``DeviceLink`` is the channel's front-end side): ``process`` is the
process (its start, drain and end), ``forwarding`` the method table and REST app that forward. It imports
neither jax nor the worker: the device process is the only one that holds models.
"""
