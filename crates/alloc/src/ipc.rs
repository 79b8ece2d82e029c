//! Allocations shared across processes (IPC): what the exporter sends, how the
//! importer maps it, and how the importer says it is done.
//!
//! An exported allocation is a [`SharedDescriptor`] (an id, the size of the
//! range to map, its pieces: one per physical handle, each at an offset,
//! whole handles only, as `cuMemMap` wants; and where the allocation lies in
//! that range) plus one shareable handle per piece, in order
//! ([`ExportedAllocation`]). [`crate::comm::CommAllocator::export`] makes one
//! of a single piece; [`crate::quilt::QuiltAllocator::export`] one of every
//! page under a (possibly stitched) Quilt block: one descriptor, and one
//! import and one map per piece.
//!
//! Protocol, over a connected Unix stream socket ([`quilt_vmm::fd_pass`]):
//! 1. the exporter sends [`send_export`]: the encoded descriptor with the
//!    POSIX descriptors attached (`SCM_RIGHTS`); it keeps the allocation's
//!    pages out of reuse from then on, even once it frees the allocation;
//! 2. the importer receives it ([`recv_export`]) and maps it at an address of
//!    its own ([`ImportedAllocation::import`]: reserve, import and map each
//!    piece, one set-access over the whole range for every device named);
//! 3. when done, the importer unmaps and releases it
//!    ([`ImportedAllocation::release`]) and sends [`send_release`] with the id;
//! 4. the exporter, on [`recv_release`], ends the export
//!    ([`crate::comm::CommAllocator::end_export`],
//!    [`crate::quilt::QuiltAllocator::end_export`]); only when every
//!    importer's export has ended can the pages be reused. End of stream instead of a release means the importer's
//!    process is gone, and its references with it (the kernel closes its
//!    descriptors, the driver its handles): the exporter may end the export
//!    too ([`Released::Gone`]).

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use quilt_vmm::fd_pass::{recv_message, send_message};
use quilt_vmm::{DeviceOrdinal, DevicePtr, PhysHandle, ShareableHandle, Vmm};

use crate::error::AllocError;

/// One piece of a shared allocation: one whole physical handle of `size`
/// bytes, mapped at `offset` from the allocation's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedPiece {
    /// Bytes from the allocation's start.
    pub offset: u64,
    /// Bytes of the piece (its handle's size).
    pub size: u64,
}

/// What an importer needs besides the handles: which allocation, how large
/// a range to map, where each handle goes, and where the allocation lies in
/// the range.
///
/// Invariant (checked by [`SharedDescriptor::decode`] and by the import):
/// the pieces are in order, non-empty, and tile `0..size` exactly; the
/// allocation, `start .. start + len`, is non-empty and inside it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedDescriptor {
    /// The exporter's name for the allocation (its address there), echoed in
    /// the release message.
    pub id: u64,
    /// Bytes of the range to map: whole handles.
    pub size: u64,
    /// Its pieces, one per handle, by offset.
    pub pieces: Vec<SharedPiece>,
    /// Where the allocation's first byte lies in the range: 0 for a
    /// communication buffer; a Quilt block shares its first and last pages
    /// with its neighbours, so it may start inside its first page.
    pub start: u64,
    /// Bytes of the allocation (`size` for a communication buffer).
    pub len: u64,
}

/// First bytes of an encoded descriptor.
const EXPORT_MAGIC: &[u8; 4] = b"QSH2";
/// First bytes of an encoded release message.
const RELEASE_MAGIC: &[u8; 4] = b"QRL1";
/// Most pieces one descriptor carries (one descriptor each, in one message).
pub const MAX_PIECES: usize = quilt_vmm::fd_pass::MAX_FDS;

fn bad(reason: &str) -> AllocError {
    AllocError::Sharing {
        reason: reason.to_string(),
    }
}

fn io_error(what: &str, e: std::io::Error) -> AllocError {
    AllocError::Sharing {
        reason: format!("{what}: {e}"),
    }
}

impl SharedDescriptor {
    /// Checks the invariant: pieces in order, non-empty, tiling `0..size`;
    /// the allocation non-empty and inside the range.
    pub fn validate(&self) -> Result<(), AllocError> {
        if self.pieces.is_empty() || self.pieces.len() > MAX_PIECES {
            return Err(bad("a descriptor has 1 to MAX_PIECES pieces"));
        }
        let mut at = 0u64;
        for p in &self.pieces {
            if p.offset != at || p.size == 0 {
                return Err(bad("pieces must tile the allocation in order"));
            }
            at = at
                .checked_add(p.size)
                .ok_or_else(|| bad("sizes overflow"))?;
        }
        if at != self.size {
            return Err(bad("pieces must add up to the range's size"));
        }
        if self.len == 0
            || self
                .start
                .checked_add(self.len)
                .is_none_or(|end| end > self.size)
        {
            return Err(bad("the allocation must be non-empty and inside the range"));
        }
        Ok(())
    }

