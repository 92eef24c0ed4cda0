#![no_main]
//! The connection handshake's hello decoder and MAC check on arbitrary input.
use distcomm::__fuzz::handshake::{self, Hello, HELLO_LEN, TOKEN_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < HELLO_LEN + TOKEN_LEN + 1 {
        return;
    }
    let mut raw = [0u8; HELLO_LEN];
    raw.copy_from_slice(&data[..HELLO_LEN]);
    let world = 1 + data[HELLO_LEN] as usize;
    if let Ok(h) = Hello::decode(&raw, world) {
        let mut mac = [0u8; TOKEN_LEN];
        mac.copy_from_slice(&data[HELLO_LEN + 1..HELLO_LEN + 1 + TOKEN_LEN]);
        // A random MAC never verifies against a secret.
        assert!(
            !handshake::verify(Some(b"fuzz secret"), b'A', &h, &h, &mac)
                || mac == handshake::mac(Some(b"fuzz secret"), b'A', &h, &h)
        );
    }
});
