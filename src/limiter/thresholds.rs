//! A limit's notification thresholds (`notify: { at: [...] }`) as the stores carry them: up to
//! [`MAX`] fractions of the limit in force, in permille, packed into one integer that rides in
//! `decide.lua`'s flags slot (10 bits each, above the flags' own 3 bits), so a limit without
//! `notify` sends exactly what it sent before and its decision costs nothing more.
//!
//! What a threshold means, for every algorithm that counts use in a window or a period: it is
//! crossed by the admission that takes the use (`requests` in force less what remains) from
//! below `fraction × requests` to at or past it. The first such admission marks the threshold
//! for that identity in the same atomic step that decides it (Redis: `SET key:nP 1 NX PX
//! window`, P the permille, beside the limit's key in its Cluster slot; in process: a marker
//! under the store's lock), and only that decision reports it: one notification per identity,
//! threshold and marker life, whichever instance admitted. A marker lives as long as the
//! window (the rolling windows: once per window length after the crossing) or until the
//! period ends (a calendar quota's key names its period, so its markers do too).

/// Most thresholds one limit may have: 5 × 10 bits + 3 flag bits stay below 2^53, the largest
/// integer a Lua number (a double) holds exactly.
/// A fraction of a limit in permille, as the policy's rules and the stores read it.
pub fn permille(fraction: f64) -> u16 {
    (fraction * 1000.0).round().clamp(0.0, 1000.0) as u16
}

pub const MAX: usize = 5;

/// Up to [`MAX`] thresholds in permille (1..=1000), ascending, packed lowest first; 0: none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Thresholds(u64);

impl Thresholds {
    /// The thresholds of `permille` (ascending, each 1..=1000, at most [`MAX`]: the policy's
    /// rules checked them); `None` when they are not.
    pub fn new(permille: &[u16]) -> Option<Thresholds> {
        let ascending = permille.windows(2).all(|pair| pair[0] < pair[1]);
        let within = permille.iter().all(|&p| (1..=1000).contains(&p));
        if permille.len() > MAX || !ascending || !within {
            return None;
        }
        let packed = permille
            .iter()
            .rev()
            .fold(0u64, |packed, &p| packed << 10 | u64::from(p));
        Some(Thresholds(packed))
    }

    /// Whether there are none (no `notify`).
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The packed form `decide.lua` reads (`flags` = 4 + 8 × this when not empty).
    pub fn packed(self) -> u64 {
        self.0
    }

    /// The thresholds in permille, lowest first.
    pub fn permille(self) -> impl Iterator<Item = u16> {
        let mut packed = self.0;
        std::iter::from_fn(move || {
            let p = (packed & 1023) as u16;
            packed >>= 10;
            (p != 0).then_some(p)
        })
    }

    /// The `index`-th threshold in permille.
    pub fn get(self, index: usize) -> Option<u16> {
        self.permille().nth(index)
    }

    /// The bits of the thresholds a use of `before` then `after` (units of `requests`) crosses
    /// upwards: bit i for the i-th threshold.
    pub fn crossing(self, requests: u32, before: u64, after: u64) -> u8 {
        let requests = u64::from(requests);
        let mut bits = 0;
        for (index, p) in self.permille().enumerate() {
            let need = u64::from(p) * requests;
            if after * 1000 >= need && before * 1000 < need {
                bits |= 1 << index;
            }
        }
        bits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_and_reads_back() {
        let t = Thresholds::new(&[500, 800, 1000]).expect("valid");
        assert_eq!(t.permille().collect::<Vec<_>>(), [500, 800, 1000]);
        assert_eq!(t.packed(), 500 | 800 << 10 | 1000 << 20);
        assert_eq!(t.get(2), Some(1000));
        assert!(Thresholds::new(&[800, 500]).is_none());
        assert!(Thresholds::new(&[500, 500]).is_none());
        assert!(Thresholds::new(&[0]).is_none());
        assert!(Thresholds::new(&[1, 2, 3, 4, 5, 6]).is_none());
        // 4 + 8 × the largest packing stays exact in a double.
        let most = Thresholds::new(&[996, 997, 998, 999, 1000]).expect("valid");
        assert!(4 + 8 * most.packed() < 1 << 53);
    }

    #[test]
    fn crossing_is_from_below_to_at_or_past() {
        let t = Thresholds::new(&[500, 800, 1000]).expect("valid");
        assert_eq!(t.crossing(10, 4, 5), 0b001);
        assert_eq!(t.crossing(10, 5, 6), 0);
        assert_eq!(t.crossing(10, 4, 10), 0b111);
        assert_eq!(t.crossing(10, 9, 10), 0b100);
        // 50 % of 7 is 3.5: crossed at 4.
        assert_eq!(t.crossing(7, 3, 4), 0b001);
        assert_eq!(t.crossing(7, 2, 3), 0);
    }
}
