//! Exported Quilt blocks keep their pages through any churn (host backend,
//! real bytes): generated sequences of allocations, frees, exports and
//! export ends. While a block has an export outstanding its bytes never
//! change, even once its owner freed it (the free waits); it is freed at its
//! last `end_export`, and the accounting and invariants hold after every
//! step.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use proptest::prelude::*;

use common::MIB;
use quilt_alloc::quilt::{GrowthPolicy, QuiltAllocator, QuiltConfig};
use quilt_alloc::{AllocError, DeviceAllocator};
use quilt_vmm::host::HostVmm;
use quilt_vmm::{CreateProps, HandleKind, HandleTypes, StreamId};

#[derive(Clone, Debug)]
enum Op {
    /// Allocate this many bytes, filled with the block's own byte.
    Alloc(u64),
    /// Free the k-th block (modulo the blocks known).
    Free(usize),
    /// Export the k-th block.
    Export(usize),
    /// End one export of the k-th block.
    EndExport(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u64..6 * MIB).prop_map(Op::Alloc),
        3 => any::<usize>().prop_map(Op::Free),
        2 => any::<usize>().prop_map(Op::Export),
        2 => any::<usize>().prop_map(Op::EndExport),
    ]
}

/// One block as the test sees it.
#[derive(Debug)]
struct Block {
    ptr: u64,
    size: u64,
    /// Its size as the allocator rounded it.
    rounded: u64,
    fill: u8,
    exports: u32,
    freed: bool,
}

fn setup() -> (Arc<HostVmm>, QuiltAllocator) {
    let host = common::host(2 * MIB, 32 * MIB);
    let mut config = QuiltConfig::default();
    config.pool.create_props = CreateProps {
        handle_types: HandleTypes::POSIX_FD,
        gpu_direct_rdma: false,
    };
    config.pool.growth = GrowthPolicy::exact();
    let quilt = QuiltAllocator::new(host.clone(), config).unwrap();
    (host, quilt)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn ipc_exported_blocks_keep_their_pages_through_any_churn(
        ops in proptest::collection::vec(op(), 1..80)
    ) {
        let (host, quilt) = setup();
        let s = StreamId::DEFAULT;
        let mut blocks: Vec<Block> = Vec::new();
        let mut next_fill = 1u8;
        for op in ops {
            match op {
                Op::Alloc(size) => match quilt.allocate(size, s) {
                    Ok(a) => {
                        host.fill(a.ptr, size, next_fill).unwrap();
                        blocks.push(Block { ptr: a.ptr, size, rounded: a.size, fill: next_fill, exports: 0, freed: false });
                        next_fill = next_fill.wrapping_add(1).max(1);
                    }
                    Err(AllocError::OutOfMemory(_)) => {}
                    Err(e) => prop_assert!(false, "allocate {size}: {e}"),
                },
                Op::Free(k) if !blocks.is_empty() => {
                    let k = k % blocks.len();
                    let r = quilt.free(blocks[k].ptr);
                    if blocks[k].freed {
                        prop_assert!(matches!(r, Err(AllocError::DoubleFree { .. })), "{r:?}");
                    } else if blocks[k].exports > 0 {
                        prop_assert!(r.is_ok(), "{r:?}");
                        blocks[k].freed = true;
                    } else {
                        prop_assert!(r.is_ok(), "{r:?}");
                        blocks.remove(k);
                    }
                }
                Op::Export(k) if !blocks.is_empty() => {
                    let k = k % blocks.len();
                    let r = quilt.export(blocks[k].ptr, HandleKind::PosixFd);
                    if blocks[k].freed {
                        prop_assert!(matches!(r, Err(AllocError::UnknownPointer { .. })), "{r:?}");
                    } else {
                        let e = r.unwrap();
                        let d = &e.descriptor;
                        prop_assert_eq!(d.len, blocks[k].rounded);
                        prop_assert!(d.start < 2 * MIB && d.start + d.len <= d.size);
                        prop_assert_eq!(e.handles.len(), d.pieces.len());
                        blocks[k].exports += 1;
                    }
                }
                Op::EndExport(k) if !blocks.is_empty() => {
                    let k = k % blocks.len();
                    let r = quilt.end_export(blocks[k].ptr);
                    if blocks[k].exports == 0 {
                        prop_assert!(matches!(r, Err(AllocError::Sharing { .. })), "{r:?}");
                    } else {
                        prop_assert!(r.is_ok(), "{r:?}");
                        blocks[k].exports -= 1;
                        if blocks[k].exports == 0 && blocks[k].freed {
                            blocks.remove(k);
                        }
                    }
                }
                _ => {}
            }
            // Every exported block, freed-but-exported ones included, keeps
            // its bytes; the allocator counts exactly the blocks held.
            for b in blocks.iter().filter(|b| b.exports > 0) {
                prop_assert!(
                    host.check_filled(b.ptr, b.size, b.fill).unwrap(),
                    "block {:#x} ({} bytes, exports {}, freed {}) lost its bytes",
                    b.ptr, b.size, b.exports, b.freed
                );
            }
            let live: u64 = blocks.iter().map(|b| b.rounded).sum();
            prop_assert_eq!(quilt.stats().allocated_bytes.current, live);
            let outstanding: u64 = blocks.iter().map(|b| u64::from(b.exports)).sum();
            prop_assert_eq!(quilt.exports_outstanding(), outstanding);
            quilt.check_invariants().map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        for b in &blocks {
            for _ in 0..b.exports {
                quilt.end_export(b.ptr).unwrap();
            }
            if !b.freed {
                quilt.free(b.ptr).unwrap();
            }
        }
        prop_assert_eq!(quilt.stats().allocated_bytes.current, 0);
        quilt.check_invariants().map_err(|e| TestCaseError::fail(e.to_string()))?;
        drop(quilt);
        prop_assert!(host.leak_report().is_empty(), "{}", host.leak_report());
    }
}
