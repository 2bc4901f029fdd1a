//! The JSON Schema of the policy file, generated from the config types, so editors can complete
//! and check a policy as it is typed (`config/sluice.schema.json`, kept in sync by
//! `tests/it/schema.rs`).
//!
//! The structs derive their schema; the values parsed from text (durations, names, key parts,
//! URLs, sizes) describe here what their `FromStr` accepts. A pattern can only approximate some
//! of those checks (a CIDR prefix length, a Redis URL), so the schema may accept a value that
//! `sluice check` refuses, never the other way round: `sluice check` stays the authority.

use std::borrow::Cow;

use schemars::generate::SchemaSettings;
use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};

use super::types::{PoolSize, StatusMatch};
use super::{
    ByteSize, Config, ConfigDuration, FieldName, HostPort, IpNet, KeyPart, MethodName, Name,
    PathPrefix, Positive, RedisUrl, Status, TokenFrom, UpstreamUrl,
};

/// The schema of the whole policy file, as pretty-printed JSON with a final newline. Draft 7,
/// the newest draft every YAML language server reads.
pub fn json_schema() -> String {
    let mut schema = SchemaSettings::draft07()
        .into_generator()
        .into_root_schema_for::<Config>();
    schema.insert("title".into(), "sluice policy".into());
    schema.insert(
        "description".into(),
        "The policy file of sluice, a rate-limiting reverse proxy. Generated from the config \
         types; `sluice check --config FILE` remains the full check."
            .into(),
    );
    let mut text = serde_json::to_string_pretty(&schema).unwrap_or_default();
    text.push('\n');
    text
}

/// Implements `JsonSchema` for a type written as one string, with a pattern and description.
macro_rules! string_schema {
    ($ty:ty, $name:literal, $pattern:expr, $description:literal, [$($example:literal),*]) => {
        impl JsonSchema for $ty {
            fn schema_name() -> Cow<'static, str> {
                $name.into()
            }
            fn json_schema(_: &mut SchemaGenerator) -> Schema {
                json_schema!({
                    "type": "string",
                    "pattern": $pattern,
                    "description": $description,
                    "examples": [$($example),*],
                })
            }
        }
    };
}

string_schema!(
    ConfigDuration,
    "Duration",
    r"^\s*0*[1-9][0-9]*(ms|s|m|h|d)\s*$",
    "A duration greater than zero with a unit: ms, s, m, h or d. A bare number is refused.",
    ["50ms", "30s", "1m", "2h", "1d"]
);
string_schema!(
    super::admin::EnvName,
    "EnvName",
    r"^[A-Za-z_][A-Za-z0-9_]{0,127}$",
    "The name of an environment variable (a letter or `_`, then letters, digits and `_`). The \
     token itself never goes in the file.",
    ["SLUICE_ADMIN_TOKEN"]
);
string_schema!(
    super::admin::AdminHost,
    "AdminHost",
    r"^([A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?$",
    "A name the admin API answers to (in the request's `Host` and `Origin`) besides its own \
     address and `localhost`, `127.0.0.1`, `[::1]`: `name` (with no port or the listener's \
     port) or `name:port` (that port only).",
    ["sluice-admin.monitoring.svc", "localhost:19090"]
);
string_schema!(
    Name,
    "Name",
    r"^[A-Za-z0-9._-]{1,64}$",
    "1 to 64 characters of A-Z, a-z, 0-9, `-`, `_`, `.`: it appears in store keys, metric \
     labels and the RateLimit-Policy field.",
    ["per-ip", "login"]
);
string_schema!(
    KeyPart,
    "KeyPart",
    r"^(client_ip|method|host|path|model|header:[!#$%&'*+.^_`|~0-9A-Za-z-]+|(query|cookie|param|jwt):[!-~]+)$",
    "Where in the request the identity comes from: `client_ip`, `header:NAME`, \
     `query:NAME`, `cookie:NAME`, `param:NAME` (a `{NAME}` segment of the path prefix), \
     `jwt:CLAIM` (a claim of the route's verified JWT), `method`, `host`, `path` or `model` \
     (the JSON body's `model`, normalised; token limits only). An absent header, query \
     parameter, cookie, claim or model falls back to the client IP.",
    [
        "client_ip",
        "header:x-api-key",
        "query:api_key",
        "cookie:session",
        "param:tenant",
        "jwt:sub"
    ]
);
string_schema!(
    TokenFrom,
    "TokenFrom",
    r"^(header:[!#$%&'*+.^_`|~0-9A-Za-z-]+|cookie:[!-~]+)$",
    "Where the token is: `header:authorization` (`Bearer TOKEN`, the default), another \
     `header:NAME` (its value, a `Bearer ` in front taken off) or `cookie:NAME`.",
    ["header:authorization", "cookie:session"]
);
string_schema!(
    MethodName,
    "Method",
    r"^[!#$%&'*+.^_`|~0-9A-Z-]+$",
    "An HTTP method, case-sensitive (`POST`, not `post`). In a list, `GET` also means `HEAD`.",
    ["GET", "POST"]
);
string_schema!(
    PathPrefix,
    "PathPrefix",
    r#"^/[!-"$-:<->@-~]*$"#,
    "A path prefix: starts with `/`, printable ASCII without a query, fragment, `;` \
     parameters or spaces (percent-encode the rest). A whole segment `{name}` is a path \
     parameter.",
    ["/", "/login", "/tenants/{tenant}/orders"]
);
string_schema!(
    super::WebhookUrl,
    "WebhookUrl",
    r"^https?://[^\s/?#@]+(/[^\s#]*)?$",
    "Where threshold notifications are POSTed: `https://host[:port]/path` (or `http://` on a \
     private network); no credentials.",
    [
        "https://hooks.example.com/sluice",
        "http://hooks.internal:8080/sluice"
    ]
);
string_schema!(
    UpstreamUrl,
    "UpstreamUrl",
    r"^https?://[^\s/?#@]+(/[^\s?#]*)?$",
    "Where the upstream lives: `http://host:port` with an optional base path put in front \
     of every forwarded path; no query, no credentials.",
    ["http://127.0.0.1:3000", "http://api.internal/v1"]
);
string_schema!(
    RedisUrl,
    "RedisUrl",
    r"^(rediss?|valkeys?|(redis|valkey)\+unix|unix)://",
    "A Redis URL: `redis://[user:password@]host:port/db` (also `valkey://`, `unix://PATH`).",
    ["redis://127.0.0.1:6379/0"]
);
string_schema!(
    HostPort,
    "HostPort",
    r"^[^\s/@]+:[0-9]{1,5}$",
    "`host:port` of a Redis Sentinel node (`[v6]:port` for an IPv6 address).",
    ["127.0.0.1:26379", "sentinel-0:26379"]
);
string_schema!(
    IpNet,
    "IpNet",
    r"^[0-9A-Fa-f:.]+(/[0-9]{1,3})?$",
    "An IP address or a CIDR range.",
    ["10.0.0.0/8", "2001:db8::/32", "127.0.0.1"]
);
string_schema!(
    FieldName,
    "HeaderName",
    r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$",
    "A header field name.",
    ["x-api-key"]
);

