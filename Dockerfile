# keygate: build in a Rust image, run as a non-root user in a slim image
# that also carries nats-server for the embedded default.

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock rustfmt.toml ./
COPY src ./src
COPY benches ./benches
COPY tests ./tests
COPY openapi ./openapi
RUN cargo build --release --locked --bin keygate

FROM nats:2.12-alpine AS nats

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /var/lib/keygate --create-home keygate
COPY --from=nats /usr/local/bin/nats-server /usr/local/bin/nats-server
COPY --from=build /src/target/release/keygate /usr/local/bin/keygate
USER keygate
WORKDIR /var/lib/keygate
ENV KEYGATE_LISTEN=0.0.0.0:8080 \
    KEYGATE_DATA_DIR=/var/lib/keygate/data \
    KEYGATE_LOG_FORMAT=json
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 CMD ["keygate", "healthcheck"]
ENTRYPOINT ["keygate"]
CMD ["serve"]
