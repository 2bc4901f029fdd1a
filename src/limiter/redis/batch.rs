//! Batching: the decisions waiting on one connection to a node leave together, as one call of
//! the decide script (`scripts/decide.lua`), which decides them in order, each all-or-nothing
//! as if it had been sent alone.
//!
//! Each connection (a `Lane`) has a bounded queue drained by one writer task. The writer
//! takes everything queued (up to `MAX_BATCH` decisions), sends it as one EVALSHA, and waits
//! for the answer; decisions that arrive meanwhile queue for the next call. So a decision on
//! an idle connection leaves at once (no timer), and under load one call carries many: Redis
//! pays its per-call cost (command dispatch, script lookup, TIME, the driver's set-up) once
//! per batch instead of once per decision, and sluice writes and reads once per batch.
//!
//! The added latency is bounded: a decision waits for at most the calls queued ahead of it
//! on its connection, at most `QUEUE / MAX_BATCH` calls of at most `MAX_BATCH` decisions
//! each, and never longer than the store timeout, which bounds the whole decision (queue and
//! call). A decision that finds every queue of its worker's connections full is not queued:
//! it fails at once with `StoreError::Busy`, counted in `sluice_store_errors_total{kind="queue_full"}`, and the route
//! answers as its `on_store_error` says.
//!
//! A worker queues its decisions on the first connection of its share (`worker::share`), and
//! on the next only when that one's queue is full: spreading them round robin would split
//! the batches and cost Redis more per decision. One connection carries a worker's decisions
//! at one call in flight, `MAX_BATCH` decisions a round trip.
//!
//! The writer is spawned on the runtime of the first decision that uses the connection (each
//! connection is used by one worker, `worker::share`), and again if that runtime has gone.
//! A decision whose caller has given up (timeout, client gone) before its batch leaves is
//! dropped from the batch. On a Redis Cluster decisions are not batched: a batch would have
//! to hold keys of one slot only (see `calls`).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::{Cmd, ErrorKind, FromRedisValue, Script, ServerErrorKind};
use tokio::sync::{mpsc, oneshot};

use super::super::{Check, StoreError};
use super::epochs::Epochs;
use super::scripts::script_error;

/// Most decisions in one call: enough to spread Redis's per-call cost thin (a token bucket's
/// script costs Redis 14–16 µs of CPU called alone and 6.8 µs pipelined 16 deep on the 2-core bench
/// machine, issue 29), few enough that one call stays short (a call of 32 decides in well
/// under a millisecond).
pub(super) const MAX_BATCH: usize = 32;

/// Most decisions waiting on one connection (beyond the call in flight).
pub(super) const QUEUE: usize = 4 * MAX_BATCH;

/// One connection to a node, with the queue of the decisions waiting on it. A clone is a
/// handle to the same connection and queue.
#[derive(Clone)]
pub(super) struct Lane {
    pub(super) conn: ConnectionManager,
    queue: Arc<Mutex<Option<mpsc::Sender<Pending>>>>,
}

/// One decision waiting for its call, or the end of a request's concurrency leases (`end`),
/// which rides in the same call: an `HDEL` inside a batch costs Redis a fraction of a call of
/// its own (bench/HISTORY.md, "Concurrency limits, the ends batched").
pub(super) struct Pending {
    keys: Vec<String>,
    member: String,
    /// The end of the leases `member` holds under `keys`, not a decision.
    end: bool,
    /// Per key: the algorithm's label and requests, window, burst, cost, flags (shadow,
    /// overridable, notify and its thresholds: `decide.lua`), max delay.
    limits: Vec<(&'static str, [u64; 6])>,
    reply: oneshot::Sender<Result<Vec<i64>, StoreError>>,
}

impl Pending {
    /// A decision of `checks` for the request named `member`; without `may_delay`, delay
    /// limits reject instead. A concurrency check's `burst` slot carries its epoch flag. Also
    /// returns where its reply arrives: the script's numbers for this request alone.
    pub(super) fn new<'a>(
        checks: impl Iterator<Item = &'a Check> + Clone,
        member: String,
        may_delay: bool,
        epochs: &Epochs,
    ) -> (Pending, oneshot::Receiver<Result<Vec<i64>, StoreError>>) {
        let (reply, answer) = oneshot::channel();
        let limits = checks
            .clone()
            .map(|check| {
                let spec = check.spec;
                let delay = if may_delay { spec.max_delay_us() } else { 0 };
                let numbers = [
                    u64::from(spec.requests),
                    spec.window_us(),
                    epochs.flag(check),
                    u64::from(spec.cost),
                    flags(&spec),
                    delay,
                ];
                (spec.algorithm.label(), numbers)
            })
            .collect();
        let pending = Pending {
            keys: checks.map(|check| check.key.clone()).collect(),
            member,
            end: false,
            limits,
            reply,
        };
        (pending, answer)
    }

    /// The end of the leases `member` holds under each of `checks` (concurrency checks). Its
    /// reply: per key, 1 if the lease was there.
    pub(super) fn end<'a>(
        checks: impl Iterator<Item = &'a Check>,
        member: String,
    ) -> (Pending, oneshot::Receiver<Result<Vec<i64>, StoreError>>) {
        let (reply, answer) = oneshot::channel();
        let pending = Pending {
            keys: checks.map(|check| check.key.clone()).collect(),
            member,
            end: true,
            limits: Vec::new(),
            reply,
        };
        (pending, answer)
    }

    /// How many numbers the script answers for this request.
    fn reply_len(&self) -> usize {
        if self.end {
            self.keys.len()
        } else {
            4 + 3 * self.keys.len()
        }
    }
}

