//! The count of the requests a route holds before forwarding them (`sluice_held_requests`,
//! which the route's `max_delayed` bounds): delayed by a rate limit (`hold`) or waiting for a
//! concurrency limit's place (`decide`, `in_flight`). A request counts for as long as its
//! guard lives, so a client that leaves stops counting with it.

use prometheus::IntGauge;

/// Counts the request among the route's held ones for as long as it lives.
pub(super) struct CountedAsHeld<'a>(&'a IntGauge);

impl<'a> CountedAsHeld<'a> {
    pub(super) fn start(held: &'a IntGauge) -> CountedAsHeld<'a> {
        held.inc();
        CountedAsHeld(held)
    }
}

impl Drop for CountedAsHeld<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}
