//! A TCP relay that adds a fixed delay each way, for measuring sluice's Redis path across a
//! slower link than loopback (the bench harness's `rtt` step, bench/harness/steps/rtt.py,
//! issue 39).
//!
//! It listens on a loopback port and forwards every accepted connection to a target port on
//! loopback (Redis), holding every chunk it reads for a fixed one-way delay before writing it
//! on, in each direction: a round trip through it takes `2 × delay` more. It is pipelined: a
//! chunk read at `t` is written at `t + delay` whatever else is in flight, so the delay adds
//! latency without capping throughput, as a longer wire would (up to the bounded queue of
//! chunks in flight per direction, past which the reader waits: TCP's own back-pressure).
//!
//! Why at the TCP level: the bench wants the latency of a distant Redis, nothing else. Bytes
//! are never lost, reordered or duplicated here; the kernel's loopback carries them. Loss,
//! and what TCP's recovery does to sluice, is tested with the TUN relay of
//! scripts/tunrelay.py, which works on packets but spends about 0.6 ms per packet of its own,
//! too much for a 0.2 ms round trip.
//!
//! Each direction of a connection is two OS threads: a reader that timestamps each chunk into
//! a bounded channel, and a writer that sleeps until each chunk is due and writes it whole.
//! Threads, not tokio tasks, because tokio's timer has a 1 ms tick, where a nanosleep is
//! precise to tens of microseconds (the writer sets its timer slack to 1 µs, from Linux's
//! default 50 µs, and wakes early by the lateness it has seen: `Pacer`). `TCP_NODELAY` is set
//! on both sockets so the kernel adds no wait of its own. The threads' own wake-ups (the
//! reader's on data, the writer's on the channel) still add some tens of µs a round trip on
//! top of `2 × DELAY_US`, more on a busy machine: measure the round trip through the relay
//! (bench/harness/steps/rtt.py measures PINGs and corrects the delay it gives).
//!
//! ```text
//! delay_relay LISTEN_PORT TARGET_PORT DELAY_US
//! ```
//!
//! It prints one line once it listens, then runs until it is killed.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::ExitCode;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::thread;
use std::time::{Duration, Instant};

/// Bytes read at once: at most one chunk's worth.
const CHUNK: usize = 64 * 1024;
/// Chunks in flight per direction before the reader waits for the writer.
const IN_FLIGHT: usize = 1024;
/// Stack of each relay thread: they hold nothing big on it (chunks are on the heap).
const STACK: usize = 128 * 1024;
/// Bound on how early a writer asks to wake before a chunk is due (see `Pacer`).
const MAX_EARLY: Duration = Duration::from_micros(200);

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parsed = match args.as_slice() {
        [listen, target, delay] => listen
            .parse::<u16>()
            .ok()
            .zip(target.parse::<u16>().ok())
            .zip(delay.parse::<u64>().ok()),
        _ => None,
    };
    let Some(((listen, target), delay_us)) = parsed else {
        eprintln!("usage: delay_relay LISTEN_PORT TARGET_PORT DELAY_US (one-way delay)");
        return ExitCode::from(2);
    };
    let delay = Duration::from_micros(delay_us);
    let listener = match TcpListener::bind(("127.0.0.1", listen)) {
        Ok(listener) => listener,
        Err(err) => {
            eprintln!("delay_relay: bind 127.0.0.1:{listen}: {err}");
            return ExitCode::FAILURE;
        }
    };
    println!("listening on 127.0.0.1:{listen}, to 127.0.0.1:{target}, {delay_us} µs each way");
    for client in listener.incoming() {
        let client = match client {
            Ok(client) => client,
            Err(err) => {
                eprintln!("delay_relay: accept: {err}");
                continue;
            }
        };
        if let Err(err) = relay(client, target, delay) {
            eprintln!("delay_relay: connection to 127.0.0.1:{target}: {err}");
        }
    }
    ExitCode::SUCCESS
}

