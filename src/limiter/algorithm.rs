//! The algorithm table: every way a limit can count, with what each can do, stated once as
//! data. The policy rules (the token budgets' among them), the deny cache, the stores' delay,
//! the store key, `sluice explain`, the rate limit service's names and the Redis scripts'
//! dispatchers read this table; nothing else names an algorithm's abilities (the book's table
//! in `guides/algorithms.md` mirrors it by hand). Adding an algorithm is: its pure Rust module (for the in-process store) and its Lua file (for Redis), one row
//! here, its config spelling, and its state kind in `local.rs` (see the book's "Adding an
//! algorithm or a limit kind").

/// How a limit counts. Every algorithm runs in both stores with the same results: one Lua file
/// each under `scripts/`, one pure Rust module each for the in-process store. (How the config
/// file spells it is the config's business: `config::AlgorithmConfig`.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// Exact: every admission's time is kept for one window.
    #[default]
    SlidingLog,
    /// The sliding log with one entry per request weighted by its cost: exact, for limits in
    /// units other than requests (token budgets), whose requests cost thousands each.
    WeightedLog,
    /// Two fixed-window counters, the previous one weighted: O(1), approximate.
    SlidingWindow,
    /// One counter per window that starts at the first hit: O(1), up to twice the limit
    /// across a boundary.
    FixedWindow,
    /// A token bucket kept as one timestamp: O(1), exact, with bursts of `burst`.
    Gcra,
    /// A calendar quota: one counter per calendar period, reset at the period's start (see
    /// `calendar`). Its check's key ends with the period and its `window` is the time left
    /// until the period ends, both set per request when the check is built.
    Calendar,
    /// Requests in flight (`concurrent:`), not per window: each admission holds a lease until
    /// the request is over (see `concurrency`). Its `requests` is how many at once; its
    /// `window` is the lease period, after which the leases of an instance that stopped
    /// renewing them are reclaimed.
    Concurrency,
}

/// How the admin API's read (`peek.lua`, `Peek::count`) finds how much a limit has counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeekCount {
    /// The check's first value of state is the count (entries, units, a counter, leases).
    FirstState,
    /// The room used: `burst` less what remains (a token bucket).
    BurstLessRemaining,
    /// The room used: `requests` less what remains (a weighted estimate).
    RequestsLessRemaining,
}

/// What one algorithm is and can do.
#[derive(Debug, Clone, Copy)]
pub struct Traits {
    pub algorithm: Algorithm,
    /// Its name in the policy file, the Lua dispatchers (its functions are `{label}_check`,
    /// `{label}_record`, `{label}_release` and, when it charges, `{label}_charge`), store
    /// keys, metrics and logs.
    pub label: &'static str,
    /// Never admits more than its limit: in any window, or at once.
    pub exact: bool,
    /// Its wait says exactly when a request fits, so `on_exceed: delay` can hold a request
    /// until then and record it at that future time, in the store's one call.
    pub delays_in_store: bool,
    /// Takes `burst`: how many may arrive at once.
    pub burst: bool,
    /// Gives back and charges exactly (`Store::keep`), so a token or money budget, which
    /// settles a reservation to what was used, can run on it.
    pub settles_exactly: bool,
    /// A key's room grows only as time passes, so a denial holds until its wait ends and the
    /// deny cache may answer it (a release, as of a lease, makes room at any moment).
    pub room_grows_with_time_only: bool,
    /// Its `window` is set per request (the time left in a calendar period): a remembered
    /// denial is for the same limit whatever that value.
    pub window_per_request: bool,
    /// How `peek.lua` reads the count.
    pub peek_count: PeekCount,
    /// Its label is part of its store keys (`prefix:route:limit:LABEL:{identity}`). Only the
    /// first algorithm's keys go without, as they did before there were others, so a limit
    /// keeps its counts across an upgrade.
    pub label_in_key: bool,
    /// The most units one key may count, for an algorithm that keeps one entry per unit: the
    /// policy refuses a token or money budget above it, whose every token would be an entry.
    pub max_units: Option<u32>,
    /// Its Lua file: `check`, `record`, `release` (and `charge` when it settles exactly).
    pub lua: &'static str,
}

