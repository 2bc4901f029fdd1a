//! Calendar quotas: one exact counter per identity and calendar period (a day, an ISO week
//! starting Monday, a month) in UTC or an IANA time zone, reset at the period's start.
//!
//! The period is found here, in Rust, from sluice's wall clock (`crate::runtime::clock`): zone rules
//! cannot run in the Redis script. The store key ends with the period's label (`2026-11`,
//! `2026-W48`, `2026-11-24`), so a new period is a new key, and the check carries the time
//! left until the period ends as its `spec.window`: the wait of a rejection and the key's
//! expiry. The stores then keep a plain counter (`scripts/calendar.lua`, and `Counter` below
//! for the in-process store), which only grows within a period and only shrinks by a
//! give-back: exact.
//!
//! The deny cache: the count only grows within a period, and the key names the period, so
//! room comes back only when the period ends; a rejection's wait is the time left in it (found
//! from sluice's wall clock when the check was built), and the next period's requests ask
//! Redis under their own key.

use std::fmt::{self, Write as _};
use std::time::Duration;

use jiff::civil::Date;
use jiff::tz::TimeZone;
use jiff::{SignedDuration, Timestamp};

use super::{LimitState, Room, Spec};

/// The calendar period a quota counts over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Period {
    Day,
    /// An ISO 8601 week: Monday 00:00 to the next Monday 00:00.
    Week,
    Month,
}

impl Period {
    /// As the policy file spells it.
    pub fn label(self) -> &'static str {
        match self {
            Period::Day => "day",
            Period::Week => "week",
            Period::Month => "month",
        }
    }

    /// The `w` sluice emits in `RateLimit-Policy` for this period, in seconds: the draft's
    /// `w` is a fixed number of seconds, which a calendar period is not, so this is its
    /// nominal length (a month: 30 days). The exact time to the reset is `RateLimit`'s `t`.
    pub fn nominal(self) -> Duration {
        const DAY: u64 = 86_400;
        Duration::from_secs(match self {
            Period::Day => DAY,
            Period::Week => 7 * DAY,
            Period::Month => 30 * DAY,
        })
    }
}

/// A quota's period and zone, as the policy compiled them.
#[derive(Debug, Clone)]
pub struct Quota {
    pub period: Period,
    pub zone: TimeZone,
    /// The zone's IANA name as the policy file spells it (`UTC` by default).
    pub zone_name: String,
}

impl PartialEq for Quota {
    fn eq(&self, other: &Quota) -> bool {
        self.period == other.period && self.zone_name == other.zone_name
    }
}

/// One period: where it starts and ends, as instants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub period: Period,
    /// The local date it starts on (its label is made from it).
    pub first_day: Date,
    pub start: Timestamp,
    pub end: Timestamp,
}

#[derive(Debug, thiserror::Error)]
#[error("no calendar period holds {0}: it is beyond the dates the calendar covers")]
pub struct OutOfRange(pub Timestamp);

impl Quota {
    /// The period holding `now`.
    pub fn span_at(&self, now: Timestamp) -> Result<Span, OutOfRange> {
        span_at(self.period, &self.zone, now)
    }
}

/// The period of kind `period` in `zone` holding `now`: its first day is the local date of
/// `now` brought back to the period's first day, it starts when that day starts in the zone
/// (which a daylight-saving change makes 23 or 25 hours long, or starts at 01:00 where the
/// change is at midnight), and ends when the next one starts.
pub fn span_at(period: Period, zone: &TimeZone, now: Timestamp) -> Result<Span, OutOfRange> {
    let out = || OutOfRange(now);
    let today = zone.to_datetime(now).date();
    let first_day = match period {
        Period::Day => today,
        Period::Week => today
            .checked_sub(SignedDuration::from_hours(
                24 * i64::from(today.weekday().to_monday_zero_offset()),
            ))
            .map_err(|_| out())?,
        Period::Month => today.first_of_month(),
    };
    let next = match period {
        Period::Day => first_day.tomorrow().map_err(|_| out())?,
        Period::Week => first_day
            .checked_add(SignedDuration::from_hours(24 * 7))
            .map_err(|_| out())?,
        Period::Month => first_day.last_of_month().tomorrow().map_err(|_| out())?,
    };
    let start_of = |day: Date| zone.to_timestamp(day.at(0, 0, 0, 0)).map_err(|_| out());
    Ok(Span {
        period,
        first_day,
        start: start_of(first_day)?,
        end: start_of(next)?,
    })
}

