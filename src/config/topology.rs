//! Where Redis is: `store.redis` as written made into one `Topology` (one Redis, Sentinel or
//! Cluster) when the file is parsed, so a file naming none or several is refused at the
//! position of the field to fix.

use std::path::Path;

use super::{ClusterConfig, ConfigError, HostPort, Position, SentinelConfig, Spanned, StoreConfig};
use crate::limiter::{ClusterSettings, SentinelSettings, Topology};

impl StoreConfig {
    /// Where Redis is (`None`: no Redis, the in-process store). Refuses a `store.redis` that
    /// gives more than one of `url`, `sentinel` and `cluster`, or none, at the position of the
    /// offending field.
    pub(super) fn read_topology(&self, file: &Path) -> Result<Option<Topology>, ConfigError> {
        let Some(redis) = &self.redis else {
            return Ok(None);
        };
        const ONE_OF: &str = "`url` (one Redis), `sentinel` (a master found through Redis \
                              Sentinel) or `cluster` (a Redis Cluster)";
        let config = &redis.value;
        let mut topologies = Vec::with_capacity(1);
        if let Some(url) = &config.url {
            topologies.push((
                Position::from(url),
                "store.redis.url",
                Topology::Single {
                    url: url.value.0.clone(),
                },
            ));
        }
        if let Some(sentinel) = &config.sentinel {
            nodes_listed(
                file,
                &sentinel.value.nodes,
                "store.redis.sentinel.nodes",
                "sentinel",
            )?;
            topologies.push((
                Position::from(sentinel),
                "store.redis.sentinel",
                Topology::Sentinel(sentinel.value.settings()),
            ));
        }
        if let Some(cluster) = &config.cluster {
            nodes_listed(
                file,
                &cluster.value.nodes,
                "store.redis.cluster.nodes",
                "cluster node",
            )?;
            topologies.push((
                Position::from(cluster),
                "store.redis.cluster",
                Topology::Cluster(cluster.value.settings()),
            ));
        }
        match topologies.len() {
            0 => Err(ConfigError::invalid(
                file,
                Position::from(redis),
                "store.redis",
                format!("needs {ONE_OF}"),
            )),
            1 => Ok(topologies.pop().map(|(_, _, topology)| topology)),
            _ => {
                let (position, field, _) = &topologies[1];
                Err(ConfigError::invalid(
                    file,
                    *position,
                    *field,
                    format!("give exactly one of {ONE_OF}"),
                ))
            }
        }
    }
}

/// Refuses an empty list of nodes to start from.
fn nodes_listed(
    file: &Path,
    nodes: &Spanned<Vec<HostPort>>,
    field: &str,
    what: &str,
) -> Result<(), ConfigError> {
    if nodes.value.is_empty() {
        return Err(ConfigError::invalid(
            file,
            Position::from(nodes),
            field,
            format!("list at least one {what} (host:port); three or more is usual"),
        ));
    }
    Ok(())
}

impl SentinelConfig {
    fn settings(&self) -> SentinelSettings {
        SentinelSettings {
            master_name: self.master_name.to_string(),
            nodes: host_ports(&self.nodes.value),
            password: self.password.clone(),
            sentinel_password: self.sentinel_password.clone(),
        }
    }
}

impl ClusterConfig {
    fn settings(&self) -> ClusterSettings {
        ClusterSettings {
            nodes: host_ports(&self.nodes.value),
            username: self.username.clone(),
            password: self.password.clone(),
        }
    }
}

