//! Tests' reading of the size of the future an async function returns,
//! from its type, without calling it: every request allocates its
//! handler's and middleware's futures and moves them into place, so rare
//! paths are boxed apart, and tests pin that down.

use std::future::Future;

/// Of a function taking four values.
pub fn of_values<A, B, C, D, F: Future>(_: impl FnOnce(A, B, C, D) -> F) -> usize {
    std::mem::size_of::<F>()
}

/// Of a function taking two references and a value.
pub fn of_refs_value<'a, A: 'a, B: 'a, C, F: Future>(_: impl FnOnce(&'a A, &'a B, C) -> F) -> usize {
    std::mem::size_of::<F>()
}

/// Of a function taking two references, a value and a reference.
pub fn of_refs_value_ref<'a, A: 'a, B: 'a, C, D: 'a, F: Future>(_: impl FnOnce(&'a A, &'a B, C, &'a D) -> F) -> usize {
    std::mem::size_of::<F>()
}
