//! Messages with file descriptors over a Unix stream socket (`SCM_RIGHTS`),
//! the way exported POSIX handles ([`crate::ShareableHandle::PosixFd`]) travel
//! between processes (as in PyTorch's and vLLM's CUDA IPC of VMM memory).
//!
//! A message is a 4-byte little-endian payload length, the payload, and up
//! to [`MAX_FDS`] descriptors attached to the first byte (one `sendmsg`
//! through `rustix::net`). The receiver reads the length with `recvmsg`,
//! collecting the descriptors, then exactly the payload, so messages never
//! run into one another on the stream.

use std::io::{self, IoSlice, IoSliceMut, Read};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// Most descriptors one message carries (the kernel's `SCM_MAX_FD`).
pub const MAX_FDS: usize = 253;

/// Largest payload accepted, in bytes (a guard against a corrupt length).
pub const MAX_PAYLOAD: usize = 16 << 20;

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what.to_owned())
}

/// Sends `payload` with `fds` attached. The descriptors stay open here (the
/// receiver gets its own copies).
pub fn send_message(socket: &UnixStream, payload: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if fds.len() > MAX_FDS {
        return Err(invalid("more descriptors than one message carries"));
    }
    if payload.len() > MAX_PAYLOAD {
        return Err(invalid("payload larger than MAX_PAYLOAD"));
    }
    let header = (payload.len() as u32).to_le_bytes();
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(invalid("descriptors do not fit the control buffer"));
    }
    let total = header.len() + payload.len();
    let mut sent = sendmsg(
        socket,
        &[IoSlice::new(&header), IoSlice::new(payload)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    // The rest (a short write), without descriptors: they went with byte 0.
    while sent < total {
        let rest: Vec<u8> = header
            .iter()
            .chain(payload.iter())
            .skip(sent)
            .copied()
            .collect();
        let mut none = SendAncillaryBuffer::default();
        let n = sendmsg(
            socket,
            &[IoSlice::new(&rest)],
            &mut none,
            SendFlags::NOSIGNAL,
        )?;
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::WriteZero));
        }
        sent += n;
    }
    Ok(())
}

/// Receives one message: its payload and the descriptors attached (at most
/// `max_fds`: a message with more is refused, and every descriptor it
/// carried is closed). End of stream before a message is `UnexpectedEof`.
pub fn recv_message(socket: &UnixStream, max_fds: usize) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let max_fds = max_fds.min(MAX_FDS);
    let mut header = [0u8; 4];
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(max_fds))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = recvmsg(
        socket,
        &mut [IoSliceMut::new(&mut header)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    if got.bytes == 0 {
        return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
    }
    let truncated = got.flags.contains(rustix::net::ReturnFlags::CTRUNC);
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = message {
            fds.extend(received);
        }
    }
    if truncated || fds.len() > max_fds {
        return Err(invalid("more descriptors arrived than max_fds"));
    }
    let mut reader = socket;
    reader.read_exact(&mut header[got.bytes..])?;
    let len = u32::from_le_bytes(header) as usize;
    if len > MAX_PAYLOAD {
        return Err(invalid("payload length larger than MAX_PAYLOAD"));
    }
    let mut payload = vec![0u8; len];
    reader.read_exact(&mut payload)?;
    Ok((payload, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, Write};
    use std::os::fd::AsFd;

    #[test]
    fn a_descriptor_and_bytes_cross_a_socket_pair() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut file = std::fs::File::from(
            rustix::fs::memfd_create("fd-pass-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap(),
        );
        file.write_all(b"quilt").unwrap();
        send_message(&a, b"first", &[file.as_fd()]).unwrap();
        send_message(&a, b"second, no fds", &[]).unwrap();
        let (payload, fds) = recv_message(&b, 4).unwrap();
        assert_eq!(payload, b"first");
        assert_eq!(fds.len(), 1);
        let mut received = std::fs::File::from(fds.into_iter().next().unwrap());
        received.rewind().unwrap();
        let mut text = String::new();
        received.read_to_string(&mut text).unwrap();
        assert_eq!(text, "quilt", "the same open file");
        let (payload, fds) = recv_message(&b, 4).unwrap();
        assert_eq!(payload, b"second, no fds");
        assert!(fds.is_empty());
        drop(a);
        assert_eq!(
            recv_message(&b, 4).unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
    }

    #[test]
    fn too_many_descriptors_are_refused_by_the_receiver() {
        let (a, b) = UnixStream::pair().unwrap();
        let one = a.try_clone().unwrap();
        let two = a.try_clone().unwrap();
        send_message(&a, b"x", &[one.as_fd(), two.as_fd()]).unwrap();
        assert_eq!(
            recv_message(&b, 1).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
    }
}
