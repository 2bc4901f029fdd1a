//! The usage index's two store calls (`limiter::usage`): a flush adds one instance's notes
//! to a limit's sorted set (one pipeline per index key: a `ZINCRBY` per identity, then a
//! `PEXPIRE`), and a report reads a set's top members (`ZREVRANGE … WITHSCORES`). Every
//! command of one call names the same key, so on a cluster the call goes to one master.

use std::time::Duration;

use super::RedisStore;
use crate::limiter::StoreError;

impl RedisStore {
    /// Adds `identities`' units to the index at `index`, which then lives `ttl` from now.
    pub async fn add_usage<'a>(
        &self,
        index: &str,
        identities: impl Iterator<Item = (&'a String, &'a u64)>,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let mut pipeline = redis::pipe();
        for (identity, units) in identities {
            pipeline
                .cmd("ZINCRBY")
                .arg(index)
                .arg(*units)
                .arg(identity)
                .ignore();
        }
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        pipeline.cmd("PEXPIRE").arg(index).arg(ttl_ms).ignore();
        let mut conn = self.connection()?;
        self.bounded(async {
            pipeline
                .query_async::<()>(&mut conn)
                .await
                .map_err(|e| self.failed(e))
        })
        .await
    }

    /// The `most` identities with the highest scores in the index at `index`, highest first.
    pub async fn top_usage(
        &self,
        index: &str,
        most: usize,
    ) -> Result<Vec<(String, f64)>, StoreError> {
        if most == 0 {
            return Ok(Vec::new());
        }
        let mut range = redis::cmd("ZREVRANGE");
        range.arg(index).arg(0).arg(most - 1).arg("WITHSCORES");
        self.run(&range, None).await
    }
}
