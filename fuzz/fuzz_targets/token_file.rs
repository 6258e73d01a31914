#![no_main]
// The body is pipewright::fuzz::token_file, so stable `cargo test` runs the corpus through it too.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    pipewright::fuzz::token_file(data);
});
