//! Redis Cluster: three cluster-enabled `redis-server` processes (and their replicas, when
//! asked) joined with `redis-cli --cluster create`.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{command_at, find_on_path, wait_for, Redis};

/// Locate `redis-cli` (Debian's `redis-tools`, installed with `redis-server`), or panic with
/// installation instructions.
pub fn redis_cli_path() -> PathBuf {
    find_on_path("redis-cli").unwrap_or_else(|| {
        panic!(
            "redis-cli not found on PATH: install it with `sudo apt-get install redis-tools` \
             (Homebrew's `redis` has it) or run `bash scripts/test.sh`, which installs it"
        )
    })
}

/// A real three-master Redis Cluster on loopback, created with `redis-cli --cluster create`
/// (no replicas: the tests move slots, they do not fail nodes over).
pub struct RedisCluster {
    pub nodes: Vec<Redis>,
}

impl RedisCluster {
    /// Starts three cluster-enabled redis-servers, joins them and waits (up to 20 s) until
    /// every node reports `cluster_state:ok`.
    pub async fn start() -> RedisCluster {
        RedisCluster::start_with_replicas(0).await
    }

    /// Three masters with `replicas` replicas each (`--cluster-replicas`).
    pub async fn start_with_replicas(replicas: usize) -> RedisCluster {
        let mut nodes = Vec::new();
        for _ in 0..3 * (1 + replicas) {
            nodes.push(
                Redis::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ])
                .await,
            );
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let output = Command::new(redis_cli_path())
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed: {}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let cluster = RedisCluster { nodes };
        for node in &cluster.nodes {
            let port = node.port();
            wait_for(Duration::from_secs(20), "cluster_state:ok", || async move {
                let info = match command_at(port, &["CLUSTER", "INFO"]).await {
                    Ok(redis::Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
                    Ok(redis::Value::VerbatimString { text, .. }) => text,
                    _ => String::new(),
                };
                info.contains("cluster_state:ok")
            })
            .await;
        }
        cluster
    }

    /// `host:port` of every node, for `store.redis.cluster.nodes`.
    pub fn addrs(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect()
    }

    /// The `store:` section for this cluster.
    pub fn store_yaml(&self) -> String {
        let nodes: Vec<String> = self.addrs().iter().map(|a| format!("\"{a}\"")).collect();
        format!(
            "store:\n  redis:\n    cluster:\n      nodes: [{}]\n    timeout: 1s\n  key_prefix: sluice-test\n",
            nodes.join(", ")
        )
    }

    /// The hash slot of `key`, as the cluster computes it.
    pub async fn slot_of(&self, key: &str) -> u16 {
        match self.nodes[0].cmd(&["CLUSTER", "KEYSLOT", key]).await {
            redis::Value::Int(slot) => slot as u16,
            other => panic!("CLUSTER KEYSLOT answered {other:?}"),
        }
    }

    /// The node id (`CLUSTER MYID`) of node `index`.
    pub async fn node_id(&self, index: usize) -> String {
        match self.nodes[index].cmd(&["CLUSTER", "MYID"]).await {
            redis::Value::BulkString(id) => String::from_utf8(id).expect("a node id"),
            other => panic!("CLUSTER MYID answered {other:?}"),
        }
    }

    /// The index of the node that owns `slot` (the one that answers `CLUSTER COUNTKEYSINSLOT`
    /// without redirecting is not enough: each node knows the whole map, so this asks node 0
    /// for `CLUSTER SLOTS` and matches ports).
    pub async fn owner_of(&self, slot: u16) -> usize {
        let redis::Value::Array(ranges) = self.nodes[0].cmd(&["CLUSTER", "SLOTS"]).await else {
            panic!("CLUSTER SLOTS did not answer an array");
        };
        for range in ranges {
            let redis::Value::Array(fields) = range else {
                continue;
            };
            let (Some(redis::Value::Int(from)), Some(redis::Value::Int(to))) =
                (fields.first(), fields.get(1))
            else {
                continue;
            };
            if (*from..=*to).contains(&i64::from(slot)) {
                if let Some(redis::Value::Array(master)) = fields.get(2) {
                    if let Some(redis::Value::Int(port)) = master.get(1) {
                        return self
                            .nodes
                            .iter()
                            .position(|n| i64::from(n.port()) == *port)
                            .expect("a node of this cluster");
                    }
                }
            }
        }
        panic!("no node owns slot {slot}");
    }

    /// The index of a replica of the master at `master` (`CLUSTER REPLICAS`) whose link to
    /// it is up, waiting up to 15 s for one: a new cluster's replicas take a moment to be
    /// known and to sync.
    pub async fn replica_of(&self, master: usize) -> usize {
        let id = self.node_id(master).await;
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(index) = self.synced_replica(&id).await {
                return index;
            }
            assert!(
                Instant::now() < deadline,
                "master {master} has no synced replica"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn synced_replica(&self, master_id: &str) -> Option<usize> {
        for (index, node) in self.nodes.iter().enumerate() {
            let info = match command_at(node.port(), &["INFO", "replication"]).await {
                Ok(redis::Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
                Ok(redis::Value::VerbatimString { text, .. }) => text,
                _ => continue,
            };
            if !info.contains("role:slave") || !info.contains("master_link_status:up") {
                continue;
            }
            let nodes = match command_at(node.port(), &["CLUSTER", "MYID"]).await {
                Ok(redis::Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
                _ => continue,
            };
            let line = match command_at(node.port(), &["CLUSTER", "NODES"]).await {
                Ok(redis::Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
                Ok(redis::Value::VerbatimString { text, .. }) => text,
                _ => continue,
            };
            // This node's own line: `<id> <addr> myself,slave <master id> ...`
            let mine = line.lines().find(|l| l.starts_with(nodes.as_str()));
            if mine.and_then(|l| l.split_whitespace().nth(3)) == Some(master_id) {
                return Some(index);
            }
        }
        None
    }

    /// Asserts that every key on every node expires within `longest` (see
    /// [`Redis::assert_every_key_expires`]); how many keys the nodes hold.
    pub async fn assert_every_key_expires(&self, longest: Duration) -> usize {
        let mut keys = 0;
        for node in &self.nodes {
            keys += node.assert_every_key_expires(longest).await;
        }
        keys
    }

    /// Number of keys node `index` holds in `slot`.
    pub async fn keys_in_slot(&self, index: usize, slot: u16) -> i64 {
        match self.nodes[index]
            .cmd(&["CLUSTER", "COUNTKEYSINSLOT", &slot.to_string()])
            .await
        {
            redis::Value::Int(n) => n,
            other => panic!("CLUSTER COUNTKEYSINSLOT answered {other:?}"),
        }
    }
}