    /// The wire form: `QSH2`, then id, size, start, len, piece count and
    /// each piece's offset and size, as little-endian `u64`s.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + 8 * (5 + 2 * self.pieces.len()));
        out.extend_from_slice(EXPORT_MAGIC);
        for v in [
            self.id,
            self.size,
            self.start,
            self.len,
            self.pieces.len() as u64,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for p in &self.pieces {
            out.extend_from_slice(&p.offset.to_le_bytes());
            out.extend_from_slice(&p.size.to_le_bytes());
        }
        out
    }

    /// Reads [`SharedDescriptor::encode`]'s form back, and validates it.
    pub fn decode(bytes: &[u8]) -> Result<SharedDescriptor, AllocError> {
        let words = words_after(bytes, EXPORT_MAGIC)?;
        let [id, size, start, len, n, rest @ ..] = words.as_slice() else {
            return Err(bad("descriptor too short"));
        };
        if rest.len() as u64 != n.saturating_mul(2) {
            return Err(bad("descriptor length disagrees with its piece count"));
        }
        let d = SharedDescriptor {
            id: *id,
            size: *size,
            pieces: rest
                .chunks_exact(2)
                .map(|c| SharedPiece {
                    offset: c[0],
                    size: c[1],
                })
                .collect(),
            start: *start,
            len: *len,
        };
        d.validate()?;
        Ok(d)
    }
}

/// The little-endian `u64`s after `magic`.
fn words_after(bytes: &[u8], magic: &[u8; 4]) -> Result<Vec<u64>, AllocError> {
    let body = bytes
        .strip_prefix(magic.as_slice())
        .ok_or_else(|| bad("message does not start with the expected tag"))?;
    if body.len() % 8 != 0 {
        return Err(bad("message is not a whole number of words"));
    }
    Ok(body
        .chunks_exact(8)
        .map(|c| {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            u64::from_le_bytes(w)
        })
        .collect())
}

/// An allocation ready to leave the process: its descriptor and one
/// shareable handle per piece, in order.
#[derive(Debug)]
pub struct ExportedAllocation {
    /// Where each handle goes.
    pub descriptor: SharedDescriptor,
    /// One per piece.
    pub handles: Vec<ShareableHandle>,
}

/// Sends `export` over `socket` (POSIX descriptors only: FABRIC and
/// simulated handles do not travel this way).
pub fn send_export(socket: &UnixStream, export: &ExportedAllocation) -> Result<(), AllocError> {
    export.descriptor.validate()?;
    if export.handles.len() != export.descriptor.pieces.len() {
        return Err(bad("one handle per piece"));
    }
    let fds = export
        .handles
        .iter()
        .map(|h| match h {
            ShareableHandle::PosixFd(fd) => Ok(fd.as_fd()),
            _ => Err(bad("only POSIX file descriptors cross a socket")),
        })
        .collect::<Result<Vec<_>, _>>()?;
    send_message(socket, &export.descriptor.encode(), &fds).map_err(|e| io_error("send export", e))
}

/// Receives an export sent by [`send_export`].
pub fn recv_export(socket: &UnixStream) -> Result<ExportedAllocation, AllocError> {
    let (bytes, fds) =
        recv_message(socket, MAX_PIECES).map_err(|e| io_error("receive export", e))?;
    let descriptor = SharedDescriptor::decode(&bytes)?;
    if fds.len() != descriptor.pieces.len() {
        return Err(bad("descriptor count differs from the piece count"));
    }
    Ok(ExportedAllocation {
        descriptor,
        handles: fds.into_iter().map(ShareableHandle::PosixFd).collect(),
    })
}

/// Tells the exporter that the import of allocation `id` is released.
pub fn send_release(socket: &UnixStream, id: u64) -> Result<(), AllocError> {
    let mut msg = RELEASE_MAGIC.to_vec();
    msg.extend_from_slice(&id.to_le_bytes());
    send_message(socket, &msg, &[]).map_err(|e| io_error("send release", e))
}

/// How an import ended, as the exporter learns it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Released {
    /// The importer released allocation `id` and said so.
    Id(u64),
    /// The socket closed: the importer's process (and its references) is gone.
    Gone,
}

/// Waits for the importer's release message (or the end of the stream).
pub fn recv_release(socket: &UnixStream) -> Result<Released, AllocError> {
    match recv_message(socket, 0) {
        Ok((bytes, _)) => match words_after(&bytes, RELEASE_MAGIC)?.as_slice() {
            [id] => Ok(Released::Id(*id)),
            _ => Err(bad("a release message holds one id")),
        },
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(Released::Gone),
        Err(e) => Err(io_error("receive release", e)),
    }
}

