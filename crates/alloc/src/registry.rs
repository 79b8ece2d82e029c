//! One allocator per device, one registry: the allocator of device `i`,
//! created on first use with its own backend and page pool.
//!
//! A [`DeviceRegistry`] knows how many devices there are and how to open the
//! driver of each (a [`VmmFactory`]: `CudaVmm::new` on a GPU machine, a
//! simulated device per ordinal in tests). [`DeviceRegistry::quilt`] returns
//! device `i`'s [`QuiltAllocator`], creating it on the first call (once, under
//! a per-device lock: concurrent first calls get the same allocator);
//! [`DeviceRegistry::comm`] does the same for its [`CommAllocator`] of
//! communication buffers, on the same backend.
//!
//! [`PeerAccess`] decides which other devices reach each device's memory:
//! with [`PeerAccess::AllDevices`] every mapping a device's allocators make
//! gets one `cuMemSetAccess` naming that device and every other one (memory
//! mapped with `cuMemMap` is not covered by `cudaEnablePeerAccess`). The
//! simulated backend charges such a call [`quilt_vmm::sim::CostModel::set_access_ns_for`]
//! the number of devices named, and counts it as one set-access.

use std::sync::{Arc, Mutex, OnceLock};

use quilt_vmm::{DeviceOrdinal, DeviceSet, Vmm, VmmError};

use crate::comm::{CommAllocator, CommConfig};
use crate::error::AllocError;
use crate::quilt::{QuiltAllocator, QuiltConfig};

/// Opens the driver of one device.
pub type VmmFactory = Box<dyn Fn(DeviceOrdinal) -> Result<Arc<dyn Vmm>, VmmError> + Send + Sync>;

/// The factory of a GPU machine: `CudaVmm::new(i)` for device `i`.
#[cfg(feature = "cuda")]
pub fn cuda_factory() -> VmmFactory {
    Box::new(|device| {
        let vmm = quilt_vmm::cuda::CudaVmm::new(device as usize)?;
        Ok(Arc::new(vmm) as Arc<dyn Vmm>)
    })
}

/// Which other devices reach each device's memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PeerAccess {
    /// None: each device's memory is set accessible to that device alone.
    #[default]
    None,
    /// Every other device of the registry.
    AllDevices,
    /// These devices (a device's own ordinal in the set is ignored for it).
    Devices(DeviceSet),
}

impl PeerAccess {
    /// The peers of `device` among `count` devices.
    pub fn peers_of(self, device: DeviceOrdinal, count: u32) -> DeviceSet {
        match self {
            PeerAccess::None => DeviceSet::EMPTY,
            PeerAccess::AllDevices => DeviceSet::all(count).without(device),
            PeerAccess::Devices(set) => set.without(device),
        }
    }
}

/// One device's slot: its backend and allocators, each made once.
#[derive(Default)]
struct Slot {
    vmm: OnceLock<Arc<dyn Vmm>>,
    quilt: OnceLock<Arc<QuiltAllocator>>,
    comm: OnceLock<Arc<CommAllocator>>,
    /// Held while one of the above is being made.
    init: Mutex<()>,
}

/// The allocators of every device of a process (see the module documentation).
pub struct DeviceRegistry {
    slots: Vec<Slot>,
    factory: VmmFactory,
    quilt_config: QuiltConfig,
    comm_config: CommConfig,
    peers: PeerAccess,
}

impl std::fmt::Debug for DeviceRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceRegistry")
            .field("devices", &self.slots.len())
            .field("opened", &self.opened())
            .field("peers", &self.peers)
            .finish_non_exhaustive()
    }
}

