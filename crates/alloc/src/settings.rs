//! Settings from text: one vocabulary of `KEY` / `VALUE` settings and one
//! parser for every front end that reads it.
//!
//! | front end ([`FrontEnd`]) | where | syntax |
//! |---|---|---|
//! | [`FrontEnd::Quilt`] | `QUILT_ALLOC_CONF` of a Rust program ([`from_env`], [`parse`]); `quilt-bench --allocator quilt:...` / `gmlake:...` ([`apply`]) | `key:value,...` / `name:key=value,...` |
//! | [`FrontEnd::Library`] | `QUILT_ALLOC_CONF` of the PyTorch library, `libquilt_torch` ([`library`]) | `key:value,...` |
//! | [`FrontEnd::Caching`] | `quilt-bench --allocator classic:...` / `expandable:...` ([`apply_caching`]) | `name:key=value,...` |
//! | [`FrontEnd::Offset`] | `quilt-bench --allocator offset:...` ([`apply_offset`]) | `name:key=value,...` |
//!
//! The separators differ ([`Syntax`]); the keys, their values and the
//! errors ([`SettingsError`]) are the same. Every key is one row of
//! [`VOCABULARY`], which says which front ends take it; the valid keys of
//! each front end ([`FrontEnd::valid_keys`]) and the lists below are derived
//! from it.
//!
//! | key | value | sets | front ends |
//! |---|---|---|---|
//! | `page_size` | a size (`20MiB`), a multiple of the granularity | [`PoolConfig::page_size`](quilt_pool::PoolConfig) | Quilt, Library |
//! | `reclaim` | `when_full`, `always`, `cached_above`, `idle_for` | [`QuiltConfig::reclaim`] | Quilt, Library |
//! | `cached_permille` | 0 to 1000, with `reclaim:cached_above` (default 50) | its bound | Quilt, Library |
//! | `idle_ops` | operations, with `reclaim:idle_for` (default 10000) | its age | Quilt, Library |
//! | `candidates` | 1 to 4096, with best-fit placement (`frag_limit:0`) | [`Placement::BestFit`]'s `candidates` | Quilt, Library |
//! | `shared_arena` | `true` / `false` | [`ArenaLayout::sharing`](crate::quilt::ArenaLayout::sharing) | Quilt, Library |
//! | `small_arena` | `true` / `false` | [`ArenaLayout::small`](crate::quilt::ArenaLayout::small) | Quilt, Library |
//! | `frag_limit` | a size; 0 stitches every request ([`Placement::BestFit`]) | [`Placement::GmlakeLimits`]'s `frag_limit` | Quilt, Library |
//! | `reuse_limit` | a whole number (0: no limit), with a `frag_limit` above 0 | [`Placement::GmlakeLimits`]'s `reuse_limit` | Quilt, Library |
//! | `growth_divisor` | pages held per page of margin; 0: exactly what is needed | [`GrowthPolicy`] | Quilt, Library |
//! | `access_per_map` | `true` / `false` | [`QuiltConfig::access`] | Quilt, Library |
//! | `map_ahead_pages` | pages mapped past each growable buffer's end (0: none) | [`QuiltConfig::map_ahead`] | Quilt, Library |
//! | `map_ahead_mode` | `background`, `inline`, `manual` | its [`AheadMode`] | Quilt, Library |
//! | `map_ahead_permille` | 0 to 1000 (0: free pool pages only) | its bound | Quilt, Library |
//! | `recycle_buffers` | released growable ranges kept (0: none) | [`QuiltConfig::recycle`] | Quilt, Library |
//! | `offload_tier` | `off`, `offloadable_tags` | [`QuiltConfig::offload_tier`] | Quilt, Library |
//! | `events` | `on_demand`, `at_free` | [`QuiltConfig::events`] | Quilt, Library |
//! | `peer_access` | devices joined by `+` (`1+2+3`), or `none` | [`QuiltConfig::peer_access`] | Quilt, Library |
//! | `max_split_size` | a size | [`CachingConfig::max_split_size`] | Caching |
//! | `roundup_power2_divisions` | 0 or a power of two | [`CachingConfig::roundup_power2_divisions`] | Caching |
//! | `garbage_collection_threshold` | a number in (0, 1) | [`CachingConfig::garbage_collection_threshold`] | Caching |
//! | `memory_fraction` | a number in (0, 1] | Quilt's [`MemoryLimit::Fraction`]; the caching allocators' `memory_fraction` | Quilt, Library, Caching |
//! | `memory_limit` | a size | Quilt's [`MemoryLimit::Bytes`] | Quilt, Library |
//! | `backend` | `cuda`, `host`, `sim` | the library's [`Backend`] | Library |
//! | `capacity` | a size above 0, with `backend:host` or `backend:sim` | the library's simulated device | Library |
//! | `max_allocs` | 1 to 4294967295 | [`OffsetConfig::max_allocs`] | Offset |
//!
//! `memory_fraction` and `memory_limit` together are refused
//! ([`SettingsError::Exclusive`]); in the PyTorch library, a later
//! `quilt_set_memory_fraction` replaces whichever was given.
//!
//! A key the other settings would ignore (`cached_permille` without
//! `reclaim:cached_above`, `reuse_limit` or `candidates` with the wrong
//! placement, `capacity` on the CUDA backend) is refused
//! ([`SettingsError::IgnoredKey`]) rather than silently dead; so is a key of
//! another front end ([`SettingsError::NotHere`]). A configuration's name
//! stays its base preset's.
//!
//! `frag_limit` chooses the placement: 0 is [`Placement::BestFit`] (its
//! `candidates` kept from the base, or 1 when the base had GMLake's limits),
//! above 0 is [`Placement::GmlakeLimits`] (its `reuse_limit` kept from the
//! base, or 0 when the base had best fit).

