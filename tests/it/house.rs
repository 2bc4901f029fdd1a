//! House rules about the shape of the code itself, checked on `src/`: no function is longer
//! than [`MAX_LINES`] lines, so a reader sees a function's steps by their names.
//!
//! A function's length runs from the line of its `fn` to the line of its closing brace (its
//! doc comment and attributes are not counted). Test code is left out: `#[cfg(test)]` items
//! and the files of out-of-line test modules (`tests.rs`, anything under a `tests/`
//! directory). The source is read by a small lexer that knows Rust's comments, strings, raw
//! strings and character literals, so a brace inside one of them is not taken for code.

use std::path::{Path, PathBuf};

/// The longest a function of `src/` may be, in lines.
const MAX_LINES: usize = 100;

/// Functions allowed past [`MAX_LINES`], as (file under `src/`, function name): only a
/// function whose body is a table (one list of data, read top to bottom), never one with
/// steps. An entry that is no longer too long fails the test, so the list cannot go stale.
const TABLES: &[(&str, &str)] = &[
    // `StoreFamilies::new`: the store's metric families, one definition after another.
    ("metrics.rs", "new"),
];

#[test]
fn no_function_in_src_is_over_a_hundred_lines() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    assert!(files.len() > 50, "found only {} files in src/", files.len());
    let mut too_long = Vec::new();
    let mut tables_seen = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("a readable source file");
        let name = file
            .strip_prefix(&src)
            .expect("under src/")
            .to_string_lossy()
            .replace('\\', "/");
        for function in functions(&text) {
            if function.lines <= MAX_LINES {
                continue;
            }
            if TABLES.contains(&(name.as_str(), function.name.as_str())) {
                tables_seen.push((name.clone(), function.name));
                continue;
            }
            too_long.push(format!(
                "src/{name}:{}: fn {} is {} lines",
                function.line, function.name, function.lines
            ));
        }
    }
    assert!(
        too_long.is_empty(),
        "functions over {MAX_LINES} lines (split each into steps named for what they do):\n{}",
        too_long.join("\n")
    );
    for (file, function) in TABLES {
        assert!(
            tables_seen
                .iter()
                .any(|(f, n)| f == file && n == function),
            "src/{file}: fn {function} is allowed as a table but is no longer over {MAX_LINES} lines: drop it from TABLES"
        );
    }
}

/// The `.rs` files under `dir`, without test modules' files.
fn rust_files(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a readable directory") {
        let path = entry.expect("a directory entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if name != "tests" {
                rust_files(&path, found);
            }
        } else if name.ends_with(".rs") && name != "tests.rs" {
            found.push(path);
        }
    }
}

/// One function found in a source file.
#[derive(Debug, PartialEq)]
struct Function {
    name: String,
    /// The line of its `fn`, from 1.
    line: usize,
    lines: usize,
}

/// A token of Rust source, as far as this check needs: words, and single punctuation.
#[derive(Debug, Clone, PartialEq)]
enum Token {
    Word(String),
    Punct(char),
}

/// The tokens of `text` with the line each starts on; comments, strings and character
/// literals are dropped (a lifetime is dropped too).
fn tokens(text: &str) -> Vec<(Token, usize)> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && at(i + 1) == '/' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            loop {
                if i >= chars.len() {
                    break;
                }
                if chars[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if chars[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if let Some(hashes) = raw_string_start(&chars, i) {
            // r"…", r#"…"#, br"…": no escapes; ends at a quote followed by as many hashes.
            i += chars[i..].iter().position(|&c| c == '"').expect("a quote") + 1;
            while i < chars.len() {
                if chars[i] == '"' && (1..=hashes).all(|k| at(i + k) == '#') {
                    i += 1 + hashes;
                    break;
                }
                if chars[i] == '\n' {
                    line += 1;
                }
                i += 1;
            }
        } else if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    i += 1;
                }
                if at(i) == '\n' {
                    line += 1;
                }
                i += 1;
            }
            i += 1;
        } else if c == '\'' {
            if at(i + 1) == '\\' {
                // An escaped character literal: '\n', '\'', '\u{1F600}'.
                i += 2;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                // A lifetime or a label: the quote, then a word that is read next.
                i += 1;
                while at(i).is_alphanumeric() || at(i) == '_' {
                    i += 1;
                }
            }
        } else if c.is_alphanumeric() || c == '_' {
            let start = i;
            while at(i).is_alphanumeric() || at(i) == '_' {
                i += 1;
            }
            out.push((Token::Word(chars[start..i].iter().collect()), line));
        } else {
            out.push((Token::Punct(c), line));
            i += 1;
        }
    }
    out
}