/// A check's flags slot in `decide.lua`: 1 shadow, 2 overridable, 4 notify, plus 8 times its
/// packed thresholds (`Thresholds`) when it notifies.
fn flags(spec: &crate::limiter::Spec) -> u64 {
    let notify = if spec.notify.is_empty() {
        0
    } else {
        4 | spec.notify.packed() << 3
    };
    u64::from(spec.shadow) | u64::from(spec.overridable) << 1 | notify
}

/// What a writer needs besides its connection.
#[derive(Clone)]
pub(super) struct Writer {
    pub(super) script: Script,
    pub(super) timeout: Duration,
}

impl Lane {
    pub(super) fn new(conn: ConnectionManager) -> Lane {
        Lane {
            conn,
            queue: Arc::new(Mutex::new(None)),
        }
    }

    /// Queues `pending` for the next call on this connection, starting the writer if it is
    /// not running; gives it back when the queue is full. Must be called on a Tokio runtime.
    pub(super) fn enqueue(&self, pending: Pending, writer: &Writer) -> Result<(), Pending> {
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        let pending = match queue.as_ref() {
            Some(sender) => match sender.try_send(pending) {
                Ok(()) => return Ok(()),
                Err(mpsc::error::TrySendError::Full(pending)) => return Err(pending),
                // The writer's runtime has gone: start another here.
                Err(mpsc::error::TrySendError::Closed(pending)) => pending,
            },
            None => pending,
        };
        let (sender, receiver) = mpsc::channel(QUEUE);
        tokio::spawn(write(self.conn.clone(), receiver, writer.clone()));
        let sent = sender.try_send(pending).map_err(|refused| match refused {
            mpsc::error::TrySendError::Full(pending)
            | mpsc::error::TrySendError::Closed(pending) => pending,
        });
        *queue = Some(sender);
        sent
    }
}

/// The writer of one connection: takes what is queued, sends it as one call, hands each
/// decision its answer, and again, until the connection's lane is dropped (a new master).
async fn write(mut conn: ConnectionManager, mut queue: mpsc::Receiver<Pending>, writer: Writer) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while queue.recv_many(&mut batch, MAX_BATCH).await > 0 {
        // Nobody waits for these any more: deciding them would record admissions never used.
        batch.retain(|pending: &Pending| !pending.reply.is_closed());
        if batch.is_empty() {
            continue;
        }
        // The script takes the decisions first, then the ends (stable: each in its order).
        batch.sort_by_key(|pending| pending.end);
        let cmd = command(&writer.script, &batch, writer.timeout);
        let result = tokio::time::timeout(writer.timeout, call(&mut conn, &cmd, &writer.script))
            .await
            .unwrap_or(Err(StoreError::Timeout(writer.timeout)));
        answer(&mut batch, result);
    }
}

/// The EVALSHA of the decide script over `batch`, whose decisions must come before its ends
/// (`write` sorts them so; `answer` hands the reply back in that order). `lateness` is the
/// store timeout: no answer is acted on later than that after the decision was queued, so
/// the exact logs count each admission that much past the time it is forwarded at (see
/// `decide.lua`'s ARGV[2]).
pub(super) fn command(script: &Script, batch: &[Pending], lateness: Duration) -> Cmd {
    let keys: usize = batch.iter().map(|pending| pending.keys.len()).sum();
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash()).arg(keys);
    for pending in batch {
        for key in &pending.keys {
            cmd.arg(key);
        }
    }
    let ends = batch.iter().filter(|pending| pending.end).count();
    cmd.arg(batch.len() - ends)
        .arg(u64::try_from(lateness.as_micros()).unwrap_or(u64::MAX));
    for pending in batch.iter().filter(|pending| !pending.end) {
        cmd.arg(&pending.member).arg(pending.keys.len());
        for (algorithm, numbers) in &pending.limits {
            cmd.arg(*algorithm);
            for number in numbers {
                cmd.arg(*number);
            }
        }
    }
    cmd.arg(ends);
    for pending in batch.iter().filter(|pending| pending.end) {
        cmd.arg(&pending.member).arg(pending.keys.len());
    }
    cmd
}

/// One call; when Redis has lost the script (restart, failover, `SCRIPT FLUSH`), loads it and
/// tries again once.
async fn call(
    conn: &mut ConnectionManager,
    cmd: &Cmd,
    script: &Script,
) -> Result<Vec<i64>, StoreError> {
    let sent = conn
        .req_packed_command(cmd)
        .await
        .and_then(redis::Value::extract_error);
    let value = match sent {
        Err(err) if err.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            script.load_async(conn).await.map_err(script_error)?;
            conn.req_packed_command(cmd)
                .await
                .and_then(redis::Value::extract_error)
        }
        result => result,
    }
    .map_err(script_error)?;
    Vec::<i64>::from_redis_value(value).map_err(|e| StoreError::Script(e.to_string()))
}

/// Hands each decision of `batch` its part of the reply (or the call's error), emptying it.
fn answer(batch: &mut Vec<Pending>, result: Result<Vec<i64>, StoreError>) {
    let expected: usize = batch.iter().map(Pending::reply_len).sum();
    let reply = match result {
        Ok(reply) if reply.len() == expected => reply,
        Ok(reply) => {
            for pending in batch.drain(..) {
                let malformed = format!("unexpected script reply {reply:?}");
                let _gone = pending.reply.send(Err(StoreError::Script(malformed)));
            }
            return;
        }
        Err(err) => {
            for pending in batch.drain(..) {
                let _gone = pending.reply.send(Err(err.clone()));
            }
            return;
        }
    };
    let mut rest = &reply[..];
    for pending in batch.drain(..) {
        let (own, after) = rest.split_at(pending.reply_len());
        rest = after;
        let _gone = pending.reply.send(Ok(own.to_vec()));
    }
}
