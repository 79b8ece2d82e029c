//! Sharing physical memory between devices and processes: the handle types a
//! `cuMemCreate` requests, the device's capabilities, shareable handles, and
//! the device sets `cuMemSetAccess` takes.
//!
//! CUDA's rules, which every backend's ledger enforces:
//! - a handle can be exported (`cuMemExportToShareableHandle`) only as a
//!   handle type requested when it was created (`CUmemAllocationProp::
//!   requestedHandleTypes`); anything else is refused;
//! - a device may request only the handle types it reports support for
//!   (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`,
//!   `..._HANDLE_TYPE_FABRIC_SUPPORTED`), and `gpuDirectRDMACapable` only where
//!   it reports `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`;
//! - memory mapped with `cuMemMap` is reachable from a device only once a
//!   `cuMemSetAccess` named that device (`cudaEnablePeerAccess` does not cover
//!   it); every device named must exist.
//!
//! [`HandleTypes::preferred_for`] is the policy production allocators use
//! (NCCL's `ncclMemAlloc`, PyTorch's expandable segments): POSIX file
//! descriptors where supported, FABRIC too where supported, and nothing the
//! device lacks.

use std::fmt;
use std::os::fd::OwnedFd;

/// A device's ordinal (CUDA's `CUdevice` ordinal, as `cuDeviceGet` takes it).
pub type DeviceOrdinal = u32;

/// One kind of shareable handle (`CUmemAllocationHandleType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum HandleKind {
    /// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: a file descriptor, passed
    /// between processes over a Unix socket (`SCM_RIGHTS`).
    PosixFd,
    /// `CU_MEM_HANDLE_TYPE_FABRIC`: 64 opaque bytes, valid across nodes of one
    /// NVLink fabric (IMEX channel); CUDA 12.3 and later.
    Fabric,
}

impl fmt::Display for HandleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HandleKind::PosixFd => "posix-fd",
            HandleKind::Fabric => "fabric",
        })
    }
}

/// The set of handle types a `cuMemCreate` requests
/// (`CUmemAllocationProp::requestedHandleTypes`, a bit set).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct HandleTypes {
    /// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
    pub posix_fd: bool,
    /// `CU_MEM_HANDLE_TYPE_FABRIC`.
    pub fabric: bool,
}

impl HandleTypes {
    /// No handle type (`CU_MEM_HANDLE_TYPE_NONE`): the handle cannot be exported.
    pub const NONE: HandleTypes = HandleTypes {
        posix_fd: false,
        fabric: false,
    };

    /// POSIX file descriptors only.
    pub const POSIX_FD: HandleTypes = HandleTypes {
        posix_fd: true,
        fabric: false,
    };

    /// True when `kind` is in the set.
    pub fn contains(self, kind: HandleKind) -> bool {
        match kind {
            HandleKind::PosixFd => self.posix_fd,
            HandleKind::Fabric => self.fabric,
        }
    }

    /// True when every type of `self` is in `other`.
    pub fn is_subset_of(self, other: HandleTypes) -> bool {
        (!self.posix_fd || other.posix_fd) && (!self.fabric || other.fabric)
    }

    /// True for the empty set.
    pub fn is_empty(self) -> bool {
        self == HandleTypes::NONE
    }

    /// The types both sets hold.
    pub fn intersect(self, other: HandleTypes) -> HandleTypes {
        HandleTypes {
            posix_fd: self.posix_fd && other.posix_fd,
            fabric: self.fabric && other.fabric,
        }
    }

    /// The production policy: POSIX file descriptors where the device supports
    /// them, FABRIC as well where it supports that, nothing it lacks.
    pub fn preferred_for(caps: &DeviceCaps) -> HandleTypes {
        HandleTypes {
            posix_fd: true,
            fabric: true,
        }
        .intersect(caps.handle_types)
    }
}

impl fmt::Display for HandleTypes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.posix_fd, self.fabric) {
            (false, false) => f.write_str("none"),
            (true, false) => f.write_str("posix-fd"),
            (false, true) => f.write_str("fabric"),
            (true, true) => f.write_str("posix-fd+fabric"),
        }
    }
}

/// What a `cuMemCreate` asks for beyond its size: the handle types it can be
/// exported as, and `allocFlags.gpuDirectRDMACapable`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CreateProps {
    /// Handle types requested (`requestedHandleTypes`).
    pub handle_types: HandleTypes,
    /// `allocFlags.gpuDirectRDMACapable`: the memory may be registered with a
    /// NIC for GPUDirect RDMA.
    pub gpu_direct_rdma: bool,
}

impl CreateProps {
    /// What NCCL's `ncclMemAlloc` asks of a device: [`HandleTypes::preferred_for`]
    /// and GPUDirect RDMA where the device supports it with VMM.
    pub fn preferred_for(caps: &DeviceCaps) -> CreateProps {
        CreateProps {
            handle_types: HandleTypes::preferred_for(caps),
            gpu_direct_rdma: caps.gpu_direct_rdma_with_vmm,
        }
    }
}

