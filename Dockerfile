# StaleFlow image: every role is `docker run IMAGE <staleflow subcommand>` (ENTRYPOINT staleflow).
#   docker build -t staleflow:0.1.0 .                                   # CPU torch (default)
#   docker build --build-arg TORCH_INDEX_URL=https://pypi.org/simple -t staleflow:0.1.0-cuda .
# Stage 1 builds the wheel; stage 2 installs only the wheel (pure Python: no compiler needed
# anywhere), so the final image holds no sources, build tools or caches.
# Base image: an exact Python release on a named Debian release; pin its digest
# (python:3.11.14-slim-bookworm@sha256:...) in your registry mirror for byte-identical builds.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
WORKDIR /src
RUN pip install --no-cache-dir build==1.2.2.post1
COPY pyproject.toml README.md ./
COPY api ./api
COPY migrations ./migrations
COPY staleflow_cli ./staleflow_cli
COPY staleflow_db ./staleflow_db
COPY workers ./workers
RUN python -m build --wheel --outdir /dist

FROM ${PYTHON_IMAGE}
# torch first, on its own index: PyPI's Linux torch is a CUDA build of several GB; the CPU
# index keeps the image small. EXTRAS: `server` (database, API: every role runs from one image),
# `torch` (CPU engines, trainer, PS), `vllm` on GPUs; a worker-only image: `worker,torch[,vllm]`.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=server,torch
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    STALEFLOW_HOME=/var/lib/staleflow
# uid/gid 10001: the ids the Kubernetes manifests run as (runAsUser, fsGroup).
RUN groupadd --gid 10001 staleflow \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /var/lib/staleflow --shell /usr/sbin/nologin staleflow \
    && mkdir -p /var/lib/staleflow /data \
    && chown staleflow:staleflow /var/lib/staleflow /data
COPY --from=builder /dist/ /tmp/dist/
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}" \
    && pip install --no-cache-dir "$(ls /tmp/dist/staleflow-*.whl)[${EXTRAS}]" \
    && rm -rf /tmp/dist
USER 10001:10001
WORKDIR /var/lib/staleflow
EXPOSE 8000 8790
ENTRYPOINT ["staleflow"]
CMD ["--help"]