impl Span {
    /// The time from `now` to the period's end (zero once it has ended).
    pub fn left_at(&self, now: Timestamp) -> Duration {
        let left = self.end.duration_since(now);
        Duration::try_from(left).unwrap_or(Duration::ZERO)
    }

    /// Appends the period's label to a store key: `2026-11-24`, `2026-W48`, `2026-11`.
    pub fn push_label(&self, out: &mut String) {
        let _ = write!(out, "{self}");
    }
}

/// The period's label (`2026-11-24`, `2026-W48` for an ISO week, `2026-11`).
impl fmt::Display for Span {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let day = self.first_day;
        match self.period {
            Period::Day => write!(f, "{:04}-{:02}-{:02}", day.year(), day.month(), day.day()),
            Period::Week => {
                let week = day.iso_week_date();
                write!(f, "{:04}-W{:02}", week.year(), week.week())
            }
            Period::Month => write!(f, "{:04}-{:02}", day.year(), day.month()),
        }
    }
}

/// The in-process store's state of one quota key: the count of its period, and when (on
/// that store's clock) the period ends, after which the key holds nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counter {
    pub count: u64,
    pub until_us: u64,
}

impl Counter {
    /// The counter at `now`: empty once its period has ended.
    pub fn at(self, now: u64) -> Counter {
        if now >= self.until_us {
            Counter::default()
        } else {
            self
        }
    }
}

/// Room for `spec.cost` more within the period; a quota without room admits again only when
/// its period ends, `spec.window` from now.
pub fn check(counter: Counter, spec: &Spec, now: u64) -> Room {
    let counter = counter.at(now);
    let requests = u64::from(spec.requests);
    let admits = counter.count + u64::from(spec.cost) <= requests;
    Room {
        admits,
        wait: if admits { 0 } else { spec.window_us() },
        state: state(counter.count, spec),
    }
}

/// Records an admission of `spec.cost` in the period that ends `spec.window` from `now`.
pub fn record(counter: &mut Counter, spec: &Spec, now: u64) -> LimitState {
    let current = counter.at(now);
    *counter = Counter {
        count: current.count + u64::from(spec.cost),
        until_us: now.saturating_add(spec.window_us()),
    };
    state(counter.count, spec)
}

/// Charges `units` more to an admission that used more than it reserved (an overrun), within
/// its period; nothing once the period has ended or the counter was reset.
pub fn charge(counter: Counter, units: u32, now: u64) -> Counter {
    let counter = counter.at(now);
    if counter.count == 0 {
        return counter;
    }
    Counter {
        count: counter.count + u64::from(units),
        ..counter
    }
}

/// Gives back `units` of an admission: exact within the period. The key is the period's, so a
/// give-back after the period ended lands on a key that no longer counts.
pub fn release(counter: Counter, units: u32, now: u64) -> Counter {
    let counter = counter.at(now);
    Counter {
        count: counter.count.saturating_sub(u64::from(units)),
        ..counter
    }
}

