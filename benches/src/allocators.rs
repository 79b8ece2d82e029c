//! The allocator registry: a name on the command line to a constructor.

use std::sync::Arc;

use quilt_alloc::baselines::classic::{ClassicAllocator, ClassicConfig};
use quilt_alloc::baselines::expandable::{ExpandableAllocator, ExpandableConfig};
use quilt_alloc::baselines::offset::{OffsetAllocator, OffsetConfig};
use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
use quilt_alloc::{AllocError, DeviceAllocator};
use quilt_vmm::Vmm;

/// The allocators every comparison runs by default, in report order.
pub const ALLOCATOR_NAMES: [&str; 5] = ["quilt", "classic", "expandable", "gmlake", "offset"];

/// Why an allocator could not be built.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// No allocator has this name.
    #[error("unknown allocator `{name}` (known: {})", ALLOCATOR_NAMES.join(", "))]
    Unknown {
        /// The name asked for.
        name: String,
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

/// Check that `name` is a known allocator, without building one.
pub fn check_name(name: &str) -> Result<(), RegistryError> {
    if ALLOCATOR_NAMES.contains(&name) {
        Ok(())
    } else {
        Err(RegistryError::Unknown {
            name: name.to_string(),
        })
    }
}

/// Build the allocator called `name` over `vmm`, with its default configuration.
pub fn build(name: &str, vmm: Arc<dyn Vmm>) -> Result<Box<dyn DeviceAllocator>, RegistryError> {
    let wrap = |source: AllocError| RegistryError::Construct {
        name: name.to_string(),
        source,
    };
    match name {
        "classic" => Ok(Box::new(
            ClassicAllocator::new(vmm, ClassicConfig::default()).map_err(wrap)?,
        )),
        "expandable" => Ok(Box::new(
            ExpandableAllocator::new(vmm, ExpandableConfig::default()).map_err(wrap)?,
        )),
        "quilt" => Ok(Box::new(
            QuiltAllocator::new(vmm, QuiltConfig::default()).map_err(wrap)?,
        )),
        "gmlake" => Ok(Box::new(
            QuiltAllocator::new(vmm, QuiltConfig::gmlake()).map_err(wrap)?,
        )),
        "offset" => Ok(Box::new(
            OffsetAllocator::new(vmm, OffsetConfig::default()).map_err(wrap)?,
        )),
        _ => Err(RegistryError::Unknown {
            name: name.to_string(),
        }),
    }
}
