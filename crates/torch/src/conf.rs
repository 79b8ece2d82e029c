//! `QUILT_ALLOC_CONF`: comma-separated `key:value` pairs, in the style of
//! `PYTORCH_CUDA_ALLOC_CONF`, read once at the library's first use.
//!
//! | key | value | default |
//! |---|---|---|
//! | `backend` | `cuda`, `host` (real host memory, for tests and trying it without a GPU), `sim` (bookkeeping only: never dereference its pointers) | `cuda` |
//! | `capacity` | bytes of the `host` or `sim` device, with units (`2GiB`) | host 1 GiB, sim 80 GiB |
//! | `memory_fraction` | the share of each device Quilt may hold, in (0, 1] | 1 |
//!
//! and every key of Quilt's policy ([`quilt_alloc::quilt::conf`]: `page_size`,
//! `reclaim`, `cached_permille`, ...). An unknown key or a bad value is an
//! error naming the valid keys; the library then refuses to allocate.

use quilt_alloc::quilt::{conf, QuiltConfig};
use quilt_alloc::units::parse_size;

/// The library's own keys (Quilt's policy keys come after them).
pub const LIBRARY_KEYS: [&str; 3] = ["backend", "capacity", "memory_fraction"];

/// Where the memory comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The GPU, through CUDA's driver.
    Cuda,
    /// Host memory behind the same virtual-memory calls (memfd + mmap).
    Host,
    /// The simulated device: addresses and bookkeeping, no memory.
    Sim,
}

impl Backend {
    /// The name used in `QUILT_ALLOC_CONF` and in the stats.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cuda => "cuda",
            Backend::Host => "host",
            Backend::Sim => "sim",
        }
    }
}

/// The parsed configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct LibraryConf {
    /// The backend of every device.
    pub backend: Backend,
    /// Capacity of a `host` or `sim` device, in bytes.
    pub capacity: u64,
    /// The share of each device the allocator may hold.
    pub memory_fraction: Option<f64>,
    /// Quilt's policy.
    pub quilt: QuiltConfig,
}

fn all_keys() -> String {
    LIBRARY_KEYS
        .iter()
        .chain(conf::KEYS.iter())
        .copied()
        .collect::<Vec<_>>()
        .join(", ")
}

/// A memory fraction in (0, 1], or why not.
pub fn check_fraction(f: f64) -> Result<f64, String> {
    if f > 0.0 && f <= 1.0 {
        Ok(f)
    } else {
        Err(format!("memory fraction {f} is not in (0, 1]"))
    }
}

/// Parse `QUILT_ALLOC_CONF`'s text (empty: every default).
pub fn parse(text: &str) -> Result<LibraryConf, String> {
    let fail = |m: String| Err(format!("QUILT_ALLOC_CONF=\"{text}\": {m}"));
    let mut backend = Backend::Cuda;
    let mut capacity: Option<u64> = None;
    let mut memory_fraction = None;
    let mut policy: Vec<(&str, &str)> = Vec::new();
    let mut seen: Vec<&str> = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((key, value)) = part.split_once(':') else {
            return fail(format!(
                "`{part}` is not key:value (valid keys: {})",
                all_keys()
            ));
        };
        let (key, value) = (key.trim(), value.trim());
        if seen.contains(&key) {
            return fail(format!("`{key}` is given twice"));
        }
        seen.push(key);
        match key {
            "backend" => {
                backend = match value {
                    "cuda" => Backend::Cuda,
                    "host" => Backend::Host,
                    "sim" => Backend::Sim,
                    _ => return fail(format!("backend `{value}`: expected cuda, host or sim")),
                }
            }
            "capacity" => match parse_size(value) {
                Ok(0) => return fail("capacity must be more than 0 bytes".into()),
                Ok(b) => capacity = Some(b),
                Err(e) => return fail(e.to_string()),
            },
            "memory_fraction" => match value.parse::<f64>().map_err(|e| e.to_string()) {
                Ok(f) => match check_fraction(f) {
                    Ok(f) => memory_fraction = Some(f),
                    Err(e) => return fail(e),
                },
                Err(e) => return fail(format!("memory_fraction `{value}`: {e}")),
            },
            k if conf::is_key(k) => policy.push((k, value)),
            k => return fail(format!("unknown key `{k}` (valid keys: {})", all_keys())),
        }
    }
    let quilt = match conf::apply(QuiltConfig::default(), &policy) {
        Ok(q) => q,
        Err(e) => return fail(e.to_string()),
    };
    if capacity.is_some() && backend == Backend::Cuda {
        return fail("capacity applies only to the host and sim backends".into());
    }
    let capacity = capacity.unwrap_or(match backend {
        Backend::Sim => 80 << 30,
        _ => 1 << 30,
    });
    Ok(LibraryConf {
        backend,
        capacity,
        memory_fraction,
        quilt,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code
    use super::*;
    use quilt_alloc::quilt::ReclaimPolicy;

    #[test]
    fn the_defaults_and_every_key() {
        let c = parse("").unwrap();
        assert_eq!(c.backend, Backend::Cuda);
        assert_eq!(c.quilt, QuiltConfig::default());
        let c = parse(" backend:host , capacity:2GiB,memory_fraction:0.5,reclaim:always").unwrap();
        assert_eq!(
            (c.backend, c.capacity, c.memory_fraction),
            (Backend::Host, 2 << 30, Some(0.5))
        );
        assert_eq!(c.quilt.reclaim, ReclaimPolicy::Always);
        assert_eq!(parse("backend:sim").unwrap().capacity, 80 << 30);
    }

    #[test]
    fn bad_configurations_name_the_valid_keys() {
        for (text, expect) in [
            (
                "colour:blue",
                "backend, capacity, memory_fraction, page_size",
            ),
            ("backend:tpu", "cuda, host or sim"),
            ("backend:host,capacity:lots", "bad size"),
            ("backend:host,capacity:0", "more than 0"),
            ("memory_fraction:1.5", "not in (0, 1]"),
            ("reclaim:sometimes", "when_full"),
            ("backend:host,backend:sim", "twice"),
            ("capacity:1GiB", "host and sim"),
            ("backend", "key:value"),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(expect), "{text}: {e}");
        }
    }
}
