# The preheat image: one binary that runs every component (gateway, workers, scaler,
# warm-pool agent), built with the CUDA backend. libcuda comes from the node's driver
# through the NVIDIA container toolkit; cuBLAS and NVRTC, which the binary loads at run
# time, ship in the image (from NVIDIA's PyPI wheels). Without a GPU every engine runs
# on the CPU.
#
#   docker build -t REGISTRY/preheat:TAG .                   # full build (default target)
#   docker build --target prebuilt -t preheat:dev .          # the binary cargo built here
#
# BASE is any glibc Debian 12 image; air-gapped builds pass one made with mmdebstrap
# (see README, "Container image").
ARG BASE=debian:bookworm-slim
ARG RUST=rust:1-bookworm

# Shared by both runtime targets: no shell step, so it also builds where no container
# can run (a plain rootfs imported as the base works).
FROM ${BASE} AS runtime-base
ENV LD_LIBRARY_PATH=/usr/local/lib/preheat-cuda \
    RUST_LOG=info
# The chart runs every pod as this user, with a read-only root filesystem.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/preheat"]
CMD ["--help"]

# The binary cargo built on this machine (`cargo build --release --features cuda`) and
# the CUDA libraries fetched beside it (`.ci/fetch-tools` puts NVRTC in
# .cache/cuda-libs; add cuBLAS there for GPU serving). CI builds this one.
FROM runtime-base AS prebuilt
ARG BINARY=target/release/preheat
COPY ${BINARY} /usr/local/bin/preheat
COPY .cache/cuda-libs/ /usr/local/lib/preheat-cuda/

# The full build from source.
FROM ${RUST} AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --features cuda --bin preheat \
    && install -m 0755 target/release/preheat /preheat

FROM ${BASE} AS cuda-libs
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-pip \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir --break-system-packages --target /opt/nvidia \
        nvidia-cublas-cu12==12.9.1.4 nvidia-cuda-nvrtc-cu12==12.9.86 \
    && mkdir -p /opt/cuda-libs \
    && cp -a /opt/nvidia/nvidia/cublas/lib/*.so* /opt/nvidia/nvidia/cuda_nvrtc/lib/*.so* /opt/cuda-libs/

FROM runtime-base AS runtime
COPY --from=build /preheat /usr/local/bin/preheat
# The slim base has no CA bundle; https model sources and Prometheus need one (add a
# private CA with SSL_CERT_FILE). The mmdebstrap base carries ca-certificates.
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=cuda-libs /opt/cuda-libs/ /usr/local/lib/preheat-cuda/
