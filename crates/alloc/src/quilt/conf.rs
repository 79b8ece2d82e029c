//! Quilt's policy from text: `KEY` / `VALUE` settings applied to a
//! [`QuiltConfig`], one vocabulary for every front end (`quilt-bench`'s
//! `--allocator quilt:KEY=VALUE,...`, and `QUILT_ALLOC_CONF`'s `KEY:VALUE,...`
//! for Rust programs ([`from_env`]) and in the PyTorch library).
//!
//! | key | value | sets |
//! |---|---|---|
//! | `page_size` | a size (`20MiB`), a multiple of the granularity | [`PoolConfig::page_size`](quilt_pool::PoolConfig) |
//! | `reclaim` | `when_full`, `always`, `cached_above`, `idle_for` | [`QuiltConfig::reclaim`] |
//! | `cached_permille` | 0 to 1000, with `reclaim=cached_above` (default 50) | its bound |
//! | `idle_ops` | operations, with `reclaim=idle_for` (default 10000) | its age |
//! | `candidates` | 1 to 4096, with best-fit placement (`frag_limit=0`) | [`Placement::BestFit`]'s `candidates` |
//! | `shared_arena` | `true` / `false` | [`ArenaLayout::sharing`](super::ArenaLayout::sharing): [`ArenaSharing::Shared`] / [`ArenaSharing::PerStream`] |
//! | `small_arena` | `true` / `false` | [`ArenaLayout::small`](super::ArenaLayout::small): [`SmallBlocks::PYTORCH`] (up to 1 MiB) / [`SmallBlocks::Mixed`] |
//! | `frag_limit` | a size; 0 stitches every request ([`Placement::BestFit`]) | [`Placement::GmlakeLimits`]'s `frag_limit` |
//! | `reuse_limit` | a whole number (0: no limit), with a `frag_limit` above 0 | [`Placement::GmlakeLimits`]'s `reuse_limit` |
//! | `growth_divisor` | pages held per page of margin; 0: exactly what is needed | [`GrowthPolicy`] |
//! | `access_per_map` | `true` / `false` | [`QuiltConfig::access`]: [`AccessGranularity::PerPage`] / [`AccessGranularity::PerRange`] |
//! | `map_ahead_pages` | the most pages mapped past each growable buffer's end, following its last step (0: none) | [`QuiltConfig::map_ahead`] |
//! | `map_ahead_mode` | `background`, `inline`, `manual` | its [`AheadMode`] |
//! | `map_ahead_permille` | 0 to 1000: grow the pool for pages ahead while it is below this share of its limit (0: free pool pages only) | its bound |
//! | `recycle_buffers` | released growable ranges kept (0: none) | [`QuiltConfig::recycle`] |
//! | `offload_tier` | `off`, `offloadable_tags` | [`QuiltConfig::offload_tier`] |
//!
//! | `peer_access` | devices joined by `+` (`1+2+3`), or `none` | [`QuiltConfig::peer_access`] |
//!
//! The serving policies are [`SERVING_KEYS`] (`docs/serving.md`); the
//! devices, [`DEVICE_KEYS`] (`docs/multi-gpu.md`).
//!
//! A key the other settings would ignore (`cached_permille` without
//! `reclaim=cached_above`, `reuse_limit` or `candidates` with the wrong
//! placement, ...) is refused rather than silently dead. The configuration's
//! name stays the base preset's.
//!
//! `frag_limit` chooses the placement: 0 is [`Placement::BestFit`] (its
//! `candidates` kept from the base, or 1 when the base had GMLake's limits),
//! above 0 is [`Placement::GmlakeLimits`] (its `reuse_limit` kept from the
//! base, or 0 when the base had best fit).

use quilt_pool::{GrowthPolicy, MemoryLimit, PageSize};
use quilt_vmm::DeviceSet;