/// The text form of a size, as `ByteSize::from_str` reads it.
const BYTE_SIZE_PATTERN: &str = r"^\s*[0-9]+\s*(B|KiB|MiB|GiB|KB|MB|GB)?$";
const BYTE_SIZE_DESCRIPTION: &str = "A size in bytes: a number of bytes, or a number with a \
     unit KiB, MiB, GiB (powers of 1024) or KB, MB, GB (powers of 1000).";

impl JsonSchema for ByteSize {
    fn schema_name() -> Cow<'static, str> {
        "ByteSize".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": ["integer", "string"],
            "minimum": 0,
            "pattern": BYTE_SIZE_PATTERN,
            "description": BYTE_SIZE_DESCRIPTION,
            "examples": ["64KiB", "10MB", 1048576],
        })
    }
}

/// A size bounded to `MIN..=MAX` bytes; only a bare number can be checked against the bounds
/// here (`sluice check` checks both forms).
pub(super) fn bytes_within<const MIN: u64, const MAX: u64>(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": ["integer", "string"],
        "minimum": MIN,
        "maximum": MAX,
        "pattern": BYTE_SIZE_PATTERN,
        "description": format!("{BYTE_SIZE_DESCRIPTION} From {MIN} to {MAX} bytes."),
    })
}

/// A count bounded to `MIN..=MAX`.
pub(super) fn count_within<const MIN: u32, const MAX: u32>(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "integer",
        "minimum": MIN,
        "maximum": MAX,
    })
}

/// An optional prefix length bounded to `MIN..=MAX` bits.
pub(super) fn prefix_within<const MIN: u32, const MAX: u32>(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": ["integer", "null"],
        "minimum": MIN,
        "maximum": MAX,
    })
}

impl JsonSchema for Positive {
    fn schema_name() -> Cow<'static, str> {
        "Positive".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        count_within::<1, { u32::MAX }>(generator)
    }
}

impl JsonSchema for super::Workers {
    fn schema_name() -> Cow<'static, str> {
        "Workers".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "`auto`: one worker per available core; or a number of workers.",
            "oneOf": [
                { "const": "auto" },
                { "type": "integer", "minimum": 1, "maximum": super::Workers::MAX },
            ],
            "default": "auto",
        })
    }
}

impl JsonSchema for PoolSize {
    fn schema_name() -> Cow<'static, str> {
        "PoolSize".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        count_within::<1, { PoolSize::MAX }>(generator)
    }
}

impl JsonSchema for StatusMatch {
    fn schema_name() -> Cow<'static, str> {
        "StatusMatch".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "A status from 100 to 599, or a class from 1xx to 5xx.",
            "oneOf": [
                {"type": "integer", "minimum": 100, "maximum": 599},
                {"type": "string", "pattern": "^\\s*([1-5][0-9][0-9]|[1-5][xX][xX])\\s*$"},
            ],
            "examples": [401, "5xx"],
        })
    }
}

impl JsonSchema for Status {
    fn schema_name() -> Cow<'static, str> {
        "Status".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "integer",
            "minimum": 200,
            "maximum": 999,
        })
    }
}
