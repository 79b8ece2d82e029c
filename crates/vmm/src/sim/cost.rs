//! The simulated backend's configuration and its cost model of the driver.

use crate::share::{DeviceOrdinal, HandleTypes};
use crate::types::{CallKind, MapRule};

/// Modelled time of each driver call, in nanoseconds.
///
/// Defaults are the published A100 figures (kvcached's `bench_vmm`, 2 MiB pages,
/// one thread; see the design brief): reserve 19 us, create 193 us per 2 MiB,
/// map 1.5 us, set-access 36 us, unmap 26 us per call; release (25 us) and
/// address-free (19 us) were not measured and are estimates. A stream
/// synchronisation is charged as a pipeline drain, 100 us (see `sync_ns`).
/// Every figure is a knob.
///
/// A successful `create` of `size` bytes costs `create_ns_per_granule *
/// size / granularity` in [`crate::DriverStats::modelled_ns`] and `create_flat_ns`
/// in [`crate::DriverStats::modelled_flat_create_ns`]. A failed `create` costs
/// `create_flat_ns` in both (the driver spends no time backing memory it refuses).
/// Every other call, failed or not, costs its per-call figure in both.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CostModel {
    /// `cuMemAddressReserve`, per call.
    pub reserve_ns: u64,
    /// `cuMemAddressFree`, per call.
    pub address_free_ns: u64,
    /// `cuMemCreate`, per granule (granularity-sized unit, 2 MiB by default) of the handle.
    pub create_ns_per_granule: u64,
    /// `cuMemCreate`, per call, in the flat model.
    pub create_flat_ns: u64,
    /// `cuMemRelease`, per call.
    pub release_ns: u64,
    /// `cuMemMap`, per call.
    pub map_ns: u64,
    /// `cuMemSetAccess`, per call.
    pub set_access_ns: u64,
    /// `cuMemUnmap`, per call.
    pub unmap_ns: u64,
    /// `cuMemGetInfo`, per call.
    pub mem_info_ns: u64,
    /// Event record, query and destroy, stream-wait-event and the capture
    /// question (`cuStreamIsCapturing`), per call: small driver calls on the
    /// allocating thread (2 us, conservatively, until a GPU measures them:
    /// `scripts/gpu-check.sh`).
    pub event_ns: u64,
    /// `cuStreamSynchronize`, per call, charged as a pipeline drain (100 us by
    /// default). The call itself is cheap; what it costs a busy GPU is not: the
    /// host blocks until every kernel already queued on the stream has run, and
    /// when it returns the device's queue is empty, so the GPU sits idle while
    /// the host launches the next kernels (launch latency of a few microseconds
    /// per kernel, several kernels before the device is busy again). 100 us is
    /// the order of a few short kernels plus that refill, on an A100 or H100
    /// running a training or serving step; it is an estimate, not a
    /// measurement: set it from a GPU when one is at hand.
    pub sync_ns: u64,
    /// `cuMemExportToShareableHandle`, per call (an estimate, not measured:
    /// the driver hands out an OS handle to an existing allocation).
    pub export_ns: u64,
    /// `cuMemImportFromShareableHandle`, per call (an estimate, not measured).
    pub import_ns: u64,
    /// `cuMemSetAccess` with several devices: added per device after the
    /// first (an estimate, not measured: each device's page tables are
    /// written, so the default is the one-device figure again).
    pub set_access_per_peer_ns: u64,
    /// `cuMemcpyDtoH` and `cuMemcpyHtoD`, per call (launch and completion
    /// latency, about 10 us; an estimate), on top of the bytes' transfer time.
    pub copy_ns: u64,
    /// Host-device copy bandwidth in bytes per microsecond (25 000, i.e.
    /// 25 GB/s: PCIe 4.0 x16 from pinned memory; an estimate): a copy of
    /// `n` bytes also costs `n / copy_bytes_per_us` us ([`CostModel::copy_bytes_ns`]).
    pub copy_bytes_per_us: u64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            reserve_ns: 19_000,
            address_free_ns: 19_000,
            create_ns_per_granule: 193_000,
            create_flat_ns: 193_000,
            release_ns: 25_000,
            map_ns: 1_500,
            set_access_ns: 36_000,
            unmap_ns: 26_000,
            mem_info_ns: 2_000,
            event_ns: 2_000,
            sync_ns: 100_000,
            export_ns: 10_000,
            import_ns: 20_000,
            set_access_per_peer_ns: 36_000,
            copy_ns: 10_000,
            copy_bytes_per_us: 25_000,
        }
    }
}

impl CostModel {
    /// The per-call figure of `kind` (for `Create`, the flat per-call figure).
    pub fn per_call_ns(&self, kind: CallKind) -> u64 {
        match kind {
            CallKind::Reserve => self.reserve_ns,
            CallKind::AddressFree => self.address_free_ns,
            CallKind::Create => self.create_flat_ns,
            CallKind::Release => self.release_ns,
            CallKind::Map => self.map_ns,
            CallKind::Unmap => self.unmap_ns,
            CallKind::SetAccess => self.set_access_ns,
            CallKind::MemInfo => self.mem_info_ns,
            CallKind::EventRecord
            | CallKind::EventQuery
            | CallKind::EventDestroy
            | CallKind::StreamWaitEvent
            | CallKind::StreamIsCapturing => self.event_ns,
            CallKind::StreamSynchronize => self.sync_ns,
            CallKind::ExportHandle => self.export_ns,
            CallKind::ImportHandle => self.import_ns,
            CallKind::MemcpyDtoH | CallKind::MemcpyHtoD => self.copy_ns,
        }
    }