impl DeviceRegistry {
    /// A registry of `device_count` devices opened by `factory`, whose Quilt
    /// allocators use `quilt_config` (its `peer_access` replaced per device
    /// by what `peers` says) and whose communication allocators use
    /// `comm_config` (its `peers` likewise).
    ///
    /// Errors: `InvalidConfig` for no device, more than
    /// [`DeviceSet::CAPACITY`], or a peer set naming a device past the count.
    pub fn new(
        device_count: u32,
        factory: VmmFactory,
        quilt_config: QuiltConfig,
        comm_config: CommConfig,
        peers: PeerAccess,
    ) -> Result<DeviceRegistry, AllocError> {
        if device_count == 0 || device_count > DeviceSet::CAPACITY {
            return Err(AllocError::InvalidConfig {
                reason: format!(
                    "registry: {device_count} devices (1 to {} supported)",
                    DeviceSet::CAPACITY
                ),
            });
        }
        if let PeerAccess::Devices(set) = peers {
            if set.to_vec().iter().any(|d| *d >= device_count) {
                return Err(AllocError::InvalidConfig {
                    reason: format!(
                        "registry: peer set {:?} names a device past the {device_count} devices",
                        set.to_vec()
                    ),
                });
            }
        }
        Ok(DeviceRegistry {
            slots: (0..device_count).map(|_| Slot::default()).collect(),
            factory,
            quilt_config,
            comm_config,
            peers,
        })
    }

    /// How many devices it covers.
    pub fn device_count(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Devices whose backend has been opened so far.
    pub fn opened(&self) -> Vec<DeviceOrdinal> {
        (0..self.device_count())
            .filter(|d| self.slots[*d as usize].vmm.get().is_some())
            .collect()
    }

    /// The peers every mapping of `device` is made accessible from.
    pub fn peers_of(&self, device: DeviceOrdinal) -> DeviceSet {
        self.peers.peers_of(device, self.device_count())
    }

    fn slot(&self, device: DeviceOrdinal) -> Result<&Slot, AllocError> {
        self.slots
            .get(device as usize)
            .ok_or_else(|| AllocError::InvalidConfig {
                reason: format!(
                    "registry: device {device} of {} devices",
                    self.device_count()
                ),
            })
    }

    /// Makes `cell`'s value with `make` unless there is one, once.
    fn get_or_make<T: Clone>(
        slot: &Slot,
        cell: &OnceLock<T>,
        make: impl FnOnce() -> Result<T, AllocError>,
    ) -> Result<T, AllocError> {
        if let Some(v) = cell.get() {
            return Ok(v.clone());
        }
        let _guard = slot.init.lock().map_err(|_| AllocError::Poisoned)?;
        if let Some(v) = cell.get() {
            return Ok(v.clone());
        }
        let v = make()?;
        // Under the lock nobody else can have set it.
        let _ = cell.set(v.clone());
        Ok(v)
    }

    /// Device `device`'s backend, opened on first use. The factory's device
    /// must report the ordinal asked for and the registry's device count.
    pub fn vmm(&self, device: DeviceOrdinal) -> Result<Arc<dyn Vmm>, AllocError> {
        let slot = self.slot(device)?;
        Self::get_or_make(slot, &slot.vmm, || {
            let vmm = (self.factory)(device)?;
            let caps = vmm.caps();
            let peers = self.peers_of(device);
            if caps.ordinal != device
                || (!peers.is_empty() && caps.device_count < self.device_count())
            {
                return Err(AllocError::InvalidConfig {
                    reason: format!(
                        "registry: device {device} opened as ordinal {} of {} devices",
                        caps.ordinal, caps.device_count
                    ),
                });
            }
            Ok(vmm)
        })
    }

    /// Device `device`'s Quilt allocator, created on first use.
    pub fn quilt(&self, device: DeviceOrdinal) -> Result<Arc<QuiltAllocator>, AllocError> {
        let vmm = self.vmm(device)?;
        let slot = self.slot(device)?;
        Self::get_or_make(slot, &slot.quilt, || {
            let config = QuiltConfig {
                peer_access: self.peers_of(device),
                ..self.quilt_config
            };
            QuiltAllocator::new(vmm, config).map(Arc::new)
        })
    }

    /// Device `device`'s communication-buffer allocator, created on first use.
    pub fn comm(&self, device: DeviceOrdinal) -> Result<Arc<CommAllocator>, AllocError> {
        let vmm = self.vmm(device)?;
        let slot = self.slot(device)?;
        Self::get_or_make(slot, &slot.comm, || {
            let config = CommConfig {
                peers: self.peers_of(device).to_vec(),
                ..self.comm_config.clone()
            };
            CommAllocator::new(vmm, config).map(Arc::new)
        })
    }
}
