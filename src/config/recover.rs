//! Reading past a mistake, so that one run of `sluice check` (or one reload) reports every
//! mistake of a file, not the first: the parser stops at the first error, so the text is
//! patched where the error points and read again. A wrong value is replaced by one of the
//! right kind (its error already said what was wrong, and the placeholder is never served:
//! a file with mistakes is refused whole); an unknown or repeated field is blanked out. Line
//! numbers never move (a patch never adds or removes a line), so every later error points
//! into the file as written. An unknown field close to a known one is read as that one (a
//! required field would otherwise be missing). A mistake that cannot be patched (a missing field, a wrong
//! shape) ends the reading there.

use super::error::scalar_range;
use super::{ConfigError, Position};

/// Patches `doc` so that the mistake `err` points at reads as valid; false when it cannot.
pub(super) fn repair(doc: &mut String, err: &ConfigError) -> bool {
    let ConfigError::Invalid {
        position, message, ..
    } = err
    else {
        return false;
    };
    let Some(index) = usize::try_from(position.line)
        .ok()
        .and_then(|line| line.checked_sub(1))
    else {
        return false;
    };
    let mut lines: Vec<String> = doc.split('\n').map(str::to_owned).collect();
    if index >= lines.len() {
        return false;
    }
    let meant = message
        .split_once("did you mean `")
        .and_then(|(_, rest)| rest.split_once('`'))
        .map(|(name, _)| name);
    let repaired = if let (true, Some(meant)) = (message.starts_with("unknown field `"), meant) {
        // Read as the field it was probably meant to be, so a required one is not missing.
        match scalar_range(&lines[index], position.column) {
            Some(range) => {
                lines[index].replace_range(range, meant);
                true
            }
            None => false,
        }
    } else if message.starts_with("unknown field `")
        || message.ends_with("each key may appear once")
    {
        drop_entry(&mut lines, index, position.column)
    } else if let Some(value) = placeholder(message, *position) {
        match scalar_range(&lines[index], position.column) {
            Some(range) => {
                lines[index].replace_range(range, &value);
                true
            }
            None => false,
        }
    } else {
        false
    };
    if repaired {
        *doc = lines.join("\n");
    }
    repaired
}

/// A value of the kind the message says was expected.
fn placeholder(message: &str, position: Position) -> Option<String> {
    let starts = |prefix: &str| message.starts_with(prefix);
    let value = if starts("expected a whole number") || starts("must be at least 1") {
        "1".to_owned()
    } else if starts("expected a duration") || starts("a duration") || starts("duration `") {
        "1s".to_owned()
    } else if starts("expected a key part") {
        "client_ip".to_owned()
    } else if starts("expected true or false") {
        "true".to_owned()
    } else if starts("expected an address and port") {
        // One per line, so that two patched addresses do not collide.
        format!("127.0.0.1:{}", 10_000 + position.line % 50_000)
    } else if starts("expected a URL") {
        "http://127.0.0.1:1".to_owned()
    } else if let Some(rest) = message.strip_prefix("unknown variant `") {
        // The first of the names expected.
        let (_, expected) = rest.split_once("expected ")?;
        let expected = expected.trim_start_matches("one of ");
        expected
            .split([',', ' '])
            .next()
            .map(|name| name.trim_matches('`'))
            .filter(|name| !name.is_empty())?
            .to_owned()
    } else {
        return None;
    };
    Some(value)
}

/// Blanks out the entry whose key starts at `column` of line `index`: in a flow mapping up to
/// its `,` (or the closing brace), in a block mapping the rest of the line and the lines
/// indented under the key.
fn drop_entry(lines: &mut [String], index: usize, column: u64) -> bool {
    let line = &lines[index];
    let Some(start) = usize::try_from(column)
        .ok()
        .and_then(|c| c.checked_sub(1))
        .and_then(|c| line.char_indices().nth(c))
        .map(|(at, _)| at)
    else {
        return false;
    };
    let before = line[..start].trim_end();
    if before.ends_with('{') || before.ends_with(',') {
        let Some(end) = flow_entry_end(&line[start..]) else {
            return false;
        };
        let blank = " ".repeat(line[start..start + end].chars().count());
        lines[index].replace_range(start..start + end, &blank);
        return true;
    }
    let indent = line[..start].chars().count();
    lines[index].truncate(start);
    for next in lines.iter_mut().skip(index + 1) {
        let body = next.trim_start();
        let deeper = next.chars().count() - body.chars().count() > indent;
        if body.is_empty() || body.starts_with('#') || deeper {
            next.clear();
        } else {
            break;
        }
    }
    true
}

