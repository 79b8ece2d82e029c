//! The allocator registry: a spec on the command line (a name, and settings
//! changed from its defaults, see [`crate::spec`]) to a constructor.

use std::sync::Arc;

use quilt_alloc::baselines::offset::OffsetAllocator;
use quilt_alloc::baselines::CachingAllocator;
use quilt_alloc::quilt::QuiltAllocator;
use quilt_alloc::{AllocError, DeviceAllocator};
use quilt_vmm::Vmm;

use crate::spec::{self, Spec, SpecError};

/// The allocators every comparison runs by default, in report order.
pub const ALLOCATOR_NAMES: [&str; 5] = spec::NAMES;

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
    let wrap = |source: AllocError| RegistryError::Construct {
        name: spec.to_string(),
        source,
    };
    Ok(match parse(spec)? {
        Spec::Caching(c) => Box::new(CachingAllocator::new(vmm, c).map_err(wrap)?),
        Spec::Quilt(c) => Box::new(QuiltAllocator::new(vmm, c).map_err(wrap)?),
        Spec::Offset(c) => Box::new(OffsetAllocator::new(vmm, c).map_err(wrap)?),
    })
}
