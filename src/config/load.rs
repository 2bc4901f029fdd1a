//! Reading a policy file: the parser's limits, and its errors turned into `ConfigError`s that
//! name the field as the user wrote it (not as serde's path sees it).

use std::path::Path;

use sha2::{Digest, Sha256};

use super::error::scalar_at;
use super::{admin, recover, Config, ConfigError, Position};

/// A policy file as read: its contents, and the SHA-256 of the bytes they were parsed from
/// (which version of the file serves, see `sluice_config_hash`).
pub struct Source {
    pub config: Config,
    pub digest: [u8; 32],
    /// The text it was parsed from (for `/admin/v1/config`).
    pub text: std::sync::Arc<str>,
}

/// Reads and parses the policy file at `file`.
pub fn load(file: &Path) -> Result<Source, ConfigError> {
    let bytes = std::fs::read(file).map_err(|source| read_error(file, source))?;
    from_bytes(&bytes, file)
}

/// Parses the bytes of a policy file; `file` is only used to name the source in errors.
pub fn from_bytes(bytes: &[u8], file: &Path) -> Result<Source, ConfigError> {
    strict(read_bytes(bytes, file)?)
}

/// Reads the bytes of a policy file past its mistakes (see `recover`): the source as read,
/// its values patched where they were wrong, with the mistakes, for a caller that checks the
/// rest of the file before it refuses it whole. An error when the text cannot be read on.
pub fn read_bytes(bytes: &[u8], file: &Path) -> Result<(Source, Vec<ConfigError>), ConfigError> {
    let digest = Sha256::digest(bytes).into();
    let text = std::str::from_utf8(bytes).map_err(|err| {
        read_error(
            file,
            std::io::Error::new(std::io::ErrorKind::InvalidData, err),
        )
    })?;
    let (config, mistakes) = read(text, file)?;
    Ok((
        Source {
            config,
            digest,
            text: std::sync::Arc::from(text),
        },
        mistakes,
    ))
}

/// The value, or every mistake found.
fn strict<T>((value, mistakes): (T, Vec<ConfigError>)) -> Result<T, ConfigError> {
    if mistakes.is_empty() {
        Ok(value)
    } else {
        Err(ConfigError::all(mistakes))
    }
}

/// The error for a policy file that cannot be read (or is not UTF-8).
pub fn read_error(file: &Path, source: std::io::Error) -> ConfigError {
    ConfigError::Read {
        file: file.to_owned(),
        source,
    }
}

/// Parses policy text; `file` is only used to name the source in errors.
pub fn parse(text: &str, file: &Path) -> Result<Config, ConfigError> {
    strict(read(text, file)?)
}

/// Policy text read past its mistakes, with them (see [`read_bytes`]).
fn read(text: &str, file: &Path) -> Result<(Config, Vec<ConfigError>), ConfigError> {
    let (mut config, mut mistakes) = read_as::<Config>(text, file)?;
    match config.store.read_topology(file) {
        Ok(topology) => config.store.topology = topology,
        Err(err) => mistakes.push(err),
    }
    if let Err(err) = admin::check(&config.admin_listen, &config.admin, file) {
        mistakes.push(err);
    }
    Ok((config, mistakes))
}

/// Parses YAML text into `T` with the policy file's limits and errors (file, line, column,
/// field as written): also used for the files other sections name (`rls.config`). Every
/// mistake the reading can pass (see `recover`) is reported, in the file's order.
pub fn parse_as<T: serde::de::DeserializeOwned>(text: &str, file: &Path) -> Result<T, ConfigError> {
    strict(read_as(text, file)?)
}

/// Most mistakes one reading reports: past it, the file is more wrong than a list can help.
const MOST_MISTAKES: usize = 50;

/// [`parse_as`] past the mistakes it can patch: the value read from the patched text and
/// the mistakes; an error (every mistake so far) when one cannot be patched.
fn read_as<T: serde::de::DeserializeOwned>(
    text: &str,
    file: &Path,
) -> Result<(T, Vec<ConfigError>), ConfigError> {
    let mut doc = text.to_owned();
    let mut mistakes: Vec<ConfigError> = Vec::new();
    loop {
        match parse_once(&doc, file) {
            Ok(value) => return Ok((value, mistakes)),
            Err(err) => {
                // A patch that did not move the reading on (the same place again) ends it.
                let again = mistakes.iter().any(|seen| same_place(seen, &err));
                let patched = !again && recover::repair(&mut doc, &err);
                if !again {
                    mistakes.push(err);
                }
                if !patched || mistakes.len() >= MOST_MISTAKES {
                    return Err(ConfigError::all(mistakes));
                }
            }
        }
    }
}