/// Connects to the target and starts both directions of one accepted connection.
fn relay(client: TcpStream, target: u16, delay: Duration) -> std::io::Result<()> {
    let server = TcpStream::connect(("127.0.0.1", target))?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    direction(client.try_clone()?, server.try_clone()?, delay)?;
    direction(server, client, delay)
}

/// One direction: `from`'s bytes written to `to`, each chunk `delay` after it was read.
fn direction(from: TcpStream, to: TcpStream, delay: Duration) -> std::io::Result<()> {
    let (tx, rx) = sync_channel(IN_FLIGHT);
    let reader_side = from.try_clone()?;
    thread::Builder::new()
        .stack_size(STACK)
        .spawn(move || read_chunks(from, tx))?;
    thread::Builder::new()
        .stack_size(STACK)
        .spawn(move || write_chunks(to, reader_side, rx, delay))?;
    Ok(())
}

/// Reads chunks as they come and queues each with the time it arrived; an end of stream or
/// an error ends the queue (the writer then passes the end on).
fn read_chunks(mut from: TcpStream, tx: SyncSender<(Instant, Vec<u8>)>) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if tx.send((Instant::now(), buf[..n].to_vec())).is_err() {
                    return; // the writer is gone: its side failed
                }
            }
        }
    }
}

/// Writes each queued chunk at its arrival time + `delay`; once the queue ends, half-closes
/// `to` as the other side did. A failed write closes both sockets of the direction, so its
/// reader stops too and the other direction sees the end.
fn write_chunks(
    mut to: TcpStream,
    from: TcpStream,
    rx: Receiver<(Instant, Vec<u8>)>,
    delay: Duration,
) {
    fine_timer_slack();
    let mut pacer = Pacer::default();
    for (read_at, chunk) in rx {
        pacer.wait_until(read_at + delay);
        if to.write_all(&chunk).is_err() {
            let _ = to.shutdown(Shutdown::Both);
            let _ = from.shutdown(Shutdown::Both);
            return;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// Waits until about a given time. A sleep on Linux ends late, by the timer slack plus the
/// wake-up (40-70 µs on the bench's virtual machine with a 1 µs slack, more when the cores are
/// busy): half of a 100 µs delay. So the pacer asks to wake that much early, learning the
/// lateness as it goes (a moving average, an eighth of each new sample, so it follows the
/// machine's load). It does not spin: a wake that comes a little early is taken as it comes,
/// so that the delay is right on average and the relay takes no CPU from what it measures.
#[derive(Default)]
struct Pacer {
    early: Duration,
}

impl Pacer {
    fn wait_until(&mut self, due: Instant) {
        let wait = due.saturating_duration_since(Instant::now());
        if wait > self.early {
            let asked = Instant::now() + (wait - self.early);
            thread::sleep(wait - self.early);
            let woke = Instant::now();
            // How late the sleep ended, against what was asked: what to ask less next time.
            let late = woke.saturating_duration_since(asked);
            self.early = if late > self.early {
                self.early + (late - self.early) / 8
            } else {
                self.early - (self.early - late) / 8
            }
            .min(MAX_EARLY);
        }
    }
}

/// Sets this thread's timer slack to 1 µs (Linux's default, 50 µs, is a quarter of the
/// bench's shortest one-way delay; a sleep may end that much late).
#[cfg(target_os = "linux")]
fn fine_timer_slack() {
    extern "C" {
        fn prctl(option: i32, ...) -> i32;
    }
    const PR_SET_TIMERSLACK: i32 = 29;
    // SAFETY: prctl(PR_SET_TIMERSLACK, ns) reads one unsigned long and changes only this
    // thread's timer slack; a failure leaves the default, which only makes sleeps coarser.
    unsafe {
        prctl(PR_SET_TIMERSLACK, 1000 as std::ffi::c_ulong);
    }
}

#[cfg(not(target_os = "linux"))]
fn fine_timer_slack() {}
