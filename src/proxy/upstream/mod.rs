//! The upstream side of the act phase: forwarding an admitted request and streaming its
//! answer back (`forward`, over the per-worker connection pools of `pool`), the registry of
//! upstream clients kept across reloads (`clients`), the header rewriting at the proxy
//! boundary (`headers`), a WebSocket upgrade's tunnel (`tunnel`) and gRPC's way of saying
//! "limited" (`grpc`). Nothing here decides whether a request goes: that is the phases' work
//! in `proxy`, on what `crate::request` read.

pub mod clients;
mod error;
pub mod forward;
pub mod grpc;
mod headers;
mod pool;
pub mod tunnel;
