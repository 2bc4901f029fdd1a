//! Which settings a reload can apply and which only a restart can: the listeners are bound,
//! the store's connections open, the worker threads started, at start-up only. Each section
//! type says it of its own fields here, by naming every one of them in a pattern without
//! `..`: a field added to `Config` (or to `server:`, `store:`, `admin:`, `tls:`) does not
//! compile until it is put on one side, a compared binding (restart-only) or `field: _`
//! (applied by a reload). `reload` refuses a file whose [`Config::restart_change`] is not
//! `None`.

use super::rls::RlsConfig;
use super::{
    AdminConfig, Config, ListenerTlsConfig, RedisConfig, ServerConfig, Spanned, StoreConfig,
};

impl Config {
    /// The first setting `new` changes from `self` (the config the process started with)
    /// that only a restart can apply, described for a person; `None`: a reload applies all
    /// of `new`.
    pub fn restart_change(&self, new: &Config) -> Option<String> {
        let Config {
            // Restart-only: bound, opened or started once.
            listen,
            admin_listen,
            admin,
            tls,
            server,
            store,
            log_format,
            // Whether there is one, its `listen` and `tls` (restart-only); its rules reload.
            rls,
            // Its sender starts with the process (its queue, its secret read once).
            webhook,
            // Applied by a reload.
            trusted_proxies: _,
            forwarded_header: _,
            response_headers: _,
            should_retry_within: _,
            reload: _,
            upstreams: _,
            jwt: _,
            models: _,
            routes: _,
        } = self;
        if new.listen != *listen {
            return Some(format!("`listen` changed from {listen} to {}", new.listen));
        }
        if new.admin_listen.value != admin_listen.value {
            return Some(format!(
                "`admin_listen` changed from {} to {}",
                admin_listen.value, new.admin_listen.value
            ));
        }
        if let Some(field) = admin.restart_change(&new.admin) {
            return Some(format!("`admin.{field}` changed"));
        }
        if new.webhook != *webhook {
            return Some("`webhook` changed".to_owned());
        }
        if new.log_format != *log_format {
            return Some("`log_format` changed".to_owned());
        }
        if tls_files(tls) != tls_files(&new.tls) {
            return Some(
                "`tls` changed (the certificate files' contents are reloaded; which files, or \
                 whether there is TLS, is not)"
                    .to_owned(),
            );
        }
        if rls_listener(rls) != rls_listener(&new.rls) {
            return Some(
                "`rls` changed: the rate limit service's listener (whether there is one, \
                 `rls.listen`, `rls.tls`) is bound at start; its rule files reload"
                    .to_owned(),
            );
        }
        if let Some(field) = server.restart_change(&new.server) {
            return Some(format!("`server.{field}` changed"));
        }
        store
            .restart_change(&new.store)
            .map(|field| format!("`store.{field}` changed"))
    }
}

/// A listener's TLS certificate and key files, and its client CA bundle.
type TlsFiles = (
    std::path::PathBuf,
    std::path::PathBuf,
    Option<std::path::PathBuf>,
);

/// Which files a listener's TLS reads, if it has TLS: their contents are watched and reloaded
/// on their own (`tls::listener`), which files (or whether there is TLS) only at start.
fn tls_files(tls: &Option<Spanned<ListenerTlsConfig>>) -> Option<TlsFiles> {
    tls.as_ref().map(|tls| {
        let ListenerTlsConfig {
            cert,
            key,
            client_ca,
        } = &tls.value;
        (
            cert.value.clone(),
            key.value.clone(),
            client_ca.as_ref().map(|ca| ca.value.clone()),
        )
    })
}

/// What of `rls:` is bound at start: its address and which TLS files.
type RlsListener = (std::net::SocketAddr, Option<TlsFiles>);

fn rls_listener(rls: &Option<Spanned<RlsConfig>>) -> Option<RlsListener> {
    let RlsConfig {
        listen,
        tls,
        // Applied by a reload.
        config: _,
        shadow_mode: _,
        algorithm: _,
        on_store_error: _,
    } = &rls.as_ref()?.value;
    Some((*listen, tls_files(tls)))
}

impl ServerConfig {
    /// The first field `new` changes: every one is applied at start only (the listeners'
    /// limits and timeouts, the worker threads, the body budgets they share).
    fn restart_change(&self, new: &ServerConfig) -> Option<&'static str> {
        let ServerConfig {
            max_request_line,
            max_header_bytes,
            max_headers,
            max_body,
            max_connections,
            header_read_timeout,
            idle_timeout,
            body_timeout,
            body_min_rate,
            body_rate_grace,
            shutdown_delay,
            shutdown_grace,
            workers,
            token_body_budget,
            token_bodies_per_connection,
        } = self;
        first_changed([
            (
                "max_request_line",
                *max_request_line == new.max_request_line,
            ),
            (
                "max_header_bytes",
                *max_header_bytes == new.max_header_bytes,
            ),
            ("max_headers", *max_headers == new.max_headers),
            ("max_body", *max_body == new.max_body),
            ("max_connections", *max_connections == new.max_connections),
            (
                "header_read_timeout",
                *header_read_timeout == new.header_read_timeout,
            ),
            ("idle_timeout", *idle_timeout == new.idle_timeout),
            ("body_timeout", *body_timeout == new.body_timeout),
            ("body_min_rate", *body_min_rate == new.body_min_rate),
            ("body_rate_grace", *body_rate_grace == new.body_rate_grace),
            ("shutdown_delay", *shutdown_delay == new.shutdown_delay),
            ("shutdown_grace", *shutdown_grace == new.shutdown_grace),
            ("workers", *workers == new.workers),
            (
                "token_body_budget",
                *token_body_budget == new.token_body_budget,
            ),
            (
                "token_bodies_per_connection",
                *token_bodies_per_connection == new.token_bodies_per_connection,
            ),
        ])
    }
}

