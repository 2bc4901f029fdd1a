//! The mistakes a new user makes in a first policy, each with the exact message `sluice check`
//! prints: what was expected in words a user knows (never a Rust type), what was written, the
//! nearest valid name ("did you mean"), and the line with a caret under the mistake. A minimal
//! policy is `listen` plus routes (`admin_listen` defaults to loopback). A file with many
//! mistakes gets them all in one run, in the file's order, with a count.

use crate::support;

use support::{sluice_check, write_config};

/// The smallest useful policy: no `admin_listen`, no store (in process).
const MINIMAL: &str = "\
listen: 127.0.0.1:8080
upstreams:
  api:
    url: http://127.0.0.1:9000
routes:
  - name: api
    match:
      path_prefix: /api
    upstream: api
    limits:
      - name: per-ip
        key: [client_ip]
        requests: 100
        window: 1m
";

/// The five ordinary mistakes and two more, in two routes: all seven in one run, in
/// the file's order; the unknown upstreams too, which only the checks after reading find.
#[test]
fn every_mistake_of_a_file_in_one_run() {
    let yaml = "\
listen: 127.0.0.1:8080
upstreams:
  api:
    url: http://127.0.0.1:9000
routes:
  - name: api
    match: { path_prefx: /api }
    upstream: apii
    limits:
      - name: per-ip
        key: [clientip]
        requests: ten
        window: 1 minute
  - name: other
    match:
      path_prefix: /o
    upstream: ap
    limits:
      - { name: x, key: [method], requests: 5, window: 1m, algorithm: gcraa, burst: 3 }
";
    let file = write_config(yaml);
    let (status, _, stderr) = sluice_check(file.path());
    assert!(!status.success());
    let path = file.path().to_str().unwrap();
    let said: Vec<String> = stderr
        .lines()
        .filter_map(|line| line.strip_prefix("error: "))
        .map(|line| line.replacen(&format!("{path}:"), "", 1))
        .map(|line| line.split(": ").take(2).collect::<Vec<_>>().join(": "))
        .collect();
    assert_eq!(
        said,
        [
            "7:14: routes[0].match.path_prefx",
            "8:15: routes[0].upstream",
            "11:15: routes[0].limits[0].key[0]",
            "12:19: routes[0].limits[0].requests",
            "13:17: routes[0].limits[0].window",
            "17:15: routes[1].upstream",
            "19:71: routes[1].limits[0].algorithm",
        ],
        "{stderr}"
    );
    assert!(
        stderr.contains("unknown upstream `ap` (defined: api); did you mean `api`?"),
        "{stderr}"
    );
    // `burst` beside the misspelt `gcraa` is not judged against the placeholder algorithm.
    assert!(!said.iter().any(|line| line.contains("burst")), "{stderr}");
    assert_eq!(
        stderr.trim_end().lines().last(),
        Some("7 errors"),
        "{stderr}"
    );
}

#[test]
fn a_minimal_policy_needs_no_admin_listen() {
    let file = write_config(MINIMAL);
    let (status, stdout, stderr) = sluice_check(file.path());
    assert!(status.success(), "{stdout}{stderr}");
}

/// `MINIMAL` with `from` replaced by `to`, checked: stderr's first line after the file name
/// must be `at: message`, and the excerpt must put `caret` under the mistake.
fn refused(from: &str, to: &str, at: &str, message: &str, caret: &str) {
    assert!(MINIMAL.contains(from), "test bug: {from:?}");
    let yaml = MINIMAL.replacen(from, to, 1);
    let file = write_config(&yaml);
    let (status, _, stderr) = sluice_check(file.path());
    assert!(!status.success(), "{to:?} must be refused");
    let path = file.path().to_str().unwrap();
    let first = stderr.lines().next().unwrap_or_default();
    assert_eq!(first, format!("error: {path}:{at}: {message}"), "{to:?}");
    let lines: Vec<&str> = stderr.lines().collect();
    let (line, column) = at.split_once(':').unwrap();
    let column: usize = column.split(':').next().unwrap().parse().unwrap();
    let written = yaml
        .lines()
        .nth(line.parse::<usize>().unwrap() - 1)
        .unwrap();
    let gutter = " ".repeat(line.len());
    assert_eq!(
        lines.get(1..4).unwrap_or_default(),
        [
            format!("{gutter} |"),
            format!("{line} | {written}"),
            format!("{gutter} | {}{caret}", " ".repeat(column - 1)),
        ],
        "{to:?}: the excerpt\n{stderr}"
    );
}

#[test]
fn a_count_that_is_not_a_number() {
    refused(
        "requests: 100",
        "requests: ten",
        "13:19: routes[0].limits[0].requests",
        "expected a whole number, got `ten`",
        "^^^",
    );
}

#[test]
fn a_negative_count() {
    refused(
        "requests: 100",
        "requests: -5",
        "13:19: routes[0].limits[0].requests",
        "expected a whole number, got `-5`",
        "^^",
    );
}