use std::borrow::Cow;
use std::fmt;

use quilt_pool::{GrowthPolicy, MemoryLimit, PageSize};
use quilt_vmm::DeviceSet;

use crate::baselines::offset::OffsetConfig;
use crate::baselines::CachingConfig;
use crate::baselines::RoundupPower2Divisions;
use crate::quilt::{
    AccessGranularity, AheadMode, ArenaSharing, EventTiming, OffloadTier, Placement, QuiltConfig,
    ReclaimPolicy, Recycle, SmallBlocks,
};
use crate::units::parse_size;

#[cfg(test)]
mod tests;

/// Who reads a setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FrontEnd {
    /// A [`QuiltConfig`]: `QUILT_ALLOC_CONF` of a Rust program ([`from_env`],
    /// [`parse`]) and the bench's `quilt` and `gmlake` specs ([`apply`]).
    Quilt,
    /// The PyTorch library's `QUILT_ALLOC_CONF` ([`library`]): Quilt's keys
    /// and the library's own (`backend`, `capacity`).
    Library,
    /// The bench's `classic` and `expandable` specs: PyTorch's caching
    /// allocator.
    Caching,
    /// The bench's `offset` spec.
    Offset,
}

impl FrontEnd {
    /// Every front end.
    pub const ALL: [FrontEnd; 4] = [
        FrontEnd::Quilt,
        FrontEnd::Library,
        FrontEnd::Caching,
        FrontEnd::Offset,
    ];

    /// The keys this front end takes, in [`VOCABULARY`]'s order.
    pub fn valid_keys(self) -> &'static [&'static str] {
        match self {
            FrontEnd::Quilt => &QUILT_FRONT_KEYS,
            FrontEnd::Library => &LIBRARY_FRONT_KEYS,
            FrontEnd::Caching => &CACHING_FRONT_KEYS,
            FrontEnd::Offset => &OFFSET_FRONT_KEYS,
        }
    }

    /// Whether this front end takes `key` (a key of [`VOCABULARY`] or not).
    pub fn takes(self, key: &str) -> bool {
        self.valid_keys().contains(&key)
    }
}

impl fmt::Display for FrontEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FrontEnd::Quilt => {
                "Quilt's configuration (QUILT_ALLOC_CONF of settings::from_env; quilt and gmlake specs)"
            }
            FrontEnd::Library => "the PyTorch library (QUILT_ALLOC_CONF of libquilt_torch)",
            FrontEnd::Caching => "PyTorch's caching allocator (classic and expandable specs)",
            FrontEnd::Offset => "the offset allocator (offset specs)",
        })
    }
}

/// What part of the vocabulary a key belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Group {
    /// Quilt's placement and reclaim policy ([`KEYS`]).
    Policy,
    /// Quilt's serving policies ([`SERVING_KEYS`], `docs/serving.md`).
    Serving,
    /// The devices a mapping is accessible from ([`DEVICE_KEYS`], `docs/multi-gpu.md`).
    Device,
    /// PyTorch's caching allocator ([`CACHING_KEYS`]).
    Caching,
    /// A memory limit ([`LIMIT_KEYS`]).
    Limit,
    /// The PyTorch library's own keys ([`LIBRARY_KEYS`]).
    Library,
    /// The offset allocator ([`OFFSET_KEYS`]).
    Offset,
}

/// One key of the vocabulary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Key {
    /// The key.
    pub name: &'static str,
    /// Its part of the vocabulary.
    pub group: Group,
    /// The front ends that take it.
    pub front_ends: &'static [FrontEnd],
    /// What a valid value is (the `expected` of [`SettingsError::BadValue`]).
    pub value: &'static str,
    /// A valid value.
    pub example: &'static str,
}

const QUILT_LIB: &[FrontEnd] = &[FrontEnd::Quilt, FrontEnd::Library];

const fn key(
    name: &'static str,
    group: Group,
    front_ends: &'static [FrontEnd],
    value: &'static str,
    example: &'static str,
) -> Key {
    Key {
        name,
        group,
        front_ends,
        value,
        example,
    }
}

