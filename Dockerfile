# One image for every srl role: `srl`, `srl-producer`, `srl-consumer` (docker-compose.yml builds it).
# CPU torch by default; for GPUs build with --build-arg TORCH_INDEX_URL=<a CUDA wheel index>.
FROM python:3.11.13-slim-bookworm

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

WORKDIR /opt/srl
COPY pyproject.toml README.md ./
COPY srl ./srl
COPY schemas ./schemas
COPY producers ./producers
COPY consumers ./consumers
COPY ranker ./ranker
COPY app ./app
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" . \
 && python -c "from srl.tinymodel import build_tiny_model; build_tiny_model('/opt/srl/models/tiny')"

RUN useradd --create-home --uid 10001 srl
USER srl
WORKDIR /home/srl
CMD ["srl", "--help"]
