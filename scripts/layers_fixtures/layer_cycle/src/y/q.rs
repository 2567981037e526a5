//! y::q uses nothing of the crate.

pub fn f() -> u32 {
    3
}
