#![no_main]
//! The TCPStore request decoder: a stream of arbitrary bytes, decoded until it fails.
use distcomm::rendezvous::proto::Command;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut r = data;
    while Command::read(&mut r).is_ok() {}
});
