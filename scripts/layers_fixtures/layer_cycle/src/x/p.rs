//! x::p uses y::q.

use crate::y::q::f;

pub fn g() -> u32 {
    f() + 1
}
