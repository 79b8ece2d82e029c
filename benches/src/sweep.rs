//! `quilt-bench sweep`: one knob of one allocator spec, one replay (and
//! bisection) per value, on one trace or workload: the usual report columns
//! per value, JSON rows with the value ([`crate::report::json::sweep_json`]),
//! and a chart of minimum capacity, efficiency and modelled driver time
//! against it ([`crate::report::charts::write_sweep_chart`]). Here: the specs
//! of the values.

/// The spec `base` with `key` set to `value` (replacing a setting of the same
/// key): `gmlake:frag_limit=32MiB` + `reuse_limit=4` gives
/// `gmlake:frag_limit=32MiB,reuse_limit=4`.
pub fn with_setting(base: &str, key: &str, value: &str) -> String {
    let (name, rest) = match base.split_once(':') {
        Some((n, r)) => (n, r),
        None => (base, ""),
    };
    let mut parts: Vec<String> = rest
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .filter(|p| p.split_once('=').map(|(k, _)| k.trim()) != Some(key))
        .map(str::to_string)
        .collect();
    parts.push(format!("{key}={value}"));
    format!("{name}:{}", parts.join(","))
}

/// `KEY=V1,V2,...` as the key and its values, or why not.
pub fn parse_vary(text: &str) -> Result<(String, Vec<String>), String> {
    let Some((key, values)) = text.split_once('=') else {
        return Err(format!("--vary `{text}`: expected KEY=V1,V2,..."));
    };
    let key = key.trim();
    let values: Vec<String> = values
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect();
    if key.is_empty() || values.is_empty() {
        return Err(format!("--vary `{text}`: expected KEY=V1,V2,..."));
    }
    Ok((key.to_string(), values))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code
    use super::*;

    #[test]
    fn settings_are_added_or_replaced() {
        assert_eq!(
            with_setting("quilt", "reclaim", "always"),
            "quilt:reclaim=always"
        );
        assert_eq!(
            with_setting("gmlake:frag_limit=32MiB", "reuse_limit", "4"),
            "gmlake:frag_limit=32MiB,reuse_limit=4"
        );
        assert_eq!(
            with_setting(
                "gmlake:frag_limit=32MiB,reuse_limit=2",
                "frag_limit",
                "64MiB"
            ),
            "gmlake:reuse_limit=2,frag_limit=64MiB"
        );
        assert_eq!(
            parse_vary("page_size=2MiB,20MiB").unwrap(),
            (
                "page_size".to_string(),
                vec!["2MiB".to_string(), "20MiB".to_string()]
            )
        );
        assert!(parse_vary("page_size").is_err());
        assert!(parse_vary("page_size=").is_err());
    }
}
