//! A stream that notes that a byte moved through it, for idle timeouts: the server's
//! connections (closed after `server.idle_timeout` of silence) and both sides of a WebSocket
//! tunnel share this one mark instead of each arming a timer per read.
//!
//! A read or a write only sets a flag (no clock is read on the I/O path: a stamp per read and
//! per write was a clock read and a 128-bit division each, several per request). The one who
//! enforces the timeout looks at the flag on a coarse tick ([`IdleWatch`], a quarter of the
//! timeout): a connection is closed after between one and one and a quarter idle timeouts of
//! silence.
//!
//! A write that the socket could not take (its buffer full: the peer reads nothing) is noted
//! too, until a later write goes through: a silence with a write waiting is a peer that
//! stopped reading, not one waiting for an answer ([`IdleWatch::write_waiting`]).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

/// Whether a byte moved since the last look, and whether a write is waiting for the socket.
/// Several streams may share one (the two sides of a tunnel).
#[derive(Clone, Default)]
pub struct Activity(Arc<Marks>);

#[derive(Default)]
struct Marks {
    moved: AtomicBool,
    /// The last write the socket was offered could not be taken (`Pending`).
    write_waiting: AtomicBool,
}

impl Activity {
    fn touch(&self) {
        // A load first: the flag is usually set already, and a store would take the cache
        // line from the core that last looked.
        if !self.0.moved.load(Ordering::Relaxed) {
            self.0.moved.store(true, Ordering::Relaxed);
        }
    }

    /// Notes how a write ended: waiting (`Pending`) or not.
    fn write_waits(&self, waiting: bool) {
        // A load first, as in `touch`: the flag rarely changes.
        if self.0.write_waiting.load(Ordering::Relaxed) != waiting {
            self.0.write_waiting.store(waiting, Ordering::Relaxed);
        }
    }

    /// Whether a byte moved since the last call (and clears the mark).
    fn take(&self) -> bool {
        self.0.moved.swap(false, Ordering::Relaxed)
    }
}

/// Ticks a quarter of the idle timeout: `TICKS` ticks in a row without activity are silence.
const TICKS: u32 = 4;

/// Watches one [`Activity`] for `idle` of silence, on a tick of `idle / 4`: one timer per
/// tick for the connection, none per request.
pub struct IdleWatch {
    activity: Activity,
    tick: Duration,
    /// Ticks in a row that found no activity.
    quiet: u32,
    next: Instant,
}

impl IdleWatch {
    pub fn new(activity: Activity, idle: Duration) -> IdleWatch {
        let tick = (idle / TICKS).max(Duration::from_millis(1));
        IdleWatch {
            activity,
            tick,
            quiet: 0,
            next: Instant::now() + tick,
        }
    }

    /// When to look next ([`IdleWatch::look`]).
    pub fn next(&self) -> Instant {
        self.next
    }

    /// Called at [`IdleWatch::next`]: whether the stream has been silent for the idle
    /// timeout (at least `TICKS` whole ticks since the tick that last saw a byte move).
    pub fn look(&mut self) -> bool {
        if self.activity.take() {
            self.quiet = 0;
        } else {
            self.quiet += 1;
        }
        self.next += self.tick;
        self.quiet >= TICKS
    }

    /// Whether a write is waiting for the socket to take it: with [`IdleWatch::look`] saying
    /// silence, the peer has read nothing for the idle timeout while there was something to
    /// send it.
    pub fn write_waiting(&self) -> bool {
        self.activity.0.write_waiting.load(Ordering::Relaxed)
    }
}

/// `io`, marking `activity` whenever a byte is read or written.
pub struct StampedIo<T> {
    io: T,
    activity: Activity,
}

impl<T> StampedIo<T> {
    pub fn new(io: T, activity: &Activity) -> StampedIo<T> {
        StampedIo {
            io,
            activity: activity.clone(),
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for StampedIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let result = Pin::new(&mut this.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.activity.touch();
        }
        result
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for StampedIo<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_write(cx, buf);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            this.activity.touch();
        }
        this.activity.write_waits(result.is_pending());
        result
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            this.activity.touch();
        }
        this.activity.write_waits(result.is_pending());
        result
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silence_is_four_quiet_ticks_after_the_tick_that_saw_a_byte() {
        let activity = Activity::default();
        let mut watch = IdleWatch::new(activity.clone(), Duration::from_secs(4));
        let first = watch.next();
        activity.touch();
        assert!(!watch.look(), "a byte moved");
        for tick in 1..TICKS {
            assert!(!watch.look(), "quiet tick {tick} of {TICKS}");
        }
        activity.touch();
        assert!(!watch.look(), "a byte moved again: the count starts over");
        for _ in 1..TICKS {
            assert!(!watch.look());
        }
        assert!(watch.look(), "the fourth quiet tick in a row is silence");
        assert_eq!(
            watch.next() - first,
            Duration::from_secs(9),
            "one tick a second"
        );
    }

    #[tokio::test]
    async fn a_write_the_peer_does_not_take_is_noted_until_one_goes_through() {
        use futures_util::FutureExt;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (ours, mut peer) = tokio::io::duplex(64);
        let activity = Activity::default();
        let watch = IdleWatch::new(activity.clone(), Duration::from_secs(4));
        let mut io = StampedIo::new(ours, &activity);
        assert_eq!(io.write(&[b'x'; 64]).now_or_never().unwrap().unwrap(), 64);
        assert!(!watch.write_waiting(), "the write went through");
        assert!(
            io.write(b"y").now_or_never().is_none(),
            "the peer reads nothing: the write waits"
        );
        assert!(watch.write_waiting());
        let mut read = [0u8; 64];
        peer.read_exact(&mut read).await.unwrap();
        assert_eq!(io.write(b"y").now_or_never().unwrap().unwrap(), 1);
        assert!(
            !watch.write_waiting(),
            "the peer read: the write went through"
        );
    }
}
