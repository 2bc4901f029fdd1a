//! `sluice usage` and `sluice overrides load`: the commands that ask a running sluice's admin
//! API (`admin_client`) instead of reading the config file.
//!
//! - `sluice usage --route R --limit L [--top N]`: the limit's top identities
//!   (`GET /admin/v1/limits/R/L/usage?top=N`).
//! - `sluice usage --part header.x-api-key=k1 [--part ...] [--route R]`: one identity in every
//!   limit its parts name (`GET /admin/v1/usage?...`).
//! - `sluice overrides load --route R --limit L FILE`: the JSON lines of FILE as one bulk load
//!   (`POST /admin/v1/limits/R/L/overrides`).
//!
//! Each prints a table, or with `--json` the admin API's answer as it came.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use http::Method;

use super::admin_client::AdminClient;

/// Where the admin API is, for every command that calls it.
pub struct AdminFlags {
    pub admin: String,
    pub token_file: Option<PathBuf>,
}

/// What `sluice usage` asks.
pub struct UsageQuestion {
    pub route: Option<String>,
    pub limit: Option<String>,
    pub top: usize,
    /// `name=value` per key part (`header.x-api-key=k1`).
    pub parts: Vec<String>,
    pub json: bool,
}

/// Runs `sluice usage`; the text to print.
pub fn usage(flags: &AdminFlags, question: &UsageQuestion) -> anyhow::Result<String> {
    let client = AdminClient::new(&flags.admin, flags.token_file.as_deref())?;
    let path = match (&question.route, &question.limit, question.parts.is_empty()) {
        (Some(route), Some(limit), true) => format!(
            "/admin/v1/limits/{}/{}/usage?top={}",
            encoded(route),
            encoded(limit),
            question.top
        ),
        (route, None, false) => {
            let mut query = String::new();
            for part in &question.parts {
                let (name, value) = part
                    .split_once('=')
                    .ok_or_else(|| anyhow::anyhow!("--part `{part}`: expected NAME=VALUE"))?;
                if !query.is_empty() {
                    query.push('&');
                }
                let _ = write!(query, "{}={}", encoded(name), encoded(value));
            }
            if let Some(route) = route {
                let _ = write!(query, "&route={}", encoded(route));
            }
            format!("/admin/v1/usage?{query}")
        }
        _ => anyhow::bail!(
            "ask for a limit's top identities (--route R --limit L [--top N]) or for one \
             identity (--part NAME=VALUE ... [--route R]), not both"
        ),
    };
    let answer = runtime()?.block_on(client.call(Method::GET, &path, Bytes::new()))?;
    if question.json {
        return Ok(format!("{answer:#}\n"));
    }
    Ok(if answer.get("identities").is_some() {
        top_table(&answer)
    } else {
        identity_table(&answer)
    })
}

/// Runs `sluice overrides load`; the text to print.
pub fn load_overrides(
    flags: &AdminFlags,
    route: &str,
    limit: &str,
    file: &Path,
    json: bool,
) -> anyhow::Result<String> {
    let client = AdminClient::new(&flags.admin, flags.token_file.as_deref())?;
    let body = std::fs::read(file)
        .map_err(|err| anyhow::anyhow!("cannot read {}: {err}", file.display()))?;
    let path = format!(
        "/admin/v1/limits/{}/{}/overrides",
        encoded(route),
        encoded(limit)
    );
    let answer = runtime()?.block_on(client.call(Method::POST, &path, Bytes::from(body)))?;
    if json {
        return Ok(format!("{answer:#}\n"));
    }
    Ok(format!(
        "{} overrides of {route}/{limit} written ({} store)\n",
        answer["written"],
        answer["store"].as_str().unwrap_or("?")
    ))
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// A limit's top identities as a table.
fn top_table(answer: &serde_json::Value) -> String {
    let money = answer.get("currency").and_then(|c| c.as_str());
    let mut rows = vec![header(money)];
    for one in answer["identities"].as_array().into_iter().flatten() {
        rows.push(row(one, money, None, money.is_some()));
    }
    let mut text = format!(
        "{}/{}: {} ({}), store {}\n",
        answer["route"].as_str().unwrap_or(""),
        answer["limit"].as_str().unwrap_or(""),
        answer["algorithm"].as_str().unwrap_or(""),
        answer["unit"].as_str().unwrap_or(""),
        answer["store"].as_str().unwrap_or(""),
    );
    text.push_str(&aligned(&rows));
    text
}

/// One identity's limits as a table.
fn identity_table(answer: &serde_json::Value) -> String {
    let mut rows = vec![vec![
        "route/limit".to_owned(),
        "identity".to_owned(),
        "used".to_owned(),
        "limit".to_owned(),
        "remaining".to_owned(),
        "reset".to_owned(),
        "spend".to_owned(),
    ]];
    for one in answer["limits"].as_array().into_iter().flatten() {
        let name = format!(
            "{}/{}",
            one["route"].as_str().unwrap_or(""),
            one["name"].as_str().unwrap_or("")
        );
        rows.push(row(one, one["currency"].as_str(), Some(name), true));
    }
    let mut text = aligned(&rows);
    for skipped in answer["not_named"].as_array().into_iter().flatten() {
        let _ = writeln!(
            text,
            "not named: {}/{} (its key: {})",
            skipped["route"].as_str().unwrap_or(""),
            skipped["limit"].as_str().unwrap_or(""),
            skipped["key"]
        );
    }
    text
}

fn header(money: Option<&str>) -> Vec<String> {
    let mut names = vec!["identity", "used", "limit", "remaining", "reset"];
    if money.is_some() {
        names.push("spend");
    }
    names.into_iter().map(str::to_owned).collect()
}

/// One identity's row; `spend_column`: the table has a spend column (filled for a money
/// budget, `money` its currency).
fn row(
    one: &serde_json::Value,
    money: Option<&str>,
    name: Option<String>,
    spend_column: bool,
) -> Vec<String> {
    // An identity's own number (an override) is starred.
    let limit = if one["overridden"].as_bool() == Some(true) {
        format!("{}*", one["limit"])
    } else {
        one["limit"].to_string()
    };
    let mut cells = Vec::new();
    cells.extend(name);
    cells.extend([
        one["identity"].as_str().unwrap_or("").to_owned(),
        one["used"].to_string(),
        limit,
        one["remaining"].to_string(),
        format!("{:.1}s", one["reset"].as_f64().unwrap_or(0.0)),
    ]);
    if spend_column {
        cells.push(match (money, one["spend"].as_str()) {
            (Some(currency), Some(spend)) => format!("{spend} {currency}"),
            _ => String::new(),
        });
    }
    cells
}

fn aligned(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(String::len)
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut text = String::new();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        let _ = writeln!(text, "{}", line.join("  ").trim_end());
    }
    text
}

/// Percent-encodes a path segment or query value.
fn encoded(text: &str) -> String {
    let mut out = String::new();
    for &byte in text.as_bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
    out
}