/// `memory_fraction`: Quilt's, the library's and the caching allocators'.
const MEMORY_FRACTION: Key = key(
    "memory_fraction",
    Group::Limit,
    &[FrontEnd::Quilt, FrontEnd::Library, FrontEnd::Caching],
    "a number in (0, 1]",
    "0.5",
);

/// Every key, once: its group, the front ends that take it, and what a
/// valid value is (see the module's table).
pub const VOCABULARY: [Key; 26] = [
    key(
        "page_size",
        Group::Policy,
        QUILT_LIB,
        "a size that is a multiple of the granularity (20MiB)",
        "4MiB",
    ),
    key(
        "reclaim",
        Group::Policy,
        QUILT_LIB,
        "one of when_full, always, cached_above, idle_for",
        "always",
    ),
    key(
        "cached_permille",
        Group::Policy,
        QUILT_LIB,
        "0 to 1000 (thousandths of the pool)",
        "20",
    ),
    key(
        "idle_ops",
        Group::Policy,
        QUILT_LIB,
        "a whole number of operations",
        "3",
    ),
    key("candidates", Group::Policy, QUILT_LIB, "1 to 4096", "2"),
    key(
        "shared_arena",
        Group::Policy,
        QUILT_LIB,
        "true or false",
        "true",
    ),
    key(
        "small_arena",
        Group::Policy,
        QUILT_LIB,
        "true or false",
        "true",
    ),
    key(
        "frag_limit",
        Group::Policy,
        QUILT_LIB,
        "a size (0: stitch every request)",
        "4MiB",
    ),
    key(
        "reuse_limit",
        Group::Policy,
        QUILT_LIB,
        "a whole number (0: no limit)",
        "3",
    ),
    key(
        "growth_divisor",
        Group::Policy,
        QUILT_LIB,
        "a whole number (0: exactly what is needed)",
        "2",
    ),
    key(
        "access_per_map",
        Group::Policy,
        QUILT_LIB,
        "true or false",
        "true",
    ),
    key(
        "events",
        Group::Policy,
        QUILT_LIB,
        "on_demand or at_free",
        "at_free",
    ),
    key(
        "map_ahead_pages",
        Group::Serving,
        QUILT_LIB,
        "a whole number of pages",
        "2",
    ),
    key(
        "map_ahead_mode",
        Group::Serving,
        QUILT_LIB,
        "background, inline or manual",
        "inline",
    ),
    key(
        "map_ahead_permille",
        Group::Serving,
        QUILT_LIB,
        "0 to 1000 (thousandths of the limit)",
        "500",
    ),
    key(
        "recycle_buffers",
        Group::Serving,
        QUILT_LIB,
        "a whole number of buffers",
        "2",
    ),
    key(
        "offload_tier",
        Group::Serving,
        QUILT_LIB,
        "off or offloadable_tags",
        "offloadable_tags",
    ),
    key(
        "peer_access",
        Group::Device,
        QUILT_LIB,
        "device ordinals joined by + (1+2+3), or none",
        "1+2",
    ),
    key(
        "max_split_size",
        Group::Caching,
        &[FrontEnd::Caching],
        "a size",
        "256MiB",
    ),
    key(
        "roundup_power2_divisions",
        Group::Caching,
        &[FrontEnd::Caching],
        "0 or a power of two",
        "4",
    ),
    key(
        "garbage_collection_threshold",
        Group::Caching,
        &[FrontEnd::Caching],
        "a number in (0, 1)",
        "0.5",
    ),
    MEMORY_FRACTION,
    key("memory_limit", Group::Limit, QUILT_LIB, "a size", "4MiB"),
    key(
        "backend",
        Group::Library,
        &[FrontEnd::Library],
        "cuda, host or sim",
        "host",
    ),
    key(
        "capacity",
        Group::Library,
        &[FrontEnd::Library],
        "a size above 0 bytes",
        "4MiB",
    ),
    key(
        "max_allocs",
        Group::Offset,
        &[FrontEnd::Offset],
        "1 to 4294967295",
        "64",
    ),
];

const fn front_has(k: &Key, front: FrontEnd) -> bool {
    let mut i = 0;
    while i < k.front_ends.len() {
        if k.front_ends[i] as u8 == front as u8 {
            return true;
        }
        i += 1;
    }
    false
}

/// Whether row `k` passes the filter: a front end that takes it, or a group.
const fn selected(k: &Key, filter: Filter) -> bool {
    match filter {
        Filter::Front(front) => front_has(k, front),
        Filter::Group(group) => k.group as u8 == group as u8,
    }
}

#[derive(Clone, Copy)]
enum Filter {
    Front(FrontEnd),
    Group(Group),
}

const fn count(filter: Filter) -> usize {
    let (mut i, mut n) = (0, 0);
    while i < VOCABULARY.len() {
        if selected(&VOCABULARY[i], filter) {
            n += 1;
        }
        i += 1;
    }
    n
}

