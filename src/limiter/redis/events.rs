//! The store's event channel: a change one instance makes that every instance's local memory
//! must forget at once (an admin reset of a key, an override of a limit's number), sent
//! through Redis pub/sub.
//!
//! An event is published on [`CHANNEL`] as `forget <prefix>`: every instance subscribed drops
//! the denials it remembers (the deny cache) under store keys that start with `<prefix>`.
//! Pub/sub reaches only the subscribers connected when it is published, so an instance whose
//! subscription is down could miss one: it is told [`Event::Lost`] (it then clears its deny
//! cache and remembers no denial, asking Redis for every decision, which is exact) until it
//! is subscribed again ([`Event::Subscribed`]). The subscription is pinged every
//! [`PING_EVERY`]; one unanswered within that time counts as lost, so a silent partition is
//! found within two periods. On a Cluster, what is published on any node reaches every node's
//! subscribers; with Sentinel, the current master's (a replica gets it by replication too).

use std::sync::Weak;
use std::time::Duration;

use futures_util::StreamExt;
use redis::Client;

use super::{Link, RedisStore};
use crate::limiter::StoreError;

/// The channel every instance listens on, whatever its key prefix: an event names the keys
/// it is about in full, so instances of other deployments find nothing of theirs in it.
pub const CHANNEL: &str = "sluice:events";

/// How often the subscription is pinged, and how long a ping may take.
const PING_EVERY: Duration = Duration::from_millis(500);

/// Between attempts to subscribe.
const RETRY: Duration = Duration::from_millis(250);

/// What the listener tells its instance.
#[derive(Debug, PartialEq, Eq)]
pub enum Event {
    /// Subscribed (again): from now on, every event is heard.
    Subscribed,
    /// The subscription is down: events published meanwhile are not heard.
    Lost,
    /// Forget what is remembered under store keys starting with this.
    Forget(String),
}

impl RedisStore {
    /// Tells every instance subscribed (this one too) to forget what it remembers under keys
    /// starting with `prefix`; how many subscribers were told.
    pub async fn publish_forget(&self, prefix: &str) -> Result<u64, StoreError> {
        let mut cmd = redis::cmd("PUBLISH");
        cmd.arg(CHANNEL).arg(format!("forget {prefix}"));
        self.run(&cmd, None).await
    }

    /// The clients to subscribe through, in the order to try.
    fn event_clients(&self) -> Vec<Client> {
        match &self.link {
            Link::Cluster(_) => self.nodes.clone(),
            Link::Single | Link::Sentinel(_) => {
                self.shared.current().client.iter().cloned().collect()
            }
        }
    }
}

/// Listens on the event channel of `store` until the store is dropped, telling `on` what it
/// hears (see the module's comment).
pub async fn listen(store: Weak<RedisStore>, on: impl Fn(Event)) {
    let mut told_lost = false;
    loop {
        let Some(clients) = store.upgrade().map(|store| store.event_clients()) else {
            return;
        };
        for client in clients {
            let Ok(Ok(mut pubsub)) =
                tokio::time::timeout(PING_EVERY * 2, client.get_async_pubsub()).await
            else {
                continue;
            };
            if !matches!(
                tokio::time::timeout(PING_EVERY * 2, pubsub.subscribe(CHANNEL)).await,
                Ok(Ok(()))
            ) {
                continue;
            }
            on(Event::Subscribed);
            told_lost = false;
            heard(&store, pubsub, &on).await;
            break;
        }
        if !told_lost {
            on(Event::Lost);
            told_lost = true;
        }
        if store.strong_count() == 0 {
            return;
        }
        tokio::time::sleep(RETRY).await;
    }
}

/// Passes on the events of one subscription until it fails, a ping goes unanswered, or the
/// store is dropped.
async fn heard(store: &Weak<RedisStore>, pubsub: redis::aio::PubSub, on: &impl Fn(Event)) {
    let (mut sink, mut messages) = pubsub.split();
    let mut pings = tokio::time::interval(PING_EVERY);
    pings.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            message = messages.next() => {
                let Some(message) = message else { return };
                let payload = message.get_payload_bytes();
                if let Some(prefix) = payload.strip_prefix(b"forget ") {
                    if let Ok(prefix) = std::str::from_utf8(prefix) {
                        on(Event::Forget(prefix.to_owned()));
                    }
                }
            }
            _ = pings.tick() => {
                if store.strong_count() == 0 {
                    return;
                }
                // Messages wait in the stream meanwhile; a ping unanswered within its period
                // is a subscription that cannot be trusted.
                let pong = tokio::time::timeout(PING_EVERY, sink.ping::<redis::Value>()).await;
                if !matches!(pong, Ok(Ok(_))) {
                    return;
                }
            }
        }
    }
}
