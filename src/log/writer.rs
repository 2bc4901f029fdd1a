//! The log writer that never makes a request wait: each formatted line is handed to a bounded
//! in-memory queue with a non-blocking send, and one dedicated thread writes the queue to
//! standard error. When the queue is full (standard error is read too slowly, or not at all:
//! a stalled log shipper, a full container pipe) the line is dropped and counted, never
//! waited for. Lines the sink refuses (standard error closed) are counted as dropped too.

use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The most bytes the writer thread gathers from the queue into one `write`: lines that
/// arrive together leave in one system call.
const BATCH_BYTES: usize = 64 * 1024;

/// Counts shared by the senders, the writer thread and whoever flushes.
#[derive(Default)]
struct Counts {
    /// Lines accepted into the queue.
    queued: AtomicU64,
    /// Lines that never reached the sink: the queue was full, or the write failed.
    dropped: AtomicU64,
    /// Lines the writer thread has taken out of the queue and finished with (written or
    /// failed); guarded so a flush can wait for it to reach a target.
    finished: Mutex<u64>,
    progressed: Condvar,
}

/// The sending side: what `tracing_subscriber` formats each event into (one `write` per
/// line). Cloning it is cheap.
#[derive(Clone)]
pub struct QueueWriter {
    sender: SyncSender<Vec<u8>>,
    counts: Arc<Counts>,
}

/// Waits, for a bounded time, until the lines queued so far have been written.
#[derive(Clone)]
pub struct Flusher {
    counts: Arc<Counts>,
}

/// Reads the queue's drop count (for the metrics, which exist only after logging started).
#[derive(Clone)]
pub struct DropCount {
    counts: Arc<Counts>,
}

/// Starts the writer thread on `sink` with a queue of `capacity` lines.
pub fn start<W: Write + Send + 'static>(
    capacity: usize,
    sink: W,
) -> io::Result<(QueueWriter, Flusher, DropCount)> {
    let (sender, receiver) = mpsc::sync_channel(capacity.max(1));
    let counts = Arc::new(Counts::default());
    let thread_counts = Arc::clone(&counts);
    std::thread::Builder::new()
        .name("sluice-log-writer".to_owned())
        .spawn(move || drain(receiver, sink, &thread_counts))?;
    Ok((
        QueueWriter {
            sender,
            counts: Arc::clone(&counts),
        },
        Flusher {
            counts: Arc::clone(&counts),
        },
        DropCount { counts },
    ))
}

/// The writer thread: takes what is queued, writes it in batches, counts what failed. It ends
/// when every sender is gone.
fn drain<W: Write>(receiver: Receiver<Vec<u8>>, mut sink: W, counts: &Counts) {
    let mut batch = Vec::with_capacity(BATCH_BYTES);
    while let Ok(first) = receiver.recv() {
        batch.clear();
        batch.extend_from_slice(&first);
        let mut lines = 1;
        while batch.len() < BATCH_BYTES {
            match receiver.try_recv() {
                Ok(line) => {
                    batch.extend_from_slice(&line);
                    lines += 1;
                }
                Err(_) => break,
            }
        }
        if sink.write_all(&batch).and_then(|()| sink.flush()).is_err() {
            counts.dropped.fetch_add(lines, Ordering::Relaxed);
        }
        let mut finished = counts
            .finished
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        *finished += lines;
        counts.progressed.notify_all();
    }
}

impl Write for &QueueWriter {
    fn write(&mut self, line: &[u8]) -> io::Result<usize> {
        match self.sender.try_send(line.to_vec()) {
            Ok(()) => {
                self.counts.queued.fetch_add(1, Ordering::Relaxed);
            }
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.counts.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
        // Dropped or not, the line is dealt with: the formatter must not retry or report it.
        Ok(line.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for QueueWriter {
    type Writer = &'a QueueWriter;

    fn make_writer(&'a self) -> Self::Writer {
        self
    }
}

impl Flusher {
    /// Waits until every line queued before this call has been written (or failed), or
    /// `timeout` has passed; whether they all were. A stalled sink costs `timeout`, no more.
    pub fn flush(&self, timeout: Duration) -> bool {
        let target = self.counts.queued.load(Ordering::Relaxed);
        let deadline = Instant::now() + timeout;
        let mut finished = self
            .counts
            .finished
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        while *finished < target {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            finished = match self.counts.progressed.wait_timeout(finished, left) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
        true
    }
}

impl DropCount {
    /// Lines dropped since the queue started.
    pub fn get(&self) -> u64 {
        self.counts.dropped.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sink that takes nothing until the test opens it, as a pipe nobody reads; it says
    /// when the writer thread has entered its first `write`.
    struct Gate {
        open: Arc<(Mutex<bool>, Condvar)>,
        entered: mpsc::Sender<()>,
        written: Arc<Mutex<Vec<u8>>>,
    }

    impl Write for Gate {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            let _ = self.entered.send(());
            let (open, changed) = &*self.open;
            let mut guard = open.lock().unwrap();
            while !*guard {
                guard = changed.wait(guard).unwrap();
            }
            self.written.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// One line, in one `write`, as the formatter hands it over.
    fn send(writer: &QueueWriter, line: &str) {
        let mut writer = writer;
        writer.write_all(format!("{line}\n").as_bytes()).unwrap();
    }

    #[test]
    fn a_stalled_sink_drops_and_counts_instead_of_blocking() {
        let open = Arc::new((Mutex::new(false), Condvar::new()));
        let written = Arc::new(Mutex::new(Vec::new()));
        let (entered, entering) = mpsc::channel();
        let sink = Gate {
            open: Arc::clone(&open),
            entered,
            written: Arc::clone(&written),
        };
        let (writer, flusher, dropped) = start(4, sink).unwrap();
        send(&writer, "line 0");
        entering.recv_timeout(Duration::from_secs(10)).unwrap();
        // The thread is stuck writing line 0: 4 lines fit in the queue, 95 are dropped, and
        // none of the 99 writes waits (the bound is generous for a loaded CI machine).
        let started = Instant::now();
        for i in 1..100 {
            send(&writer, &format!("line {i}"));
        }
        assert!(started.elapsed() < Duration::from_secs(2));
        assert_eq!(dropped.get(), 95);
        assert!(
            !flusher.flush(Duration::from_millis(50)),
            "a stalled sink flushed"
        );
        *open.0.lock().unwrap() = true;
        open.1.notify_all();
        assert!(flusher.flush(Duration::from_secs(10)));
        let text = String::from_utf8(written.lock().unwrap().clone()).unwrap();
        assert_eq!(text, "line 0\nline 1\nline 2\nline 3\nline 4\n");
    }

    #[test]
    fn a_failing_sink_counts_its_lines_as_dropped() {
        struct Closed;
        impl Write for Closed {
            fn write(&mut self, _: &[u8]) -> io::Result<usize> {
                Err(io::ErrorKind::BrokenPipe.into())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let (writer, flusher, dropped) = start(1000, Closed).unwrap();
        for _ in 0..10 {
            send(&writer, "lost");
        }
        assert!(flusher.flush(Duration::from_secs(10)));
        assert_eq!(dropped.get(), 10);
    }
}
