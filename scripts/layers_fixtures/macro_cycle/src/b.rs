//! b: uses a back only through a path inside a macro invocation.

pub fn helper() -> u32 {
    // The planted edge back to a, in println!'s token tree:
    println!("a says {}", crate::a::ANSWER);
    1
}
