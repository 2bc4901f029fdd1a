//! Which worker the current thread is (see `server`: one thread and one current-thread
//! runtime per worker), so that what every request uses can be the worker's own. A Redis
//! connection's driving task runs on the runtime that opened it: a request served by
//! another worker would wake that worker's thread for its call, and again for the answer.

use std::cell::Cell;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

static COUNT: AtomicUsize = AtomicUsize::new(1);

thread_local! {
    /// 0 on any thread that is not a worker's: the main thread is worker 0.
    static INDEX: Cell<usize> = const { Cell::new(0) };
}

/// How many workers serve; set once at start, before any of them serves.
pub fn set_count(count: usize) {
    COUNT.store(count.max(1), Ordering::Relaxed);
}

/// Marks the calling thread as worker `index`.
pub fn enter(index: usize) {
    INDEX.with(|current| current.set(index));
}

/// The current worker's share of `total` things shared out among the workers: a slice of its
/// own when there are at least as many as workers, else all of them.
pub fn share(total: usize) -> Range<usize> {
    share_of(total, INDEX.with(Cell::get), COUNT.load(Ordering::Relaxed))
}

fn share_of(total: usize, index: usize, count: usize) -> Range<usize> {
    if total < count || index >= count {
        return 0..total;
    }
    index * total / count..(index + 1) * total / count
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_every_thing_once_and_none_is_empty() {
        for count in 1..=8 {
            for total in count..=40 {
                let mut covered = Vec::new();
                for index in 0..count {
                    let share = share_of(total, index, count);
                    assert!(!share.is_empty(), "{total} among {count}: {index} has none");
                    covered.extend(share);
                }
                assert_eq!(
                    covered,
                    (0..total).collect::<Vec<_>>(),
                    "{total} among {count}"
                );
            }
        }
    }

    #[test]
    fn fewer_things_than_workers_are_shared_by_all() {
        assert_eq!(share_of(1, 1, 2), 0..1);
        assert_eq!(share_of(3, 0, 4), 0..3);
        assert_eq!(share_of(4, 1, 2), 2..4);
    }
}
