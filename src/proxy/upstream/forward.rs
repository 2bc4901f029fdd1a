//! Sending an admitted request to its upstream and bringing the response back, bodies
//! streamed both ways. An upstream that cannot be reached is a 502, one that does not answer
//! its response headers in time is a 504; a client body that breaks off, outgrows the
//! route's `max_body` or falls behind its pace before the upstream answers is the client's
//! 400, 413 or 408.
//!
//! An upstream is spoken to over HTTP/1.1, or over HTTP/2 with prior knowledge when it is
//! marked `http2` (gRPC): then `TE: trailers` is passed on, and trailers flow both ways as
//! frames of the streamed bodies. A WebSocket upgrade to an HTTP/1.1 upstream keeps its
//! `Connection`/`Upgrade` fields, and a `101` answer turns both connections into a tunnel.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderValue, HOST, TE};
use http::uri::{PathAndQuery, Scheme};
use http::{Request, Response, StatusCode, Uri, Version};
use hyper::body::Incoming;
use prometheus::{IntCounter, IntCounterVec};

pub use super::error::ForwardError;
use super::pool::Connector;
pub use super::pool::UpstreamBody;

use super::headers;
use super::tunnel;
use crate::metrics::UpstreamErrorKind;
use crate::policy::{Route, Upstream};
use crate::proxy::request_body::{BodyRefusals, ClientBody, RequestBody};
use crate::proxy::unread_body;
use crate::tls::UpstreamTls;

/// The HTTP/1.1 (or, for an `http2` upstream, HTTP/2) client of one upstream (over TLS for an
/// https one), with its error counters; its connections are pooled per worker (see `pool`).
/// Long-lived: the registry in `upstream::clients` keeps it across reloads that leave the
/// upstream unchanged, and with it the warm connections.
pub struct UpstreamClient {
    connector: Arc<Connector>,
    errors: UpstreamErrors,
}

/// `sluice_upstream_errors_total` of one upstream, one counter per kind.
struct UpstreamErrors {
    connect: IntCounter,
    timeout: IntCounter,
    other: IntCounter,
}

impl UpstreamClient {
    /// `errors` is `sluice_upstream_errors_total`; `upstream` names this upstream in it.
    /// `tls`: the settings of an https upstream. A failed TLS handshake is a connect error.
    /// `http2`: speak HTTP/2 with prior knowledge (h2c) instead of HTTP/1.1.
    pub fn new(
        authority: &http::uri::Authority,
        connect_timeout: Duration,
        tls: Option<&UpstreamTls>,
        upstream: &str,
        errors: &IntCounterVec,
        http2: bool,
    ) -> UpstreamClient {
        let counter = |kind: UpstreamErrorKind| errors.with_label_values(&[upstream, kind.label()]);
        UpstreamClient {
            connector: Arc::new(Connector::new(authority, connect_timeout, tls, http2)),
            errors: UpstreamErrors {
                connect: counter(UpstreamErrorKind::Connect),
                timeout: counter(UpstreamErrorKind::Timeout),
                other: counter(UpstreamErrorKind::Other),
            },
        }
    }
}

impl UpstreamErrors {
    /// The counter to blame for `err`; none when the client's body failed.
    fn of(&self, err: &ForwardError) -> Option<&IntCounter> {
        match err {
            ForwardError::Connect(_) => Some(&self.connect),
            ForwardError::Timeout(_) => Some(&self.timeout),
            ForwardError::Other(_) => Some(&self.other),
            ForwardError::Body(_) => None,
        }
    }
}