impl StoreConfig {
    /// The first restart-only field `new` changes: where the store is and how it is reached
    /// (its connections are opened at start), and the key prefix (a new one would start every
    /// count afresh while the old keys live on).
    fn restart_change(&self, new: &StoreConfig) -> Option<&'static str> {
        let StoreConfig {
            redis: _, // compared through `topology`, made from it, and `same_redis`
            topology: _,
            local,
            key_prefix,
            // Applied by a reload: read per decision.
            on_store_error: _,
        } = self;
        first_changed([
            ("redis", self.same_redis(new)),
            ("local", *local == new.local),
            ("key_prefix", *key_prefix == new.key_prefix),
        ])
    }

    /// Whether `other` has the same Redis, reached the same way, wherever its values stand
    /// in the file.
    pub fn same_redis(&self, other: &StoreConfig) -> bool {
        let tuning = |c: &StoreConfig| {
            c.redis.as_ref().map(|redis| {
                let RedisConfig {
                    // Where Redis is: compared as the `topology` made from them.
                    url: _,
                    sentinel: _,
                    cluster: _,
                    timeout,
                    pool_size,
                } = &redis.value;
                (*timeout, *pool_size)
            })
        };
        self.topology == other.topology && tuning(self) == tuning(other)
    }
}

impl AdminConfig {
    /// The first field `new` changes: all are applied at start (the token is read from the
    /// environment then).
    fn restart_change(&self, new: &AdminConfig) -> Option<&'static str> {
        let AdminConfig {
            token_env,
            api,
            hosts,
        } = self;
        let name = |env: &Option<Spanned<super::EnvName>>| env.as_ref().map(|t| t.value.clone());
        first_changed([
            ("token_env", name(token_env) == name(&new.token_env)),
            ("api", *api == new.api),
            ("hosts", *hosts == new.hosts),
        ])
    }
}

/// The name of the first field that is not the same.
fn first_changed<const N: usize>(fields: [(&'static str, bool); N]) -> Option<&'static str> {
    fields
        .into_iter()
        .find(|(_, same)| !same)
        .map(|(field, _)| field)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::{parse, Config};

    const BASE: &str = "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\n";

    fn config(head: &str, rest: &str) -> Config {
        parse(&format!("{head}{rest}routes: []\n"), Path::new("t.yaml")).expect("valid")
    }

    #[test]
    fn each_change_that_needs_a_restart_is_named() {
        let running = config(BASE, "");
        let change = |rest: &str, head: &str| running.restart_change(&config(head, rest));
        assert_eq!(change("", BASE), None);
        assert_eq!(
            change("", "listen: 127.0.0.1:3\nadmin_listen: 127.0.0.1:2\n").as_deref(),
            Some("`listen` changed from 127.0.0.1:1 to 127.0.0.1:3")
        );
        assert_eq!(
            change("", "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:4\n").as_deref(),
            Some("`admin_listen` changed from 127.0.0.1:2 to 127.0.0.1:4")
        );
        assert_eq!(
            change("server:\n  max_headers: 7\n", BASE).as_deref(),
            Some("`server.max_headers` changed")
        );
        assert_eq!(
            change("store:\n  key_prefix: other\n", BASE).as_deref(),
            Some("`store.key_prefix` changed")
        );
        assert_eq!(
            change("store:\n  redis:\n    url: redis://127.0.0.1:6379\n", BASE).as_deref(),
            Some("`store.redis` changed")
        );
        assert_eq!(
            change("admin:\n  api: false\n", BASE).as_deref(),
            Some("`admin.api` changed")
        );
        assert!(change("tls:\n  cert: c.pem\n  key: k.pem\n", BASE)
            .is_some_and(|change| change.starts_with("`tls` changed")));
        assert_eq!(change("store:\n  on_store_error: deny\n", BASE), None);
        assert_eq!(change("reload:\n  settle: 2s\n", BASE), None);
    }

    #[test]
    fn moving_a_section_in_the_file_is_not_a_change() {
        let store =
            "store:\n  redis:\n    sentinel: { master_name: m, nodes: [\"127.0.0.1:26379\"] }\n";
        let running = config(BASE, store);
        let moved = config(&format!("{BASE}# a comment, and a blank line\n\n"), store);
        assert_eq!(running.restart_change(&moved), None);
        let other = config(BASE, &store.replace("26379", "26380"));
        assert_eq!(
            running.restart_change(&other).as_deref(),
            Some("`store.redis` changed")
        );
    }
}
