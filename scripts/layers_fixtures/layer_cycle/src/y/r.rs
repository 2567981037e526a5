//! y::r uses x::s.

pub fn k() -> u32 {
    crate::x::s::h() + 1
}
