//! WebSocket upgrades passed through: the client's `Upgrade: websocket` request is forwarded
//! with its `Connection`/`Upgrade` fields, and when the upstream answers `101 Switching
//! Protocols` both connections are taken over from HTTP and their bytes copied both ways
//! until either side closes or the tunnel has been idle for the listener's idle timeout.
//! sluice does not parse WebSocket frames: the upgrade request is what is rate-limited.

use http::header::{HeaderMap, HeaderValue, CONNECTION, UPGRADE};
use http::{Request, Version};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;

use crate::limiter::LeaseHold;
use crate::runtime::activity::{Activity, IdleWatch, StampedIo};
use crate::server::ConnectionHold;

/// Whether `request` asks to switch its HTTP/1.1 connection to WebSocket (RFC 6455 §4.1):
/// `Connection` names `upgrade` and `Upgrade` names `websocket`. Other protocols (h2c among
/// them) are not passed through: their `Upgrade` is removed like any hop-by-hop field.
pub fn is_websocket_upgrade<B>(request: &Request<B>) -> bool {
    asks_websocket(request.version(), request.headers())
}

/// `is_websocket_upgrade` from a request's version and header fields.
pub fn asks_websocket(version: Version, headers: &HeaderMap) -> bool {
    version == Version::HTTP_11
        && has_token(headers, CONNECTION, "upgrade")
        && has_token(headers, UPGRADE, "websocket")
}

fn has_token(headers: &HeaderMap, name: http::header::HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        // `Upgrade: websocket/13` names a version after the protocol.
        .any(|item| {
            let item = item.trim();
            let protocol = item.split('/').next().unwrap_or(item);
            protocol.eq_ignore_ascii_case(token)
        })
}

/// The client's side of an upgrade, taken from the request before it is forwarded.
pub struct ClientSide {
    on_upgrade: OnUpgrade,
    /// The value of the client's `Upgrade` field, sent on to the upstream.
    pub protocol: HeaderValue,
    hold: Option<ConnectionHold>,
    /// A concurrency limit's lease, held until the tunnel closes.
    lease: Option<LeaseHold>,
}

impl ClientSide {
    /// Takes the upgrade future and the connection hold out of `request`'s extensions.
    pub fn take<B>(request: &mut Request<B>) -> ClientSide {
        let protocol = request
            .headers()
            .get(UPGRADE)
            .cloned()
            .unwrap_or_else(|| HeaderValue::from_static("websocket"));
        let hold = request.extensions_mut().remove::<ConnectionHold>();
        let lease = request.extensions_mut().remove::<LeaseHold>();
        ClientSide {
            on_upgrade: hyper::upgrade::on(request),
            protocol,
            hold,
            lease,
        }
    }
}

/// Sets the two fields that ask the next hop to switch protocols.
pub fn set_upgrade_fields(headers: &mut HeaderMap, protocol: HeaderValue) {
    headers.insert(CONNECTION, HeaderValue::from_static("upgrade"));
    headers.insert(UPGRADE, protocol);
}

/// Once both sides have switched, copies bytes both ways in a task of its own. `upstream`
/// is the upgrade future of the upstream's `101` response.
pub fn spawn(client: ClientSide, upstream: OnUpgrade, route: String) {
    tokio::spawn(async move {
        let ClientSide {
            on_upgrade,
            hold,
            lease,
            ..
        } = client;
        let (client_io, upstream_io) = match tokio::try_join!(on_upgrade, upstream) {
            Ok(pair) => pair,
            Err(err) => {
                tracing::debug!(route, error = %err, "a WebSocket upgrade did not complete");
                return;
            }
        };
        let idle_timeout = hold.as_ref().map(|hold| hold.idle_timeout);
        let activity = Activity::default();
        let mut client_io = StampedIo::new(TokioIo::new(client_io), &activity);
        let mut upstream_io = StampedIo::new(TokioIo::new(upstream_io), &activity);
        let copy = tokio::io::copy_bidirectional(&mut client_io, &mut upstream_io);
        // A concurrency lease that cannot be renewed closes the tunnel: the store gives the
        // place to another request.
        let lost = lease.as_ref().map(|lease| lease.0.lost());
        let copying = async {
            match idle_timeout {
                Some(idle) => until_idle(copy, IdleWatch::new(activity, idle)).await,
                None => Some(copy.await),
            }
        };
        let ended = match lost {
            None => copying.await,
            Some(lost) => tokio::select! {
                ended = copying => ended,
                () = lost => {
                    tracing::warn!(route, "WebSocket closed: its concurrency lease could not be renewed");
                    None
                }
            },
        };
        match ended {
            Some(Ok((up, down))) => {
                tracing::debug!(route, bytes_up = up, bytes_down = down, "WebSocket closed")
            }
            Some(Err(err)) => tracing::debug!(route, error = %err, "WebSocket broke off"),
            None => tracing::debug!(
                route,
                "WebSocket closed after the idle timeout or a lost lease"
            ),
        }
        // The connections close as they drop here, and the client's slot and the request's
        // lease are given back.
        drop(hold);
        drop(lease);
    });
}

/// Runs `copy` until it ends (`Some`), or until no byte has moved for `idle` (`None`).
async fn until_idle<F: std::future::Future>(copy: F, mut idle: IdleWatch) -> Option<F::Output> {
    let mut copy = std::pin::pin!(copy);
    loop {
        tokio::select! {
            ended = copy.as_mut() => return Some(ended),
            _ = tokio::time::sleep_until(idle.next()) => {
                if idle.look() {
                    return None;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(connection: &str, upgrade: &str) -> Request<()> {
        Request::builder()
            .header(CONNECTION, connection)
            .header(UPGRADE, upgrade)
            .body(())
            .unwrap()
    }

    #[test]
    fn a_websocket_upgrade_is_recognised_by_its_tokens() {
        assert!(is_websocket_upgrade(&request("Upgrade", "websocket")));
        assert!(is_websocket_upgrade(&request(
            "keep-alive, upgrade",
            "WebSocket"
        )));
        assert!(!is_websocket_upgrade(&request("keep-alive", "websocket")));
        assert!(!is_websocket_upgrade(&request("upgrade", "h2c")));
        let mut http2 = request("upgrade", "websocket");
        *http2.version_mut() = Version::HTTP_2;
        assert!(!is_websocket_upgrade(&http2));
    }
}
