//! `admin:`: who may use the admin API on `admin_listen` (`/admin/v1/*`). The token itself is
//! never in the file (a policy file is committed, mounted from ConfigMaps, printed by
//! `/admin/v1/config`): the file names the environment variable that holds it. `hosts` adds
//! names the admin listener answers to (`admin::guard` refuses every other `Host`).

use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::str::FromStr;

use serde::de::{Deserialize, Deserializer, Error as _};

use super::{ConfigError, Position, Spanned};

#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// The environment variable holding the bearer token `/admin/v1/*` requires.
    #[schemars(with = "Option<EnvName>")]
    pub token_env: Option<Spanned<EnvName>>,
    /// Serve `/admin/v1/*` at all; `false` leaves `admin_listen` with `/metrics`, `/healthz`
    /// and `/readyz` only (then no token is needed on any address).
    #[serde(default = "enabled")]
    pub api: bool,
    /// Names the admin API answers to besides its own address and the loopback names (a
    /// Service's DNS name, a port-forward's `localhost:PORT`): `name` (with no port or the
    /// listener's port) or `name:port` (that port only).
    #[serde(default)]
    pub hosts: Vec<AdminHost>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            token_env: None,
            api: true,
            hosts: Vec::new(),
        }
    }
}

/// A name in `admin.hosts`: a host (a DNS name, an IPv4 address or a bracketed IPv6 one),
/// lower-cased, and the port it must come with, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminHost {
    pub host: String,
    pub port: Option<u16>,
}

impl FromStr for AdminHost {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let refused = || {
            format!(
                "expected a host name the admin API answers to, like `sluice-admin.internal`, \
                 `sluice-admin.internal:9090` or `[fd00::7]:9090` (no scheme, path or \
                 wildcard), got `{text}`"
            )
        };
        let (host, port) = split_host_port(text).ok_or_else(refused)?;
        let name_ok = host.starts_with('[')
            || (!host.is_empty()
                && host.len() <= 253
                && host
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.'));
        if !name_ok {
            return Err(refused());
        }
        Ok(AdminHost {
            host: host.to_ascii_lowercase(),
            port,
        })
    }
}

/// `host` or `host:port` (a bracketed IPv6 literal keeps its brackets); `None` when the port
/// is not a number from 1 to 65535 or an IPv6 literal is not closed. As in a `Host` field:
/// the admin listener's guard reads requests with it too.
pub fn split_host_port(text: &str) -> Option<(&str, Option<u16>)> {
    let (host, port) = if text.starts_with('[') {
        let end = text.find(']')?;
        let (host, rest) = text.split_at(end + 1);
        if host[1..end].parse::<std::net::Ipv6Addr>().is_err() {
            return None;
        }
        match rest {
            "" => (host, None),
            _ => (host, Some(rest.strip_prefix(':')?)),
        }
    } else {
        match text.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (text, None),
        }
    };
    let port = match port {
        None => None,
        Some(digits) if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) => {
            Some(digits.parse::<u16>().ok().filter(|&p| p != 0)?)
        }
        Some(_) => return None,
    };
    Some((host, port))
}

impl<'de> Deserialize<'de> for AdminHost {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(D::Error::custom)
    }
}

fn enabled() -> bool {
    true
}

/// The name of an environment variable: a letter or `_`, then letters, digits and `_` (what a
/// shell, Docker and Kubernetes can all set).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvName(String);

impl EnvName {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for EnvName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for EnvName {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let mut chars = text.chars();
        let first_ok = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
        if !first_ok || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') || text.len() > 128 {
            return Err(format!(
                "expected the name of an environment variable (like SLUICE_ADMIN_TOKEN: a letter \
                 or `_`, then letters, digits and `_`), got `{text}`; the token itself never \
                 goes in the file"
            ));
        }
        Ok(EnvName(text.to_owned()))
    }
}

impl<'de> Deserialize<'de> for EnvName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(D::Error::custom)
    }
}

/// Refuses an admin API reachable from other hosts without a token: it can reset any client's
/// quota and reload the policy.
pub fn check(
    admin_listen: &Spanned<SocketAddr>,
    admin: &AdminConfig,
    file: &Path,
) -> Result<(), ConfigError> {
    if admin.api && admin.token_env.is_none() && !admin_listen.value.ip().is_loopback() {
        return Err(ConfigError::invalid(
            file,
            Position::from(admin_listen),
            "admin_listen",
            format!(
                "{} is not a loopback address, and the admin API (/admin/v1/*, which can reset \
                 quotas and reload the policy) has no token: set `admin: {{ token_env: NAME }}` \
                 to the environment variable holding its bearer token, or `admin: {{ api: false \
                 }}` to serve only /metrics, /healthz and /readyz there",
                admin_listen.value
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_names() {
        assert!("SLUICE_ADMIN_TOKEN".parse::<EnvName>().is_ok());
        assert!("_x1".parse::<EnvName>().is_ok());
        assert!("".parse::<EnvName>().is_err());
        assert!("1TOKEN".parse::<EnvName>().is_err());
        assert!("MY-TOKEN".parse::<EnvName>().is_err());
        assert!("s3cr3t token".parse::<EnvName>().is_err());
    }

    #[test]
    fn admin_hosts() {
        let host = |text: &str| text.parse::<AdminHost>().map(|h| (h.host, h.port));
        assert_eq!(
            host("Admin.Example"),
            Ok(("admin.example".to_owned(), None))
        );
        assert_eq!(host("admin:9090"), Ok(("admin".to_owned(), Some(9090))));
        assert_eq!(host("[::1]:80"), Ok(("[::1]".to_owned(), Some(80))));
        assert_eq!(host("10.0.0.7"), Ok(("10.0.0.7".to_owned(), None)));
        for bad in [
            "",
            "http://admin",
            "admin:",
            "admin:0",
            "admin:70000",
            "*.example",
            "[::1",
            "[x]:1",
            "a/b",
        ] {
            assert!(host(bad).is_err(), "{bad}");
        }
    }
}