use super::config::{
    AccessGranularity, ArenaSharing, Placement, QuiltConfig, ReclaimPolicy, SmallBlocks,
};
use super::config::{AheadMode, OffloadTier, Recycle};
use crate::units::parse_size;

/// Quilt's placement and reclaim keys, in the table's order (the serving
/// policies' are [`SERVING_KEYS`]).
pub const KEYS: [&str; 11] = [
    "page_size",
    "reclaim",
    "cached_permille",
    "idle_ops",
    "candidates",
    "shared_arena",
    "small_arena",
    "frag_limit",
    "reuse_limit",
    "growth_divisor",
    "access_per_map",
];

/// The serving policies' keys (growable buffers, the offload tier), beside [`KEYS`].
pub const SERVING_KEYS: [&str; 5] = [
    "map_ahead_pages",
    "map_ahead_mode",
    "map_ahead_permille",
    "recycle_buffers",
    "offload_tier",
];

/// The keys of the devices a mapping is accessible from, beside [`KEYS`].
pub const DEVICE_KEYS: [&str; 1] = ["peer_access"];

/// Every key [`apply`] knows: [`KEYS`], [`SERVING_KEYS`], [`DEVICE_KEYS`].
pub fn all_keys() -> Vec<&'static str> {
    KEYS.iter()
        .chain(SERVING_KEYS.iter())
        .chain(DEVICE_KEYS.iter())
        .copied()
        .collect()
}

/// The values of `reclaim`.
pub const RECLAIM_VALUES: [&str; 4] = ["when_full", "always", "cached_above", "idle_for"];

/// A setting that cannot be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfError {
    /// No such key.
    #[error("no setting `{key}` (valid keys: {})", valid.join(", "))]
    UnknownKey {
        /// The key given.
        key: String,
        /// The valid keys.
        valid: Vec<&'static str>,
    },
    /// A value that does not parse or is out of range.
    #[error("`{key}` = `{value}`: {reason}")]
    BadValue {
        /// The key.
        key: String,
        /// The value given.
        value: String,
        /// What a valid value is.
        reason: String,
    },
    /// A key given twice.
    #[error("`{0}` is given twice")]
    Repeated(String),
    /// A setting the others make dead, or that contradicts them.
    #[error("{0}")]
    Conflict(String),
}

