#!/usr/bin/env bash
# One entry point for a fresh machine: `tools/dev.sh serve` sets up the environment, writes the
# demo model repository (./models) if absent and serves it on 127.0.0.1:8001;
# `tools/dev.sh test` sets up the environments (.venv, .venv-triton for the stock-Triton peer
# and .venv-deploy for the deployment checks), type-checks kserve_trio with pyright (basic mode,
# configured in pyproject.toml; any error fails the run) and runs the whole test suite, slow
# tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3

say() { echo "dev.sh: $*" >&2; }

setup() {
  if [ ! -x .venv/bin/python ]; then
    say "creating the virtual environment .venv ($("$PY" --version))"
    "$PY" -m venv .venv
  fi
  # Reinstall only when the project metadata changed since the last setup.
  stamp=.venv/.kserve_trio-installed
  want=$(sha256sum pyproject.toml | cut -d' ' -f1)
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    say "installing kserve_trio and its dependencies into .venv (first run: a few minutes)"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev,torch,tracing]'
    echo "$want" > "$stamp"
  fi
}

# The stock-Triton peer of the interoperability test (tests/e2e/test_triton_peer.py) runs from
# its own environment: nvidia-pytriton pins tritonclient ~= 2.50, which must not reach .venv.
TRITON_REQ="nvidia-pytriton==0.7.0"
setup_triton() {
  if [ ! -x .venv-triton/bin/python ]; then
    say "creating .venv-triton for the stock Triton peer of the interoperability test"
    "$PY" -m venv .venv-triton
  fi
  stamp=.venv-triton/.kserve_trio-installed
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$TRITON_REQ" ]; then
    say "installing $TRITON_REQ into .venv-triton (first run: about a minute)"
    .venv-triton/bin/python -m pip install --quiet --disable-pip-version-check "$TRITON_REQ"
    echo "$TRITON_REQ" > "$stamp"
  fi
}

# The deployment tests' schema checkers (tests/deploy/) run from their own environment: the
# kserve SDK brings a model-server stack (fastapi, uvicorn, pandas, ~55 packages) and upper
# pins on protobuf, grpcio-tools, numpy and psutil that must not bind .venv.
DEPLOY_REQ="kserve==0.21.0 kubernetes-validate==1.37.0 promql-parser==0.11.0"
setup_deploy() {
  if [ ! -x .venv-deploy/bin/python ]; then
    say "creating .venv-deploy for the deployment manifests' schema checkers"
    "$PY" -m venv .venv-deploy
  fi
  stamp=.venv-deploy/.kserve_trio-installed
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$DEPLOY_REQ" ]; then
    say "installing $DEPLOY_REQ into .venv-deploy (first run: about a minute)"
    # shellcheck disable=SC2086
    .venv-deploy/bin/python -m pip install --quiet --disable-pip-version-check $DEPLOY_REQ
    echo "$DEPLOY_REQ" > "$stamp"
  fi
}

cmd=${1:-help}
shift || true
case "$cmd" in
  serve)
    setup
    if [ ! -d models ]; then
      say "writing the demo models (mlp, cnn, scale4, mlp_bf16, mlp_softmax) to ./models"
      .venv/bin/python -m kserve_trio bundle demo models
    fi
    say "serving ./models on 127.0.0.1:8001 (Ctrl-C stops)"
    exec .venv/bin/python -m kserve_trio worker --model-repo models "$@"
    ;;
  test)
    # Each phase says how long it took, so a slow run names its slow part.
    started=$SECONDS
    setup
    setup_triton
    setup_deploy
    say "environments ready ($((SECONDS - started)) s)"
    phase=$SECONDS
    say "type-checking kserve_trio (pyright, basic mode)"
    .venv/bin/pyright
    say "pyright done ($((SECONDS - phase)) s)"
    phase=$SECONDS
    # Three processes, a test file at a time each (a module's fixtures stay in one process):
    # on 2 cores three finish sooner than two, because many tests wait on a subprocess or a
    # socket (docs/benchmarks/history.md, "Test suite"). KSERVE_TRIO_TEST_PROCS sets how many
    # (1: one process, no xdist). Files are handed out in collection order, which puts the
    # longest first (tests/conftest.py); xdist's default hands out the files with the most
    # tests first, and the long ones, which start processes and have few tests, ran last.
    procs=${KSERVE_TRIO_TEST_PROCS:-3}
    # Bytecode is written and read back: the suite starts a few hundred Python processes and
    # pytest rewrites every test file's asserts, each once per process when an environment
    # sets PYTHONDONTWRITEBYTECODE (git-ignored __pycache__; docs/benchmarks.md, "Test suite").
    unset PYTHONDONTWRITEBYTECODE
    .venv/bin/python -m compileall -q kserve_trio tests tools > /dev/null
    say "running the test suite (slow tests included, $procs processes)"
    status=0
    if [ "$procs" -gt 1 ]; then
      .venv/bin/python -m pytest --run-slow -n "$procs" --dist loadfile --no-loadscope-reorder "$@" || status=$?
    else
      .venv/bin/python -m pytest --run-slow "$@" || status=$?
    fi
    say "tests done ($((SECONDS - phase)) s; everything: $((SECONDS - started)) s)"
    exit "$status"
    ;;
  *)
    echo "usage: tools/dev.sh serve|test [args...]" >&2
    exit 2
    ;;
esac
