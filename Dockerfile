# One image for every Talaria service; docker-compose.yml picks the module to run.
# Build the wheel in one stage and install it (not `pip install -e .`) in the next, so the image
# runs exactly what a user's `pip install talaria_serving-*.whl` gets: one `talaria` import root with its
# migrations, audit queries and simulator data as package data.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY talaria ./talaria
COPY migrations ./migrations
COPY ops ./ops
RUN pip wheel --no-deps -w /wheels .

FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# CPU torch from PyTorch's index (a GPU image would use the CUDA index instead).
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# Mooncake's transfer engine moves migrated KV pages between agents (docs/migration.md); its
# wheel links the RDMA and NUMA user libraries, present even where only its TCP protocol runs.
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 librdmacm1 libnuma1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN pip install "$(ls /wheels/*.whl)[mooncake]" && rm -rf /wheels
# Services run as an unprivileged user. The directories named volumes mount on are its own, so
# a new volume (data, the generated secrets) starts owned by it; nothing else in the image is.
RUN useradd --system --uid 10001 --user-group --home-dir /app --shell /usr/sbin/nologin talaria \
    && mkdir -p /app /data /secrets && chown talaria:talaria /app /data /secrets && chmod 0700 /secrets
USER talaria:talaria
WORKDIR /app
ENTRYPOINT ["python", "-m"]
