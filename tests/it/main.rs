//! sluice's integration tests, as one test crate: one module per area, all linked into a
//! single test binary (`cargo test --test it`), because linking the whole crate once per test
//! file was most of the suite's time on a 2-core machine.
//!
//! Every test runs against real processes (a `redis-server`, upstream servers on 127.0.0.1,
//! the `sluice` binary itself): see `support`. A test's full name is `module::test_name`. One
//! module's tests: `cargo test --test it limits::`; one test:
//! `cargo test --test it limits::retry_after_is_exact_redis -- --exact`.
//!
//! All tests share this one process and cargo's test threads (one per core by default), so a
//! test may not assume it is alone: ports are picked free at start and retried when taken,
//! nothing sets process-wide environment variables, and the tests that load the machine or
//! assert time bounds hold `support::heavy()`, so that no two of them run at once.

mod support;

mod admin;
mod admin_api;
mod admin_browsers;
mod algorithms;
mod batching;
mod calendar_quotas;
mod check_cli;
mod check_mistakes;
mod cluster;
mod combos;
mod concurrency;
mod connections;
mod count_outcome;
mod deny_cache;
mod distributed;
mod exact_answers;
mod explain;
mod faults;
mod framing;
mod grpc;
mod hostile_requests;
mod house;
mod identities;
mod ipv6_prefixes;
mod jwks_url;
mod jwt_identities;
mod key_expiry;
mod limits;
mod llm_sdks;
mod local_store;
mod logs;
mod model_switch;
mod notifications;
mod overrides;
mod partitions;
mod paths;
mod policy_keys;
mod prometheus;
mod proxy_headers;
mod redis_path;
mod release;
mod reload;
mod rls;
mod rls_probes;
mod schema;
mod script_flush;
mod sentinel;
mod shaping;
mod shutdown;
mod slow_bodies;
mod streaming;
mod tls;
mod token_bodies;
mod token_bounds;
mod token_budgets;
mod token_mix;
mod usage;
mod websocket;
mod weighted_log;
mod workers;
