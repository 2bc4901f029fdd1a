//! TLS on `rls.listen` (`rls.tls`): connections are accepted and their handshakes run in
//! tasks of their own (a slow client holds only its own handshake, for at most
//! `HANDSHAKE_TIMEOUT`), then handed to tonic's server as a stream. The acceptor is the
//! gateway listener's (`tls::ListenerTls`): the same files, checks, ALPN (`h2` first),
//! rotation and client certificates (`client_ca`), verified in the handshake.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// How long a client has to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// One TLS connection, as tonic's server takes it.
pub struct TlsConnection(TlsStream<TcpStream>);

impl tonic::transport::server::Connected for TlsConnection {
    type ConnectInfo = ();

    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for TlsConnection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConnection {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

/// Accepts on `listener` and sends each connection whose handshake completed; ends when the
/// receiver is dropped (the server stopped).
pub async fn accept(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    ready: mpsc::Sender<Result<TlsConnection, io::Error>>,
) {
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of descriptors and the like: pause, as the gateway's listener does.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = ready.closed() => return,
        };
        let _ = stream.set_nodelay(true);
        let (acceptor, ready) = (acceptor.clone(), ready.clone());
        tokio::spawn(async move {
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => {
                    let _ = ready.send(Ok(TlsConnection(tls))).await;
                }
                Ok(Err(err)) => {
                    tracing::debug!(target: "sluice::rls", error = %err, "TLS handshake failed")
                }
                Err(_) => tracing::debug!(target: "sluice::rls", "TLS handshake timed out"),
            }
        });
    }
}
