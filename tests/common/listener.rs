//! A check that a closed listener serves nothing, shared by the library's and the proxy's
//! tests.

/// Whether nothing at `addr` serves a new connection: it is refused, or it ends without a
/// byte of answer. The second is for a moment the kernel allows: a child process another test
/// is starting holds a copy of every descriptor of this one between its fork and its exec, a
/// listener closed here included, so a connection can still be queued on that listener until
/// the exec closes it and resets what it queued. Blocking on purpose: the runtime, and with it
/// paused time, stands still meanwhile, so a listener still open here would never answer
/// either, and the read's deadline ends the wait with `false`.
pub fn refuses(addr: std::net::SocketAddr) -> bool {
    use std::io::{ErrorKind, Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(addr) else {
        return true;
    };
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let _ = stream.write_all(b"GET /livez HTTP/1.1\r\nhost: test\r\n\r\n");
    match stream.read(&mut [0u8; 1]) {
        Ok(n) => n == 0,
        Err(e) => !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
    }
}