const fn names<const N: usize>(filter: Filter) -> [&'static str; N] {
    let mut out = [""; N];
    let (mut i, mut n) = (0, 0);
    while i < VOCABULARY.len() {
        if selected(&VOCABULARY[i], filter) {
            out[n] = VOCABULARY[i].name;
            n += 1;
        }
        i += 1;
    }
    out
}

const QUILT: Filter = Filter::Front(FrontEnd::Quilt);
const LIBRARY: Filter = Filter::Front(FrontEnd::Library);
const CACHING: Filter = Filter::Front(FrontEnd::Caching);
const OFFSET: Filter = Filter::Front(FrontEnd::Offset);

/// The keys of [`FrontEnd::Quilt`]: a [`QuiltConfig`] and its memory limit.
pub const QUILT_FRONT_KEYS: [&str; count(QUILT)] = names(QUILT);
/// The keys of [`FrontEnd::Library`]: Quilt's and the library's own.
pub const LIBRARY_FRONT_KEYS: [&str; count(LIBRARY)] = names(LIBRARY);
/// The keys of [`FrontEnd::Caching`].
pub const CACHING_FRONT_KEYS: [&str; count(CACHING)] = names(CACHING);
/// The keys of [`FrontEnd::Offset`].
pub const OFFSET_FRONT_KEYS: [&str; count(OFFSET)] = names(OFFSET);

/// Quilt's placement and reclaim keys ([`Group::Policy`]).
pub const KEYS: [&str; count(Filter::Group(Group::Policy))] = names(Filter::Group(Group::Policy));
/// Quilt's serving policies' keys (growable buffers, the offload tier).
pub const SERVING_KEYS: [&str; count(Filter::Group(Group::Serving))] =
    names(Filter::Group(Group::Serving));
/// The keys of the devices a mapping is accessible from.
pub const DEVICE_KEYS: [&str; count(Filter::Group(Group::Device))] =
    names(Filter::Group(Group::Device));
/// PyTorch's caching allocator's keys.
pub const CACHING_KEYS: [&str; count(Filter::Group(Group::Caching))] =
    names(Filter::Group(Group::Caching));
/// The memory limit's keys (give one).
pub const LIMIT_KEYS: [&str; count(Filter::Group(Group::Limit))] =
    names(Filter::Group(Group::Limit));
/// The PyTorch library's own keys.
pub const LIBRARY_KEYS: [&str; count(Filter::Group(Group::Library))] =
    names(Filter::Group(Group::Library));
/// The offset allocator's keys.
pub const OFFSET_KEYS: [&str; count(Filter::Group(Group::Offset))] =
    names(Filter::Group(Group::Offset));

/// The values of `reclaim`.
pub const RECLAIM_VALUES: [&str; 4] = ["when_full", "always", "cached_above", "idle_for"];

/// The allocators a bench spec may name, in report order.
pub const SPEC_NAMES: [&str; 5] = ["quilt", "classic", "expandable", "gmlake", "offset"];

/// The row of `name`, if it is a key.
pub fn lookup(name: &str) -> Option<&'static Key> {
    VOCABULARY.iter().find(|k| k.name == name)
}

/// Settings that cannot be applied: the one error of every front end.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SettingsError {
    /// No key of the vocabulary has this name.
    #[error("no setting `{key}` (valid keys: {})", valid.join(", "))]
    UnknownKey {
        /// The key given.
        key: String,
        /// The keys of the front end that read it.
        valid: &'static [&'static str],
    },
    /// A key of the vocabulary that this front end does not take.
    #[error("`{key}` is a setting of {}, not of {here} (valid keys here: {})", front_names(applies_to), valid.join(", "))]
    NotHere {
        /// The key.
        key: &'static str,
        /// The front end that read it.
        here: FrontEnd,
        /// The front ends that take it.
        applies_to: &'static [FrontEnd],
        /// The keys `here` takes.
        valid: &'static [&'static str],
    },
    /// A value that does not parse or is out of range.
    #[error("`{key}` = `{value}`: expected {expected}")]
    BadValue {
        /// The key.
        key: &'static str,
        /// The value given.
        value: String,
        /// What a valid value is.
        expected: Cow<'static, str>,
    },
    /// A key the other settings make dead.
    #[error("`{key}` would be ignored: {because}")]
    IgnoredKey {
        /// The key.
        key: &'static str,
        /// Why.
        because: &'static str,
    },
    /// Two keys of which at most one may be given.
    #[error("`{first}` and `{second}` are given together: give one of them")]
    Exclusive {
        /// The one given first.
        first: &'static str,
        /// The other.
        second: &'static str,
    },
    /// A key given twice.
    #[error("`{key}` is given twice")]
    Repeated {
        /// The key.
        key: &'static str,
    },
    /// A part of the text that is not a setting in its syntax.
    #[error("`{part}`: expected {expected}")]
    Malformed {
        /// The part of the text.
        part: String,
        /// The syntax of a setting (`key:value`, `KEY=VALUE`).
        expected: &'static str,
    },
    /// A bench spec names no allocator.
    #[error("unknown allocator `{name}` (known: {})", known.join(", "))]
    UnknownAllocator {
        /// The name given.
        name: String,
        /// The names known.
        known: &'static [&'static str],
    },
}

