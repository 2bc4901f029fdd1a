//! The TCP settings of every connection to a Redis node (one node, the sentinels' master, a
//! cluster's nodes).
//!
//! Without them, a connection caught by a silent partition (packets dropped, no RST) keeps its
//! unacknowledged data waiting for the next retransmission, whose backoff doubles up to
//! 120 s: after the network heals, every call on it waits for that retransmission (measured:
//! back in Redis 5.4 s after an 8 s partition, `tests/it/partitions.rs`). With them, such a
//! connection fails within `UNACKNOWLEDGED_FOR`, is replaced by the `redis` crate's
//! connection manager, and a fresh one answers as soon as the network does (0.7 s).

use std::time::Duration;

use redis::io::tcp::{socket2, TcpSettings};

/// How long sent data may stay unacknowledged before the kernel gives a connection up
/// (`TCP_USER_TIMEOUT`).
pub(super) const UNACKNOWLEDGED_FOR: Duration = Duration::from_secs(1);

/// No Nagle delay on the small writes of a call (the crate leaves it on), and a dead or
/// partitioned peer found within `UNACKNOWLEDGED_FOR` whether the connection is busy (the
/// user timeout) or idle (keepalive probes after 5 s, every second, 3 of them).
pub(super) fn tcp_settings() -> TcpSettings {
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(5))
        .with_interval(Duration::from_secs(1))
        .with_retries(3);
    TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(keepalive)
        .set_user_timeout(UNACKNOWLEDGED_FOR)
}
