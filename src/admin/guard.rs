//! What keeps a web page from using the admin API. A browser on the operator's machine can
//! reach a loopback listener: a page may post to it cross-site (a `text/plain` `POST` needs
//! no preflight), and after DNS rebinding its own name resolves to `127.0.0.1`, so the page's
//! requests are same-origin to the browser and carry the page's name in `Host`. Three
//! checks close both ways in, whatever the token:
//! - the `Host` (or h2 `:authority`) must name this listener: the connection's own address
//!   (the local end of the socket, concrete even on `0.0.0.0`), `localhost`, `127.0.0.1` or
//!   `[::1]`, or a name in `admin.hosts`; a port, when given, must be the listener's (or the
//!   one `admin.hosts` names). Rebinding always brings the attacker's name, refused: `421`.
//! - an `Origin`, when present, must be this listener's own (`http://` and a host the first
//!   check accepts, its port the listener's, `80` when the origin names none): `403`.
//! - a state-changing call (any method but `GET` and `HEAD`) must carry `X-Sluice-Admin`, a
//!   header no page can send to another origin without a CORS preflight, which this listener
//!   never grants: `403`. (A content type would do for `POST` only and is easy to get wrong.)
//!
//! `/metrics`, `/healthz` and `/readyz` only get the `Origin` check: Prometheus and kubelet
//! probes name the listener by a pod IP, a Service or Compose name, whatever reaches it, and
//! these answers change nothing and name no client.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use http::header::{HeaderMap, HOST, ORIGIN};
use http::{Method, StatusCode, Uri};

use crate::config::{split_host_port, AdminHost};

/// The header every state-changing admin call carries (any value; `1` by convention).
pub const ADMIN_HEADER: &str = "x-sluice-admin";

/// The loopback names the admin API always answers to (with no port or the listener's).
const LOOPBACK_NAMES: [&str; 3] = ["localhost", "127.0.0.1", "[::1]"];

/// A refusal: its status and a sentence saying what to send instead.
#[derive(Debug, PartialEq, Eq)]
pub struct Refusal {
    pub status: StatusCode,
    pub detail: String,
}

/// The names `admin.hosts` adds.
pub struct Guard {
    hosts: Vec<AdminHost>,
}

impl Guard {
    pub fn new(hosts: Vec<AdminHost>) -> Guard {
        Guard { hosts }
    }

    /// The checks of an open endpoint (`/metrics`, `/healthz`, `/readyz`): the `Origin` only.
    pub fn open(&self, headers: &HeaderMap, local: Option<SocketAddr>) -> Result<(), Refusal> {
        self.origin(headers, local)
    }

    /// The checks of an admin API call: `Host`, `Origin`, and for a state-changing method
    /// the `X-Sluice-Admin` header.
    pub fn api(
        &self,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        local: Option<SocketAddr>,
    ) -> Result<(), Refusal> {
        self.host(uri, headers, local)?;
        self.origin(headers, local)?;
        if method != Method::GET && method != Method::HEAD && !headers.contains_key(ADMIN_HEADER) {
            return Err(Refusal {
                status: StatusCode::FORBIDDEN,
                detail: format!(
                    "a {method} to the admin API needs the header `X-Sluice-Admin: 1` (which a \
                     web page cannot send to another origin): add `-H 'X-Sluice-Admin: 1'`"
                ),
            });
        }
        Ok(())
    }

    fn host(
        &self,
        uri: &Uri,
        headers: &HeaderMap,
        local: Option<SocketAddr>,
    ) -> Result<(), Refusal> {
        let mut fields = headers.get_all(HOST).iter();
        let field = match (fields.next(), fields.next()) {
            (Some(_), Some(_)) => return Err(misdirected("two `Host` fields")),
            (Some(host), None) => Some(
                host.to_str()
                    .map_err(|_| misdirected("a `Host` that is not text"))?,
            ),
            (None, _) => None,
        };
        // HTTP/2's `:authority`, or an HTTP/1.1 absolute-form target, names the host too (and
        // wins over the field, RFC 9112 §3.2.2): both must name this listener. HTTP/1.0 may
        // name none, which no browser does (rebinding needs the page's name in it).
        for given in [field, uri.authority().map(|a| a.as_str())]
            .into_iter()
            .flatten()
        {
            self.names_host(given, local)?;
        }
        Ok(())
    }

    fn names_host(&self, given: &str, local: Option<SocketAddr>) -> Result<(), Refusal> {
        let accepted = split_host_port(given)
            .is_some_and(|(host, port)| self.names_listener(host, port, local, false));
        if accepted {
            return Ok(());
        }
        Err(misdirected(&format!(
            "the `Host` `{given}`, which is not this listener's address ({}), `localhost`, \
             `127.0.0.1` or `[::1]` (with no port or the listener's), nor a name in \
             `admin.hosts`",
            local.map_or_else(|| "unknown".to_owned(), |l| l.to_string())
        )))
    }

