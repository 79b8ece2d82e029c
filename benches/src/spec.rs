//! Allocator specs on the command line: `NAME[:KEY=VALUE[,KEY=VALUE...]]`,
//! an allocator of the registry with some of its settings changed, so that
//! every knob is an experiment without writing Rust.
//!
//! ```text
//! quilt                               Quilt's default policy
//! quilt:reclaim=always                move cached pages before every growth
//! quilt:reclaim=cached_above,cached_permille=20
//! quilt:page_size=20MiB,candidates=1
//! gmlake:frag_limit=32MiB,reuse_limit=4
//! classic:max_split_size=256MiB,roundup_power2_divisions=4
//! ```
//!
//! Sizes take the usual units (`parse_size`). An unknown name or key, a bad
//! value, or a key that the chosen settings would ignore is a [`SpecError`]
//! that says what is valid.

use quilt_alloc::baselines::offset::OffsetConfig;
use quilt_alloc::baselines::CachingConfig;
use quilt_alloc::baselines::RoundupPower2Divisions;
use quilt_alloc::quilt::conf::{self, ConfError};
use quilt_alloc::quilt::QuiltConfig;

use crate::units::parse_size;

/// The allocators a spec may name, in report order.
pub const NAMES: [&str; 5] = ["quilt", "classic", "expandable", "gmlake", "offset"];

/// The keys of Quilt's placement and reclaim policy (the `quilt` and
/// `gmlake` presets).
pub const QUILT_KEYS: [&str; 11] = conf::KEYS;

/// The keys of Quilt's serving policies (map-ahead, recycling of growable
/// buffers, the offload tier), accepted beside [`QUILT_KEYS`]: the
/// `llm-serving-growable` workloads run them (`docs/serving.md`).
pub const QUILT_SERVING_KEYS: [&str; 5] = conf::SERVING_KEYS;

/// The keys of PyTorch's caching allocator (`classic`, `expandable`).
pub const CACHING_KEYS: [&str; 3] = [
    "max_split_size",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
];

/// The keys of the `offset` baseline.
pub const OFFSET_KEYS: [&str; 1] = ["max_allocs"];

/// An allocator and its settings, as a spec named them.
#[derive(Clone, Debug, PartialEq)]
pub enum Spec {
    /// Quilt's policy (the `quilt` and `gmlake` presets, changed or not);
    /// its name ([`QuiltConfig::name`]) is the preset's.
    Quilt(QuiltConfig),
    /// PyTorch's caching allocator (the `classic` and `expandable` presets,
    /// changed or not); its name ([`CachingConfig::name`]) is the preset's.
    Caching(CachingConfig),
    /// The `offset-allocator` crate over one arena.
    Offset(OffsetConfig),
}

/// A spec that cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// No allocator has this name.
    #[error("unknown allocator `{name}` (known: {})", NAMES.join(", "))]
    UnknownName {
        /// The name given.
        name: String,
    },
    /// The allocator has no such setting.
    #[error("`{name}` has no setting `{key}` (valid keys: {})", valid.join(", "))]
    UnknownKey {
        /// The allocator.
        name: String,
        /// The key given.
        key: String,
        /// Its valid keys.
        valid: Vec<&'static str>,
    },
    /// A value that does not parse or is out of range.
    #[error("`{key}={value}`: {reason}")]
    BadValue {
        /// The key.
        key: String,
        /// The value given.
        value: String,
        /// What a valid value is.
        reason: String,
    },
    /// Not `KEY=VALUE`, or a key given twice.
    #[error("`{part}`: {reason}")]
    Malformed {
        /// The part of the spec.
        part: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Settings that contradict each other, or one the others make dead.
    #[error("{0}")]
    Conflict(String),
}

/// One `KEY=VALUE` of a spec.
struct Setting<'a> {
    key: &'a str,
    value: &'a str,
}

impl Setting<'_> {
    fn bad(&self, reason: impl Into<String>) -> SpecError {
        SpecError::BadValue {
            key: self.key.to_string(),
            value: self.value.to_string(),
            reason: reason.into(),
        }
    }

    fn size(&self) -> Result<u64, SpecError> {
        parse_size(self.value).map_err(|e| self.bad(e.to_string()))
    }

    fn count(&self) -> Result<u64, SpecError> {
        self.value
            .parse::<u64>()
            .map_err(|_| self.bad("expected a whole number"))
    }
}

