# adaptlm server image: the shipped default checkpoint served on port 8000.
#   docker build -t adaptlm . && docker run -p 8000:8000 adaptlm
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    ADAPTLM_HOST=0.0.0.0 ADAPTLM_PORT=8000

WORKDIR /app
RUN pip install --no-cache-dir "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY adaptlm ./adaptlm
COPY models ./models
COPY kernels ./kernels
COPY server ./server
COPY clients ./clients
COPY trainer ./trainer
COPY loadtest ./loadtest
COPY checkpoints ./checkpoints
RUN pip install --no-cache-dir . && useradd --create-home adaptlm \
    && mkdir -p /var/lib/adaptlm && chown adaptlm /var/lib/adaptlm
# In-memory sessions are written to the volume at `docker stop` (SIGTERM) and read back at start.
ENV ADAPTLM_CHECKPOINT=/app/checkpoints/default ADAPTLM_SESSION_SNAPSHOT=/var/lib/adaptlm/sessions.zip
VOLUME /var/lib/adaptlm
USER adaptlm
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=3s CMD python -c "import httpx; httpx.get('http://127.0.0.1:8000/readyz').raise_for_status()"
CMD ["adaptlm", "serve"]
