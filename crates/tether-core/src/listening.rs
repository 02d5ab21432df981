//! Whether a TCP socket of this network namespace listens on a port.
//!
//! Asked of the kernel's socket diagnostics (`NETLINK_SOCK_DIAG`, as `ss -tl` does), which
//! walk only the listening sockets: tens of microseconds. Reading `/proc/net/tcp` and `tcp6`
//! instead walks every bucket of the established-connections table, whose size follows the
//! machine's memory (about 1.2 ms each on a 24 GiB machine with 80 sockets): polled every
//! millisecond while a rank starts its store, that kept a core busy. Where the netlink
//! socket is not available (a sandbox without it), `/proc` answers
//! ([`crate::proc::tcp_listening`]).

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// `SOCK_DIAG_BY_FAMILY` of linux/sock_diag.h.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `TCP_LISTEN` of the kernel's TCP states.
const TCP_LISTEN: u8 = 10;
/// Replies are read this many bytes at a time (the kernel fills up to a page or so).
const BUFFER: usize = 32 * 1024;

/// `struct nlmsghdr`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Header {
    len: u32,
    kind: u16,
    flags: u16,
    seq: u32,
    pid: u32,
}

/// `struct inet_diag_sockid` (ports and addresses in network byte order).
#[repr(C)]
#[derive(Clone, Copy)]
struct SockId {
    sport: [u8; 2],
    dport: [u8; 2],
    src: [u32; 4],
    dst: [u32; 4],
    interface: u32,
    cookie: [u32; 2],
}

/// `struct inet_diag_req_v2`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Request {
    family: u8,
    protocol: u8,
    ext: u8,
    pad: u8,
    states: u32,
    id: SockId,
}

/// A dump request for the listening TCP sockets of `family`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Message {
    header: Header,
    request: Request,
}

/// Whether a TCP socket of this network namespace listens on `port`, on any address.
pub fn tcp(port: u16) -> bool {
    match diag_listening(port) {
        Ok(found) => found,
        Err(err) => {
            log::debug!(target: "tether::listening", "socket diagnostics unavailable ({err}); reading /proc/net/tcp");
            crate::proc::tcp_listening(port)
        }
    }
}

/// The socket diagnostics' answer, IPv4 then IPv6.
fn diag_listening(port: u16) -> io::Result<bool> {
    // SAFETY: socket(2) with constant arguments; the fd is owned at once.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by socket(2) and is owned by nothing else.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    if dump_has(&socket, 1, libc::AF_INET as u8, port)? {
        return Ok(true);
    }
    // A kernel without IPv6 has no IPv6 listener (it answers the dump with an error).
    Ok(dump_has(&socket, 2, libc::AF_INET6 as u8, port).unwrap_or(false))
}

/// Sends one dump request and reads its replies; whether one of them listens on `port`.
fn dump_has(socket: &OwnedFd, seq: u32, family: u8, port: u16) -> io::Result<bool> {
    request(socket, seq, family)?;
    let mut buffer = vec![0u8; BUFFER];
    let mut found = false;
    loop {
        // SAFETY: recv(2) into a live buffer of its length.
        let got = unsafe {
            libc::recv(
                socket.as_raw_fd(),
                buffer.as_mut_ptr().cast(),
                buffer.len(),
                0,
            )
        };
        if got < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        match replies(&buffer[..got as usize], seq, port)? {
            Reply::More(listens) => found |= listens,
            Reply::Done => return Ok(found),
        }
    }
}

/// Asks the kernel for the listening TCP sockets of `family`.
fn request(socket: &OwnedFd, seq: u32, family: u8) -> io::Result<()> {
    let message = Message {
        header: Header {
            len: size_of::<Message>() as u32,
            kind: SOCK_DIAG_BY_FAMILY,
            flags: (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16,
            seq,
            pid: 0,
        },
        request: Request {
            family,
            protocol: libc::IPPROTO_TCP as u8,
            ext: 0,
            pad: 0,
            states: 1 << TCP_LISTEN,
            // SAFETY: plain integers; all zeros is a valid value (no address, no cookie).
            id: unsafe { std::mem::zeroed() },
        },
    };
    // SAFETY: sockaddr_nl is plain data; zeroed, then the family set: the kernel (pid 0).
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: `message` and `kernel` are live, plain data of the sizes given.
    let sent = unsafe {
        libc::sendto(
            socket.as_raw_fd(),
            (&message as *const Message).cast(),
            size_of::<Message>(),
            0,
            (&kernel as *const libc::sockaddr_nl).cast(),
            size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

enum Reply {
    /// Sockets, one of them listening on the port or not; more replies follow.
    More(bool),
    /// The dump is over.
    Done,
}

/// The netlink messages of one datagram.
fn replies(mut data: &[u8], seq: u32, port: u16) -> io::Result<Reply> {
    let mut listens = false;
    while data.len() >= size_of::<Header>() {
        let header = read_header(data);
        let len = header.len as usize;
        if len < size_of::<Header>() || len > data.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "a truncated netlink reply",
            ));
        }
        if header.seq == seq {
            match header.kind as i32 {
                libc::NLMSG_DONE => return Ok(Reply::Done),
                libc::NLMSG_ERROR => {
                    let body = &data[size_of::<Header>()..len];
                    let code = body
                        .get(..4)
                        .map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
                    return Err(io::Error::from_raw_os_error(code.saturating_neg().max(1)));
                }
                _ if header.kind == SOCK_DIAG_BY_FAMILY => {
                    // inet_diag_msg: family, state, timer, retrans, then the socket id.
                    let body = &data[size_of::<Header>()..len];
                    if let Some(b) = body.get(..6) {
                        listens |= b[1] == TCP_LISTEN && u16::from_be_bytes([b[4], b[5]]) == port;
                    }
                }
                _ => {}
            }
        }
        // Messages are aligned to 4 bytes.
        let next = (len + 3) & !3;
        data = data.get(next..).unwrap_or_default();
    }
    Ok(Reply::More(listens))
}

fn read_header(data: &[u8]) -> Header {
    // SAFETY: the caller checked that `data` holds a whole header; read_unaligned copes
    // with any alignment of the buffer.
    unsafe { std::ptr::read_unaligned(data.as_ptr().cast::<Header>()) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn a_listening_socket_is_found_and_a_closed_one_is_not() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(diag_listening(port).unwrap());
        assert!(tcp(port));
        assert_eq!(crate::proc::tcp_listening(port), tcp(port));
        drop(listener);
        assert!(!diag_listening(port).unwrap());
        assert!(!tcp(port));
    }

    #[test]
    fn an_ipv6_listener_is_found() {
        let listener = TcpListener::bind("[::1]:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(diag_listening(port).unwrap());
    }

    #[test]
    fn a_connected_socket_is_not_a_listener() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (_accepted, _) = listener.accept().unwrap();
        let client_port = client.local_addr().unwrap().port();
        assert!(!diag_listening(client_port).unwrap());
    }
}
