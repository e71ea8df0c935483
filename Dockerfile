# needle-net CPU image: the needle package (C++ CPU backend built here), the chain node
# and the worker, all behind the `needle-net` command.
#
#   docker build -t needle-net .
#
# Offline builds (no package index reachable from inside the build): put wheels of every
# dependency in deploy/wheels/ and build with --build-arg PIP_NO_INDEX=1; pick a local
# base image with --build-arg BASE_IMAGE=... (docs/deploy.md, "Building without a registry").
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
# python:3.11-slim ships Python's headers; a plain Debian base needs python3-dev for them.
RUN headers=$(python3 -c "import os, sysconfig; \
print('' if os.path.exists(sysconfig.get_paths()['include'] + '/Python.h') else 'python3-dev')") \
 && apt-get update \
 && apt-get install -y --no-install-recommends g++ make cmake ninja-build $headers \
 && rm -rf /var/lib/apt/lists/*
ARG PIP_NO_INDEX=0
ENV PIP_FIND_LINKS=/wheels PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    CMAKE_ARGS="-DNEEDLE_NATIVE=OFF"
COPY deploy/wheels /wheels
RUN python3 -m venv /opt/needle-net \
 && /opt/needle-net/bin/pip install "scikit-build-core>=0.10,<2" "pybind11>=2.12,<4"
# Dependencies in their own layer: rebuilt when pyproject.toml changes, not with every source.
COPY pyproject.toml /src/
RUN /opt/needle-net/bin/python -c "import tomllib; \
print('\n'.join(tomllib.load(open('/src/pyproject.toml', 'rb'))['project']['dependencies']))" \
    > /tmp/requirements.txt \
 && /opt/needle-net/bin/pip install -r /tmp/requirements.txt
COPY CMakeLists.txt README.md /src/
COPY csrc /src/csrc
COPY needle /src/needle
COPY verifier /src/verifier
COPY chain /src/chain
COPY node /src/node
RUN /opt/needle-net/bin/pip install --no-build-isolation --no-deps /src

FROM ${BASE_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/needle-net /opt/needle-net
ENV PATH=/opt/needle-net/bin:$PATH NEEDLE_NET_CACHE=/opt/needle-net/cache PYTHONUNBUFFERED=1
# Compile the market contract once at build time, not in every container on first start.
RUN python -c "from chain.compile import compiled_market; compiled_market()"
COPY deploy/worker-entrypoint.sh deploy/dev_faucet.py deploy/demo_operands.py /opt/needle-net/deploy/
RUN python /opt/needle-net/deploy/demo_operands.py /opt/needle-net/demo
WORKDIR /var/lib/needle-net
EXPOSE 8545 8600
CMD ["needle-net", "--help"]
