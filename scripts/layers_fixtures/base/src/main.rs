//! The binary: reaches the library by its name.

use fixture::a;

fn main() {
    println!("{} {}", a::answer(), fixture::app::run());
}