fn host_ports(nodes: &[HostPort]) -> Vec<(String, u16)> {
    nodes
        .iter()
        .map(|node| (node.host.clone(), node.port))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::parse;
    use super::*;

    const HEAD: &str = "listen: 127.0.0.1:8080\nadmin_listen: 127.0.0.1:9090\n";

    fn error_of(yaml: &str) -> String {
        match parse(yaml, Path::new("test.yaml")) {
            Ok(_) => panic!("expected an error for:\n{yaml}"),
            Err(err) => err.to_string(),
        }
    }

    #[test]
    fn redis_needs_exactly_one_of_url_sentinel_and_cluster() {
        let sentinel =
            "    sentinel:\n      master_name: mymaster\n      nodes: [\"127.0.0.1:26379\"]\n";
        let url = "    url: redis://127.0.0.1:6379/0\n";
        let cluster = "    cluster:\n      nodes: [\"127.0.0.1:7000\"]\n";
        let both = format!("{HEAD}routes: []\nstore:\n  redis:\n{url}{sentinel}");
        assert_eq!(
            error_of(&both),
            "test.yaml:8:7: store.redis.sentinel: give exactly one of `url` (one Redis), \
             `sentinel` (a master found through Redis Sentinel) or `cluster` (a Redis Cluster)"
        );
        let both = format!("{HEAD}routes: []\nstore:\n  redis:\n{url}{cluster}");
        assert!(
            error_of(&both).starts_with("test.yaml:8:7: store.redis.cluster: give exactly one of"),
            "{}",
            error_of(&both)
        );
        let neither = format!("{HEAD}routes: []\nstore:\n  redis:\n    timeout: 1s\n");
        assert_eq!(
            error_of(&neither),
            "test.yaml:6:5: store.redis: needs `url` (one Redis), `sentinel` (a master found \
             through Redis Sentinel) or `cluster` (a Redis Cluster)"
        );
        let no_nodes =
            format!("{HEAD}routes: []\nstore:\n  redis:\n    cluster: {{ nodes: [] }}\n");
        let err = error_of(&no_nodes);
        assert!(
            err.starts_with(
                "test.yaml:6:23: store.redis.cluster.nodes: list at least one cluster node"
            ),
            "{err}"
        );
        let bad = format!(
            "{HEAD}routes: []\nstore:\n  redis:\n    cluster: {{ nodes: [\"h:1\", \"h:0\"] }}\n"
        );
        let err = error_of(&bad);
        assert!(
            err.contains(": store.redis.cluster.nodes[1]: expected host:port"),
            "{err}"
        );
        let unknown = format!("{HEAD}routes: []\nstore:\n  redis:\n    cluster: {{ nodes: [\"h:1\"], replicas: 1 }}\n");
        let err = error_of(&unknown);
        assert!(err.contains("store.redis.cluster"), "{err}");
        let none = format!(
            "{HEAD}routes: []\nstore:\n  redis:\n    sentinel: {{ master_name: m, nodes: [] }}\n"
        );
        let err = error_of(&none);
        assert!(
            err.starts_with("test.yaml:6:40: store.redis.sentinel.nodes: list at least one"),
            "{err}"
        );
        let bad = format!("{HEAD}routes: []\nstore:\n  redis:\n    sentinel: {{ master_name: m, nodes: [\"h:1\", nope] }}\n");
        let err = error_of(&bad);
        assert!(
            err.contains(": store.redis.sentinel.nodes[1]: expected host:port"),
            "{err}"
        );
    }

    #[test]
    fn a_sentinel_store_parses() {
        let yaml = format!(
            "{HEAD}routes: []\nstore:\n  redis:\n    sentinel:\n      master_name: mymaster\n      nodes: [\"127.0.0.1:26379\", \"[::1]:26380\"]\n      password: secret\n    timeout: 80ms\n"
        );
        let config = parse(&yaml, Path::new("test.yaml")).expect("parses");
        let Some(Topology::Sentinel(sentinel)) = &config.store.topology else {
            panic!(
                "expected a sentinel topology, got {:?}",
                config.store.topology
            );
        };
        assert_eq!(sentinel.master_name, "mymaster");
        assert_eq!(
            sentinel.nodes,
            [("127.0.0.1".to_owned(), 26379), ("::1".to_owned(), 26380)]
        );
        assert_eq!(sentinel.password.as_deref(), Some("secret"));
        assert_eq!(sentinel.sentinel_password, None);
    }

    #[test]
    fn each_redis_topology_is_made_when_the_file_is_parsed() {
        let store = |redis: &str| {
            let yaml = format!("{HEAD}routes: []\nstore:\n  redis:\n{redis}");
            parse(&yaml, Path::new("test.yaml")).expect("parses").store
        };
        let single = store("    url: redis://127.0.0.1:6379\n");
        assert_eq!(
            single.topology,
            Some(Topology::Single {
                url: "redis://127.0.0.1:6379".to_owned()
            })
        );
        let cluster = store("    cluster:\n      nodes: [\"127.0.0.1:7000\"]\n      username: u\n");
        assert_eq!(
            cluster.topology,
            Some(Topology::Cluster(ClusterSettings {
                nodes: vec![("127.0.0.1".to_owned(), 7000)],
                username: Some("u".to_owned()),
                password: None,
            }))
        );
        assert!(!single.same_redis(&cluster));
        let moved = store("    timeout: 50ms\n    url: redis://127.0.0.1:6379\n");
        assert!(
            single.same_redis(&moved),
            "the same values elsewhere in the file"
        );
        assert!(!single.same_redis(&store("    url: redis://127.0.0.1:6380\n")));
        let local = parse(&format!("{HEAD}routes: []\n"), Path::new("test.yaml")).expect("parses");
        assert_eq!(local.store.topology, None);
    }
}
