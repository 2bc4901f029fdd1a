# Multi-stage build: compile in the Rust image, run from a distroless base as a non-root user.
# Mount your policy at /etc/sluice/sluice.yaml (it must listen on 0.0.0.0 inside a container).
FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
# Cargo.toml names a benchmark target; cargo refuses a manifest whose targets are missing.
COPY microbench ./microbench
RUN cargo build --release --locked \
    && strip target/release/sluice

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/sluice /usr/local/bin/sluice
COPY deploy/sluice.container.yaml /etc/sluice/sluice.yaml
# 65532 is the `nonroot` user of the distroless image.
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["/usr/local/bin/sluice"]
CMD ["run", "--config", "/etc/sluice/sluice.yaml"]