fn bad(key: &str, value: &str, reason: impl Into<String>) -> ConfError {
    ConfError::BadValue {
        key: key.to_string(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

fn size(key: &str, value: &str) -> Result<u64, ConfError> {
    parse_size(value).map_err(|e| bad(key, value, e.to_string()))
}

fn count(key: &str, value: &str) -> Result<u64, ConfError> {
    value
        .parse::<u64>()
        .map_err(|_| bad(key, value, "expected a whole number"))
}

fn flag(key: &str, value: &str) -> Result<bool, ConfError> {
    match value {
        "true" | "on" | "1" => Ok(true),
        "false" | "off" | "0" => Ok(false),
        _ => Err(bad(key, value, "expected true or false")),
    }
}

/// The peer devices of `peer_access`: ordinals joined by `+`, or `none`.
fn device_set(key: &str, value: &str) -> Result<DeviceSet, ConfError> {
    if value == "none" {
        return Ok(DeviceSet::EMPTY);
    }
    let mut set = DeviceSet::EMPTY;
    for part in value.split('+') {
        let d: u32 = part.trim().parse().map_err(|_| {
            bad(
                key,
                value,
                "expected device ordinals joined by + (1+2+3), or none",
            )
        })?;
        if set.contains(d) {
            return Err(bad(key, value, format!("device {d} is named twice")));
        }
        set = set.with(d).ok_or_else(|| {
            bad(
                key,
                value,
                format!("device {d}: ordinals go up to {}", DeviceSet::CAPACITY - 1),
            )
        })?;
    }
    Ok(set)
}

/// True when `key` is one of Quilt's policy keys ([`KEYS`], [`SERVING_KEYS`]
/// or [`DEVICE_KEYS`]).
pub fn is_key(key: &str) -> bool {
    KEYS.contains(&key) || SERVING_KEYS.contains(&key) || DEVICE_KEYS.contains(&key)
}

/// `base` with `settings` (key, value) applied, checked; `base` itself is
/// never changed.
///
/// ```
/// use quilt_alloc::quilt::{conf, QuiltConfig, ReclaimPolicy};
///
/// let c = conf::apply(QuiltConfig::default(), &[("reclaim", "cached_above"), ("cached_permille", "20")])?;
/// assert_eq!(c.reclaim, ReclaimPolicy::CachedAbove(20));
/// let s = conf::apply(QuiltConfig::default(), &[("map_ahead_pages", "2"), ("map_ahead_mode", "inline")])?;
/// assert_eq!((s.map_ahead.pages, s.map_ahead.mode), (2, quilt_alloc::quilt::AheadMode::Inline));
/// assert!(conf::apply(QuiltConfig::default(), &[("colour", "blue")]).is_err());
/// # Ok::<(), quilt_alloc::quilt::conf::ConfError>(())
/// ```
pub fn apply(base: QuiltConfig, settings: &[(&str, &str)]) -> Result<QuiltConfig, ConfError> {
    let mut c = base;
    let mut reclaim: Option<&str> = None;
    let mut permille: Option<u64> = None;
    let mut idle: Option<u64> = None;
    let mut frag: Option<u64> = None;
    let mut reuse: Option<u64> = None;
    let mut candidates: Option<usize> = None;
    for (i, &(key, value)) in settings.iter().enumerate() {
        if settings[..i].iter().any(|&(k, _)| k == key) {
            return Err(ConfError::Repeated(key.to_string()));
        }
        match key {
            "page_size" => {
                let b = size(key, value)?;
                if b == 0 {
                    return Err(bad(key, value, "expected a multiple of the granularity"));
                }
                c.pool.page_size = PageSize::Bytes(b);
            }
            "reclaim" => {
                if !RECLAIM_VALUES.contains(&value) {
                    return Err(bad(
                        key,
                        value,
                        format!("expected one of {}", RECLAIM_VALUES.join(", ")),
                    ));
                }
                reclaim = Some(value);
            }
            "cached_permille" => {
                let n = count(key, value)?;
                if n > 1000 {
                    return Err(bad(
                        key,
                        value,
                        "expected 0 to 1000 (thousandths of the pool)",
                    ));
                }
                permille = Some(n);
            }
            "idle_ops" => idle = Some(count(key, value)?),
            "candidates" => {
                let n = count(key, value)?;
                candidates = Some(
                    usize::try_from(n)
                        .ok()
                        .filter(|n| (1..=4096).contains(n))
                        .ok_or_else(|| bad(key, value, "expected 1 to 4096"))?,
                );
            }
            "shared_arena" => {
                c.layout.sharing = if flag(key, value)? {
                    ArenaSharing::Shared
                } else {
                    ArenaSharing::PerStream
                }
            }
            "small_arena" => {
                c.layout.small = if flag(key, value)? {
                    SmallBlocks::PYTORCH
                } else {
                    SmallBlocks::Mixed
                }
            }
            "frag_limit" => frag = Some(size(key, value)?),
            "reuse_limit" => reuse = Some(count(key, value)?),
            "growth_divisor" => {
                let d = count(key, value)?;
                c.pool.growth = if d == 0 {
                    GrowthPolicy::exact()
                } else {
                    GrowthPolicy {
                        ahead_divisor: d,
                        ..GrowthPolicy::default()
                    }
                };
            }
            "access_per_map" => {
                c.access = if flag(key, value)? {
                    AccessGranularity::PerPage
                } else {
                    AccessGranularity::PerRange
                }
            }
            "peer_access" => c.peer_access = device_set(key, value)?,
            "map_ahead_pages" => c.map_ahead.pages = count(key, value)?,
            "map_ahead_mode" => {
                c.map_ahead.mode = match value {
                    "background" => AheadMode::Background,
                    "inline" => AheadMode::Inline,
                    "manual" => AheadMode::Manual,
                    _ => return Err(bad(key, value, "expected background, inline or manual")),
                }
            }
            "map_ahead_permille" => {
                let n = count(key, value)?;
                if n > 1000 {
                    return Err(bad(
                        key,
                        value,
                        "expected 0 to 1000 (thousandths of the limit)",
                    ));
                }
                c.map_ahead.below_per_mille = n;
            }
            "recycle_buffers" => {
                c.recycle = Recycle {
                    max_buffers: usize::try_from(count(key, value)?)
                        .map_err(|_| bad(key, value, "too large"))?,
                }
            }
            "offload_tier" => {
                c.offload_tier = match value {
                    "off" => OffloadTier::Off,
                    "offloadable_tags" => OffloadTier::OffloadableTags,
                    _ => return Err(bad(key, value, "expected off or offloadable_tags")),
                }
            }
            _ => {
                return Err(ConfError::UnknownKey {
                    key: key.to_string(),
                    valid: all_keys(),
                })
            }
        }
    }
    match reclaim {
        Some("when_full") => c.reclaim = ReclaimPolicy::WhenFull,
        Some("always") => c.reclaim = ReclaimPolicy::Always,
        Some("cached_above") => c.reclaim = ReclaimPolicy::CachedAbove(permille.unwrap_or(50)),
        Some("idle_for") => c.reclaim = ReclaimPolicy::IdleFor(idle.unwrap_or(10_000)),
        _ => {}
    }
    if permille.is_some() && !matches!(c.reclaim, ReclaimPolicy::CachedAbove(_)) {
        return Err(ConfError::Conflict(
            "cached_permille applies only with reclaim=cached_above".into(),
        ));
    }
    if idle.is_some() && !matches!(c.reclaim, ReclaimPolicy::IdleFor(_)) {
        return Err(ConfError::Conflict(
            "idle_ops applies only with reclaim=idle_for".into(),
        ));
    }
    c.placement = placement(c.placement, frag, reuse, candidates)?;
    Ok(c)
}

/// The placement `frag_limit`, `reuse_limit` and `candidates` (each if given)
/// make of `base`.
fn placement(
    base: Placement,
    frag: Option<u64>,
    reuse: Option<u64>,
    candidates: Option<usize>,
) -> Result<Placement, ConfError> {
    let (base_frag, base_reuse, base_candidates) = match base {
        Placement::BestFit { candidates } => (0, 0, candidates),
        Placement::GmlakeLimits {
            frag_limit,
            reuse_limit,
        } => (frag_limit, reuse_limit, 1),
    };
    match frag.unwrap_or(base_frag) {
        0 if reuse.is_some() => Err(ConfError::Conflict(
            "reuse_limit applies only with a frag_limit above 0 (GMLake's limits: frag_limit, reuse_limit); with frag_limit=0 every request is stitched (best fit: candidates)"
                .into(),
        )),
        0 => Ok(Placement::BestFit {
            candidates: candidates.unwrap_or(base_candidates),
        }),
        _ if candidates.is_some() => Err(ConfError::Conflict(
            "candidates applies only with frag_limit=0 (best fit: candidates); with a frag_limit above 0 (GMLake's limits: frag_limit, reuse_limit) placement is plain best fit"
                .into(),
        )),
        frag_limit => Ok(Placement::GmlakeLimits {
            frag_limit,
            reuse_limit: reuse.unwrap_or(base_reuse),
        }),
    }
}

/// The keys of [`parse`] beyond Quilt's policy keys.
pub const LIMIT_KEYS: [&str; 2] = ["memory_fraction", "memory_limit"];

/// A configuration from text in `QUILT_ALLOC_CONF`'s grammar (the PyTorch
/// library's too): comma-separated `key:value` pairs, Quilt's policy keys
/// ([`KEYS`]) and a memory limit, `memory_fraction` (0 < f <= 1) or
/// `memory_limit` (a size), applied to `base`. An unknown key names the
/// valid ones.
///
/// ```
/// use quilt_alloc::quilt::{conf, MemoryLimit, QuiltConfig, ReclaimPolicy};
///
/// let c = conf::parse(QuiltConfig::default(), "reclaim:always, memory_limit:8GiB")?;
/// assert_eq!(c.reclaim, ReclaimPolicy::Always);
/// assert_eq!(c.pool.limit, MemoryLimit::Bytes(8 << 30));
/// assert!(conf::parse(QuiltConfig::default(), "colour:blue").is_err());
/// # Ok::<(), quilt_alloc::quilt::conf::ConfError>(())
/// ```
pub fn parse(base: QuiltConfig, text: &str) -> Result<QuiltConfig, ConfError> {
    let mut pairs: Vec<(&str, &str)> = Vec::new();
    let mut limit: Option<MemoryLimit> = None;
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((key, value)) = part.split_once(':') else {
            return Err(bad(part, "", "expected key:value"));
        };
        let (key, value) = (key.trim(), value.trim());
        match key {
            "memory_fraction" | "memory_limit" if limit.is_some() => {
                return Err(ConfError::Conflict(
                    "give one of memory_fraction and memory_limit".into(),
                ))
            }
            "memory_fraction" => {
                let f: f64 = value
                    .parse()
                    .map_err(|_| bad(key, value, "expected a number in (0, 1]"))?;
                if !(f > 0.0 && f <= 1.0) {
                    return Err(bad(key, value, "expected a number in (0, 1]"));
                }
                limit = Some(MemoryLimit::Fraction(f));
            }
            "memory_limit" => limit = Some(MemoryLimit::Bytes(size(key, value)?)),
            k if is_key(k) => pairs.push((k, value)),
            k => {
                return Err(ConfError::UnknownKey {
                    key: k.to_string(),
                    valid: all_keys().into_iter().chain(LIMIT_KEYS).collect(),
                })
            }
        }
    }
    let c = apply(base, &pairs)?;
    Ok(match limit {
        Some(l) => c.with_limit(l),
        None => c,
    })
}

/// [`parse`] of the environment variable `QUILT_ALLOC_CONF` (the default
/// configuration when it is unset).
pub fn from_env() -> Result<QuiltConfig, ConfError> {
    parse(
        QuiltConfig::default(),
        &std::env::var("QUILT_ALLOC_CONF").unwrap_or_default(),
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code
    use super::*;

    #[test]
    fn text_in_alloc_conf_grammar() {
        let c = parse(QuiltConfig::default(), "page_size:4MiB,memory_fraction:0.5").unwrap();
        assert_eq!(c.pool.page_size, PageSize::Bytes(4 << 20));
        assert_eq!(c.pool.limit, MemoryLimit::Fraction(0.5));
        assert_eq!(
            parse(QuiltConfig::default(), " ").unwrap(),
            QuiltConfig::default()
        );
        let e = parse(QuiltConfig::default(), "colour:blue")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("memory_fraction, memory_limit") && e.contains("reclaim"),
            "{e}"
        );
        for bad_text in [
            "memory_fraction:2",
            "memory_limit:lots",
            "memory_limit:1GiB,memory_fraction:0.5",
            "reclaim",
            "reclaim:often",
        ] {
            assert!(
                parse(QuiltConfig::default(), bad_text).is_err(),
                "{bad_text}"
            );
        }
    }

    #[test]
    fn frag_limit_chooses_the_placement_and_the_name_stays_the_presets() {
        let gmlake = QuiltConfig::gmlake();
        let c = apply(gmlake, &[("frag_limit", "32MiB")]).unwrap();
        assert_eq!(
            c.placement,
            Placement::GmlakeLimits {
                frag_limit: 32 << 20,
                reuse_limit: 10
            }
        );
        assert_eq!(c.name, "gmlake");
        let c = apply(gmlake, &[("frag_limit", "0"), ("candidates", "4")]).unwrap();
        assert_eq!(c.placement, Placement::BestFit { candidates: 4 });
        assert_eq!(c.name, "gmlake", "a spec's name is its preset's");
        assert_eq!(
            apply(gmlake, &[("frag_limit", "0")]).unwrap().placement,
            Placement::BestFit { candidates: 1 }
        );
        let c = apply(QuiltConfig::default(), &[("frag_limit", "8MiB")]).unwrap();
        assert_eq!(
            c.placement,
            Placement::GmlakeLimits {
                frag_limit: 8 << 20,
                reuse_limit: 0
            }
        );
        assert_eq!(c.name, "quilt");
        let c = apply(
            QuiltConfig::default(),
            &[
                ("shared_arena", "false"),
                ("small_arena", "true"),
                ("access_per_map", "true"),
            ],
        )
        .unwrap();
        assert_eq!(c.layout.sharing, ArenaSharing::PerStream);
        assert_eq!(c.layout.small, SmallBlocks::PYTORCH);
        assert_eq!(c.access, AccessGranularity::PerPage);
        for dead in [
            &[("candidates", "2")][..],
            &[("frag_limit", "0"), ("reuse_limit", "3")],
        ] {
            let e = apply(gmlake, dead).unwrap_err();
            assert!(matches!(e, ConfError::Conflict(_)), "{dead:?}: {e}");
            let text = e.to_string();
            for valid in ["frag_limit", "reuse_limit", "candidates"] {
                assert!(text.contains(valid), "{text}");
            }
        }
        // Every configuration `apply` makes is a valid one.
        for c in [gmlake, QuiltConfig::default()] {
            for (k, v) in [
                ("frag_limit", "0"),
                ("frag_limit", "1MiB"),
                ("small_arena", "true"),
            ] {
                apply(c, &[(k, v)]).unwrap().validate().unwrap();
            }
        }
    }

    #[test]
    fn settings_apply_and_bad_ones_say_what_is_valid() {
        let c = apply(
            QuiltConfig::default(),
            &[
                ("page_size", "20MiB"),
                ("reclaim", "always"),
                ("candidates", "3"),
            ],
        )
        .unwrap();
        assert_eq!(c.pool.page_size, PageSize::Bytes(20 << 20));
        assert_eq!(c.reclaim, ReclaimPolicy::Always);
        assert_eq!(c.placement, Placement::BestFit { candidates: 3 });
        let e = apply(QuiltConfig::default(), &[("colour", "blue")]).unwrap_err();
        assert!(e.to_string().contains("page_size, reclaim"), "{e}");
        let e = apply(QuiltConfig::default(), &[("reclaim", "often")]).unwrap_err();
        assert!(e.to_string().contains("when_full, always"), "{e}");
        for dead in [
            &[("cached_permille", "5")][..],
            &[("reclaim", "always"), ("idle_ops", "5")],
            &[("reuse_limit", "2")],
            &[("frag_limit", "32MiB"), ("candidates", "2")],
        ] {
            assert!(matches!(
                apply(QuiltConfig::default(), dead),
                Err(ConfError::Conflict(_))
            ));
        }
        assert!(matches!(
            apply(
                QuiltConfig::default(),
                &[("candidates", "2"), ("candidates", "3")]
            ),
            Err(ConfError::Repeated(_))
        ));
        assert!(matches!(
            apply(QuiltConfig::default(), &[("candidates", "0")]),
            Err(ConfError::BadValue { .. })
        ));
    }
}
