#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code
use super::*;

/// A valid value of `key` (its row's example).
fn good_value(key: &str) -> &'static str {
    lookup(key).map(|k| k.example).unwrap_or("?")
}

/// The settings a key needs beside it to be live.
fn companions(key: &str) -> &'static [(&'static str, &'static str)] {
    match key {
        "cached_permille" => &[("reclaim", "cached_above")],
        "idle_ops" => &[("reclaim", "idle_for")],
        "reuse_limit" => &[("frag_limit", "32MiB")],
        "capacity" => &[("backend", "host")],
        _ => &[],
    }
}

/// Each front end, fed `pairs` through its own syntax and entry point.
fn through(front: FrontEnd, pairs: &[(&str, &str)]) -> Result<(), SettingsError> {
    let conf_text = |sep: &str| {
        pairs
            .iter()
            .map(|(k, v)| format!("{k}{sep}{v}"))
            .collect::<Vec<_>>()
            .join(",")
    };
    match front {
        FrontEnd::Quilt => {
            // QUILT_ALLOC_CONF's text and the spec's pairs agree.
            let text = parse(QuiltConfig::default(), &conf_text(":"));
            let spec_text = format!("quilt:{}", conf_text("="));
            let (name, spec_pairs) = split_spec(&spec_text)?;
            assert_eq!(name, "quilt");
            let spec = apply(QuiltConfig::default(), &spec_pairs);
            assert_eq!(text, spec, "{pairs:?}");
            text.map(|_| ())
        }
        FrontEnd::Library => library(&conf_text(":")).map(|_| ()),
        FrontEnd::Caching => {
            let c = apply_caching(CachingConfig::classic(), pairs).map(|_| ());
            let e = apply_caching(CachingConfig::expandable(), pairs).map(|_| ());
            assert_eq!(c, e, "{pairs:?}");
            c
        }
        FrontEnd::Offset => apply_offset(OffsetConfig::default(), pairs).map(|_| ()),
    }
}

#[test]
fn every_front_end_takes_its_keys_and_refuses_the_others_alike() {
    for front in FrontEnd::ALL {
        for k in &VOCABULARY {
            let mut pairs: Vec<(&str, &str)> = companions(k.name).to_vec();
            pairs.push((k.name, good_value(k.name)));
            let got = through(front, &pairs);
            if k.front_ends.contains(&front) {
                // Companions are of the same front ends as the key.
                assert_eq!(got, Ok(()), "{front:?} refuses {}", k.name);
                assert!(front.takes(k.name));
            } else {
                assert!(!front.takes(k.name));
                let alone = through(front, &[(k.name, good_value(k.name))]);
                assert_eq!(
                    alone,
                    Err(SettingsError::NotHere {
                        key: k.name,
                        here: front,
                        applies_to: k.front_ends,
                        valid: front.valid_keys(),
                    }),
                    "{front:?} takes {}",
                    k.name
                );
            }
        }
        // An unknown key: the same error everywhere, naming the front end's keys.
        let e = through(front, &[("colour", "blue")]).unwrap_err();
        assert_eq!(
            e,
            SettingsError::UnknownKey {
                key: "colour".into(),
                valid: front.valid_keys()
            }
        );
        for key in front.valid_keys() {
            assert!(e.to_string().contains(key), "{front:?}: {key} not in {e}");
        }
        // A bad value: the same error in every front end that takes the key.
        for k in VOCABULARY.iter().filter(|k| k.front_ends.contains(&front)) {
            let e = through(front, &[(k.name, "lots")]).unwrap_err();
            assert!(
                matches!(&e, SettingsError::BadValue { key, value, .. } if *key == k.name && value == "lots"),
                "{front:?} {}: {e}",
                k.name
            );
            for other in k.front_ends {
                assert_eq!(through(*other, &[(k.name, "lots")]).unwrap_err(), e);
            }
        }
    }
}

