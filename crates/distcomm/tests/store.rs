//! The TCPStore-compatible store: our client against our server, timeouts, bounds, prefixing.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distcomm::rendezvous::{PrefixStore, Store, TcpStore, TcpStoreServer};
use distcomm::Error;

fn pair() -> (TcpStoreServer, TcpStore) {
    let server = TcpStoreServer::bind("127.0.0.1:0").unwrap();
    let client =
        TcpStore::connect(&server.local_addr().to_string(), Duration::from_secs(5)).unwrap();
    (server, client)
}

#[test]
fn set_get_add_check_delete_append() {
    let (_s, c) = pair();
    c.set("a", b"hello").unwrap();
    assert_eq!(c.get("a").unwrap(), b"hello");
    assert_eq!(c.add("n", 5).unwrap(), 5);
    assert_eq!(c.add("n", -2).unwrap(), 3);
    assert_eq!(c.get("n").unwrap(), b"3");
    assert!(c.check(&["a", "n"]).unwrap());
    assert!(!c.check(&["a", "missing"]).unwrap());
    assert_eq!(c.num_keys().unwrap(), 2);
    c.append("a", b" world").unwrap();
    assert_eq!(c.get("a").unwrap(), b"hello world");
    assert!(c.delete_key("a").unwrap());
    assert!(!c.delete_key("a").unwrap());
    assert_eq!(c.num_keys().unwrap(), 1);
    // compare_set: absent + empty expected sets; mismatch returns current.
    assert_eq!(c.compare_set("cs", b"", b"v1").unwrap(), b"v1");
    assert_eq!(c.compare_set("cs", b"nope", b"v2").unwrap(), b"v1");
    assert_eq!(c.compare_set("cs", b"v1", b"v2").unwrap(), b"v2");
    c.multi_set(&[("m1", b"x"), ("m2", b"y")]).unwrap();
    assert_eq!(
        c.multi_get(&["m1", "m2"]).unwrap(),
        vec![b"x".to_vec(), b"y".to_vec()]
    );
    c.ping().unwrap();
}

#[test]
fn wait_times_out_naming_keys_and_connection_stays_usable() {
    let (_s, c) = pair();
    let t = Instant::now();
    match c.wait(&["never", "nor-this"], Duration::from_millis(200)) {
        Err(Error::StoreTimeout { keys, .. }) => assert_eq!(keys, vec!["never", "nor-this"]),
        other => panic!("{other:?}"),
    }
    assert!(t.elapsed() >= Duration::from_millis(200));
    // The cancel left the connection in sync.
    c.set("k", b"1").unwrap();
    assert_eq!(c.get("k").unwrap(), b"1");
}

#[test]
fn wait_is_woken_by_another_client() {
    let (s, c) = pair();
    let addr = s.local_addr().to_string();
    let h = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        let other = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        other.set("late", b"x").unwrap();
    });
    c.wait(&["late"], Duration::from_secs(10)).unwrap();
    assert_eq!(c.get("late").unwrap(), b"x");
    h.join().unwrap();
}

#[test]
fn prefix_store_namespaces_keys() {
    let (_s, c) = pair();
    let base: Arc<dyn Store> = Arc::new(c);
    let a = PrefixStore::new("a", base.clone());
    let b = PrefixStore::new("b", base.clone());
    a.set("k", b"1").unwrap();
    b.set("k", b"2").unwrap();
    assert_eq!(a.get("k").unwrap(), b"1");
    assert_eq!(base.get("b/k").unwrap(), b"2");
    assert!(a.check(&["k"]).unwrap());
    assert!(!a.check(&["other"]).unwrap());
}

fn raw(server: &TcpStoreServer) -> TcpStream {
    let s = TcpStream::connect(server.local_addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// The server closed the connection (EOF or reset), as opposed to our read timing out.
fn closed(mut s: TcpStream) -> bool {
    let mut b = [0u8; 1];
    match s.read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

#[test]
fn hostile_clients_are_disconnected_without_allocating() {
    let (server, c) = pair();
    // No validation first.
    let mut s = raw(&server);
    s.write_all(&[1, 0, 0, 0, 0, 0, 0, 0, 0]).unwrap();
    assert!(closed(s));
    // Wrong magic.
    let mut s = raw(&server);
    s.write_all(&[0, 1, 2, 3, 4]).unwrap();
    assert!(closed(s));
    // A key length of 2^63: refused before allocation.
    let mut s = raw(&server);
    let mut m = vec![0u8];
    m.extend_from_slice(&0x3C85_F7CEu32.to_le_bytes());
    m.push(1);
    m.extend_from_slice(&(1u64 << 63).to_le_bytes());
    s.write_all(&m).unwrap();
    assert!(closed(s));
    // An unknown command.
    let mut s = raw(&server);
    let mut m = vec![0u8];
    m.extend_from_slice(&0x3C85_F7CEu32.to_le_bytes());
    m.push(200);
    s.write_all(&m).unwrap();
    assert!(closed(s));
    // The server is still fine for everyone else.
    c.set("ok", b"1").unwrap();
    assert_eq!(c.get("ok").unwrap(), b"1");
}

/// A loopback port that refuses connections while the returned socket lives: bound (so that
/// no other test can take it meanwhile), never listening.
fn refused_port() -> (std::os::fd::OwnedFd, u16) {
    use std::os::fd::FromRawFd;
    // SAFETY: plain socket calls on a descriptor we own from here on (OwnedFd closes it);
    // `addr` and `len` are valid for the sizes passed.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let owned = std::os::fd::OwnedFd::from_raw_fd(fd);
        let mut addr: libc::sockaddr_in = std::mem::zeroed();
        addr.sin_family = libc::AF_INET as libc::sa_family_t;
        addr.sin_addr.s_addr = u32::from_ne_bytes([127, 0, 0, 1]);
        let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let sa = &mut addr as *mut libc::sockaddr_in as *mut libc::sockaddr;
        assert_eq!(libc::bind(fd, sa, len), 0, "bind");
        assert_eq!(libc::getsockname(fd, sa, &mut len), 0, "getsockname");
        (owned, u16::from_be(addr.sin_port))
    }
}

#[test]
fn client_gives_up_on_a_missing_server_with_a_clear_error() {
    let (_bound, port) = refused_port();
    let e =
        TcpStore::connect(&format!("127.0.0.1:{port}"), Duration::from_millis(300)).unwrap_err();
    assert!(e.to_string().contains("connect to store"), "{e}");
}
