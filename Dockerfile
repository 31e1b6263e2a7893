# One image for every tokcap service; docker-compose.yml picks the subcommand.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY capture ./capture
COPY transports ./transports
COPY api ./api
COPY engine ./engine
COPY tokcap ./tokcap
RUN pip install . \
    && useradd --system --uid 10001 --home-dir /app tokcap
COPY deploy/tokcap.yaml /etc/tokcap/tokcap.yaml

USER tokcap
ENTRYPOINT ["tokcap"]
CMD ["--help"]
