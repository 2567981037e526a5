# keygate container image.
#
#   docker build -t keygate .
#   docker run --rm -p 8080:8080 -e KEYGATE_NATS_URL=nats://nats:4222 \
#     -e KEYGATE_AUTH_HS256_SECRET="$(openssl rand -base64 48)" keygate
#
# The image listens on 0.0.0.0:8080, where keygate refuses to start without a
# verification key (KEYGATE_AUTH_HS256_SECRET, KEYGATE_AUTH_PUBLIC_KEY or
# KEYGATE_AUTH_JWKS). deploy/ has Kubernetes manifests and a compose file.
#
# Stage 1 builds the release binary; its dependencies are compiled in a layer
# of their own, so editing src/ does not recompile them. Stage 2 is a slim
# Debian runtime with keygate, nats-server (for the embedded default, when no
# KEYGATE_NATS_URL is given) and CA certificates, running as uid 10001.

FROM rust:1.95-bookworm AS build
WORKDIR /src

# Dependency layer: the manifest and lock file with stub sources for every
# target Cargo.toml declares (Cargo refuses a manifest whose targets are
# missing). Rebuilt only when Cargo.toml or Cargo.lock change.
COPY Cargo.toml Cargo.lock ./
COPY testkit/Cargo.toml ./testkit/
RUN mkdir -p src benches tests/it testkit/src \
    && printf 'fn main() {}\n' > src/main.rs \
    && : > src/lib.rs \
    && : > testkit/src/lib.rs \
    && for f in benches/publish.rs benches/delivery.rs benches/websocket.rs benches/soak.rs benches/cluster.rs \
        tests/it/main.rs; do printf 'fn main() {}\n' > "$f"; done \
    && cargo build --release --locked --bin keygate \
    && rm -rf src benches tests testkit/src

# The real sources. COPY keeps the files' own (older) modification times, so
# touch the crate roots: otherwise Cargo could take the stub build as fresh.
COPY src ./src
COPY benches ./benches
COPY tests ./tests
COPY testkit/src ./testkit/src
RUN touch src/main.rs src/lib.rs \
    && cargo build --release --locked --bin keygate \
    && ./target/release/keygate --version

# The official nats image (scratch-based on Linux) holds one static binary,
# /nats-server.
FROM nats:2.12 AS nats

FROM debian:bookworm-slim
LABEL org.opencontainers.image.title="keygate" \
      org.opencontainers.image.description="Ordered-per-key processing on NATS JetStream for HTTP and WebSocket clients" \
      org.opencontainers.image.licenses="Apache-2.0"

# ca-certificates: TLS to NATS and to HTTPS webhook endpoints. Left unpinned
# on purpose so a rebuild picks up Debian's security updates.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 keygate \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/keygate --shell /usr/sbin/nologin keygate \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/keygate /var/lib/keygate/data

COPY --from=nats /nats-server /usr/local/bin/nats-server
COPY --from=build /src/target/release/keygate /usr/local/bin/keygate

# Numeric, so Kubernetes' runAsNonRoot can verify it without /etc/passwd.
USER 10001:10001
WORKDIR /var/lib/keygate

# KEYGATE_DATA_DIR holds the embedded nats-server's store; mount a volume
# there when running without KEYGATE_NATS_URL (development only).
ENV KEYGATE_LISTEN=0.0.0.0:8080 \
    KEYGATE_DATA_DIR=/var/lib/keygate/data \
    KEYGATE_LOG_FORMAT=json

# 8080: the API. 9090: the admin listener (/healthz, /readyz, /metrics) when
# KEYGATE_ADMIN_LISTEN=0.0.0.0:9090 is set.
EXPOSE 8080 9090

HEALTHCHECK --interval=10s --timeout=5s --start-period=15s --retries=3 CMD ["keygate", "healthcheck"]
ENTRYPOINT ["keygate"]
CMD ["serve"]
