//! The JSON Schema of the policy file: the committed `config/sluice.schema.json` is what the
//! config types generate, and every example policy points editors at it.
//!
//! To regenerate the file after changing the config types:
//! `SLUICE_UPDATE_SCHEMA=1 cargo test --test it schema::`.
//! (CI also validates every example policy against it: `scripts/check-deploy.sh`.)

use std::path::Path;

use serde_json::Value;

const SCHEMA: &str = "config/sluice.schema.json";

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn the_committed_schema_is_what_the_config_types_generate() {
    let generated = sluice::config::json_schema();
    let path = repo().join(SCHEMA);
    if std::env::var_os("SLUICE_UPDATE_SCHEMA").is_some() {
        std::fs::write(&path, &generated).expect("write the schema");
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{SCHEMA} is not what the config types generate: regenerate it with \
         `SLUICE_UPDATE_SCHEMA=1 cargo test --test it schema::` and commit it"
    );
}

/// Unknown fields are errors for serde (`deny_unknown_fields`), so they are for the schema.
#[test]
fn every_object_refuses_unknown_fields() {
    let schema: Value = serde_json::from_str(&sluice::config::json_schema()).expect("JSON");
    let mut objects = vec![("(root)".to_owned(), &schema)];
    for (name, def) in schema["definitions"].as_object().expect("definitions") {
        objects.push((name.clone(), def));
    }
    let mut checked = 0;
    for (name, object) in objects {
        if object["type"] == "object" {
            assert_eq!(
                object["additionalProperties"],
                Value::Bool(false),
                "{name} accepts unknown fields"
            );
            checked += 1;
        }
    }
    assert!(checked >= 12, "only {checked} objects in the schema");
    let route = &schema["definitions"]["RouteConfig"]["properties"];
    assert!(route["match"].is_object(), "serde's rename of `matcher`");
    assert!(route.get("matcher").is_none());
}

/// Each example policy starts with the comment that tells the YAML language server (VS Code,
/// Neovim, ...) which schema to complete and check it with.
#[test]
fn example_policies_name_the_schema() {
    let mut policies: Vec<_> = std::fs::read_dir(repo().join("config"))
        .expect("config/")
        .map(|entry| entry.expect("entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "yaml"))
        .collect();
    policies.push(repo().join("deploy/sluice.container.yaml"));
    assert!(policies.len() >= 4, "{policies:?}");
    for path in policies {
        let text = std::fs::read_to_string(&path).expect("read policy");
        let first = text.lines().next().unwrap_or_default();
        let target = first
            .strip_prefix("# yaml-language-server: $schema=")
            .unwrap_or_else(|| panic!("{} does not start with the schema comment", path.display()));
        let schema = path.parent().expect("a folder").join(target);
        assert_eq!(
            schema.canonicalize().ok(),
            repo().join(SCHEMA).canonicalize().ok(),
            "{}: `{target}` is not {SCHEMA}",
            path.display()
        );
    }
}