    /// The transfer time of a copy of `bytes` between host and device, on
    /// top of its per-call figure (saturating; 0 when the bandwidth is 0).
    pub fn copy_bytes_ns(&self, bytes: u64) -> u64 {
        if self.copy_bytes_per_us == 0 {
            return 0;
        }
        bytes.saturating_mul(1000) / self.copy_bytes_per_us
    }

    /// Modelled time of a `cuMemSetAccess` naming `devices` devices:
    /// `set_access_ns` for the first, `set_access_per_peer_ns` for each other.
    pub fn set_access_ns_for(&self, devices: u64) -> u64 {
        self.set_access_ns.saturating_add(
            self.set_access_per_peer_ns
                .saturating_mul(devices.saturating_sub(1)),
        )
    }

    /// Modelled time of a successful `create` of `size` bytes at `granularity`,
    /// proportional model (saturating; a partial granule counts as a whole one).
    pub fn create_proportional_ns(&self, size: u64, granularity: u64) -> u64 {
        let granules = if granularity == 0 {
            0
        } else {
            size.div_ceil(granularity)
        };
        self.create_ns_per_granule.saturating_mul(granules)
    }
}

/// Two MiB, the default granularity (CUDA's minimum on current GPUs).
pub const DEFAULT_GRANULARITY: u64 = 2 << 20;

/// 128 TiB, the default limit on reservable virtual address space.
pub const DEFAULT_VA_LIMIT: u64 = 128 << 40;

/// 80 GiB, the default simulated device capacity (an A100 / H100 80 GB).
pub const DEFAULT_CAPACITY: u64 = 80 << 30;

/// [`SimConfig::gpu_lag_ops`] by default: the simulated device never catches up by
/// itself; work completes only on a synchronisation or when a test says so
/// ([`super::SimVmm::complete_stream`], [`super::SimVmm::complete_all`]).
pub const LAG_NEVER: u64 = u64::MAX;

/// Configuration of a [`super::SimVmm`].
///
/// Invariant (checked by [`super::SimVmm::new`]): `granularity` is a non-zero
/// power of two.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimConfig {
    /// Bytes of physical memory the simulated device has (`create` fails beyond it).
    pub capacity: u64,
    /// Allocation granularity in bytes (a power of two; 2 MiB by default).
    pub granularity: u64,
    /// Modelled time of each call.
    pub cost: CostModel,
    /// Total bytes of virtual address space that may be reserved at once.
    pub va_limit: u64,
    /// Which maps are accepted: [`MapRule::WholeHandle`] (the default, CUDA's
    /// documented rule) or [`MapRule::AnyOffset`] (an experiment; reported by
    /// [`crate::Vmm::map_rule`]).
    pub map_rule: MapRule,
    /// How far the device runs behind the host, in operations of the clock
    /// ([`super::SimVmm::advance`]): work queued on a stream at clock `t`
    /// completes once the clock reaches `t + gpu_lag_ops` and every event the
    /// stream waited on before it has completed. 0: every event completes as
    /// soon as it is recorded (a device that keeps up). [`LAG_NEVER`] (the
    /// default, what unit tests want): only synchronisation and explicit
    /// catch-ups complete work.
    pub gpu_lag_ops: u64,
    /// Devices of the simulated machine (1 by default): `set_access_for`
    /// may name ordinals `0..device_count`.
    pub device_count: u32,
    /// This device's ordinal (0 by default; below `device_count`).
    pub ordinal: DeviceOrdinal,
    /// Handle types the device supports: POSIX file descriptors by default
    /// (as every Linux data-centre GPU), FABRIC not (it needs an IMEX channel).
    pub handle_types: HandleTypes,
    /// Whether the device reports GPUDirect RDMA with VMM (true by default, as
    /// an A100 or H100 does).
    pub gpu_direct_rdma: bool,
    /// The recommended granularity (`CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`);
    /// 0 (the default): the granularity itself. Otherwise a power of two
    /// multiple of the granularity.
    pub recommended_granularity: u64,
    /// Time the simulation's own host work in every call (false by
    /// default): [`crate::DriverStats::measured_ns`] then sums, per call,
    /// the host time from before the device's lock is taken to after the
    /// call is accounted. For harnesses that tell the allocator's host time
    /// from the simulator's (`quilt-bench scale`); the two clock readings of
    /// each call cost host time of their own.
    pub time_calls: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            capacity: DEFAULT_CAPACITY,
            granularity: DEFAULT_GRANULARITY,
            cost: CostModel::default(),
            va_limit: DEFAULT_VA_LIMIT,
            map_rule: MapRule::WholeHandle,
            gpu_lag_ops: LAG_NEVER,
            device_count: 1,
            ordinal: 0,
            handle_types: HandleTypes::POSIX_FD,
            gpu_direct_rdma: true,
            recommended_granularity: 0,
            time_calls: false,
        }
    }
}
