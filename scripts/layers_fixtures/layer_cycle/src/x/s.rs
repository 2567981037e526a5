//! x::s uses nothing of the crate.

pub fn h() -> u32 {
    2
}
