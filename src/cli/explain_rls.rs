//! `sluice explain-rls`: the rate limit service's answer to one `ShouldRateLimit` call, from
//! the files alone.

use std::path::Path;

use crate::version::{load, ListenerFiles};

/// `sluice explain-rls`: the rate limit service's answer to one call, from the files alone.
pub fn explain_rls(
    file: &Path,
    domain: &str,
    descriptors: &[String],
    hits: u32,
) -> anyhow::Result<String> {
    let loaded = load(file, ListenerFiles::Skip)?;
    let Some(rls) = loaded.rls else {
        anyhow::bail!("{}: has no `rls:` section", file.display());
    };
    let descriptors = descriptors
        .iter()
        .map(|text| crate::rls::explain::descriptor(text))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(crate::rls::explain::explain(
        &rls,
        domain,
        descriptors,
        hits,
    )?)
}