fn same_place(a: &ConfigError, b: &ConfigError) -> bool {
    matches!(
        (a, b),
        (ConfigError::Invalid { position: p, .. }, ConfigError::Invalid { position: q, .. })
            if p == q
    )
}

/// One reading of `text`, which stops at its first error.
fn parse_once<T: serde::de::DeserializeOwned>(text: &str, file: &Path) -> Result<T, ConfigError> {
    let mut failed_at = String::new();
    let result = serde_saphyr::with_deserializer_from_str_with_options(text, options(), |de| {
        serde_path_to_error::deserialize(de).map_err(|err| {
            failed_at = err.path().to_string();
            err.into_inner()
        })
    });
    result.map_err(|err| {
        let position = err
            .location()
            .map(|l| Position {
                line: l.line(),
                column: l.column(),
            })
            .unwrap_or_default();
        ConfigError::invalid(
            file,
            position,
            field_of(&failed_at, &err),
            plain_message(&err, scalar_at(text, position)),
        )
    })
}

/// Policy text as a JSON value (aliases resolved), read with the same limits as `parse`: for
/// showing the file in force, not for checking it.
pub fn to_json(text: &str) -> Result<serde_json::Value, serde_saphyr::Error> {
    serde_saphyr::from_str_with_options(text, options())
}

/// Limits that keep a hostile or broken file (deep nesting, alias bombs) from using much time
/// or memory; a real policy is far below every one of them.
fn options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        with_snippet: false,
        budget: serde_saphyr::budget! {
            max_reader_input_bytes: Some(16 * 1024 * 1024),
            max_events: 200_000,
            max_aliases: 1_000,
            max_anchors: 1_000,
            max_depth: 32,
            max_nodes: 100_000,
            max_total_scalar_bytes: 16 * 1024 * 1024,
            max_recorded_anchor_events: 50_000,
        },
        alias_limits: serde_saphyr::alias_limits! {
            max_total_replayed_events: 50_000,
        },
    }
}

/// The key given twice, when the error is a duplicate key.
fn duplicate_key(err: &serde_saphyr::Error) -> Option<&str> {
    match err.without_snippet() {
        serde_saphyr::Error::DuplicateMappingKey { key, .. } => key.as_deref(),
        _ => None,
    }
}

/// The field path of an error, as the user wrote it. serde_path_to_error writes `.` for the
/// document root and `?` for a mapping key it has not read (as with a duplicate key, which the
/// parser names), and sees a `Spanned` field as a struct holding the value in a field `value`,
/// a segment that is not in the file. (Right under `upstreams`, `value` is an upstream's name.)
fn field_of(failed_at: &str, err: &serde_saphyr::Error) -> String {
    if failed_at == "." {
        return String::new();
    }
    let mut path = String::new();
    for segment in failed_at.split('.') {
        let spanned_value = segment
            .strip_prefix("value")
            .filter(|rest| rest.is_empty() || rest.starts_with('['));
        match (spanned_value, duplicate_key(err)) {
            (Some(index), _) if !path.is_empty() && path != "upstreams" => {
                path.push_str(index);
                continue;
            }
            (_, Some(key)) if segment == "?" => segment_into(&mut path, key),
            _ => segment_into(&mut path, segment),
        }
    }
    path
}

fn segment_into(path: &mut String, segment: &str) {
    if !path.is_empty() {
        path.push('.');
    }
    path.push_str(segment);
}

/// The parser appends " at line L, column C"; we print the position up front instead. Its
/// message for a duplicate key suggests a parser option, which is no help to a user; for a
/// number it names a Rust type ("invalid u32"), which says nothing either: the message says
/// what was expected and what was written. An unknown field or name gets the nearest of the
/// ones expected.
fn plain_message(err: &serde_saphyr::Error, written: Option<&str>) -> String {
    if let Some(key) = duplicate_key(err) {
        return format!("`{key}` is given twice; each key may appear once");
    }
    let text = err.to_string();
    let text = match text.rfind(" at line ") {
        Some(cut) => &text[..cut],
        None => &text,
    };
    let got = written.map(|w| format!(", got `{w}`")).unwrap_or_default();
    match text.strip_prefix("invalid ") {
        Some("u8" | "u16" | "u32" | "u64" | "usize" | "i8" | "i16" | "i32" | "i64" | "isize") => {
            return format!("expected a whole number{got}");
        }
        Some("f32" | "f64") => return format!("expected a number{got}"),
        Some("bool" | "boolean") => return format!("expected true or false{got}"),
        Some("socket address syntax") => {
            return format!("expected an address and port like 127.0.0.1:8080{got}")
        }
        _ => {}
    }
    format!("{text}{}", nearest_expected(text))
}