/// Where a flow mapping's entry that begins `rest` ends: after its `,`, or at the `}` or `]`
/// closing its collection (nested collections and quoted text skipped).
fn flow_entry_end(rest: &str) -> Option<usize> {
    let mut depth = 0usize;
    let mut quote = None;
    for (at, c) in rest.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '"' | '\'') => quote = Some(c),
            (None, '{' | '[') => depth += 1,
            (None, '}' | ']') if depth == 0 => return Some(at),
            (None, '}' | ']') => depth -= 1,
            (None, ',') if depth == 0 => return Some(at + 1),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn at(line: u64, column: u64, message: &str) -> ConfigError {
        ConfigError::invalid(Path::new("t"), Position { line, column }, "f", message)
    }

    #[test]
    fn a_wrong_value_becomes_one_of_its_kind() {
        let mut doc = "a:\n  requests: ten\n  window: 1 minute\n".to_owned();
        assert!(repair(
            &mut doc,
            &at(2, 13, "expected a whole number, got `ten`")
        ));
        assert!(repair(&mut doc, &at(3, 11, "expected a duration like 30s")));
        assert_eq!(doc, "a:\n  requests: 1\n  window: 1s\n");
        let mut doc = "k: [clientip, method]\n".to_owned();
        assert!(repair(
            &mut doc,
            &at(1, 5, "expected a key part `client_ip`")
        ));
        assert_eq!(doc, "k: [client_ip, method]\n");
        let mut doc = "algorithm: gcraa\n".to_owned();
        let message = "unknown variant `gcraa`, expected one of sliding_log, gcra";
        assert!(repair(&mut doc, &at(1, 12, message)));
        assert_eq!(doc, "algorithm: sliding_log\n");
    }

    #[test]
    fn an_unknown_field_is_blanked_and_no_line_moves() {
        let mut doc = "m:\n  path_prefx: /api\n  methods: [GET]\n".to_owned();
        assert!(repair(&mut doc, &at(2, 3, "unknown field `path_prefx`")));
        assert_eq!(doc, "m:\n  \n  methods: [GET]\n");
        let mut doc = "m: { path_prefx: /a, methods: [GET] }\n".to_owned();
        assert!(repair(&mut doc, &at(1, 6, "unknown field `path_prefx`")));
        assert_eq!(doc, format!("m: {{{}methods: [GET] }}\n", " ".repeat(17)));
        let mut doc = "- name: a\n  extra:\n    deep: 1\n  key: v\n".to_owned();
        assert!(repair(&mut doc, &at(2, 3, "unknown field `extra`")));
        assert_eq!(doc, "- name: a\n  \n\n  key: v\n");
    }

    #[test]
    fn a_near_miss_is_read_as_the_field_meant() {
        let mut doc = "m: { path_prefx: /a }\n".to_owned();
        let message = "unknown field `path_prefx`, expected one of path_prefix, methods; \
                       did you mean `path_prefix`?";
        assert!(repair(&mut doc, &at(1, 6, message)));
        assert_eq!(doc, "m: { path_prefix: /a }\n");
    }

    #[test]
    fn what_cannot_be_patched_is_left() {
        let mut doc = "a: 1\n".to_owned();
        assert!(!repair(&mut doc, &at(1, 1, "missing field `window`")));
        assert!(!repair(&mut doc, &at(9, 1, "expected a whole number")));
        assert_eq!(doc, "a: 1\n");
    }
}