/// Where a quota stands with `count` used: what is left, and the time to its reset.
fn state(count: u64, spec: &Spec) -> LimitState {
    LimitState {
        remaining: u32::try_from(u64::from(spec.requests).saturating_sub(count))
            .unwrap_or(u32::MAX),
        reset: spec.window,
        overridden: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Algorithm;

    fn ts(text: &str) -> Timestamp {
        text.parse().expect("an instant")
    }

    fn zone(name: &str) -> TimeZone {
        TimeZone::get(name).expect("a bundled zone")
    }

    fn span(period: Period, name: &str, at: &str) -> Span {
        span_at(period, &zone(name), ts(at)).expect("in range")
    }

    #[test]
    fn an_overrun_is_charged_within_its_period_only() {
        let counter = Counter {
            count: 5,
            until_us: 100,
        };
        assert_eq!(charge(counter, 7, 50).count, 12);
        assert_eq!(
            charge(counter, 7, 100),
            Counter::default(),
            "the period ended"
        );
        assert_eq!(charge(Counter::default(), 7, 50).count, 0, "reset");
    }

    #[test]
    fn months_end_on_their_last_day_whatever_their_length() {
        let jan = span(Period::Month, "UTC", "2027-01-31T23:59:59Z");
        assert_eq!(jan.to_string(), "2027-01");
        assert_eq!(jan.end, ts("2027-02-01T00:00:00Z"));
        let feb = span(Period::Month, "UTC", "2027-02-28T12:00:00Z");
        assert_eq!(feb.end, ts("2027-03-01T00:00:00Z"));
        let leap = span(Period::Month, "UTC", "2028-02-29T12:00:00Z");
        assert_eq!(leap.to_string(), "2028-02");
        assert_eq!(leap.end, ts("2028-03-01T00:00:00Z"));
        let apr = span(Period::Month, "UTC", "2026-04-30T23:00:00Z");
        assert_eq!(apr.end, ts("2026-05-01T00:00:00Z"));
        assert_eq!(apr.start, ts("2026-04-01T00:00:00Z"));
    }

    #[test]
    fn a_week_runs_monday_to_monday_and_is_labelled_by_its_iso_week() {
        // 2026-11-29 is a Sunday.
        let week = span(Period::Week, "UTC", "2026-11-29T23:59:59Z");
        assert_eq!(week.start, ts("2026-11-23T00:00:00Z"));
        assert_eq!(week.end, ts("2026-11-30T00:00:00Z"));
        assert_eq!(week.to_string(), "2026-W48");
        // 2027-01-01 (a Friday) is in ISO week 53 of 2026.
        assert_eq!(
            span(Period::Week, "UTC", "2027-01-01T12:00:00Z").to_string(),
            "2026-W53"
        );
    }

    #[test]
    fn days_across_daylight_saving_changes_are_23_and_25_hours_long() {
        let short = span(Period::Day, "America/New_York", "2026-03-08T12:00:00Z");
        assert_eq!(short.to_string(), "2026-03-08");
        assert_eq!(short.start, ts("2026-03-08T05:00:00Z"));
        assert_eq!(short.end, ts("2026-03-09T04:00:00Z"));
        assert_eq!(short.end.duration_since(short.start).as_hours(), 23);
        let long = span(Period::Day, "America/New_York", "2026-11-01T12:00:00Z");
        assert_eq!(long.end.duration_since(long.start).as_hours(), 25);
        assert_eq!(long.end, ts("2026-11-02T05:00:00Z"));
    }

    #[test]
    fn a_quota_counts_exactly_and_waits_until_its_period_ends() {
        let spec = Spec {
            algorithm: Algorithm::Calendar,
            requests: 3,
            window: Duration::from_secs(10),
            cost: 2,
            ..Spec::default()
        };
        let mut counter = Counter::default();
        assert!(check(counter, &spec, 0).admits);
        assert_eq!(record(&mut counter, &spec, 0).remaining, 1);
        let full = check(counter, &spec, 1_000_000);
        assert!(!full.admits);
        assert_eq!(full.wait, 10_000_000);
        let given_back = release(counter, 2, 1_000_000);
        assert!(check(given_back, &spec, 1_000_000).admits);
        // Past the period's end the key holds nothing.
        assert!(check(counter, &spec, 10_000_000).admits);
    }

    use proptest::prelude::*;

    const ZONES: [&str; 6] = [
        "UTC",
        "Europe/Berlin",
        "America/New_York",
        "Australia/Lord_Howe",
        "Pacific/Chatham",
        "America/Santiago",
    ];

    fn period() -> impl Strategy<Value = Period> {
        proptest::sample::select(vec![Period::Day, Period::Week, Period::Month])
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Every instant lies in exactly one period: the one found for it holds it, and
        /// periods tile time (the end of one is the start of the next, and the instant just
        /// before a start lies in the previous period).
        #[test]
        fn periods_tile_time(
            seconds in 0i64..2_100_000_000,
            zone_index in 0..ZONES.len(),
            period in period(),
        ) {
            let tz = zone(ZONES[zone_index]);
            let now = Timestamp::from_second(seconds).expect("in range");
            let here = span_at(period, &tz, now).expect("in range");
            prop_assert!(here.start <= now && now < here.end, "{:?} at {}", here, now);
            let next = span_at(period, &tz, here.end).expect("in range");
            prop_assert_eq!(next.start, here.end);
            prop_assert!(next.to_string() != here.to_string());
            let before = here.start.checked_sub(SignedDuration::from_nanos(1)).expect("in range");
            let previous = span_at(period, &tz, before).expect("in range");
            prop_assert_eq!(previous.end, here.start);
            prop_assert!(previous.to_string() != here.to_string());
            // Lengths stay within what a period can be, DST changes included.
            let hours = here.end.duration_since(here.start).as_hours();
            let (least, most) = match period {
                Period::Day => (22, 26),
                Period::Week => (7 * 24 - 2, 7 * 24 + 2),
                Period::Month => (28 * 24 - 2, 31 * 24 + 2),
            };
            prop_assert!((least..=most).contains(&hours), "{} hours: {:?}", hours, here);
        }
    }
}
