"""Process plumbing: how a server process is configured and what it runs on.

- ``config``: a worker's typed configuration (``ServerConfig``), its YAML schema, environment
  overrides, validation and reporting, and the edge limits (``EdgeLimits``);
- ``node``: node files (``node.yaml``) and the resolution of one worker's configuration;
- ``event_loops``: the event loops the project runs on and the reaches below anyio;
- ``upstream_env``: the upstream server's ``REACTANT_*`` variables read as their new names;
- ``restricted``: restricted protocols (RPC groups that need a header), parsed from the
  configuration and checked by the servers.

Stands on ``core.memory`` (the configuration checks shared-memory name prefixes); never on the
protocol or bundle domains. The face loads nothing: import from the modules.
"""
