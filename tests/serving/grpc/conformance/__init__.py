"""A conformance suite on raw HTTP/2 frames, in the spirit of h2spec: RFC 9113 (HTTP/2),
RFC 7541 (HPACK) and gRPC over HTTP/2, case by case, against the CLI worker, the CLI gateway
and a worker's front end (``test_conformance``). The cases are a table (``cases``); the raw
client that sends them is a plain socket (``raw_client``) writing what ``frames`` builds;
``expect`` holds what a case expects and how the answer is judged; ``targets`` the servers."""
