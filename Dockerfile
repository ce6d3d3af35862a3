# redjax: one image for every process (`redjax serve | api | worker | dashboard | generate | bench`).
#
#   docker build -t redjax .                                    # CPU build of JAX (the default)
#   docker build -t redjax --build-arg JAX_EXTRA=cuda12 .       # NVIDIA GPUs: installs jax[cuda12]
#   docker run --rm -p 8000:8000 redjax                         # whole stack on the demo model
#   docker run --rm -p 8000:8000 -v /path/to/hf-model:/models/model:ro redjax redjax serve --model /models/model
#
# No weights are downloaded, at build time or at run time: the image carries the small demo model
# that ships inside the package, and any other model is a local Hugging Face directory mounted in.
FROM python:3.11-slim

# Empty: the CPU build of JAX that `pip install .` brings. "cuda12": also install jax[cuda12]
# (the CUDA 12 wheels, plugin included), for workers that run on NVIDIA GPUs.
ARG JAX_EXTRA=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# g++: workers build the CPU paged-attention kernel on first start (for the host's own CPU)
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml README.md ./
COPY api ./api
COPY dashboard ./dashboard
COPY worker ./worker
RUN pip install . \
    && if [ -n "$JAX_EXTRA" ]; then pip install "jax[${JAX_EXTRA}]==$(python -c 'import jax; print(jax.__version__)')"; fi \
    && cd / && rm -rf /src

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin redjax \
    && mkdir -p /models && chown redjax:redjax /models
USER redjax
WORKDIR /home/redjax

# `redjax serve` and `redjax api` bind 127.0.0.1 by default; in a container they must listen on
# every interface to be reachable through a published port. Same for `redjax dashboard`.
ENV REDJAX_API_HOST=0.0.0.0 \
    REDJAX_DASHBOARD_HOST=0.0.0.0

# 8000: the API (and, under `redjax serve`, the dashboard at /dashboard/); 8001: `redjax dashboard`.
EXPOSE 8000 8001

CMD ["redjax", "serve"]