#[test]
fn a_misspelt_key_part() {
    refused(
        "[client_ip]",
        "[clientip]",
        "12:15: routes[0].limits[0].key[0]",
        "expected a key part `client_ip`, `header:NAME`, `query:NAME`, `cookie:NAME`, \
         `param:NAME`, `jwt:CLAIM`, `method`, `host`, `path` or `model`, got `clientip`; \
         did you mean `client_ip`?",
        "^^^^^^^^",
    );
}

#[test]
fn a_misspelt_key_part_prefix() {
    refused(
        "[client_ip]",
        "[\"headers:x-api-key\"]",
        "12:15: routes[0].limits[0].key[0]",
        "expected a key part `client_ip`, `header:NAME`, `query:NAME`, `cookie:NAME`, \
         `param:NAME`, `jwt:CLAIM`, `method`, `host`, `path` or `model`, got \
         `headers:x-api-key`; did you mean `header:x-api-key`?",
        "^^^^^^^^^^^^^^^^^",
    );
}

#[test]
fn a_duration_in_words() {
    refused(
        "window: 1m",
        "window: 1 minute",
        "14:17: routes[0].limits[0].window",
        "expected a duration like 30s (units: ms, s, m, h, d), got `1 minute`; did you mean `1m`?",
        "^^^^^^^^",
    );
}

#[test]
fn a_duration_without_a_unit() {
    refused(
        "window: 1m",
        "window: 60",
        "14:17: routes[0].limits[0].window",
        "a duration needs a unit (ms, s, m, h, d), got `60`",
        "^^",
    );
}

#[test]
fn a_misspelt_field() {
    refused(
        "path_prefix: /api",
        "path_prefx: /api",
        "8:7: routes[0].match.path_prefx",
        "unknown field `path_prefx`, expected one of path_prefix, methods, case_sensitive; \
         did you mean `path_prefix`?",
        "^^^^^^^^^^",
    );
}

#[test]
fn a_misspelt_limit_field() {
    refused(
        "requests: 100",
        "reqeusts: 100",
        "13:9: routes[0].limits[0].reqeusts",
        "unknown field `reqeusts`, expected one of name, key, requests, tokens, money, \
         currency, concurrent, lease, window, quota, time_zone, algorithm, burst, cost, shadow, \
         overrides, report, notify, when, on_exceed, max_delay, count, ipv6_prefix, ipv4_prefix, reserve, settle; \
         did you mean `requests`?",
        "^^^^^^^^",
    );
}

#[test]
fn an_unknown_upstream() {
    refused(
        "upstream: api",
        "upstream: apii",
        "9:15: routes[0].upstream",
        "unknown upstream `apii` (defined: api); did you mean `api`?",
        "^^^^",
    );
}

#[test]
fn a_misspelt_algorithm() {
    refused(
        "window: 1m",
        "window: 1m\n        algorithm: gcraa",
        "15:20: routes[0].limits[0].algorithm",
        "unknown variant `gcraa`, expected one of sliding_log, sliding_window, fixed_window, \
         gcra, weighted_log; did you mean `gcra`?",
        "^^^^^",
    );
}

#[test]
fn a_misspelt_period() {
    refused(
        "window: 1m",
        "quota: dya",
        "14:16: routes[0].limits[0].quota",
        "unknown variant `dya`, expected one of day, week, month; did you mean `day`?",
        "^^^",
    );
}

#[test]
fn a_misspelt_exceed_action() {
    refused(
        "window: 1m",
        "window: 1m\n        on_exceed: dealy",
        "15:20: routes[0].limits[0].on_exceed",
        "unknown variant `dealy`, expected one of reject, delay, switch_model; did you mean `delay`?",
        "^^^^^",
    );
}

#[test]
fn a_flag_that_is_not_true_or_false() {
    refused(
        "window: 1m",
        "window: 1m\n        shadow: 2",
        "15:17: routes[0].limits[0].shadow",
        "expected true or false, got `2`",
        "^",
    );
}

#[test]
fn a_listen_address_without_a_port() {
    refused(
        "listen: 127.0.0.1:8080",
        "listen: 127.0.0.1",
        "1:9: listen",
        "expected an address and port like 127.0.0.1:8080, got `127.0.0.1`",
        "^^^^^^^^^",
    );
}

#[test]
fn burst_on_an_algorithm_without_it() {
    refused(
        "window: 1m",
        "window: 1m\n        burst: 5",
        "15:16: routes[0].limits[0].burst",
        "`burst` applies to `algorithm: gcra` only, not `sliding_log`",
        "^",
    );
}

#[test]
fn notify_without_a_webhook() {
    refused(
        "window: 1m",
        "window: 1m\n        notify: { at: [0.5, 0.8] }",
        "15:17: routes[0].limits[0].notify",
        "notifications need somewhere to go: add a top-level `webhook: { url: http://..., \
         secret_env: NAME }`",
        "^^^^",
    );
}

#[test]
fn notify_fractions_out_of_order() {
    refused(
        "window: 1m",
        "window: 1m\n        notify: { at: [0.8, 0.8] }\nwebhook: { url: \"http://127.0.0.1:9/h\", secret_env: HOOK }",
        "15:24: routes[0].limits[0].notify.at[0]",
        "list the fractions in ascending order, each once (to a thousandth): [0.5, 0.8, 1.0]",
        "^^^",
    );
}