#[test]
fn the_key_lists_come_from_the_one_table() {
    let names: Vec<&str> = VOCABULARY.iter().map(|k| k.name).collect();
    for (i, n) in names.iter().enumerate() {
        assert!(!names[..i].contains(n), "{n} twice");
        assert!(lookup(n).is_some());
    }
    for front in FrontEnd::ALL {
        let expect: Vec<&str> = VOCABULARY
            .iter()
            .filter(|k| k.front_ends.contains(&front))
            .map(|k| k.name)
            .collect();
        assert_eq!(front.valid_keys(), &expect[..], "{front:?}");
    }
    let groups: Vec<&str> = KEYS
        .iter()
        .chain(&SERVING_KEYS)
        .chain(&DEVICE_KEYS)
        .chain(&CACHING_KEYS)
        .chain(&LIMIT_KEYS)
        .chain(&LIBRARY_KEYS)
        .chain(&OFFSET_KEYS)
        .copied()
        .collect();
    assert_eq!(groups, names, "the groups cover the table, in its order");
    assert_eq!(LIMIT_KEYS, ["memory_fraction", "memory_limit"]);
    assert_eq!(LIBRARY_KEYS, ["backend", "capacity"]);
    // The library takes every key of Quilt's configuration, and two more.
    assert!(QUILT_FRONT_KEYS.iter().all(|k| FrontEnd::Library.takes(k)));
    assert_eq!(LIBRARY_FRONT_KEYS.len(), QUILT_FRONT_KEYS.len() + 2);
}

#[test]
fn memory_limit_and_memory_fraction_are_one_or_the_other() {
    for front in [FrontEnd::Quilt, FrontEnd::Library] {
        for text in [
            "memory_limit:1GiB,memory_fraction:0.5",
            "memory_fraction:0.5,memory_limit:1GiB",
        ] {
            let e = match front {
                FrontEnd::Quilt => parse(QuiltConfig::default(), text).unwrap_err(),
                _ => library(text).unwrap_err(),
            };
            assert!(matches!(e, SettingsError::Exclusive { .. }), "{e}");
            assert!(e.to_string().contains("give one"), "{e}");
        }
    }
    assert_eq!(
        library("backend:host,capacity:8GiB,memory_limit:2GiB")
            .unwrap()
            .quilt
            .pool
            .limit,
        MemoryLimit::Bytes(2 << 30)
    );
    assert_eq!(
        library("memory_fraction:0.25").unwrap().quilt.pool.limit,
        MemoryLimit::Fraction(0.25)
    );
    assert_eq!(check_fraction(0.5), Ok(0.5));
    let e = check_fraction(2.0).unwrap_err();
    assert_eq!(e, fraction(&MEMORY_FRACTION, "2").unwrap_err());
    assert!(e.to_string().contains("(0, 1]"), "{e}");
}

#[test]
fn the_syntaxes_differ_only_in_separators() {
    assert_eq!(
        split(" a:1 , b:2,", Syntax::AllocConf).unwrap(),
        [("a", "1"), ("b", "2")]
    );
    assert_eq!(
        split("a=1,b=2", Syntax::Spec).unwrap(),
        [("a", "1"), ("b", "2")]
    );
    for (text, syntax, form) in [
        ("reclaim", Syntax::AllocConf, "key:value"),
        ("reclaim", Syntax::Spec, "KEY=VALUE"),
        ("reclaim=", Syntax::Spec, "KEY=VALUE"),
        ("a=1,,b=2", Syntax::Spec, "KEY=VALUE"),
    ] {
        let e = split(text, syntax).unwrap_err();
        assert!(
            matches!(&e, SettingsError::Malformed { expected, .. } if *expected == form),
            "{text}: {e}"
        );
    }
    assert_eq!(split_spec("gmlake").unwrap(), ("gmlake", vec![]));
}

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
        "backend:host",
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
        assert!(
            matches!(e, SettingsError::IgnoredKey { .. }),
            "{dead:?}: {e}"
        );
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
            Err(SettingsError::IgnoredKey { .. })
        ));
    }
    assert!(matches!(
        apply(
            QuiltConfig::default(),
            &[("candidates", "2"), ("candidates", "3")]
        ),
        Err(SettingsError::Repeated { key: "candidates" })
    ));
    assert!(matches!(
        apply(QuiltConfig::default(), &[("candidates", "0")]),
        Err(SettingsError::BadValue { .. })
    ));
}

#[test]
fn the_library_s_own_keys() {
    let c = library("").unwrap();
    assert_eq!(c.backend, Backend::Cuda);
    assert_eq!(c.quilt, QuiltConfig::default());
    assert_eq!(library("backend:sim").unwrap().capacity, 80 << 30);
    assert_eq!(library("backend:host").unwrap().capacity, 1 << 30);
    for (text, expect) in [
        ("backend:tpu", "cuda, host or sim"),
        ("backend:host,capacity:lots", "bad size"),
        ("backend:host,capacity:0", "above 0"),
        ("capacity:1GiB", "host and sim"),
        ("backend:host,backend:sim", "twice"),
        ("backend", "key:value"),
    ] {
        let e = library(text).unwrap_err().to_string();
        assert!(e.contains(expect), "{text}: {e}");
    }
}
