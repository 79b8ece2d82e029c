//! `QUILT_ALLOC_CONF`: comma-separated `key:value` pairs, in the style of
//! `PYTORCH_CUDA_ALLOC_CONF`, read once at the library's first use, by the
//! one settings parser, [`quilt_alloc::settings::library`] (its table lists
//! every key; its front end [`FrontEnd::Library`]).
//!
//! | key | value | default |
//! |---|---|---|
//! | `backend` | `cuda`, `host` (real host memory, for tests and trying it without a GPU), `sim` (bookkeeping only: never dereference its pointers) | `cuda` |
//! | `capacity` | bytes of the `host` or `sim` device, with units (`2GiB`) | host 1 GiB, sim 80 GiB |
//! | `memory_fraction` | the share of each device Quilt may hold, in (0, 1] | 1 |
//! | `memory_limit` | the bytes of each device Quilt may hold (`2GiB`); not with `memory_fraction` | the device |
//!
//! and every key of Quilt's policy (`page_size`, `reclaim`,
//! `cached_permille`, ...: [`quilt_alloc::settings::QUILT_FRONT_KEYS`]). An
//! unknown key or a bad value is an error naming the valid keys; the library
//! then refuses to allocate. `quilt_set_memory_fraction` replaces the limit
//! of `memory_fraction` or `memory_limit`.

use quilt_alloc::settings;
pub use quilt_alloc::settings::{Backend, FrontEnd, LibrarySettings as LibraryConf};

/// The library's valid keys: its own (`backend`, `capacity`), Quilt's, and
/// the memory limit's.
pub const VALID_KEYS: &[&str] = &settings::LIBRARY_FRONT_KEYS;

/// A memory fraction set at run time (`quilt_set_memory_fraction`, torch's
/// `set_per_process_memory_fraction`), in [0, 1] as torch takes it (0: no
/// memory may be held), or why not. `QUILT_ALLOC_CONF`'s `memory_fraction`
/// stays in (0, 1].
pub fn check_fraction(f: f64) -> Result<f64, String> {
    if f == 0.0 {
        return Ok(0.0);
    }
    settings::check_fraction(f)
        .map_err(|e| format!("{e}; set_per_process_memory_fraction also takes 0"))
}

/// Parse `QUILT_ALLOC_CONF`'s text (empty: every default). The error starts
/// with `QUILT_ALLOC_CONF="..."` (the Python package tells configuration
/// errors by it).
pub fn parse(text: &str) -> Result<LibraryConf, String> {
    settings::library(text).map_err(|e| format!("QUILT_ALLOC_CONF=\"{text}\": {e}"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code
    use super::*;
    use quilt_alloc::quilt::{MemoryLimit, QuiltConfig, ReclaimPolicy};

    #[test]
    fn the_defaults_and_every_key() {
        let c = parse("").unwrap();
        assert_eq!(c.backend, Backend::Cuda);
        assert_eq!(c.quilt, QuiltConfig::default());
        let c = parse(" backend:host , capacity:2GiB,memory_fraction:0.5,reclaim:always").unwrap();
        assert_eq!(
            (c.backend, c.capacity, c.quilt.pool.limit),
            (Backend::Host, 2 << 30, MemoryLimit::Fraction(0.5))
        );
        assert_eq!(c.quilt.reclaim, ReclaimPolicy::Always);
        assert_eq!(parse("backend:sim").unwrap().capacity, 80 << 30);
        let c = parse("backend:host,capacity:8GiB,memory_limit:2GiB").unwrap();
        assert_eq!(c.quilt.pool.limit, MemoryLimit::Bytes(2 << 30));
    }

    #[test]
    fn bad_configurations_name_the_valid_keys() {
        for (text, expect) in [
            ("colour:blue", "backend, capacity"),
            ("colour:blue", "memory_fraction, memory_limit"),
            ("colour:blue", "page_size"),
            ("backend:tpu", "cuda, host or sim"),
            ("backend:host,capacity:lots", "bad size"),
            ("backend:host,capacity:0", "above 0"),
            ("memory_fraction:1.5", "(0, 1]"),
            ("memory_fraction:0.5,memory_limit:1GiB", "give one"),
            ("reclaim:sometimes", "when_full"),
            ("backend:host,backend:sim", "twice"),
            ("capacity:1GiB", "host and sim"),
            ("backend", "key:value"),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(expect), "{text}: {e}");
            assert!(e.starts_with("QUILT_ALLOC_CONF=\""), "{e}");
        }
    }

    #[test]
    fn a_fraction_set_at_run_time_is_in_0_to_1_as_torch_takes_it() {
        for f in [0.0, -0.0, 1e-9, 0.5, 1.0] {
            assert_eq!(check_fraction(f).unwrap(), f.abs());
        }
        for f in [-0.1, 1.0001, f64::NAN, f64::INFINITY] {
            let e = check_fraction(f).unwrap_err();
            assert!(e.contains("memory_fraction") && e.contains("0"), "{f}: {e}");
        }
        assert!(
            parse("memory_fraction:0").is_err(),
            "the configuration's stays in (0, 1]"
        );
    }

    #[test]
    fn the_library_takes_every_key_of_quilt_s_configuration() {
        for key in settings::QUILT_FRONT_KEYS {
            assert!(VALID_KEYS.contains(&key), "{key}");
        }
        for key in ["backend", "capacity", "memory_limit", "memory_fraction"] {
            assert!(FrontEnd::Library.takes(key), "{key}");
        }
    }

    /// The library and a Rust program's `QUILT_ALLOC_CONF`
    /// (`settings::parse`) read every key of Quilt's configuration alike,
    /// and refuse every other key of the vocabulary but the library's own
    /// with the same error.
    #[test]
    fn the_library_and_from_env_agree_on_every_key() {
        for k in &settings::VOCABULARY {
            let text = format!("{}:{}", k.name, k.example);
            let lib = settings::library(&text);
            let rust = settings::parse(QuiltConfig::default(), &text);
            match (
                FrontEnd::Quilt.takes(k.name),
                FrontEnd::Library.takes(k.name),
            ) {
                (true, true) => assert_eq!(
                    lib.map(|l| l.quilt).map_err(|e| e.to_string()),
                    rust.map_err(|e| e.to_string()),
                    "{}",
                    k.name
                ),
                (false, true) => {
                    // The library's own keys (`capacity` needs a host or sim backend).
                    assert!(matches!(rust, Err(settings::SettingsError::NotHere { .. })));
                    let with_host = match k.name {
                        "backend" => text.clone(),
                        _ => format!("backend:host,{text}"),
                    };
                    assert!(parse(&with_host).is_ok(), "{with_host}");
                }
                (_, false) => {
                    let (lib, rust) = (lib.unwrap_err(), rust.unwrap_err());
                    assert!(
                        matches!(lib, settings::SettingsError::NotHere { .. }),
                        "{lib}"
                    );
                    assert!(
                        matches!(rust, settings::SettingsError::NotHere { .. }),
                        "{rust}"
                    );
                    assert!(parse(&text).unwrap_err().contains(&lib.to_string()));
                }
            }
        }
    }
}
