#!/usr/bin/env bash
# The KServe Python model server the REST benchmark compares against (tools/bench/rest_peer.py)
# runs from its own environment, .venv-kserve: kserve pins protobuf, grpcio and numpy ranges
# that must not bind .venv. Re-running it installs only when the pinned version changed.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3.11}
KSERVE_REQ="kserve==0.21.0"
if [ ! -x .venv-kserve/bin/python ]; then
  echo "creating .venv-kserve"
  "$PY" -m venv .venv-kserve
fi
stamp=.venv-kserve/.kserve_trio-installed
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$KSERVE_REQ" ]; then
  echo "installing $KSERVE_REQ into .venv-kserve (first run: a minute or two)"
  .venv-kserve/bin/python -m pip install --quiet --disable-pip-version-check "$KSERVE_REQ"
  echo "$KSERVE_REQ" > "$stamp"
fi
.venv-kserve/bin/python -c "import importlib.metadata as m; print('kserve', m.version('kserve'))"
