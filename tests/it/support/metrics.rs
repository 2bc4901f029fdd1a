//! Prometheus text exposition, parsed, for tests that read sluice's `/metrics`.

use std::collections::BTreeMap;

/// One sample of a Prometheus text exposition.
#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Parse the Prometheus text format (no escapes beyond `\"`, `\\`, `\n`).
pub fn parse_metrics(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, labels, rest) = if let Some(brace) = line.find('{') {
            let name = &line[..brace];
            let mut labels = BTreeMap::new();
            let bytes: Vec<char> = line[brace + 1..].chars().collect();
            let mut i = 0;
            loop {
                while i < bytes.len() && (bytes[i] == ',' || bytes[i] == ' ') {
                    i += 1;
                }
                if i >= bytes.len() {
                    panic!("unterminated labels in metrics line {line:?}");
                }
                if bytes[i] == '}' {
                    i += 1;
                    break;
                }
                let start = i;
                while bytes[i] != '=' {
                    i += 1;
                }
                let key: String = bytes[start..i].iter().collect();
                i += 1; // '='
                assert_eq!(bytes[i], '"', "label value must be quoted in {line:?}");
                i += 1;
                let mut val = String::new();
                while bytes[i] != '"' {
                    if bytes[i] == '\\' {
                        i += 1;
                        val.push(match bytes[i] {
                            'n' => '\n',
                            c => c,
                        });
                    } else {
                        val.push(bytes[i]);
                    }
                    i += 1;
                }
                i += 1; // closing quote
                labels.insert(key.trim().to_string(), val);
            }
            let rest: String = bytes[i..].iter().collect();
            (name.to_string(), labels, rest)
        } else {
            let mut parts = line.splitn(2, ' ');
            let name = parts.next().unwrap().to_string();
            (
                name,
                BTreeMap::new(),
                parts.next().unwrap_or("").to_string(),
            )
        };
        let value_str = rest.split_whitespace().next().unwrap_or("");
        let value = match value_str {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v
                .parse()
                .unwrap_or_else(|_| panic!("bad sample value in metrics line {line:?}")),
        };
        out.push(Sample {
            name,
            labels,
            value,
        });
    }
    out
}

/// Samples named `name` whose labels include all of `labels`.
pub fn samples<'a>(all: &'a [Sample], name: &str, labels: &[(&str, &str)]) -> Vec<&'a Sample> {
    all.iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            labels
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(|x| x == v).unwrap_or(false))
        })
        .collect()
}

/// Sum of the values of the samples named `name` matching `labels` (0 if none).
pub fn metric_sum(all: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples(all, name, labels).iter().map(|s| s.value).sum()
}