/// Forwards `request` (from `peer`) to `upstream` through its `client`, its body held to
/// `route`'s `max_body` and pace (faults counted in `refusals`), and returns the response
/// with hop-by-hop fields removed. A WebSocket upgrade the upstream accepts becomes a tunnel
/// (see `tunnel`) named after `route`. With it, what the answer (the upstream's, or sluice's
/// when the forward fails) must say of the client's connection: one whose body was not read
/// to its end by then closes (`unread_body::after_reading`).
pub async fn forward(
    upstream: &Upstream,
    client: &UpstreamClient,
    mut request: Request<ClientBody<Incoming>>,
    peer: SocketAddr,
    route: &Route,
    refusals: &Arc<BodyRefusals>,
) -> (
    Result<Response<UpstreamBody>, ForwardError>,
    unread_body::Connection,
) {
    let upgrade = take_upgrade(upstream, &mut request);
    let wants_trailers = upstream.http2 && asks_trailers(&request);
    let (parts, body) = request.into_parts();
    let version = parts.version;
    let (body, progress) = RequestBody::new(
        body,
        route.max_body.unwrap_or(u64::MAX),
        route.body_pace,
        Arc::clone(refusals),
    );
    let tls_client = parts.extensions.get::<crate::tls::ClientTls>().is_some();
    let mut request = Request::from_parts(parts, body);
    // Taken out: the upstream's own goes in (HTTP/1.1, `pool`) or none (HTTP/2: `:authority`).
    let host = request.headers_mut().remove(HOST).or_else(|| {
        request
            .uri()
            .authority()
            .and_then(|a| a.as_str().parse().ok())
    });
    // Told with the answer, the upstream's or sluice's: whether the client's body was read
    // to its end by then. A WebSocket tunnel takes the connection over, no longer HTTP.
    let connection =
        |switched: bool| unread_body::after_reading(version, switched || progress.read_to_end());
    match upstream_uri(upstream, request.uri()) {
        Ok(uri) => *request.uri_mut() = uri,
        Err(err) => return (Err(err), connection(false)),
    }

    let origin = ClientOrigin {
        peer,
        host,
        tls_client,
    };
    rewrite_head(
        &mut request,
        upstream,
        upgrade.as_ref(),
        wants_trailers,
        origin,
    );
    let sent = client.connector.send(request, upgrade.is_some());
    let result = match tokio::time::timeout(upstream.timeout, sent).await {
        Ok(result) => result,
        Err(_) => Err(ForwardError::Timeout(upstream.timeout)),
    };
    match result {
        Ok(mut response) => {
            let tunnel = upstream_answer(&mut response, upgrade, route);
            (Ok(response), connection(tunnel))
        }
        Err(err) => {
            // A failed body makes the upstream exchange fail too; the body is what to blame.
            let err = progress.fault().map_or(err, ForwardError::Body);
            if let Some(counter) = client.errors.of(&err) {
                counter.inc();
            }
            (Err(err), connection(false))
        }
    }
}

/// The client's side of a WebSocket upgrade to tunnel, taken out of `request`, if it asks
/// for one `upstream` can take. Without one, the request's extensions lose what only a
/// tunnel may hold: the client's connection slot, and a concurrency lease (it rides with the
/// answer, not the upstream's request).
fn take_upgrade(
    upstream: &Upstream,
    request: &mut Request<ClientBody<Incoming>>,
) -> Option<tunnel::ClientSide> {
    // Extended CONNECT (RFC 8441) is not supported, so an HTTP/2 upstream gets no upgrade.
    let upgrade = (!upstream.http2 && tunnel::is_websocket_upgrade(request))
        .then(|| tunnel::ClientSide::take(request));
    if upgrade.is_none() {
        request
            .extensions_mut()
            .remove::<crate::server::ConnectionHold>();
        request
            .extensions_mut()
            .remove::<crate::limiter::LeaseHold>();
    }
    upgrade
}

