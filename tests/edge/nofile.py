"""``python -m tests.edge.nofile N COMMAND...``: run COMMAND with its open-file limit at N
(soft and hard), as ``prlimit --nofile=N:N`` would, without forking from a threaded test
process (a ``preexec_fn`` would)."""

from __future__ import annotations

import os
import resource
import sys

if __name__ == "__main__":
    limit, argv = int(sys.argv[1]), sys.argv[2:]
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    os.execv(argv[0], argv)
