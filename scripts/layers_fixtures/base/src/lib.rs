//! A crate shaped like keygate's layers, for `scripts/check-layers --self-test`.

pub mod a;
pub mod app;
pub mod b;
pub mod http;