/// Whether the request sends `TE: trailers`: the one TE allowed in HTTP/2, and gRPC servers
/// require it.
fn asks_trailers<B>(request: &Request<B>) -> bool {
    request
        .headers()
        .get_all(TE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .any(|item| item.trim().eq_ignore_ascii_case("trailers"))
}

/// What the upstream is told of where the request came from (`headers::add_forwarded`).
struct ClientOrigin {
    peer: SocketAddr,
    /// The client's `Host` (or its URI's authority).
    host: Option<HeaderValue>,
    /// The client spoke TLS to sluice.
    tls_client: bool,
}

/// The request's version and fields as the upstream gets them: the upstream's own version,
/// no hop-by-hop fields, the upgrade's and `TE: trailers` (`wants_trailers`) sent on, and the
/// forwarded fields.
fn rewrite_head(
    request: &mut Request<RequestBody>,
    upstream: &Upstream,
    upgrade: Option<&tunnel::ClientSide>,
    wants_trailers: bool,
    origin: ClientOrigin,
) {
    // The upstream speaks its own version whatever the client spoke; the client sets Host
    // (HTTP/1.1) or :authority (HTTP/2) from the URI.
    *request.version_mut() = if upstream.http2 {
        Version::HTTP_2
    } else {
        Version::HTTP_11
    };
    let headers = request.headers_mut();
    // One pass over the names for both edits.
    let found = headers::scan(headers);
    headers::remove_scanned(headers, &found);
    if let Some(upgrade) = upgrade {
        tunnel::set_upgrade_fields(headers, upgrade.protocol.clone());
    }
    if wants_trailers {
        headers.insert(TE, HeaderValue::from_static("trailers"));
    }
    let ClientOrigin {
        peer,
        host,
        tls_client,
    } = origin;
    headers::add_forwarded(headers, &found, peer.ip(), host, tls_client);
}

/// The upstream's response as the client gets it: without hop-by-hop fields, and, when it
/// accepts the client's WebSocket `upgrade`, with the tunnel between them started (named
/// after `route`). Returns whether it did.
fn upstream_answer(
    response: &mut Response<UpstreamBody>,
    upgrade: Option<tunnel::ClientSide>,
    route: &Route,
) -> bool {
    let switched = upgrade.filter(|_| response.status() == StatusCode::SWITCHING_PROTOCOLS);
    let protocol = response.headers().get(http::header::UPGRADE).cloned();
    headers::remove_hop_by_hop(response.headers_mut());
    let Some(client_side) = switched else {
        return false;
    };
    let protocol = protocol.unwrap_or_else(|| client_side.protocol.clone());
    tunnel::set_upgrade_fields(response.headers_mut(), protocol);
    let upstream_side = hyper::upgrade::on(response);
    tunnel::spawn(client_side, upstream_side, route.name.as_str().to_owned());
    true
}

fn upstream_uri(upstream: &Upstream, original: &Uri) -> Result<Uri, ForwardError> {
    let unbuildable = |e: &dyn std::fmt::Display| {
        ForwardError::Other(format!("cannot build the upstream URI: {e}"))
    };
    let original = original
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    let path_and_query: PathAndQuery = if upstream.base_path.is_empty() {
        original
    } else {
        format!("{}{original}", upstream.base_path)
            .parse()
            .map_err(|e| unbuildable(&e))?
    };
    Uri::builder()
        .scheme(if upstream.tls.is_some() {
            Scheme::HTTPS
        } else {
            Scheme::HTTP
        })
        .authority(upstream.authority.clone())
        .path_and_query(path_and_query)
        .build()
        .map_err(|e| unbuildable(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstream(base_path: &str) -> Upstream {
        Upstream {
            name: "api".parse().unwrap(),
            authority: "10.0.0.1:3000".parse().unwrap(),
            base_path: base_path.to_owned(),
            connect_timeout: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            tls: None,
            http2: false,
        }
    }

    #[test]
    fn the_path_and_query_are_kept_and_the_base_path_put_in_front() {
        let original: Uri = "http://front.example/users/7?fields=a,b".parse().unwrap();
        assert_eq!(
            upstream_uri(&upstream(""), &original).unwrap(),
            "http://10.0.0.1:3000/users/7?fields=a,b"
        );
        assert_eq!(
            upstream_uri(&upstream("/v1"), &original).unwrap(),
            "http://10.0.0.1:3000/v1/users/7?fields=a,b"
        );
    }
}