    fn origin(&self, headers: &HeaderMap, local: Option<SocketAddr>) -> Result<(), Refusal> {
        let Some(origin) = headers.get(ORIGIN) else {
            return Ok(());
        };
        let own = origin
            .to_str()
            .ok()
            .and_then(|o| o.strip_prefix("http://"))
            .and_then(split_host_port)
            // An origin without a port is at HTTP's port 80.
            .is_some_and(|(host, port)| {
                self.names_listener(host, Some(port.unwrap_or(80)), local, true)
            });
        if own {
            return Ok(());
        }
        Err(Refusal {
            status: StatusCode::FORBIDDEN,
            detail: format!(
                "the request comes from the web page of another origin (`Origin: {}`): the \
                 admin listener serves no page, and answers only its own origin",
                String::from_utf8_lossy(origin.as_bytes())
            ),
        })
    }

    /// Whether `host` with `port` names this listener. `exact_port`: the port is the one a
    /// browser connected to (an `Origin`'s), so a name without a port in `admin.hosts` and
    /// the loopback names need the listener's own port.
    fn names_listener(
        &self,
        host: &str,
        port: Option<u16>,
        local: Option<SocketAddr>,
        exact_port: bool,
    ) -> bool {
        let own_port = local.map(|l| l.port());
        let port_is_own = match port {
            None => !exact_port,
            Some(port) => Some(port) == own_port,
        };
        let host = host.to_ascii_lowercase();
        let literal = ip_literal(&host);
        let loopback = LOOPBACK_NAMES.contains(&host.as_str())
            || literal.is_some_and(|ip| {
                ip == IpAddr::from([127, 0, 0, 1]) || ip == IpAddr::from(Ipv6Addr::LOCALHOST)
            });
        let own_address = literal
            .zip(local)
            .is_some_and(|(ip, local)| ip == local.ip().to_canonical());
        if (loopback || own_address) && port_is_own {
            return true;
        }
        self.hosts.iter().any(|allowed| {
            let same_name = match (ip_literal(&allowed.host), literal) {
                (Some(a), Some(b)) => a == b,
                _ => allowed.host == host,
            };
            same_name
                && match allowed.port {
                    Some(allowed) => port == Some(allowed),
                    None => port_is_own,
                }
        })
    }
}

/// The address a host names when it is an IP literal (IPv6 in brackets), IPv4-mapped IPv6
/// addresses as IPv4.
fn ip_literal(host: &str) -> Option<IpAddr> {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if bare.len() == host.len() && host.contains(':') {
        return None;
    }
    bare.parse::<IpAddr>().ok().map(|ip| ip.to_canonical())
}

