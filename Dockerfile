# syntax=docker/dockerfile:1
# adaptlm server image: one `adaptlm serve` (one uvicorn process) on port 8000, serving the shipped default
# checkpoint. Configured only through ADAPTLM_* variables (server/settings.py); see docs/operations.md.
#   docker build -t adaptlm .                                  # CPU (the default): the CPU build of torch
#   docker build --build-arg VARIANT=cuda -t adaptlm:cuda .    # CUDA: torch's CUDA build (its CUDA libraries
#                                                              # come as wheels; the host gives the driver)
#   docker run -p 8000:8000 adaptlm            docker run --gpus all -p 8000:8000 adaptlm:cuda
# The install steps are `make serve`'s (the same torch pin, installed first, then the SDK and the server; the test
# tests/deploy/test_image.py holds them together): no dev or loadtest extras, nothing from apt.
ARG VARIANT=cpu
ARG TORCH=torch==2.13.0
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS python
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH

# torch first, pinned (as `make serve`): each variant's build of the same version.
# (DL3013: the pin is the TORCH argument, which hadolint does not expand.)
FROM python AS torch-cpu
ARG TORCH
# hadolint ignore=DL3013
RUN python -m venv /opt/venv && pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "${TORCH}"

FROM python AS torch-cuda
ARG TORCH
# hadolint ignore=DL3013
RUN python -m venv /opt/venv && pip install --no-cache-dir "${TORCH}"

# Then the SDK (clients/, the adaptlm-client distribution, which the server depends on: named here, pip takes it
# from the tree, never from an index) and the server (not editable: the runtime stage copies only the environment).
# (DL3006: torch-${VARIANT} is one of the stages above, not an image to tag.)
# hadolint ignore=DL3006
FROM torch-${VARIANT} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY adaptlm ./adaptlm
COPY models ./models
COPY kernels ./kernels
COPY server ./server
COPY clients ./clients
COPY trainer ./trainer
COPY loadtest ./loadtest
RUN pip install --no-cache-dir ./clients .

# The runtime: the virtual environment and the checkpoints, no compilers, no source tree, not root.
FROM python AS runtime
ARG VARIANT
# A numeric user, so that Kubernetes' runAsNonRoot can check it (deploy/k8s/).
RUN groupadd --system --gid 10001 adaptlm && useradd --system --create-home --uid 10001 --gid 10001 adaptlm \
    && mkdir -p /var/lib/adaptlm && chown adaptlm /var/lib/adaptlm
COPY --from=build /opt/venv /opt/venv
COPY checkpoints /app/checkpoints
WORKDIR /app
# NVIDIA_*: read by the NVIDIA container toolkit (the CUDA variant); harmless on the CPU one.
ENV ADAPTLM_HOST=0.0.0.0 ADAPTLM_PORT=8000 ADAPTLM_CHECKPOINT=/app/checkpoints/default \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
LABEL org.opencontainers.image.title="adaptlm" org.opencontainers.image.description="adaptlm server (${VARIANT})"
USER 10001:10001
EXPOSE 8000
# Ready once the model is loaded (503 before); the start period covers loading.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, httpx; httpx.get('http://127.0.0.1:%s/readyz' % os.environ.get('ADAPTLM_PORT', '8000'), timeout=2).raise_for_status()"]
CMD ["adaptlm", "serve"]
