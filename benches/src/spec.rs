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
//! The keys, their values and their errors are those of `QUILT_ALLOC_CONF`:
//! one parser, [`quilt_alloc::settings`], whose table says which allocator
//! takes which key (`quilt` and `gmlake`: [`FrontEnd::Quilt`], the keys of
//! `QUILT_ALLOC_CONF` in a Rust program, `memory_limit` and
//! `memory_fraction` included; `classic` and `expandable`:
//! [`FrontEnd::Caching`]; `offset`: [`FrontEnd::Offset`]); only the
//! separators differ (`=` here, `:` there). The PyTorch library's own keys
//! (`backend`, `capacity`) are refused, naming where they apply.
//!
//! Sizes take the usual units (`parse_size`). An unknown name or key, a bad
//! value, or a key that the chosen settings would ignore is a [`SpecError`]
//! that says what is valid.

use quilt_alloc::baselines::offset::OffsetConfig;
use quilt_alloc::baselines::CachingConfig;
use quilt_alloc::quilt::QuiltConfig;
use quilt_alloc::settings::{self, FrontEnd};

/// The allocators a spec may name, in report order.
pub const NAMES: [&str; 5] = settings::SPEC_NAMES;

/// The keys of Quilt's placement and reclaim policy (the `quilt` and
/// `gmlake` presets).
pub const QUILT_KEYS: [&str; 12] = settings::KEYS;

/// The keys of Quilt's serving policies (map-ahead, recycling of growable
/// buffers, the offload tier), accepted beside [`QUILT_KEYS`]: the
/// `llm-serving-growable` workloads run them (`docs/serving.md`).
pub const QUILT_SERVING_KEYS: [&str; 5] = settings::SERVING_KEYS;

/// The keys of PyTorch's caching allocator (`classic`, `expandable`), the
/// memory fraction aside.
pub const CACHING_KEYS: [&str; 3] = settings::CACHING_KEYS;

/// The keys of the `offset` baseline.
pub const OFFSET_KEYS: [&str; 1] = settings::OFFSET_KEYS;

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

/// A spec that cannot be built: the settings' one error
/// ([`settings::SettingsError`]; an unknown allocator is
/// [`settings::SettingsError::UnknownAllocator`]).
pub type SpecError = settings::SettingsError;

/// The front end of the allocator `name`, if it is one.
pub fn front_end(name: &str) -> Option<FrontEnd> {
    match name {
        "quilt" | "gmlake" => Some(FrontEnd::Quilt),
        "classic" | "expandable" => Some(FrontEnd::Caching),
        "offset" => Some(FrontEnd::Offset),
        _ => None,
    }
}

/// Parse a spec.
pub fn parse(text: &str) -> Result<Spec, SpecError> {
    let (name, pairs) = settings::split_spec(text)?;
    match name {
        "quilt" => settings::apply(QuiltConfig::default(), &pairs).map(Spec::Quilt),
        "gmlake" => settings::apply(QuiltConfig::gmlake(), &pairs).map(Spec::Quilt),
        "classic" => settings::apply_caching(CachingConfig::classic(), &pairs).map(Spec::Caching),
        "expandable" => {
            settings::apply_caching(CachingConfig::expandable(), &pairs).map(Spec::Caching)
        }
        "offset" => settings::apply_offset(OffsetConfig::default(), &pairs).map(Spec::Offset),
        _ => Err(SpecError::UnknownAllocator {
            name: name.to_string(),
            known: &NAMES,
        }),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code
    use super::*;
    use quilt_alloc::baselines::RoundupPower2Divisions;
    use quilt_alloc::quilt::{GrowthPolicy, PageSize, Placement, ReclaimPolicy};
    use quilt_alloc::settings::VOCABULARY;

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
            Err(SpecError::Repeated { key: "candidates" })
        ));
        assert!(matches!(
            parse("quilt:candidates=0"),
            Err(SpecError::BadValue { .. })
        ));
        assert!(matches!(
            parse("offset:reclaim=always"),
            Err(SpecError::NotHere { .. })
        ));
        assert!(matches!(
            parse("offset:colour=blue"),
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
            assert!(
                matches!(parse(text), Err(SpecError::IgnoredKey { .. })),
                "{text}"
            );
        }
    }

    /// Every key of the one vocabulary, in every spec: taken where the
    /// allocator's front end takes it, else refused with the error
    /// `QUILT_ALLOC_CONF` gives for it (`settings::parse` and a spec agree).
    #[test]
    fn specs_take_and_refuse_the_vocabulary_as_quilt_alloc_conf_does() {
        for name in NAMES {
            let front = front_end(name).unwrap();
            for k in &VOCABULARY {
                let got = parse(&format!("{name}:{}={}", k.name, k.example));
                if name == "quilt" {
                    let conf = settings::parse(
                        QuiltConfig::default(),
                        &format!("{}:{}", k.name, k.example),
                    );
                    assert_eq!(
                        got.clone().map(|_| ()),
                        conf.map(|_| ()),
                        "{name}: {}",
                        k.name
                    );
                }
                if front.takes(k.name) {
                    // Taken; at most dead without its companion setting.
                    assert!(
                        matches!(got, Ok(_) | Err(SpecError::IgnoredKey { .. })),
                        "{name}: {}: {got:?}",
                        k.name
                    );
                } else {
                    let e = got.unwrap_err();
                    assert!(
                        matches!(e, SpecError::NotHere { here, .. } if here == front),
                        "{name}: {}: {e}",
                        k.name
                    );
                }
            }
        }
        let e = parse("quilt:backend=host").unwrap_err().to_string();
        assert!(e.contains("PyTorch library"), "{e}");
        let c = quilt_of("quilt:memory_limit=2GiB");
        assert_eq!(
            c.pool.limit,
            quilt_alloc::quilt::MemoryLimit::Bytes(2 << 30)
        );
        match parse("classic:memory_fraction=0.5").unwrap() {
            Spec::Caching(c) => assert_eq!(c.memory_fraction, Some(0.5)),
            other => panic!("{other:?}"),
        }
    }
}
