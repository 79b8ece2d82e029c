//! `peer_access` in `QUILT_ALLOC_CONF`'s grammar (`quilt_alloc::settings`): the text
//! reaches `QuiltConfig::peer_access`, an allocator built from it makes
//! every mapping accessible from those peers (simulated devices), and bad
//! values are refused with what a valid one is.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
use quilt_alloc::settings::{self, SettingsError};
use quilt_alloc::DeviceAllocator;
use quilt_vmm::sim::{SimConfig, SimVmm};
use quilt_vmm::{DeviceSet, StreamId};

const MIB: u64 = 1 << 20;

#[test]
fn peer_access_from_conf_text_reaches_every_mapping() {
    let c = settings::parse(QuiltConfig::default(), "peer_access:1+3, reclaim:always").unwrap();
    assert_eq!(c.peer_access, DeviceSet::of(&[1, 3]).unwrap());
    let none = settings::parse(QuiltConfig::default(), "peer_access:none").unwrap();
    assert_eq!(none.peer_access, DeviceSet::EMPTY);
    let applied = settings::apply(QuiltConfig::default(), &[("peer_access", "2")]).unwrap();
    assert_eq!(applied.peer_access, DeviceSet::of(&[2]).unwrap());
    assert!(settings::FrontEnd::Quilt.takes("peer_access"));
    assert!(settings::FrontEnd::Library.takes("peer_access"));
    assert_eq!(settings::DEVICE_KEYS, ["peer_access"]);

    // Device 0 of four: every page it maps is accessible from 0, 1 and 3.
    let sim = Arc::new(
        SimVmm::new(SimConfig {
            capacity: 1 << 30,
            device_count: 4,
            ordinal: 0,
            ..SimConfig::default()
        })
        .unwrap(),
    );
    let quilt = QuiltAllocator::new(sim.clone(), c).unwrap();
    let s = StreamId::DEFAULT;
    let blocks: Vec<_> = [3 * MIB, 7 * MIB + 5, 512, 20 * MIB]
        .iter()
        .map(|&n| quilt.allocate(n, s).unwrap())
        .collect();
    quilt.free(blocks[1].ptr).unwrap();
    let stitched = quilt.allocate(9 * MIB, s).unwrap();
    let page = quilt.pool_stats().page_size;
    for b in blocks
        .iter()
        .filter(|b| b.ptr != blocks[1].ptr)
        .chain([&stitched])
    {
        let mut at = b.ptr - b.ptr % page;
        while at < b.ptr + b.size {
            assert_eq!(
                sim.devices_with_access(at),
                Some(vec![0, 1, 3]),
                "page at {at:#x} of block {:#x}",
                b.ptr
            );
            at += page;
        }
    }
    quilt.check_invariants().unwrap();
}

#[test]
fn peer_access_bad_values_say_what_is_valid() {
    for (value, expect) in [
        ("1,2", "joined by +"),
        ("one", "joined by +"),
        ("1+", "joined by +"),
        ("", "joined by +"),
        ("2+2", "named twice"),
        ("64", "up to 63"),
        ("all", "or none"),
    ] {
        let e = settings::apply(QuiltConfig::default(), &[("peer_access", value)]).unwrap_err();
        assert!(matches!(e, SettingsError::BadValue { .. }), "{value}: {e}");
        assert!(e.to_string().contains(expect), "{value}: {e}");
    }
    // In the text grammar a comma ends the value: `1,2` is a value and a bad pair.
    assert!(settings::parse(QuiltConfig::default(), "peer_access:1,2").is_err());
    assert!(matches!(
        settings::apply(
            QuiltConfig::default(),
            &[("peer_access", "1"), ("peer_access", "2")]
        ),
        Err(SettingsError::Repeated { .. })
    ));
}
