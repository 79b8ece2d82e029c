//! The driver layer's one error type.

use crate::types::{CallKind, DevicePtr};

/// Everything a driver call can fail with. Every variant carries the figures
/// needed to tell what went wrong without a debugger.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VmmError {
    /// The device (or the simulated capacity) cannot back `requested` more bytes.
    #[error("{call}: out of memory: requested {requested} bytes, {available} bytes available")]
    OutOfMemory {
        /// The call that failed.
        call: CallKind,
        /// Bytes asked for.
        requested: u64,
        /// Bytes still available when the call failed (0 when unknown).
        available: u64,
    },
    /// `cuMemAddressReserve` found no free range of virtual address space of
    /// `requested` bytes (the driver's `CUDA_ERROR_OUT_OF_MEMORY` for a
    /// reservation, the simulated device's address-space limit, the host
    /// backend's arena). Not device memory: releasing physical memory does
    /// not help, releasing reservations (or reserving less) does.
    #[error("{call}: virtual address space exhausted: no free range of {requested} bytes ({available} bytes unreserved, 0 when unknown)")]
    AddressSpaceExhausted {
        /// The call that failed ([`CallKind::Reserve`]).
        call: CallKind,
        /// Bytes of address space asked for.
        requested: u64,
        /// Bytes of address space still unreserved when known (0 when unknown).
        available: u64,
    },
    /// An argument broke one of the driver's rules.
    #[error("{call}: invalid argument `{argument}` = {value:#x}: {rule}")]
    InvalidArgument {
        /// The call that failed.
        call: CallKind,
        /// The argument's name as in the CUDA documentation.
        argument: &'static str,
        /// The value passed.
        value: u64,
        /// The rule it broke, in words.
        rule: &'static str,
    },
    /// An unmap, or a free of a range, named memory that is not mapped.
    #[error("{call}: range {ptr:#x}+{size:#x} is not mapped")]
    NotMapped {
        /// The call that failed.
        call: CallKind,
        /// Start of the range.
        ptr: DevicePtr,
        /// Length of the range.
        size: u64,
    },
    /// A map named a range that already has a mapping in it.
    #[error("{call}: range {ptr:#x}+{size:#x} is already mapped")]
    AlreadyMapped {
        /// The call that failed.
        call: CallKind,
        /// Start of the range.
        ptr: DevicePtr,
        /// Length of the range.
        size: u64,
    },
    /// An address range still has mappings in it and cannot be freed.
    #[error("{call}: range {ptr:#x}+{size:#x} still has {mappings} mapping(s)")]
    StillMapped {
        /// The call that failed.
        call: CallKind,
        /// Start of the range.
        ptr: DevicePtr,
        /// Length of the range.
        size: u64,
        /// Mappings still inside it.
        mappings: usize,
    },
    /// No driver, no device, or the device lacks virtual memory management.
    #[error("backend unavailable: {reason}")]
    Unavailable {
        /// Why.
        reason: Unavailability,
    },
    /// The backend does not implement the call (a default body of the
    /// [`crate::Vmm`] trait), or the device lacks what the call needs.
    #[error("{call}: not supported by the {backend} backend: {reason}")]
    Unsupported {
        /// The call that failed.
        call: CallKind,
        /// The backend's name ([`crate::Vmm::backend_name`]).
        backend: &'static str,
        /// What is missing, in words.
        reason: &'static str,
    },
    /// The CUDA driver returned an error (or the simulated backend injected one).
    #[error("{call}: {name} ({code}): {text}")]
    Driver {
        /// The call that failed.
        call: CallKind,
        /// The numeric `CUresult`.
        code: u32,
        /// Its name, e.g. `CUDA_ERROR_INVALID_VALUE`.
        name: String,
        /// The driver's description of it.
        text: String,
    },
}

impl VmmError {
    /// The call that failed, where there is one.
    pub fn call(&self) -> Option<CallKind> {
        match self {
            VmmError::OutOfMemory { call, .. }
            | VmmError::AddressSpaceExhausted { call, .. }
            | VmmError::InvalidArgument { call, .. }
            | VmmError::NotMapped { call, .. }
            | VmmError::AlreadyMapped { call, .. }
            | VmmError::StillMapped { call, .. }
            | VmmError::Driver { call, .. }
            | VmmError::Unsupported { call, .. } => Some(*call),
            VmmError::Unavailable { .. } => None,
        }
    }

    /// True for out-of-memory (including a driver's `CUDA_ERROR_OUT_OF_MEMORY`)
    /// of device memory; false for [`VmmError::AddressSpaceExhausted`].
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, VmmError::OutOfMemory { .. })
            || matches!(self, VmmError::Driver { code: 2, .. })
    }
}

impl VmmError {
    /// True when a reservation found no free virtual address space
    /// ([`VmmError::AddressSpaceExhausted`]).
    pub fn is_address_space_exhausted(&self) -> bool {
        matches!(self, VmmError::AddressSpaceExhausted { .. })
    }
}

/// Why a backend cannot be had ([`VmmError::Unavailable`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unavailability {
    /// No `libcuda` could be loaded.
    #[error("libcuda could not be loaded: no CUDA driver on this machine")]
    NoDriver,
    /// The loaded `libcuda` lacks symbols the CUDA backend calls.
    #[error("libcuda lacks {} symbol(s) this backend calls: {}", .missing.len(), .missing.join(", "))]
    MissingSymbols {
        /// The symbols missing, in the order the backend lists them.
        missing: Vec<&'static str>,
    },
    /// A setup call of the driver failed.
    #[error("{step} failed: {name} ({code}): {text}")]
    Setup {
        /// The driver call, e.g. `cuInit`.
        step: &'static str,
        /// The numeric `CUresult`.
        code: u32,
        /// Its name, e.g. `CUDA_ERROR_NO_DEVICE`.
        name: String,
        /// The driver's description of it.
        text: String,
    },
    /// No device of that ordinal.
    #[error("device ordinal {ordinal} out of range: {count} CUDA device(s)")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver reports.
        count: u32,
    },
    /// The device lacks virtual memory management.
    #[error("device {ordinal} does not support virtual memory management")]
    NoVmm {
        /// The device's ordinal.
        ordinal: usize,
    },
    /// The driver reported a granularity that is not a power of two.
    #[error("granularity {granularity} is not a power of two")]
    Granularity {
        /// The granularity reported, in bytes.
        granularity: u64,
    },
    /// The host backend runs on 64-bit Linux only.
    #[error("the host backend needs 64-bit Linux (memfd and mmap)")]
    Platform,
    /// The host backend's address arena could not be reserved.
    #[error("cannot reserve a {size}-byte address arena: {text} ({name})")]
    Arena {
        /// The smallest size tried, in bytes.
        size: u64,
        /// The system error's label (e.g. `errno 12`).
        name: String,
        /// The system's description of it.
        text: String,
    },
}

/// Result alias of the driver layer.
pub type Result<T, E = VmmError> = std::result::Result<T, E>;