/// Every algorithm, in the order their Lua files are concatenated (`weighted_log.lua` uses
/// `log_expire` from `sliding_log.lua`, so it comes after).
pub const ALGORITHMS: [Traits; 7] = [
    Traits {
        algorithm: Algorithm::SlidingLog,
        label: "sliding_log",
        exact: true,
        delays_in_store: true,
        burst: false,
        settles_exactly: true,
        room_grows_with_time_only: true,
        window_per_request: false,
        peek_count: PeekCount::FirstState,
        label_in_key: false,
        max_units: Some(1_000_000),
        lua: include_str!("scripts/sliding_log.lua"),
    },
    Traits {
        algorithm: Algorithm::WeightedLog,
        label: "weighted_log",
        exact: true,
        // Its wait is exact, but a token budget's requests are held by their reservation,
        // not shaped: delay is for request limits.
        delays_in_store: false,
        burst: false,
        settles_exactly: true,
        room_grows_with_time_only: true,
        window_per_request: false,
        peek_count: PeekCount::FirstState,
        label_in_key: true,
        max_units: None,
        lua: include_str!("scripts/weighted_log.lua"),
    },
    Traits {
        algorithm: Algorithm::SlidingWindow,
        label: "sliding_window",
        exact: false,
        delays_in_store: false,
        burst: false,
        settles_exactly: false,
        room_grows_with_time_only: true,
        window_per_request: false,
        peek_count: PeekCount::RequestsLessRemaining,
        label_in_key: true,
        max_units: None,
        lua: include_str!("scripts/sliding_window.lua"),
    },
    Traits {
        algorithm: Algorithm::FixedWindow,
        label: "fixed_window",
        exact: false,
        delays_in_store: false,
        burst: false,
        settles_exactly: false,
        room_grows_with_time_only: true,
        window_per_request: false,
        peek_count: PeekCount::FirstState,
        label_in_key: true,
        max_units: None,
        lua: include_str!("scripts/fixed_window.lua"),
    },
    Traits {
        algorithm: Algorithm::Gcra,
        label: "gcra",
        exact: true,
        delays_in_store: true,
        burst: true,
        settles_exactly: false,
        room_grows_with_time_only: true,
        window_per_request: false,
        peek_count: PeekCount::BurstLessRemaining,
        label_in_key: true,
        max_units: None,
        lua: include_str!("scripts/gcra.lua"),
    },
    Traits {
        algorithm: Algorithm::Calendar,
        label: "calendar",
        exact: true,
        delays_in_store: false,
        burst: false,
        // Gives back within the request's period: the key names the period.
        settles_exactly: true,
        room_grows_with_time_only: true,
        window_per_request: true,
        peek_count: PeekCount::FirstState,
        label_in_key: true,
        max_units: None,
        lua: include_str!("scripts/calendar.lua"),
    },
    Traits {
        algorithm: Algorithm::Concurrency,
        label: "concurrency",
        exact: true,
        // A slot frees when a request ends, at no time known in advance: a request that
        // waits for one waits outside the store (`proxy::hold`), holding nothing.
        delays_in_store: false,
        burst: false,
        settles_exactly: false,
        room_grows_with_time_only: false,
        window_per_request: false,
        peek_count: PeekCount::FirstState,
        label_in_key: true,
        max_units: None,
        lua: include_str!("scripts/concurrency.lua"),
    },
];

impl Algorithm {
    /// What a token or money budget counts with when its limit names no `algorithm`: exact,
    /// settling exactly, and one entry per request however many tokens it costs.
    pub const FOR_BUDGETS: Algorithm = Algorithm::WeightedLog;

    /// This algorithm's row of the table.
    pub fn traits(self) -> &'static Traits {
        // The table lists every variant once, in declaration order (checked by a test).
        &ALGORITHMS[self as usize]
    }

    /// The name used in the policy file, the Lua driver, store keys, metrics and logs.
    pub fn label(self) -> &'static str {
        self.traits().label
    }

    /// The labels of the algorithms that have `ability`, for messages ("sliding_log or gcra").
    pub fn labels_with(ability: impl Fn(&Traits) -> bool) -> String {
        let labels: Vec<&str> = ALGORITHMS
            .iter()
            .filter(|t| ability(t))
            .map(|t| t.label)
            .collect();
        match labels.split_last() {
            None => String::new(),
            Some((last, [])) => (*last).to_owned(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_lists_every_algorithm_once_in_order() {
        for (index, traits) in ALGORITHMS.iter().enumerate() {
            assert_eq!(traits.algorithm as usize, index, "{}", traits.label);
            assert_eq!(traits.algorithm.traits().label, traits.label);
        }
    }

    #[test]
    fn every_lua_file_defines_what_the_dispatchers_call() {
        for traits in &ALGORITHMS {
            for function in ["check", "record", "release"] {
                let defined = format!("local function {}_{function}(", traits.label);
                assert!(
                    traits.lua.contains(&defined),
                    "{} lacks {defined}",
                    traits.label
                );
            }
            let charges = format!("local function {}_charge(", traits.label);
            assert_eq!(
                traits.lua.contains(&charges),
                traits.settles_exactly,
                "{}: charges exactly when it settles exactly",
                traits.label
            );
        }
    }

    #[test]
    fn a_budget_counts_exactly_with_one_entry_per_request() {
        let traits = Algorithm::FOR_BUDGETS.traits();
        assert!(traits.settles_exactly && traits.max_units.is_none());
        // Only the first row's keys go without a label: they predate the others.
        let unlabelled: Vec<&str> = ALGORITHMS
            .iter()
            .filter(|t| !t.label_in_key)
            .map(|t| t.label)
            .collect();
        assert_eq!(unlabelled, [Algorithm::default().label()]);
    }

    #[test]
    fn names_the_algorithms_with_an_ability() {
        assert_eq!(
            Algorithm::labels_with(|t| t.delays_in_store),
            "sliding_log or gcra"
        );
        assert_eq!(
            Algorithm::labels_with(|t| t.settles_exactly),
            "sliding_log, weighted_log or calendar"
        );
    }
}
