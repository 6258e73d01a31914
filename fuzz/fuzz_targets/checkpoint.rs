#![no_main]
// The body is pipewright::fuzz::checkpoint, so stable `cargo test` runs the corpus through it too.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    pipewright::fuzz::checkpoint(data);
});