fn misdirected(what: &str) -> Refusal {
    Refusal {
        status: StatusCode::MISDIRECTED_REQUEST,
        detail: format!(
            "the admin API does not answer to {what}; a request for it names this listener \
             (a name from DNS rebinding would otherwise reach it): add the name to \
             `admin.hosts` if it is yours"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(fields: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in fields {
            map.append(*name, value.parse().expect("a field value"));
        }
        map
    }

    fn api(
        guard: &Guard,
        method: Method,
        local: &str,
        fields: &[(&'static str, &str)],
    ) -> Option<u16> {
        let local: SocketAddr = local.parse().expect("an address");
        guard
            .api(
                &method,
                &Uri::from_static("/admin/v1/reload"),
                &headers(fields),
                Some(local),
            )
            .err()
            .map(|r| r.status.as_u16())
    }

    #[test]
    fn hosts_name_the_listener_or_are_refused() {
        let guard = Guard::new(vec![
            "admin.internal".parse().expect("a host"),
            "localhost:19090".parse().expect("a host"),
        ]);
        let get = |local: &str, host: &str| api(&guard, Method::GET, local, &[("host", host)]);
        for host in [
            "127.0.0.1:9090",
            "127.0.0.1",
            "localhost:9090",
            "LOCALHOST",
            "[::1]:9090",
            "admin.internal",
            "admin.internal:9090",
            "localhost:19090",
        ] {
            assert_eq!(get("127.0.0.1:9090", host), None, "{host}");
        }
        // The connection's own address on a wildcard listener: a probe's pod IP.
        assert_eq!(get("10.1.2.3:9090", "10.1.2.3:9090"), None);
        assert_eq!(get("[::ffff:10.1.2.3]:9090", "10.1.2.3:9090"), None);
        for host in [
            "evil.example:9090",
            "evil.example",
            "127.0.0.1:8080",
            "localhost:80",
            "10.1.2.4:9090",
            "admin.internal:8080",
            "localhost.:9090",
            "127.0.0.1:9090:1",
            "",
        ] {
            assert_eq!(get("127.0.0.1:9090", host), Some(421), "{host}");
        }
        assert_eq!(get("10.1.2.3:9090", "10.1.2.3:9091"), Some(421));
        let absolute = |target: &'static str| {
            let local: SocketAddr = "127.0.0.1:9090".parse().expect("an address");
            let fields = headers(&[("host", "localhost:9090")]);
            guard
                .api(
                    &Method::GET,
                    &Uri::from_static(target),
                    &fields,
                    Some(local),
                )
                .err()
                .map(|r| r.status.as_u16())
        };
        assert_eq!(absolute("http://evil.example/admin/v1/config"), Some(421));
        assert_eq!(absolute("http://localhost:9090/admin/v1/config"), None);
        assert_eq!(
            api(
                &guard,
                Method::GET,
                "127.0.0.1:9090",
                &[("host", "localhost:9090"), ("host", "evil")]
            ),
            Some(421)
        );
    }

    #[test]
    fn origins_are_the_listeners_own_and_changes_need_the_header() {
        let guard = Guard::new(Vec::new());
        let with = |method: Method, fields: &[(&'static str, &str)]| {
            api(&guard, method, "127.0.0.1:9090", fields)
        };
        let host = ("host", "127.0.0.1:9090");
        assert_eq!(
            with(Method::GET, &[host, ("origin", "http://127.0.0.1:9090")]),
            None
        );
        assert_eq!(
            with(Method::GET, &[host, ("origin", "http://localhost:9090")]),
            None
        );
        for origin in [
            "http://evil.example",
            "http://localhost",
            "http://localhost:8080",
            "https://127.0.0.1:9090",
            "null",
            "http://127.0.0.1:9090/x",
        ] {
            assert_eq!(
                with(Method::GET, &[host, ("origin", origin)]),
                Some(403),
                "{origin}"
            );
        }
        assert_eq!(with(Method::POST, &[host]), Some(403));
        assert_eq!(
            with(
                Method::DELETE,
                &[host, ("content-type", "application/json")]
            ),
            Some(403)
        );
        assert_eq!(with(Method::POST, &[host, ("x-sluice-admin", "1")]), None);
        assert_eq!(with(Method::HEAD, &[host]), None);
    }

    /// A name from DNS that is none of the accepted ones: what a rebinding page brings.
    fn foreign_name() -> impl proptest::strategy::Strategy<Value = String> {
        proptest::prop_oneof![
            "[a-z][a-z0-9-]{0,20}(\\.[a-z]{2,6}){0,2}",
            // Near misses of the accepted names.
            "(localhost|admin\\.internal)[a-z0-9.-]{1,4}",
            "[a-z0-9-]{1,4}\\.(localhost|admin\\.internal)",
        ]
        .prop_filter("an accepted name", |n| {
            n != "localhost" && n != "admin.internal"
        })
    }

    use proptest::strategy::Strategy;

    proptest::proptest! {
        /// Whatever foreign name or port a request brings in `Host`, or a page in `Origin`,
        /// the API refuses it; the loopback names in any case, with the listener's port,
        /// pass; and no method but GET and HEAD passes without the header.
        #[test]
        fn foreign_names_ports_and_methods_are_refused(
            name in foreign_name(),
            port in proptest::option::of(1u16..),
            loopback in proptest::sample::select(vec!["localhost", "LocalHost", "127.0.0.1", "[::1]", "[::ffff:127.0.0.1]"]),
            method in proptest::sample::select(vec!["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "PURGE"]),
        ) {
            let guard = Guard::new(vec!["admin.internal".parse().expect("a host")]);
            let local = "127.0.0.1:9090";
            let host = match port {
                Some(port) => format!("{name}:{port}"),
                None => name.clone(),
            };
            proptest::prop_assert_eq!(api(&guard, Method::GET, local, &[("host", &host)]), Some(421), "{}", host);
            let own = format!("{loopback}:9090");
            let origin = format!("http://{host}");
            proptest::prop_assert_eq!(
                api(&guard, Method::GET, local, &[("host", &own), ("origin", &origin)]),
                Some(403),
                "{}", origin
            );
            proptest::prop_assert_eq!(api(&guard, Method::GET, local, &[("host", &own)]), None, "{}", own);
            if let Some(port) = port.filter(|&p| p != 9090) {
                let elsewhere = format!("{loopback}:{port}");
                proptest::prop_assert_eq!(api(&guard, Method::GET, local, &[("host", &elsewhere)]), Some(421), "{}", elsewhere);
            }
            let method: Method = method.parse().expect("a method");
            proptest::prop_assert_eq!(api(&guard, method.clone(), local, &[("host", &own)]), Some(403));
            proptest::prop_assert_eq!(api(&guard, method, local, &[("host", &own), ("x-sluice-admin", "1")]), None);
        }
    }
}
