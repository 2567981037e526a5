//! Any bytes as a publish or batch request body: the properties of
//! src/publish/properties.rs hold (parsing and preparing never panic;
//! whatever is accepted goes to a literal subject the stream captures, in
//! the partition range its transform stamps).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|body: &[u8]| keygate::publish::properties::check_body(body));
