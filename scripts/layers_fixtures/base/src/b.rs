//! b: the bottom layer; uses nothing of the crate.

pub fn helper() -> u32 {
    1
}