/// The number of `#` of a raw string starting at `i` (`r"`, `r#"`, `br"` …), if one does.
fn raw_string_start(chars: &[char], i: usize) -> Option<usize> {
    let before = i.checked_sub(1).map(|b| chars[b]);
    if before.is_some_and(|b| b.is_alphanumeric() || b == '_') {
        return None;
    }
    let mut j = i;
    if chars.get(j) == Some(&'b') {
        j += 1;
    }
    if chars.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let hashes = chars[j..].iter().take_while(|&&c| c == '#').count();
    (chars.get(j + hashes) == Some(&'"')).then_some(hashes)
}

/// Every function with a body in `text`, outside `#[cfg(test)]` items.
fn functions(text: &str) -> Vec<Function> {
    let tokens = tokens(text);
    let word = |i: usize| match tokens.get(i) {
        Some((Token::Word(w), _)) => Some(w.as_str()),
        _ => None,
    };
    let punct = |i: usize, c: char| matches!(tokens.get(i), Some((Token::Punct(p), _)) if *p == c);
    let mut found = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let cfg_test = punct(i, '#')
            && punct(i + 1, '[')
            && word(i + 2) == Some("cfg")
            && punct(i + 3, '(')
            && word(i + 4) == Some("test")
            && punct(i + 5, ')')
            && punct(i + 6, ']');
        if cfg_test {
            i = item_end(&tokens, i + 7);
            continue;
        }
        if word(i) == Some("fn") {
            if let Some(name) = word(i + 1) {
                if let Some(open) = body_start(&tokens, i + 2) {
                    let close = matching(&tokens, open);
                    let line = tokens[i].1;
                    found.push(Function {
                        name: name.to_owned(),
                        line,
                        lines: tokens[close].1 - line + 1,
                    });
                }
            }
        }
        i += 1;
    }
    found
}

/// The `{` that opens the body of a function whose signature starts at `i`, or `None` when
/// the signature ends with `;` (a trait's method without a default).
fn body_start(tokens: &[(Token, usize)], mut i: usize) -> Option<usize> {
    let mut depth = 0i32;
    while let Some((token, _)) = tokens.get(i) {
        match token {
            Token::Punct('(' | '[') => depth += 1,
            Token::Punct(')' | ']') => depth -= 1,
            Token::Punct('{') if depth == 0 => return Some(i),
            Token::Punct(';') if depth == 0 => return None,
            _ => {}
        }
        i += 1;
    }
    None
}

/// The index of the `}` that closes the `{` at `open` (the last token if none does).
fn matching(tokens: &[(Token, usize)], open: usize) -> usize {
    let mut depth = 0;
    for (i, (token, _)) in tokens.iter().enumerate().skip(open) {
        match token {
            Token::Punct('{') => depth += 1,
            Token::Punct('}') => {
                depth -= 1;
                if depth == 0 {
                    return i;
                }
            }
            _ => {}
        }
    }
    tokens.len() - 1
}

/// The index just past the item starting at `i` (after its attributes): past its first `;`
/// outside brackets, or past the block its first `{` opens.
fn item_end(tokens: &[(Token, usize)], i: usize) -> usize {
    match body_start(tokens, i) {
        Some(open) => matching(tokens, open) + 1,
        None => {
            let mut j = i;
            while j < tokens.len() && tokens[j].0 != Token::Punct(';') {
                j += 1;
            }
            j + 1
        }
    }
}

#[test]
fn the_lexer_counts_code_braces_only() {
    let text = r####"
/// A doc comment with a { brace.
pub async fn first<'a>(x: &'a str) -> [u8; 2] {
    let a = "a } in a string \" still";
    let b = r#"a raw } "string"#;
    let c = '}';
    let d = '\'';
    /* a { block /* nested } */ comment */
    'outer: loop { break 'outer; }
    [0, 1]
}

trait T {
    fn declared(&self) -> u8;
    fn defaulted(&self) -> u8 {
        1
    }
}

#[cfg(test)]
mod tests {
    fn hidden() {
    }
}

fn last() { let _ = br"}"; }
"####;
    let found = functions(text);
    let summary: Vec<(&str, usize, usize)> = found
        .iter()
        .map(|f| (f.name.as_str(), f.line, f.lines))
        .collect();
    assert_eq!(
        summary,
        [("first", 3, 9), ("defaulted", 15, 3), ("last", 26, 1)]
    );
}
