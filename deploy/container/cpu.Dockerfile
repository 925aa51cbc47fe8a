# syntax=docker/dockerfile:1
# kserve_trio, CPU image: the node supervisor serving a model repository mounted at /models.
#
#   docker build -f deploy/container/cpu.Dockerfile -t kserve-trio:0.1.0-cpu .
#   docker run --rm -p 8001:8001 -p 8002:8002 --shm-size=1g -v "$PWD/models:/models:ro" \
#       kserve-trio:0.1.0-cpu
#
# The build context is the repository root; cpu.Dockerfile.dockerignore keeps it to the files
# copied below. Every path, command, port and variable named here is checked against the
# project by tests/deploy/test_container.py. See docs/deploy.md.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kserve_trio ./kserve_trio
RUN python -m venv /app/.venv \
    && /app/.venv/bin/pip install --upgrade pip \
    && /app/.venv/bin/pip install .

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 kserve \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/kserve --create-home kserve \
    && install -d -o 10001 -g 10001 /run/kserve_trio /models
COPY --from=build /app/.venv /app/.venv
COPY deploy/container/node.yaml /etc/kserve_trio/node.yaml
COPY deploy/container/kserve-node.yaml /etc/kserve_trio/kserve-node.yaml
ENV PATH=/app/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/kserve \
    KSERVE_TRIO_NODE_FILE=/etc/kserve_trio/node.yaml \
    KSERVE_TRIO_RUNTIME_DIR=/run/kserve_trio
USER 10001:10001
WORKDIR /home/kserve
VOLUME ["/models"]
# 8001: KServe V2 gRPC. 8002: admin HTTP (/metrics, /healthz, /readyz).
EXPOSE 8001 8002
HEALTHCHECK --interval=15s --timeout=10s --start-period=300s --retries=3 \
    CMD ["/app/.venv/bin/python", "-m", "kserve_trio", "probe", "--timeout", "5"]
ENTRYPOINT ["/app/.venv/bin/python", "-m", "kserve_trio"]
CMD ["node"]
