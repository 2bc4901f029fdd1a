//! A real WebSocket echo server (tokio-tungstenite) for the tests, in cleartext (`ws://`) or
//! behind TLS (`wss://`): it echoes text and binary messages, closes on `close-me`, refuses
//! the handshake under `/ws/refused`, and notes each upgrade request and how each connection
//! ended.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

pub type Client = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// Generous bound on each step.
pub const STEP: Duration = Duration::from_secs(10);

/// How a connection to the echo server ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Ended {
    /// The client sent a Close frame.
    CloseFrame,
    /// The connection broke off or ended without a Close frame.
    Disconnected,
    /// The server closed it (after `close-me`).
    ClosedByServer,
}

#[derive(Debug, Default)]
pub struct EchoState {
    /// The handshake requests the server accepted: (path, upgrade, connection).
    pub upgrades: Vec<(String, String, String)>,
    pub ended: Vec<Ended>,
    pub tls_handshakes: usize,
}

/// A WebSocket echo server: echoes text and binary messages, closes on `close-me`, and
/// refuses the handshake with 403 on paths under `/ws/refused`.
pub struct EchoServer {
    pub addr: SocketAddr,
    state: Arc<Mutex<EchoState>>,
    task: JoinHandle<()>,
}

impl EchoServer {
    pub async fn start() -> EchoServer {
        EchoServer::start_with(None).await
    }

    /// The same server behind TLS (`wss://`) with `acceptor`'s certificate.
    pub async fn start_tls(acceptor: tokio_rustls::TlsAcceptor) -> EchoServer {
        EchoServer::start_with(Some(acceptor)).await
    }

    async fn start_with(acceptor: Option<tokio_rustls::TlsAcceptor>) -> EchoServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(EchoState::default()));
        let task = tokio::spawn({
            let state = Arc::clone(&state);
            async move {
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        continue;
                    };
                    let state = Arc::clone(&state);
                    let acceptor = acceptor.clone();
                    tokio::spawn(async move {
                        match acceptor {
                            None => echo(stream, state).await,
                            Some(acceptor) => {
                                state.lock().unwrap().tls_handshakes += 1;
                                if let Ok(stream) = acceptor.accept(stream).await {
                                    echo(stream, state).await;
                                }
                            }
                        }
                    });
                }
            }
        });
        EchoServer { addr, state, task }
    }

    /// How many connections opened a TLS handshake (a `start_tls` server).
    pub fn tls_handshakes(&self) -> usize {
        self.state.lock().unwrap().tls_handshakes
    }

    pub fn upgrades(&self) -> Vec<(String, String, String)> {
        self.state.lock().unwrap().upgrades.clone()
    }

    pub fn ended(&self) -> Vec<Ended> {
        self.state.lock().unwrap().ended.clone()
    }

    /// Waits until `count` connections have ended.
    pub async fn wait_ended(&self, count: usize) -> Vec<Ended> {
        let deadline = Instant::now() + STEP;
        loop {
            let ended = self.ended();
            if ended.len() >= count {
                return ended;
            }
            assert!(
                Instant::now() < deadline,
                "the upstream saw {} of {count} connections end: {ended:?}",
                ended.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

// tungstenite's callback type fixes the error type.
#[allow(clippy::result_large_err)]
async fn echo<S>(stream: S, state: Arc<Mutex<EchoState>>)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let callback = {
        let state = Arc::clone(&state);
        move |request: &Request, response: Response| -> Result<Response, ErrorResponse> {
            let path = request.uri().path().to_owned();
            if path.starts_with("/ws/refused") {
                let mut refusal = ErrorResponse::new(Some("no upgrade here".to_owned()));
                *refusal.status_mut() = http::StatusCode::FORBIDDEN;
                return Err(refusal);
            }
            let field = |name: &str| {
                request
                    .headers()
                    .get(name)
                    .map(|v| v.to_str().unwrap().to_owned())
                    .unwrap_or_default()
            };
            state
                .lock()
                .unwrap()
                .upgrades
                .push((path, field("upgrade"), field("connection")));
            Ok(response)
        }
    };
    let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(stream, callback).await else {
        return;
    };
    let ended = loop {
        match ws.next().await {
            Some(Ok(Message::Text(text))) if text.as_str() == "close-me" => {
                let _ = ws
                    .close(Some(CloseFrame {
                        code: CloseCode::Away,
                        reason: "asked to".into(),
                    }))
                    .await;
                // Wait for the client's answering Close, then the end.
                while let Some(Ok(_)) = ws.next().await {}
                break Ended::ClosedByServer;
            }
            Some(Ok(message @ (Message::Text(_) | Message::Binary(_)))) => {
                if ws.send(message).await.is_err() {
                    break Ended::Disconnected;
                }
            }
            Some(Ok(Message::Close(_))) => {
                // tungstenite answers the Close itself; drain to the end.
                while let Some(Ok(_)) = ws.next().await {}
                break Ended::CloseFrame;
            }
            Some(Ok(_)) => {}
            Some(Err(_)) | None => break Ended::Disconnected,
        }
    };
    state.lock().unwrap().ended.push(ended);
}