/// An allocation of another process, mapped here: its own address range, a
/// handle per piece imported on this process's device, access set for the
/// devices named. [`ImportedAllocation::release`] (or drop) unmaps it and
/// releases the handles; the memory lives on in the exporter.
#[derive(Debug)]
pub struct ImportedAllocation {
    vmm: Arc<dyn Vmm>,
    id: u64,
    /// The mapped range: whole handles.
    base: DevicePtr,
    mapped_size: u64,
    /// The allocation in it: its offset and size.
    start: u64,
    size: u64,
    handles: Vec<PhysHandle>,
    released: bool,
}

impl ImportedAllocation {
    /// Maps `export` on `vmm`: one reservation of its size (aligned to the
    /// device's recommended granularity), one import and one map per piece,
    /// one set-access over the range naming `devices` (this device when
    /// empty). The shareable handles may be dropped afterwards. On failure
    /// everything done so far is undone.
    pub fn import(
        vmm: Arc<dyn Vmm>,
        export: &ExportedAllocation,
        devices: &[DeviceOrdinal],
    ) -> Result<ImportedAllocation, AllocError> {
        let d = &export.descriptor;
        d.validate()?;
        if export.handles.len() != d.pieces.len() {
            return Err(bad("one handle per piece"));
        }
        let caps = vmm.caps();
        let own = [caps.ordinal];
        let devices = if devices.is_empty() {
            &own[..]
        } else {
            devices
        };
        let ptr = vmm.reserve(d.size, caps.recommended_granularity.max(caps.granularity))?;
        let mut out = ImportedAllocation {
            vmm,
            id: d.id,
            base: ptr,
            mapped_size: d.size,
            start: d.start,
            size: d.len,
            handles: Vec::with_capacity(d.pieces.len()),
            released: false,
        };
        let mut mapped = 0u64;
        let result = (|| {
            for (piece, shared) in d.pieces.iter().zip(&export.handles) {
                let h = out.vmm.import_handle(shared, piece.size)?;
                out.handles.push(h);
                out.vmm.map(ptr + piece.offset, piece.size, h, 0)?;
                mapped = piece.offset + piece.size;
            }
            out.vmm.set_access_for(ptr, d.size, devices)
        })();
        if let Err(e) = result {
            if mapped > 0 {
                let _ = out.vmm.unmap(ptr, mapped);
            }
            for h in out.handles.drain(..) {
                let _ = out.vmm.release(h);
            }
            let _ = out.vmm.address_free(ptr, d.size);
            out.released = true;
            return Err(e.into());
        }
        Ok(out)
    }

    /// The exporter's id of the allocation (for [`send_release`]).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The allocation's first byte in this process.
    pub fn ptr(&self) -> DevicePtr {
        self.base + self.start
    }

    /// The allocation's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The whole range mapped here (whole handles around the allocation:
    /// what lies outside `ptr() .. ptr() + size()` belongs to the
    /// exporter's neighbouring allocations, and is not this import's to
    /// touch), as (address, bytes).
    pub fn mapped(&self) -> (DevicePtr, u64) {
        (self.base, self.mapped_size)
    }

    /// Unmaps it, releases its handles and frees its address range. Returns
    /// its id, for [`send_release`].
    pub fn release(mut self) -> Result<u64, AllocError> {
        self.teardown()?;
        Ok(self.id)
    }

    fn teardown(&mut self) -> Result<(), AllocError> {
        if self.released {
            return Ok(());
        }
        self.vmm.unmap(self.base, self.mapped_size)?;
        for h in std::mem::take(&mut self.handles) {
            self.vmm.release(h)?;
        }
        self.vmm.address_free(self.base, self.mapped_size)?;
        self.released = true;
        Ok(())
    }
}

impl Drop for ImportedAllocation {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            tracing::warn!(id = self.id, %e, "imported allocation not torn down at drop");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_round_trip_and_bad_ones_are_refused() {
        let d = SharedDescriptor {
            id: 0x7f00_0000_0000,
            size: 6 << 20,
            start: 1 << 20,
            len: 4 << 20,
            pieces: vec![
                SharedPiece {
                    offset: 0,
                    size: 2 << 20,
                },
                SharedPiece {
                    offset: 2 << 20,
                    size: 4 << 20,
                },
            ],
        };
        assert_eq!(SharedDescriptor::decode(&d.encode()).unwrap(), d);
        let mut gap = d.clone();
        gap.pieces[1].offset += 1;
        assert!(SharedDescriptor::decode(&gap.encode()).is_err());
        let mut short = d.clone();
        short.size += 1;
        assert!(short.validate().is_err());
        let bytes = d.encode();
        assert!(SharedDescriptor::decode(&bytes[..bytes.len() - 8]).is_err());
        assert!(SharedDescriptor::decode(b"QRL1\0\0\0\0\0\0\0\0").is_err());
        let mut outside = d.clone();
        outside.len = (5 << 20) + 1;
        assert!(matches!(
            SharedDescriptor::decode(&outside.encode()),
            Err(AllocError::Sharing { .. })
        ));
        let mut empty = d.clone();
        empty.len = 0;
        assert!(empty.validate().is_err());
    }
}