fn front_names(fronts: &[FrontEnd]) -> String {
    fronts
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(" and ")
}

/// The separators of a front end's text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Syntax {
    /// `QUILT_ALLOC_CONF`: `key:value,key:value`.
    AllocConf,
    /// A bench spec's settings (after `name:`): `key=value,key=value`.
    Spec,
}

impl Syntax {
    fn separator(self) -> char {
        match self {
            Syntax::AllocConf => ':',
            Syntax::Spec => '=',
        }
    }

    fn form(self) -> &'static str {
        match self {
            Syntax::AllocConf => "key:value",
            Syntax::Spec => "KEY=VALUE",
        }
    }
}

/// The (key, value) pairs of `text` in `syntax`, trimmed; empty parts are
/// skipped in `QUILT_ALLOC_CONF`'s syntax (`" "` is no setting) and refused
/// in a spec's.
pub fn split(text: &str, syntax: Syntax) -> Result<Pairs<'_>, SettingsError> {
    let mut out = Vec::new();
    for part in text.split(',') {
        let trimmed = part.trim();
        if trimmed.is_empty() && syntax == Syntax::AllocConf {
            continue;
        }
        let malformed = || SettingsError::Malformed {
            part: trimmed.to_string(),
            expected: syntax.form(),
        };
        let (k, v) = trimmed
            .split_once(syntax.separator())
            .ok_or_else(malformed)?;
        let (k, v) = (k.trim(), v.trim());
        if k.is_empty() || (v.is_empty() && syntax == Syntax::Spec) {
            return Err(malformed());
        }
        out.push((k, v));
    }
    Ok(out)
}

/// (key, value) pairs, as [`split`] gives them.
pub type Pairs<'a> = Vec<(&'a str, &'a str)>;

/// A bench spec split into its allocator name and its settings
/// (`NAME[:KEY=VALUE,...]`).
pub fn split_spec(text: &str) -> Result<(&str, Pairs<'_>), SettingsError> {
    match text.split_once(':') {
        Some((name, rest)) => Ok((name.trim(), split(rest, Syntax::Spec)?)),
        None => Ok((text.trim(), Vec::new())),
    }
}

/// The rows of `pairs` for `front`: each key known, taken by `front`, given
/// once.
pub fn check(
    front: FrontEnd,
    pairs: &[(&str, &str)],
) -> Result<Vec<(&'static Key, String)>, SettingsError> {
    let mut out: Vec<(&'static Key, String)> = Vec::new();
    for &(name, value) in pairs {
        let Some(k) = lookup(name) else {
            return Err(SettingsError::UnknownKey {
                key: name.to_string(),
                valid: front.valid_keys(),
            });
        };
        if !k.front_ends.contains(&front) {
            return Err(SettingsError::NotHere {
                key: k.name,
                here: front,
                applies_to: k.front_ends,
                valid: front.valid_keys(),
            });
        }
        if out.iter().any(|(seen, _)| seen.name == k.name) {
            return Err(SettingsError::Repeated { key: k.name });
        }
        out.push((k, value.to_string()));
    }
    Ok(out)
}

fn bad(k: &Key, value: &str) -> SettingsError {
    SettingsError::BadValue {
        key: k.name,
        value: value.to_string(),
        expected: Cow::Borrowed(k.value),
    }
}

fn size(k: &Key, value: &str) -> Result<u64, SettingsError> {
    parse_size(value).map_err(|e| SettingsError::BadValue {
        key: k.name,
        value: value.to_string(),
        expected: Cow::Owned(format!("{} ({e})", k.value)),
    })
}

fn count_of(k: &Key, value: &str) -> Result<u64, SettingsError> {
    value.parse::<u64>().map_err(|_| bad(k, value))
}

fn permille(k: &Key, value: &str) -> Result<u64, SettingsError> {
    match value.parse::<u64>() {
        Ok(n) if n <= 1000 => Ok(n),
        _ => Err(bad(k, value)),
    }
}

fn flag(k: &Key, value: &str) -> Result<bool, SettingsError> {
    match value {
        "true" | "on" | "1" => Ok(true),
        "false" | "off" | "0" => Ok(false),
        _ => Err(bad(k, value)),
    }
}

fn fraction(k: &Key, value: &str) -> Result<f64, SettingsError> {
    match value.parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        _ => Err(bad(k, value)),
    }
}

