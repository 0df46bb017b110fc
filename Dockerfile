# One image for every Talaria service; docker-compose.yml picks the module to run.
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# CPU torch from PyTorch's index (a GPU image would use the CUDA index instead).
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY talaria ./talaria
COPY migrations ./migrations
COPY ops ./ops
RUN pip install -e .
ENTRYPOINT ["python", "-m"]
