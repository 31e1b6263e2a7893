# One image for every tokcap service; docker-compose.yml picks the subcommand. Two targets:
# product (the default: the front end and the workers) and devtools (also the development
# engine, for the local stack's engine service).
FROM python:3.11-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY capture ./capture
COPY transports ./transports
COPY api ./api
COPY tokcap ./tokcap
RUN pip install '.[report]' \
    && useradd --system --uid 10001 --home-dir /app tokcap
COPY deploy/tokcap.yaml /etc/tokcap/tokcap.yaml

FROM base AS devtools
COPY devtools ./devtools
RUN pip install ./devtools
USER tokcap
ENTRYPOINT ["tokcap"]
CMD ["--help"]

FROM base AS product
USER tokcap
ENTRYPOINT ["tokcap"]
CMD ["--help"]