/// For serde's "unknown field `x`, expected one of `a`, `b`" (or "unknown variant", or
/// "expected `a` or `b`"): "did you mean" the nearest of those.
fn nearest_expected(message: &str) -> String {
    let Some(rest) = message
        .strip_prefix("unknown field `")
        .or_else(|| message.strip_prefix("unknown variant `"))
    else {
        return String::new();
    };
    let Some((written, expected)) = rest.split_once('`') else {
        return String::new();
    };
    let expected = expected
        .trim_start_matches(", expected ")
        .trim_start_matches("one of ");
    let names = expected
        .split([',', ' '])
        .map(|name| name.trim_matches('`'))
        .filter(|name| !name.is_empty() && *name != "or");
    super::did_you_mean(written, names)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    fn error_of(yaml: &str) -> String {
        match parse(yaml, Path::new("test.yaml")) {
            Ok(_) => panic!("expected an error for:\n{yaml}"),
            Err(err) => err.to_string(),
        }
    }

    const HEAD: &str = "listen: 127.0.0.1:8080\nadmin_listen: 127.0.0.1:9090\n";

    #[test]
    fn a_bad_duration_names_line_column_and_field() {
        let yaml = format!(
            "{HEAD}routes:\n  - name: x\n    match: {{ path_prefix: / }}\n    respond: {{ status: 200 }}\n    limits:\n      - {{ name: a, key: [client_ip], requests: 5, window: thirty }}\n"
        );
        let err = error_of(&yaml);
        assert!(
            err.starts_with("test.yaml:8:59: routes[0].limits[0].window: expected a duration"),
            "{err}"
        );
    }

    #[test]
    fn unknown_fields_are_refused() {
        let yaml = format!("{HEAD}routes: []\nstore: {{ redis_url: x }}\n");
        let err = error_of(&yaml);
        assert!(err.contains("test.yaml:4:10"), "{err}");
        assert!(err.contains("unknown field `redis_url`"), "{err}");
    }

    #[test]
    fn field_paths_are_as_written() {
        let route = "routes:\n  - name: \"a b\"\n    match: { path_prefix: / }\n";
        let err = error_of(&format!("{HEAD}{route}"));
        assert!(
            err.starts_with("test.yaml:4:11: routes[0].name: a name"),
            "{err}"
        );
        let limit = "    respond: { status: 200 }\n    limits: [{ name: a, key: [client_ip, \"claim:sub\"], requests: 1, window: 1s }]\n";
        let err = error_of(&format!("{HEAD}{}{limit}", route.replace("\"a b\"", "r")));
        assert!(
            err.contains(": routes[0].limits[0].key[1]: expected a key part"),
            "{err}"
        );
        let upstream = "upstreams:\n  value: { url: nonsense }\nroutes: []\n";
        let err = error_of(&format!("{HEAD}{upstream}"));
        assert!(
            err.contains(": upstreams.value.url: expected a URL"),
            "{err}"
        );
    }

    #[test]
    fn zero_requests_are_refused() {
        let yaml = format!(
            "{HEAD}routes:\n  - name: x\n    match: {{ path_prefix: / }}\n    respond: {{ status: 200 }}\n    limits: [{{ name: a, key: [client_ip], requests: 0, window: 1s }}]\n"
        );
        let err = error_of(&yaml);
        assert!(err.contains("routes[0].limits[0].requests"), "{err}");
    }

    #[test]
    fn alias_bombs_are_refused() {
        let mut yaml = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for (name, prev) in ["b", "c", "d", "e", "f", "g", "h", "i"]
            .iter()
            .zip(["a", "b", "c", "d", "e", "f", "g", "h"])
        {
            let refs = vec![format!("*{prev}"); 10].join(", ");
            yaml.push_str(&format!("{name}: &{name} [{refs}]\n"));
        }
        let started = std::time::Instant::now();
        let result: Result<BTreeMap<String, serde_json::Value>, _> =
            serde_saphyr::from_str_with_options(&yaml, options());
        let err = result
            .expect_err("a billion laughs must not parse")
            .to_string();
        assert!(err.contains("budget") || err.contains("alias"), "{err}");
        // Refused in milliseconds; the bound is generous for a loaded CI machine, and a parser
        // that expanded the 10^9 nodes would take far longer (or run out of memory) first.
        assert!(started.elapsed() < std::time::Duration::from_secs(30));
    }

    /// A valid file that uses every field, the starting point of the mutations below.
    const VALID: &str = r#"listen: 127.0.0.1:8080
admin_listen: 127.0.0.1:9090
store:
  redis:
    url: redis://127.0.0.1:6379/0
    timeout: 50ms
    pool_size: 32
  key_prefix: sluice
upstreams:
  api:
    url: "http://127.0.0.1:3000/v1"
    connect_timeout: 2s
    timeout: 30s
routes:
  - name: login
    match:
      path_prefix: /login
      methods: [POST]
    upstream: api
    limits:
      - name: per-ip
        key: [client_ip, "header:x-api-key"]
        requests: 5
        window: 1m
  - name: status
    match: { path_prefix: /status }
    respond:
      status: 200
      body: "ok\n"
      content_type: text/plain
"#;

    /// One change to a line-oriented YAML file.
    #[derive(Debug, Clone)]
    enum Edit {
        /// Replace what follows the line's first `:` (or the whole line) with this text.
        Value(prop::sample::Index, String),
        Delete(prop::sample::Index),
        Duplicate(prop::sample::Index),
        /// Add or remove this many leading spaces.
        Indent(prop::sample::Index, i8),
        /// Replace one byte of the file.
        Byte(prop::sample::Index, u8),
    }

    fn edit() -> impl Strategy<Value = Edit> {
        let line = any::<prop::sample::Index>;
        prop_oneof![
            (line(), "\\PC{0,12}").prop_map(|(i, v)| Edit::Value(i, v)),
            (line(), r#"[ -~]{0,12}"#).prop_map(|(i, v)| Edit::Value(i, v)),
            line().prop_map(Edit::Delete),
            line().prop_map(Edit::Duplicate),
            (line(), -4i8..=4).prop_map(|(i, n)| Edit::Indent(i, n)),
            (line(), any::<u8>()).prop_map(|(i, b)| Edit::Byte(i, b)),
        ]
    }

    fn apply(text: &str, edits: &[Edit]) -> String {
        let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
        for edit in edits {
            if lines.is_empty() {
                break;
            }
            match edit {
                Edit::Value(i, value) => {
                    let at = i.index(lines.len());
                    let line = &mut lines[at];
                    let keep = line.find(':').map_or(0, |colon| colon + 1);
                    line.truncate(keep);
                    line.push(' ');
                    line.push_str(value);
                }
                Edit::Delete(i) => {
                    lines.remove(i.index(lines.len()));
                }
                Edit::Duplicate(i) => {
                    let at = i.index(lines.len());
                    lines.insert(at, lines[at].clone());
                }
                Edit::Indent(i, n) => {
                    let at = i.index(lines.len());
                    let line = &mut lines[at];
                    if *n >= 0 {
                        line.insert_str(0, &" ".repeat(*n as usize));
                    } else {
                        let spaces = line.len() - line.trim_start_matches(' ').len();
                        line.drain(..spaces.min(n.unsigned_abs() as usize));
                    }
                }
                Edit::Byte(i, byte) => {
                    let mut bytes = lines.join("\n").into_bytes();
                    if !bytes.is_empty() {
                        let at = i.index(bytes.len());
                        bytes[at] = *byte;
                    }
                    let text = String::from_utf8_lossy(&bytes).into_owned();
                    lines = text.lines().map(str::to_owned).collect();
                }
            }
        }
        lines.join("\n") + "\n"
    }

    /// `parse` answers every input with a config or an error that names the file.
    fn parses_or_names_the_file(text: &str) -> Result<(), TestCaseError> {
        if let Err(err) = parse(text, Path::new("fuzz.yaml")) {
            let message = err.to_string();
            prop_assert!(message.starts_with("fuzz.yaml"), "{}", message);
        }
        Ok(())
    }

    #[test]
    fn the_mutations_start_from_a_valid_file() {
        let config = parse(VALID, Path::new("valid.yaml")).expect("VALID parses");
        assert_eq!(config.routes.len(), 2);
        assert_eq!(apply(VALID, &[]), VALID);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn arbitrary_bytes_parse_or_are_refused(
            bytes in prop::collection::vec(any::<u8>(), 0..2048),
        ) {
            parses_or_names_the_file(&String::from_utf8_lossy(&bytes))?;
        }

        #[test]
        fn mutations_of_a_valid_file_parse_or_are_refused(
            edits in prop::collection::vec(edit(), 1..6),
        ) {
            parses_or_names_the_file(&apply(VALID, &edits))?;
        }
    }
}
