//! The allocator registry: a spec on the command line (a name, and settings
//! changed from its defaults, see [`crate::spec`]) to a constructor, and what
//! the harness asks of each allocator besides ([`Entry`]: whether it runs
//! the serving events natively, whether it is the reference of the ratio
//! columns).

use std::sync::Arc;

use quilt_alloc::baselines::offset::OffsetAllocator;
use quilt_alloc::baselines::CachingAllocator;
use quilt_alloc::quilt::QuiltAllocator;
use quilt_alloc::{AllocError, DeviceAllocator};
use quilt_vmm::Vmm;

use crate::spec::{self, Spec, SpecError};

/// The allocators every comparison runs by default, in report order.
pub const ALLOCATOR_NAMES: [&str; 5] = spec::NAMES;

/// What the harness asks of an allocator of the registry, besides building it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The name a spec starts with.
    pub name: &'static str,
    /// Runs the serving events (growable buffers, tagged allocations, sleep
    /// and wake) on its own API ([`build_for_serving`] gives it as
    /// [`Built::Native`]); the others have them emulated ([`crate::serving_events`]).
    pub native_serving: bool,
    /// The reference allocator: with its default settings, the row the wide
    /// table's ratio columns (`min cap/classic`, ...) divide by.
    pub reference: bool,
    /// The allocator under study: drawn last and thicker in the charts.
    pub subject: bool,
}

/// Every allocator of the registry, in the order of [`ALLOCATOR_NAMES`].
pub const REGISTRY: [Entry; 5] = [
    Entry {
        name: "quilt",
        native_serving: true,
        reference: false,
        subject: true,
    },
    Entry {
        name: "classic",
        native_serving: false,
        reference: true,
        subject: false,
    },
    Entry {
        name: "expandable",
        native_serving: false,
        reference: false,
        subject: false,
    },
    // Quilt's GMLake preset: GMLake has no growable buffers.
    Entry {
        name: "gmlake",
        native_serving: false,
        reference: false,
        subject: false,
    },
    Entry {
        name: "offset",
        native_serving: false,
        reference: false,
        subject: false,
    },
];

/// The registry's entry of the allocator `spec` names (`NAME[:...]`), if any.
pub fn entry(spec: &str) -> Option<&'static Entry> {
    let name = spec.split_once(':').map_or(spec, |(name, _)| name).trim();
    REGISTRY.iter().find(|e| e.name == name)
}

/// Whether `spec` is the reference allocator with its default settings (no
/// setting changed): the row the ratio columns divide by.
pub fn is_reference(spec: &str) -> bool {
    !spec.contains(':') && entry(spec).is_some_and(|e| e.reference)
}

/// Whether `spec` names the allocator under study (any settings).
pub fn is_subject(spec: &str) -> bool {
    entry(spec).is_some_and(|e| e.subject)
}

/// Why an allocator could not be built.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The spec names no allocator, or a setting it does not have, or a bad value.
    #[error("allocator `{spec}`: {source}")]
    Spec {
        /// The spec as given.
        spec: String,
        /// What is wrong with it.
        source: SpecError,
    },
    /// The constructor failed.
    #[error("building allocator `{name}`: {source}")]
    Construct {
        /// The allocator.
        name: String,
        /// The constructor's error.
        source: AllocError,
    },
}

/// Check that `spec` names a known allocator with valid settings, without
/// building one.
pub fn check_name(spec: &str) -> Result<(), RegistryError> {
    parse(spec).map(|_| ())
}

fn parse(text: &str) -> Result<Spec, RegistryError> {
    spec::parse(text).map_err(|source| RegistryError::Spec {
        spec: text.to_string(),
        source,
    })
}

/// Build the allocator that `spec` names (`NAME[:KEY=VALUE,...]`, see
/// [`crate::spec`]) over `vmm`.
pub fn build(spec: &str, vmm: Arc<dyn Vmm>) -> Result<Box<dyn DeviceAllocator>, RegistryError> {
    construct(spec, parse(spec)?, vmm)
}

/// An allocator built for a replay with serving events.
pub enum Built {
    /// One whose registry entry runs the serving events natively
    /// ([`Entry::native_serving`]): Quilt's own API.
    Native(QuiltAllocator),
    /// Any other: its serving events are emulated.
    Emulated(Box<dyn DeviceAllocator>),
}

/// [`build`], keeping the allocator's own type where its registry entry
/// runs the serving events natively.
pub fn build_for_serving(spec: &str, vmm: Arc<dyn Vmm>) -> Result<Built, RegistryError> {
    let native = entry(spec).is_some_and(|e| e.native_serving);
    match parse(spec)? {
        Spec::Quilt(c) if native => QuiltAllocator::new(vmm, c)
            .map(Built::Native)
            .map_err(|source| construct_error(spec, source)),
        other => construct(spec, other, vmm).map(Built::Emulated),
    }
}

fn construct_error(spec: &str, source: AllocError) -> RegistryError {
    RegistryError::Construct {
        name: spec.to_string(),
        source,
    }
}

fn construct(
    spec: &str,
    parsed: Spec,
    vmm: Arc<dyn Vmm>,
) -> Result<Box<dyn DeviceAllocator>, RegistryError> {
    let wrap = |source: AllocError| construct_error(spec, source);
    Ok(match parsed {
        Spec::Caching(c) => Box::new(CachingAllocator::new(vmm, c).map_err(wrap)?),
        Spec::Quilt(c) => Box::new(QuiltAllocator::new(vmm, c).map_err(wrap)?),
        Spec::Offset(c) => Box::new(OffsetAllocator::new(vmm, c).map_err(wrap)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_registry_lists_every_name_in_order_with_one_reference_and_one_subject() {
        let names: Vec<&str> = REGISTRY.iter().map(|e| e.name).collect();
        assert_eq!(names, ALLOCATOR_NAMES);
        assert_eq!(REGISTRY.iter().filter(|e| e.reference).count(), 1);
        assert_eq!(REGISTRY.iter().filter(|e| e.subject).count(), 1);
        assert!(is_reference("classic"));
        assert!(!is_reference("classic:max_split_size=256MiB"));
        assert!(is_subject("quilt:reclaim=always") && !is_subject("gmlake"));
        assert!(entry("nope").is_none());
    }
}