/// What a device reports about sharing (`cuDeviceGetAttribute`,
/// `cuDeviceGetCount`, `cuMemGetAllocationGranularity`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceCaps {
    /// This device's ordinal.
    pub ordinal: DeviceOrdinal,
    /// Devices visible to the process (`cuDeviceGetCount`): valid ordinals
    /// for `set_access_for` are `0..device_count`.
    pub device_count: u32,
    /// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`.
    pub vmm: bool,
    /// The handle types it supports (`..._HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`,
    /// `..._HANDLE_TYPE_FABRIC_SUPPORTED`).
    pub handle_types: HandleTypes,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`.
    pub gpu_direct_rdma_with_vmm: bool,
    /// `cuMemGetAllocationGranularity(..., CU_MEM_ALLOC_GRANULARITY_MINIMUM)`.
    pub granularity: u64,
    /// `cuMemGetAllocationGranularity(..., CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)`:
    /// what NCCL aligns communication buffers to (a multiple of `granularity`).
    pub recommended_granularity: u64,
}

impl DeviceCaps {
    /// A lone device `0` of `granularity` that shares nothing: what a backend
    /// without sharing support reports.
    pub fn single(granularity: u64) -> DeviceCaps {
        DeviceCaps {
            ordinal: 0,
            device_count: 1,
            vmm: true,
            handle_types: HandleTypes::NONE,
            gpu_direct_rdma_with_vmm: false,
            granularity,
            recommended_granularity: granularity,
        }
    }

    /// Every device of the process, this one included, in order.
    pub fn all_devices(&self) -> Vec<DeviceOrdinal> {
        (0..self.device_count).collect()
    }
}

/// An exported handle (`cuMemExportToShareableHandle`): owns its OS object.
///
/// Not `Clone`: a POSIX descriptor is closed when this is dropped (after it
/// was sent to another process or imported, dropping it is what CUDA's
/// users do: the importer holds its own reference).
#[derive(Debug)]
pub enum ShareableHandle {
    /// A POSIX file descriptor (the host backend's is the memfd itself).
    PosixFd(OwnedFd),
    /// A FABRIC handle's 64 bytes.
    Fabric([u8; 64]),
    /// The simulated backend's handle: valid within this process, on any
    /// simulated device.
    Sim(SimShared),
}

impl ShareableHandle {
    /// Its kind.
    pub fn kind(&self) -> HandleKind {
        match self {
            ShareableHandle::PosixFd(_) => HandleKind::PosixFd,
            ShareableHandle::Fabric(_) => HandleKind::Fabric,
            ShareableHandle::Sim(s) => s.kind,
        }
    }
}

/// The simulated backend's shareable handle: an id of the exported memory and
/// its size (it cannot be forged: its fields are private).
#[derive(Debug, PartialEq, Eq)]
pub struct SimShared {
    pub(crate) id: u64,
    pub(crate) size: u64,
    pub(crate) kind: HandleKind,
}

impl SimShared {
    /// The exported memory's id (the same for every export of one handle).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Bytes of the exported memory.
    pub fn size(&self) -> u64 {
        self.size
    }
}

/// A set of device ordinals below 64 (a bit set; `Copy`, so that
/// configurations holding one stay `Copy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DeviceSet(u64);

impl DeviceSet {
    /// The empty set.
    pub const EMPTY: DeviceSet = DeviceSet(0);

    /// Most devices a set can name (ordinals `0..CAPACITY`).
    pub const CAPACITY: u32 = 64;

    /// The set of `devices`; `None` when one is `CAPACITY` or more.
    pub fn of(devices: &[DeviceOrdinal]) -> Option<DeviceSet> {
        devices.iter().try_fold(DeviceSet::EMPTY, |s, d| s.with(*d))
    }

    /// Devices `0..count`, all of them (at most [`DeviceSet::CAPACITY`]).
    pub fn all(count: u32) -> DeviceSet {
        match count {
            0 => DeviceSet::EMPTY,
            c if c >= DeviceSet::CAPACITY => DeviceSet(u64::MAX),
            c => DeviceSet((1u64 << c) - 1),
        }
    }

    /// The set with `device` added; `None` when it is `CAPACITY` or more.
    pub fn with(self, device: DeviceOrdinal) -> Option<DeviceSet> {
        (device < DeviceSet::CAPACITY).then(|| DeviceSet(self.0 | (1u64 << device)))
    }

    /// The set without `device`.
    pub fn without(self, device: DeviceOrdinal) -> DeviceSet {
        if device < DeviceSet::CAPACITY {
            DeviceSet(self.0 & !(1u64 << device))
        } else {
            self
        }
    }

    /// True when `device` is in the set.
    pub fn contains(self, device: DeviceOrdinal) -> bool {
        device < DeviceSet::CAPACITY && self.0 & (1u64 << device) != 0
    }

    /// True for the empty set.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// How many devices it holds.
    pub fn len(self) -> usize {
        self.0.count_ones() as usize
    }

    /// Its devices in increasing order.
    pub fn to_vec(self) -> Vec<DeviceOrdinal> {
        (0..DeviceSet::CAPACITY)
            .filter(|d| self.contains(*d))
            .collect()
    }

    /// `first`, then the set's other devices in increasing order: the
    /// descriptor order of a `cuMemSetAccess` for `first` and these peers.
    pub fn access_list(self, first: DeviceOrdinal) -> Vec<DeviceOrdinal> {
        std::iter::once(first)
            .chain(self.without(first).to_vec())
            .collect()
    }
}
