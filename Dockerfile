# One image for every kvguard role: backend prefill/decode/unified, gateway, admin (migrations),
# canary probes. The command picks the role: `docker run kvguard gateway`, `... backend decode`.
# CPU build; GPU hosts build FROM a CUDA base and install the CUDA wheel of the same torch release.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LITELLM_LOCAL_MODEL_COST_MAP=True \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

# The Debian libraries the environment's native code links against beyond the base image (glibc,
# libstdc++, zlib): Mooncake's transfer engine needs libibverbs.so.1, libnuma.so.1 and
# libcurl.so.4. tests/ops/test_ops_image.py reads every shared object the pip installs below put
# in the image and fails when one needs a library no package here (or in the base) provides.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 kvguard
WORKDIR /app

# Dependencies first (cached layer): the CPU torch wheel, then the rest of the project's pins.
COPY pyproject.toml README.md ./
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"

COPY kvguard ./kvguard
COPY backend ./backend
COPY gateway ./gateway
COPY canary ./canary
COPY migrations ./migrations
COPY dashboards ./dashboards
RUN pip install ".[mooncake]"

USER kvguard
# Health checks in compose.yaml use this interpreter (no curl in the image).
EXPOSE 8000 8100
ENTRYPOINT ["kvguard"]
CMD ["--help"]