/// A memory fraction given as a number (`quilt_set_memory_fraction`):
/// `fraction` if it is in (0, 1], else `memory_fraction`'s
/// [`SettingsError::BadValue`].
pub fn check_fraction(fraction_given: f64) -> Result<f64, SettingsError> {
    fraction(&MEMORY_FRACTION, &fraction_given.to_string())
}

/// The peer devices of `peer_access`: ordinals joined by `+`, or `none`.
fn device_set(k: &Key, value: &str) -> Result<DeviceSet, SettingsError> {
    if value == "none" {
        return Ok(DeviceSet::EMPTY);
    }
    let because = |why: String| SettingsError::BadValue {
        key: k.name,
        value: value.to_string(),
        expected: Cow::Owned(format!("{} ({why})", k.value)),
    };
    let mut set = DeviceSet::EMPTY;
    for part in value.split('+') {
        let d: u32 = part.trim().parse().map_err(|_| bad(k, value))?;
        if set.contains(d) {
            return Err(because(format!("device {d} is named twice")));
        }
        set = set.with(d).ok_or_else(|| {
            because(format!(
                "device {d}: ordinals go up to {}",
                DeviceSet::CAPACITY - 1
            ))
        })?;
    }
    Ok(set)
}

/// `base` with `pairs` of [`FrontEnd::Quilt`] applied, checked; `base`
/// itself is never changed. The bench's `quilt` and `gmlake` specs.
///
/// ```
/// use quilt_alloc::quilt::{AheadMode, MemoryLimit, QuiltConfig, ReclaimPolicy};
/// use quilt_alloc::settings;
///
/// let c = settings::apply(QuiltConfig::default(), &[("reclaim", "cached_above"), ("cached_permille", "20")])?;
/// assert_eq!(c.reclaim, ReclaimPolicy::CachedAbove(20));
/// let s = settings::apply(QuiltConfig::default(), &[("map_ahead_pages", "2"), ("map_ahead_mode", "inline")])?;
/// assert_eq!((s.map_ahead.pages, s.map_ahead.mode), (2, AheadMode::Inline));
/// let l = settings::apply(QuiltConfig::default(), &[("memory_limit", "2GiB")])?;
/// assert_eq!(l.pool.limit, MemoryLimit::Bytes(2 << 30));
/// assert!(settings::apply(QuiltConfig::default(), &[("colour", "blue")]).is_err());
/// # Ok::<(), settings::SettingsError>(())
/// ```
pub fn apply(base: QuiltConfig, pairs: &[(&str, &str)]) -> Result<QuiltConfig, SettingsError> {
    quilt_config(base, &check(FrontEnd::Quilt, pairs)?)
}

