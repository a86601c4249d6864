# One image for every Trident service: the API, the controller, Ray head and worker nodes.
# Everything is installed here, at build time; a container only runs its command.
#
#   docker build -t trident:cpu .                             # torch's CPU build (default)
#   docker build -t trident:cuda --build-arg VARIANT=cuda .   # torch's CUDA build, GPU nodes
#
# docker-compose.yml builds it (VARIANT from the environment, default cpu).
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0

FROM python:3.11-slim-bookworm AS base
# build-essential: DeepSpeed compiles its CPU Adam (optimizer offload) when a job first needs
# it. tini, the entrypoint, forwards SIGTERM and reaps what Ray's processes leave behind.
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential tini \
 && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/trident \
    PATH=/opt/trident/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
RUN python -m venv /opt/trident

# torch first, from the index of the variant: the project's own range (torch>=2.4) then keeps
# it, as `make install` does.
FROM base AS torch-cpu
ARG TORCH_VERSION
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"

FROM base AS torch-cuda
ARG TORCH_VERSION
# PyPI's Linux torch is the CUDA build and brings CUDA's libraries (and NCCL) as wheels; only
# the driver comes from the host, through the NVIDIA container toolkit. For another CUDA
# version: --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 (for example).
ARG TORCH_INDEX_URL=https://pypi.org/simple
RUN pip install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility

FROM torch-${VARIANT} AS trident
ARG VARIANT
WORKDIR /opt/trident/src
COPY pyproject.toml alembic.ini ./
COPY service service
COPY workers workers
COPY api api
COPY client client
COPY cli cli
COPY migrations migrations
COPY examples examples
RUN pip install . \
 && cd / && python -c "import torch, ray, api.app, service.control.daemon"

# Not root. /data holds checkpoints and logs (TRIDENT_DATA_DIR); a named volume mounted there
# starts out owned by this user.
RUN useradd --create-home --uid 1000 trident \
 && mkdir /data \
 && chown trident:trident /data
USER trident
# Out of the source tree, so that every process imports the installed packages.
WORKDIR /home/trident
ENV TRIDENT_DATA_DIR=/data
VOLUME /data
EXPOSE 8000
LABEL org.opencontainers.image.title="trident" \
      org.opencontainers.image.description="Trident ($VARIANT)"

ENTRYPOINT ["tini", "--"]
CMD ["trident", "--help"]
