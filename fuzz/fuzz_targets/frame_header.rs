#![no_main]
//! The transport's frame header decoder: any 48 bytes, any eager limit.
use distcomm::__fuzz::frame::{Header, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < HEADER_LEN + 8 {
        return;
    }
    let mut raw = [0u8; HEADER_LEN];
    raw.copy_from_slice(&data[..HEADER_LEN]);
    let mut lim = [0u8; 8];
    lim.copy_from_slice(&data[HEADER_LEN..HEADER_LEN + 8]);
    if let Ok(h) = Header::decode(&raw, u64::from_le_bytes(lim)) {
        // What decodes re-encodes to the same bytes.
        assert_eq!(h.encode(), raw);
    }
});