/// `base` with the Quilt and limit rows of `rows` applied (rows already
/// checked; the library's own are skipped).
fn quilt_config(
    base: QuiltConfig,
    rows: &[(&'static Key, String)],
) -> Result<QuiltConfig, SettingsError> {
    let mut c = base;
    let mut reclaim: Option<&str> = None;
    let mut cached: Option<u64> = None;
    let mut idle: Option<u64> = None;
    let mut frag: Option<u64> = None;
    let mut reuse: Option<u64> = None;
    let mut candidates: Option<usize> = None;
    let mut limit: Option<(&'static str, MemoryLimit)> = None;
    for (k, value) in rows {
        let value = value.as_str();
        match k.name {
            "page_size" => match size(k, value)? {
                0 => return Err(bad(k, value)),
                b => c.pool.page_size = PageSize::Bytes(b),
            },
            "reclaim" => {
                if !RECLAIM_VALUES.contains(&value) {
                    return Err(bad(k, value));
                }
                reclaim = Some(value);
            }
            "cached_permille" => cached = Some(permille(k, value)?),
            "idle_ops" => idle = Some(count_of(k, value)?),
            "candidates" => {
                candidates = Some(
                    usize::try_from(count_of(k, value)?)
                        .ok()
                        .filter(|n| (1..=4096).contains(n))
                        .ok_or_else(|| bad(k, value))?,
                )
            }
            "shared_arena" => {
                c.layout.sharing = if flag(k, value)? {
                    ArenaSharing::Shared
                } else {
                    ArenaSharing::PerStream
                }
            }
            "small_arena" => {
                c.layout.small = if flag(k, value)? {
                    SmallBlocks::PYTORCH
                } else {
                    SmallBlocks::Mixed
                }
            }
            "frag_limit" => frag = Some(size(k, value)?),
            "reuse_limit" => reuse = Some(count_of(k, value)?),
            "growth_divisor" => {
                let d = count_of(k, value)?;
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
                c.access = if flag(k, value)? {
                    AccessGranularity::PerPage
                } else {
                    AccessGranularity::PerRange
                }
            }
            "peer_access" => c.peer_access = device_set(k, value)?,
            "map_ahead_pages" => c.map_ahead.pages = count_of(k, value)?,
            "map_ahead_mode" => {
                c.map_ahead.mode = match value {
                    "background" => AheadMode::Background,
                    "inline" => AheadMode::Inline,
                    "manual" => AheadMode::Manual,
                    _ => return Err(bad(k, value)),
                }
            }
            "map_ahead_permille" => c.map_ahead.below_per_mille = permille(k, value)?,
            "recycle_buffers" => {
                c.recycle = Recycle {
                    max_buffers: usize::try_from(count_of(k, value)?).map_err(|_| bad(k, value))?,
                }
            }
            "offload_tier" => {
                c.offload_tier = match value {
                    "off" => OffloadTier::Off,
                    "offloadable_tags" => OffloadTier::OffloadableTags,
                    _ => return Err(bad(k, value)),
                }
            }
            "events" => {
                c.events = match value {
                    "on_demand" => EventTiming::OnDemand,
                    "at_free" => EventTiming::AtFree,
                    _ => return Err(bad(k, value)),
                }
            }
            "memory_fraction" | "memory_limit" => {
                let l = if k.name == "memory_limit" {
                    MemoryLimit::Bytes(size(k, value)?)
                } else {
                    MemoryLimit::Fraction(fraction(k, value)?)
                };
                if let Some((first, _)) = limit {
                    return Err(SettingsError::Exclusive {
                        first,
                        second: k.name,
                    });
                }
                limit = Some((k.name, l));
            }
            _ => {} // the library's own keys: read by `library`
        }
    }
    match reclaim {
        Some("when_full") => c.reclaim = ReclaimPolicy::WhenFull,
        Some("always") => c.reclaim = ReclaimPolicy::Always,
        Some("cached_above") => c.reclaim = ReclaimPolicy::CachedAbove(cached.unwrap_or(50)),
        Some("idle_for") => c.reclaim = ReclaimPolicy::IdleFor(idle.unwrap_or(10_000)),
        _ => {}
    }
    if cached.is_some() && !matches!(c.reclaim, ReclaimPolicy::CachedAbove(_)) {
        return Err(SettingsError::IgnoredKey {
            key: "cached_permille",
            because: "cached_permille applies only with reclaim=cached_above",
        });
    }
    if idle.is_some() && !matches!(c.reclaim, ReclaimPolicy::IdleFor(_)) {
        return Err(SettingsError::IgnoredKey {
            key: "idle_ops",
            because: "idle_ops applies only with reclaim=idle_for",
        });
    }
    c.placement = placement(c.placement, frag, reuse, candidates)?;
    if let Some((_, l)) = limit {
        c = c.with_limit(l);
    }
    Ok(c)
}

/// The placement `frag_limit`, `reuse_limit` and `candidates` (each if given)
/// make of `base`.
fn placement(
    base: Placement,
    frag: Option<u64>,
    reuse: Option<u64>,
    candidates: Option<usize>,
) -> Result<Placement, SettingsError> {
    let (base_frag, base_reuse, base_candidates) = match base {
        Placement::BestFit { candidates } => (0, 0, candidates),
        Placement::GmlakeLimits {
            frag_limit,
            reuse_limit,
        } => (frag_limit, reuse_limit, 1),
    };
    match frag.unwrap_or(base_frag) {
        0 if reuse.is_some() => Err(SettingsError::IgnoredKey {
            key: "reuse_limit",
            because: "reuse_limit applies only with a frag_limit above 0 (GMLake's limits: frag_limit, reuse_limit); with frag_limit=0 every request is stitched (best fit: candidates)",
        }),
        0 => Ok(Placement::BestFit {
            candidates: candidates.unwrap_or(base_candidates),
        }),
        _ if candidates.is_some() => Err(SettingsError::IgnoredKey {
            key: "candidates",
            because: "candidates applies only with frag_limit=0 (best fit: candidates); with a frag_limit above 0 (GMLake's limits: frag_limit, reuse_limit) placement is plain best fit",
        }),
        frag_limit => Ok(Placement::GmlakeLimits {
            frag_limit,
            reuse_limit: reuse.unwrap_or(base_reuse),
        }),
    }
}

/// A configuration from text in `QUILT_ALLOC_CONF`'s syntax: comma-separated
/// `key:value` pairs of [`FrontEnd::Quilt`] (Quilt's keys and one of
/// `memory_fraction`, `memory_limit`), applied to `base`. An unknown key
/// names the valid ones; the PyTorch library's own keys are
/// [`SettingsError::NotHere`].
///
/// ```
/// use quilt_alloc::quilt::{MemoryLimit, QuiltConfig, ReclaimPolicy};
/// use quilt_alloc::settings;
///
/// let c = settings::parse(QuiltConfig::default(), "reclaim:always, memory_limit:8GiB")?;
/// assert_eq!(c.reclaim, ReclaimPolicy::Always);
/// assert_eq!(c.pool.limit, MemoryLimit::Bytes(8 << 30));
/// assert!(settings::parse(QuiltConfig::default(), "colour:blue").is_err());
/// # Ok::<(), settings::SettingsError>(())
/// ```
pub fn parse(base: QuiltConfig, text: &str) -> Result<QuiltConfig, SettingsError> {
    apply(base, &split(text, Syntax::AllocConf)?)
}

/// [`parse`] of the environment variable `QUILT_ALLOC_CONF` over the default
/// configuration (the default configuration when it is unset).
pub fn from_env() -> Result<QuiltConfig, SettingsError> {
    parse(
        QuiltConfig::default(),
        &std::env::var("QUILT_ALLOC_CONF").unwrap_or_default(),
    )
}

/// Where the PyTorch library's memory comes from (`backend`).
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

/// The PyTorch library's settings ([`library`]).
#[derive(Clone, Debug, PartialEq)]
pub struct LibrarySettings {
    /// The backend of every device.
    pub backend: Backend,
    /// Capacity of a `host` or `sim` device, in bytes.
    pub capacity: u64,
    /// Quilt's policy, with the memory limit of `memory_fraction` or
    /// `memory_limit` (the pool's default, the whole device, without).
    pub quilt: QuiltConfig,
}

/// The PyTorch library's `QUILT_ALLOC_CONF` ([`FrontEnd::Library`]):
/// `backend` (`cuda` by default), `capacity` (host 1 GiB, sim 80 GiB, only
/// with those backends) and every key of [`FrontEnd::Quilt`], `memory_limit`
/// included.
///
/// ```
/// use quilt_alloc::quilt::MemoryLimit;
/// use quilt_alloc::settings::{self, Backend};
///
/// let s = settings::library("backend:host,capacity:8GiB,memory_limit:2GiB")?;
/// assert_eq!((s.backend, s.capacity), (Backend::Host, 8 << 30));
/// assert_eq!(s.quilt.pool.limit, MemoryLimit::Bytes(2 << 30));
/// assert!(settings::library("capacity:1GiB").is_err(), "capacity on cuda");
/// # Ok::<(), settings::SettingsError>(())
/// ```
pub fn library(text: &str) -> Result<LibrarySettings, SettingsError> {
    let rows = check(FrontEnd::Library, &split(text, Syntax::AllocConf)?)?;
    let mut backend = Backend::Cuda;
    let mut capacity: Option<u64> = None;
    for (k, value) in &rows {
        match k.name {
            "backend" => {
                backend = match value.as_str() {
                    "cuda" => Backend::Cuda,
                    "host" => Backend::Host,
                    "sim" => Backend::Sim,
                    _ => return Err(bad(k, value)),
                }
            }
            "capacity" => match size(k, value)? {
                0 => return Err(bad(k, value)),
                b => capacity = Some(b),
            },
            _ => {}
        }
    }
    let quilt = quilt_config(QuiltConfig::default(), &rows)?;
    if capacity.is_some() && backend == Backend::Cuda {
        return Err(SettingsError::IgnoredKey {
            key: "capacity",
            because: "capacity applies only to the host and sim backends",
        });
    }
    let capacity = capacity.unwrap_or(match backend {
        Backend::Sim => 80 << 30,
        _ => 1 << 30,
    });
    Ok(LibrarySettings {
        backend,
        capacity,
        quilt,
    })
}

/// The fields the caching allocators share.
/// `base` with `pairs` of [`FrontEnd::Caching`] applied (the bench's
/// `classic` and `expandable` specs: two presets of one caching allocator).
pub fn apply_caching(
    base: CachingConfig,
    pairs: &[(&str, &str)],
) -> Result<CachingConfig, SettingsError> {
    let mut c = base;
    for (k, value) in check(FrontEnd::Caching, pairs)? {
        let value = value.as_str();
        match k.name {
            "max_split_size" => c.max_split_size = Some(size(k, value)?),
            "roundup_power2_divisions" => {
                let n = count_of(k, value)?;
                if n != 0 && !n.is_power_of_two() {
                    return Err(bad(k, value));
                }
                c.roundup_power2_divisions = RoundupPower2Divisions::uniform(n);
            }
            "garbage_collection_threshold" => match value.parse::<f64>() {
                Ok(t) if t > 0.0 && t < 1.0 => c.garbage_collection_threshold = Some(t),
                _ => return Err(bad(k, value)),
            },
            "memory_fraction" => c.memory_fraction = Some(fraction(k, value)?),
            _ => {}
        }
    }
    Ok(c)
}

/// `base` with `pairs` of [`FrontEnd::Offset`] applied (the bench's
/// `offset` spec).
pub fn apply_offset(
    base: OffsetConfig,
    pairs: &[(&str, &str)],
) -> Result<OffsetConfig, SettingsError> {
    let mut c = base;
    for (k, value) in check(FrontEnd::Offset, pairs)? {
        if k.name == "max_allocs" {
            let n = u32::try_from(count_of(k, &value)?)
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| bad(k, &value))?;
            c.max_allocs = Some(n);
        }
    }
    Ok(c)
}