/// Split `text` into its name and settings.
fn split(text: &str) -> Result<(&str, Vec<Setting<'_>>), SpecError> {
    let (name, rest) = match text.split_once(':') {
        Some((n, r)) => (n.trim(), Some(r)),
        None => (text.trim(), None),
    };
    let mut settings: Vec<Setting<'_>> = Vec::new();
    for part in rest.into_iter().flat_map(|r| r.split(',')) {
        let Some((key, value)) = part.split_once('=') else {
            return Err(SpecError::Malformed {
                part: part.to_string(),
                reason: "expected KEY=VALUE",
            });
        };
        let (key, value) = (key.trim(), value.trim());
        if key.is_empty() || value.is_empty() {
            return Err(SpecError::Malformed {
                part: part.to_string(),
                reason: "expected KEY=VALUE",
            });
        }
        if settings.iter().any(|s| s.key == key) {
            return Err(SpecError::Malformed {
                part: part.to_string(),
                reason: "key given twice",
            });
        }
        settings.push(Setting { key, value });
    }
    Ok((name, settings))
}

fn unknown(name: &str, key: &str, valid: &[&'static str]) -> SpecError {
    SpecError::UnknownKey {
        name: name.to_string(),
        key: key.to_string(),
        valid: valid.to_vec(),
    }
}

/// Parse a spec.
pub fn parse(text: &str) -> Result<Spec, SpecError> {
    let (name, settings) = split(text)?;
    match name {
        "quilt" => quilt(name, QuiltConfig::default(), &settings).map(Spec::Quilt),
        "gmlake" => quilt(name, QuiltConfig::gmlake(), &settings).map(Spec::Quilt),
        "classic" | "expandable" => {
            let mut c = if name == "classic" {
                CachingConfig::classic()
            } else {
                CachingConfig::expandable()
            };
            caching(
                name,
                &settings,
                &mut c.max_split_size,
                &mut c.roundup_power2_divisions,
                &mut c.garbage_collection_threshold,
            )?;
            Ok(Spec::Caching(c))
        }
        "offset" => {
            let mut c = OffsetConfig::default();
            for s in &settings {
                match s.key {
                    "max_allocs" => {
                        let n = s.count()?;
                        let n = u32::try_from(n)
                            .ok()
                            .filter(|&n| n > 0)
                            .ok_or_else(|| s.bad("expected 1 to 4294967295"))?;
                        c.max_allocs = Some(n);
                    }
                    k => return Err(unknown(name, k, &OFFSET_KEYS)),
                }
            }
            Ok(Spec::Offset(c))
        }
        _ => Err(SpecError::UnknownName {
            name: name.to_string(),
        }),
    }
}

/// The settings of PyTorch's caching allocator.
fn caching(
    name: &str,
    settings: &[Setting<'_>],
    max_split_size: &mut Option<u64>,
    divisions: &mut RoundupPower2Divisions,
    gc_threshold: &mut Option<f64>,
) -> Result<(), SpecError> {
    for s in settings {
        match s.key {
            "max_split_size" => *max_split_size = Some(s.size()?),
            "roundup_power2_divisions" => {
                let n = s.count()?;
                if n != 0 && !n.is_power_of_two() {
                    return Err(s.bad("expected 0 or a power of two"));
                }
                *divisions = RoundupPower2Divisions::uniform(n);
            }
            "garbage_collection_threshold" => {
                let t: f64 = s
                    .value
                    .parse()
                    .map_err(|_| s.bad("expected a number in (0, 1)"))?;
                if !(t > 0.0 && t < 1.0) {
                    return Err(s.bad("expected a number in (0, 1)"));
                }
                *gc_threshold = Some(t);
            }
            k => return Err(unknown(name, k, &CACHING_KEYS)),
        }
    }
    Ok(())
}

/// Quilt's policy from `base` with `settings` applied (the vocabulary of
/// [`quilt_alloc::quilt::conf`]).
fn quilt(
    name: &str,
    base: QuiltConfig,
    settings: &[Setting<'_>],
) -> Result<QuiltConfig, SpecError> {
    let pairs: Vec<(&str, &str)> = settings.iter().map(|s| (s.key, s.value)).collect();
    conf::apply(base, &pairs).map_err(|e| match e {
        ConfError::UnknownKey { key, valid } => SpecError::UnknownKey {
            name: name.to_string(),
            key,
            valid,
        },
        ConfError::BadValue { key, value, reason } => SpecError::BadValue { key, value, reason },
        ConfError::Repeated(key) => SpecError::Malformed {
            part: key,
            reason: "key given twice",
        },
        ConfError::Conflict(m) => SpecError::Conflict(m),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code
    use super::*;
    use quilt_alloc::quilt::{GrowthPolicy, PageSize, Placement, ReclaimPolicy};

    fn quilt_of(text: &str) -> QuiltConfig {
        match parse(text).unwrap() {
            Spec::Quilt(c) => c,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_bare_name_is_the_default_configuration() {
        assert_eq!(parse("quilt").unwrap(), Spec::Quilt(QuiltConfig::default()));
        assert_eq!(parse("gmlake").unwrap(), Spec::Quilt(QuiltConfig::gmlake()));
        assert_eq!(
            parse("classic").unwrap(),
            Spec::Caching(CachingConfig::classic())
        );
        assert_eq!(
            parse("offset").unwrap(),
            Spec::Offset(OffsetConfig::default())
        );
    }

    #[test]
    fn settings_change_the_configuration() {
        let c = quilt_of("quilt:reclaim=cached_above,cached_permille=20,page_size=20MiB");
        assert_eq!(c.reclaim, ReclaimPolicy::CachedAbove(20));
        assert_eq!(c.pool.page_size, PageSize::Bytes(20 << 20));
        assert_eq!(
            quilt_of("quilt:reclaim=always").reclaim,
            ReclaimPolicy::Always
        );
        assert_eq!(
            quilt_of("quilt:reclaim=idle_for,idle_ops=500").reclaim,
            ReclaimPolicy::IdleFor(500)
        );
        let g = quilt_of("gmlake:frag_limit=32MiB,reuse_limit=4");
        assert_eq!(
            g.placement,
            Placement::GmlakeLimits {
                frag_limit: 32 << 20,
                reuse_limit: 4
            }
        );
        assert_eq!(g.name, "gmlake");
        assert_eq!(
            quilt_of("quilt:growth_divisor=0").pool.growth,
            GrowthPolicy::exact()
        );
        match parse("classic:max_split_size=256MiB,roundup_power2_divisions=4").unwrap() {
            Spec::Caching(c) => {
                assert_eq!(c.max_split_size, Some(256 << 20));
                assert_eq!(
                    c.roundup_power2_divisions,
                    RoundupPower2Divisions::uniform(4)
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_serving_keys_are_quilt_keys_too() {
        let c = quilt_of("quilt:map_ahead_mode=inline,map_ahead_pages=2,recycle_buffers=4");
        assert_eq!(c.map_ahead.pages, 2);
        assert_eq!(c.map_ahead.mode, quilt_alloc::quilt::AheadMode::Inline);
        assert_eq!(c.recycle.max_buffers, 4);
        let e = parse("quilt:colour=blue").unwrap_err().to_string();
        for key in QUILT_KEYS.iter().chain(QUILT_SERVING_KEYS.iter()) {
            assert!(e.contains(key), "{key} not listed: {e}");
        }
    }

    #[test]
    fn bad_specs_say_what_is_valid() {
        let e = parse("quilt:colour=blue").unwrap_err().to_string();
        assert!(
            e.contains("colour") && e.contains("reclaim") && e.contains("page_size"),
            "{e}"
        );
        let e = parse("quilt:reclaim=sometimes").unwrap_err().to_string();
        assert!(e.contains("when_full") && e.contains("always"), "{e}");
        let e = parse("nope").unwrap_err().to_string();
        assert!(e.contains("quilt") && e.contains("classic"), "{e}");
        assert!(matches!(
            parse("quilt:page_size=lots"),
            Err(SpecError::BadValue { .. })
        ));
        assert!(matches!(
            parse("quilt:reclaim"),
            Err(SpecError::Malformed { .. })
        ));
        assert!(matches!(
            parse("quilt:candidates=2,candidates=3"),
            Err(SpecError::Malformed { .. })
        ));
        assert!(matches!(
            parse("quilt:candidates=0"),
            Err(SpecError::BadValue { .. })
        ));
        assert!(matches!(
            parse("offset:reclaim=always"),
            Err(SpecError::UnknownKey { .. })
        ));
    }

    #[test]
    fn dead_knobs_are_refused() {
        for text in [
            "quilt:cached_permille=20",
            "quilt:reclaim=always,idle_ops=3",
            "quilt:reuse_limit=4",
            "gmlake:candidates=4",
            "gmlake:frag_limit=0,reuse_limit=4",
        ] {
            assert!(matches!(parse(text), Err(SpecError::Conflict(_))), "{text}");
        }
    }
}
