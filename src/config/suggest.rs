//! "Did you mean": the nearest of the names a field takes to what was written, for error
//! messages that a user fixes in one pass (unknown fields, key parts, upstream names,
//! duration units).

/// Edit distance (insertions, deletions, substitutions, and a swap of two neighbours) between
/// `a` and `b`, compared without case: `path_prefx` is 1 from `path_prefix`.
fn distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().flat_map(char::to_lowercase).collect();
    let b: Vec<char> = b.chars().flat_map(char::to_lowercase).collect();
    // Three rows of the usual table: the one before the previous is for swaps.
    let mut before: Vec<usize> = vec![0; b.len() + 1];
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    let mut current = vec![0; b.len() + 1];
    for i in 1..=a.len() {
        current[0] = i;
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (previous[j] + 1)
                .min(current[j - 1] + 1)
                .min(previous[j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(before[j - 2] + 1);
            }
            current[j] = best;
        }
        std::mem::swap(&mut before, &mut previous);
        std::mem::swap(&mut previous, &mut current);
    }
    previous[b.len()]
}

/// The candidate nearest to `written`, when it is near enough to be what was meant: at most
/// a third of its length away (and at least one edit, at most three). Ties go to the first.
pub fn closest<'a>(
    written: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    let most = (written.chars().count() / 3).clamp(1, 3);
    candidates
        .into_iter()
        .map(|candidate| (distance(written, candidate), candidate))
        .filter(|&(d, _)| d <= most)
        .min_by_key(|&(d, _)| d)
        .map(|(_, candidate)| candidate)
}

/// `"; did you mean `x`?"` for the nearest candidate, or nothing.
pub fn did_you_mean<'a>(written: &str, candidates: impl IntoIterator<Item = &'a str>) -> String {
    closest(written, candidates)
        .map(|name| format!("; did you mean `{name}`?"))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_names_are_suggested_and_far_ones_are_not() {
        let fields = ["path_prefix", "methods", "case_sensitive"];
        assert_eq!(closest("path_prefx", fields), Some("path_prefix"));
        assert_eq!(closest("method", fields), Some("methods"));
        assert_eq!(closest("Methods", fields), Some("methods"));
        assert_eq!(closest("hosts", fields), None);
        assert_eq!(
            closest("clientip", ["client_ip", "method"]),
            Some("client_ip")
        );
        assert_eq!(closest("apii", ["api", "billing"]), Some("api"));
        // A swap of two neighbours is one edit.
        assert_eq!(
            closest("reqeusts", ["requests", "tokens"]),
            Some("requests")
        );
        assert_eq!(closest("xyz", ["abc"]), None);
        assert_eq!(did_you_mean("apii", ["api"]), "; did you mean `api`?");
        assert_eq!(did_you_mean("zzzz", ["api"]), "");
    }
}
