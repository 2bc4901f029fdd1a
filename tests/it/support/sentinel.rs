//! Redis Sentinel: a master, a replica and three `redis-sentinel` processes watching them,
//! all real child processes on free loopback ports.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::redis_server::{command_with_password, info_text};
use super::{find_on_path, free_port, wait_for, Redis};

/// Locate `redis-sentinel`, or panic with installation instructions.
pub fn redis_sentinel_path() -> PathBuf {
    find_on_path("redis-sentinel").unwrap_or_else(|| {
        panic!(
            "redis-sentinel not found on PATH: install it with \
             `sudo apt-get install redis-sentinel` (Homebrew's `redis` has it) or run \
             `bash scripts/test.sh`, which installs it"
        )
    })
}

/// One `redis-sentinel` child process with its generated `sentinel.conf`.
pub struct SentinelProcess {
    child: Child,
    pub port: u16,
    dir: tempfile::TempDir,
}

impl SentinelProcess {
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("sentinel.log")).unwrap_or_default()
    }
}

impl Drop for SentinelProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A real master, one replica (`--replicaof`) and three `redis-sentinel` processes watching
/// them as `mymaster` with quorum 2, all on free loopback ports.
pub struct SentinelCluster {
    /// The master at start (after a failover, a replica or stopped).
    pub first_master: Redis,
    /// The replica at start (after a failover, the master).
    pub first_replica: Redis,
    pub sentinels: Vec<SentinelProcess>,
    /// `requirepass` of the sentinels, if any.
    sentinel_password: Option<String>,
}

/// The name the sentinels monitor the master under.
pub const MASTER_NAME: &str = "mymaster";

impl SentinelCluster {
    /// Starts everything and waits (up to 30 s) until the replica is in sync and every
    /// sentinel knows the master, the replica and the two other sentinels.
    pub async fn start() -> SentinelCluster {
        SentinelCluster::start_with_passwords(None, None).await
    }

    /// Like [`SentinelCluster::start`], with `requirepass` on the master and replica
    /// (`password`) and on the sentinels (`sentinel_password`).
    pub async fn start_with_passwords(
        password: Option<&str>,
        sentinel_password: Option<&str>,
    ) -> SentinelCluster {
        let sentinel_bin = redis_sentinel_path();
        let auth: Vec<&str> = match password {
            Some(p) => vec!["--requirepass", p, "--masterauth", p],
            None => Vec::new(),
        };
        let first_master = Redis::start_with(&auth).await;
        let master_port = first_master.port().to_string();
        let mut replica_args = vec!["--replicaof", "127.0.0.1", &master_port];
        replica_args.extend(&auth);
        let first_replica = Redis::start_with(&replica_args).await;
        let replica_port = first_replica.port();
        wait_for(
            Duration::from_secs(30),
            "the replica to sync with the master",
            || async move {
                let info = command_with_password(replica_port, password, &["INFO", "replication"]);
                info_text(info.await).is_some_and(|t| t.contains("master_link_status:up"))
            },
        )
        .await;
        let sentinels = (0..3)
            .map(|_| {
                spawn_sentinel(
                    &sentinel_bin,
                    first_master.port(),
                    password,
                    sentinel_password,
                )
            })
            .collect();
        let cluster = SentinelCluster {
            first_master,
            first_replica,
            sentinels,
            sentinel_password: sentinel_password.map(str::to_owned),
        };
        for sentinel in &cluster.sentinels {
            let port = sentinel.port;
            wait_for(
                Duration::from_secs(30),
                "a sentinel to know the whole group",
                || async move {
                    let replicas = sentinel_list(port, sentinel_password, "replicas").await;
                    let others = sentinel_list(port, sentinel_password, "sentinels").await;
                    let replica_known = replicas.iter().any(|r| {
                        r.get("port") == Some(&replica_port.to_string())
                            && !r.get("flags").is_some_and(|f| f.contains("down"))
                    });
                    replica_known && others.len() == 2
                },
            )
            .await;
        }
        cluster
    }

    /// `host:port` of every sentinel, for sluice's `nodes`.
    pub fn nodes(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect()
    }

    /// The master's port according to the first sentinel that answers.
    pub async fn master_port(&self) -> Option<u16> {
        for sentinel in &self.sentinels {
            let answer = command_with_password(
                sentinel.port,
                self.sentinel_password.as_deref(),
                &["SENTINEL", "get-master-addr-by-name", MASTER_NAME],
            )
            .await;
            if let Ok(value) = answer {
                if let Ok(Some((_, port))) = redis::from_redis_value::<Option<(String, u16)>>(value)
                {
                    return Some(port);
                }
            }
        }
        None
    }

    /// Logs of every sentinel, for a failure message.
    pub fn logs(&self) -> String {
        self.sentinels
            .iter()
            .map(|s| format!("---- sentinel {} ----\n{}", s.port, s.log()))
            .collect()
    }
}

fn spawn_sentinel(
    bin: &Path,
    master_port: u16,
    password: Option<&str>,
    sentinel_password: Option<&str>,
) -> SentinelProcess {
    let dir = tempfile::tempdir().expect("tempdir for sentinel");
    let port = free_port();
    // Fast but reliable on a busy 2-core machine: down after 1 s without an answer, a
    // failover attempt may be retried after 3 s.
    let conf = format!(
        "port {port}\nbind 127.0.0.1\ndaemonize no\ndir {dir}\nlogfile {dir}/sentinel.log\n\
         sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 2\n\
         sentinel down-after-milliseconds {MASTER_NAME} 1000\n\
         sentinel failover-timeout {MASTER_NAME} 3000\n\
         sentinel parallel-syncs {MASTER_NAME} 1\n",
        dir = dir.path().display()
    );
    let mut conf = conf;
    if let Some(p) = password {
        conf.push_str(&format!("sentinel auth-pass {MASTER_NAME} {p}\n"));
    }
    if let Some(p) = sentinel_password {
        // Sentinels authenticate to each other with `sentinel-pass`.
        conf.push_str(&format!("requirepass {p}\nsentinel sentinel-pass {p}\n"));
    }
    let conf_path = dir.path().join("sentinel.conf");
    std::fs::write(&conf_path, conf).expect("write sentinel.conf");
    let child = Command::new(bin)
        .arg(&conf_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("failed to spawn {}: {e}", bin.display()));
    SentinelProcess { child, port, dir }
}

/// `SENTINEL <what> mymaster` (replicas or sentinels) as a list of field maps; empty when the
/// sentinel does not answer yet.
async fn sentinel_list(
    port: u16,
    password: Option<&str>,
    what: &str,
) -> Vec<BTreeMap<String, String>> {
    match command_with_password(port, password, &["SENTINEL", what, MASTER_NAME]).await {
        Ok(value) => redis::from_redis_value(value).unwrap_or_default(),
        Err(_) => Vec::new(),
    }
}
