//! Compute kernels. `cpu/` is always built and is the reference every other
//! backend is checked against. Kernels never allocate and never decide how
//! many threads to use: they run on the rayon pool the caller installed, and
//! split work so that every output element is computed in one fixed order,
//! whatever the thread count.

pub mod cpu;
pub mod profile;
