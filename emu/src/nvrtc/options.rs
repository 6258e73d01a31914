//! nvrtcCompileProgram's options, as NVRTC spells them (its documentation's
//! "Supported Compile Options"). Only what the emulator honours is accepted;
//! anything else is refused with a message naming the option, so a caller
//! never believes a setting took effect when it did not.

/// The architectures of the emulated device's families (real architectures:
/// the image is a CUBIN stand-in, never PTX).
pub const SUPPORTED_ARCHS: [i32; 2] = [80, 90];

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// e.g. 90 for sm_90.
    pub arch: i32,
    /// The C++ standard, as the host compiler's -std takes it ("c++17").
    pub std: String,
    /// -D's argument, NAME or NAME=VALUE, in order.
    pub defines: Vec<String>,
    /// -I's argument, in order.
    pub include_paths: Vec<String>,
}

impl Options {
    pub fn arch_name(&self) -> String {
        format!("sm_{}", self.arch)
    }
}

/// Parses `args`; the error is the program log's message.
pub fn parse(args: &[String]) -> Result<Options, String> {
    let mut arch = None;
    let mut std = "c++17".to_string();
    let mut defines = vec![];
    let mut include_paths = vec![];
    let mut i = 0;
    // An option's value: after '=', glued on (-DX), or the next argument.
    let value = |i: &mut usize, arg: &str, long: &[&str], short: &str| -> Option<Result<String, String>> {
        for name in long.iter().chain([&short]) {
            if name.is_empty() {
                continue;
            }
            if let Some(v) = arg.strip_prefix(name).and_then(|r| r.strip_prefix('=')) {
                return Some(Ok(v.to_string()));
            }
            if arg == *name {
                *i += 1;
                return Some(args.get(*i).cloned().ok_or(format!("option '{arg}' is missing its value")));
            }
        }
        if short.len() == 2 {
            if let Some(v) = arg.strip_prefix(short).filter(|v| !v.is_empty()) {
                return Some(Ok(v.to_string()));
            }
        }
        None
    };
    while i < args.len() {
        let arg = args[i].as_str();
        if let Some(v) = value(&mut i, arg, &["--gpu-architecture", "-arch"], "") {
            arch = Some(parse_arch(&v?)?);
        } else if let Some(v) = value(&mut i, arg, &["--std", "-std"], "") {
            let v = v?;
            // cuda_emu.h needs C++11 (thread_local is __shared__).
            if !matches!(v.as_str(), "c++11" | "c++14" | "c++17" | "c++20") {
                return Err(format!(
                    "invalid value for option '--std': '{v}' (the emulator takes c++11, c++14, c++17, c++20)"
                ));
            }
            std = v;
        } else if let Some(v) = value(&mut i, arg, &["--define-macro"], "-D") {
            let v = v?;
            if v.is_empty() || v.starts_with('=') {
                return Err(format!("option '{arg}' defines no macro name"));
            }
            defines.push(v);
        } else if let Some(v) = value(&mut i, arg, &["--include-path"], "-I") {
            include_paths.push(v?);
        } else if matches!(
            arg,
            "-default-device"
                | "--device-as-default-execution-space"
                | "--device-debug"
                | "-G"
                | "-lineinfo"
                | "--generate-line-info"
        ) {
            // Execution spaces mean nothing on the CPU (every function is
            // both), and debug or line information changes no result.
        } else if arg.starts_with("--ptxas-options") || arg == "-Xptxas" {
            return Err(format!(
                "option '{arg}' is not supported by the emulator: it has no ptxas, and register or spill \
                 reports are properties of real hardware"
            ));
        } else {
            return Err(format!("unrecognized option '{arg}' (the emulator accepts --gpu-architecture, --std, -D, -I, -default-device, --device-debug, -lineinfo)"));
        }
        i += 1;
    }
    let arch = arch.ok_or_else(|| {
        format!("no --gpu-architecture: the emulator builds an image for {} and has no default", arch_list())
    })?;
    Ok(Options { arch, std, defines, include_paths })
}

fn arch_list() -> String {
    SUPPORTED_ARCHS.iter().map(|a| format!("sm_{a}")).collect::<Vec<_>>().join(" or ")
}

fn parse_arch(v: &str) -> Result<i32, String> {
    let refuse = |why: &str| format!("invalid value for option '--gpu-architecture': '{v}' ({why})");
    if v.starts_with("compute_") {
        return Err(refuse(&format!(
            "a virtual architecture asks for PTX, which the emulator does not produce; use {}",
            arch_list()
        )));
    }
    let n: i32 = v.strip_prefix("sm_").and_then(|n| n.parse().ok()).ok_or_else(|| refuse("not sm_XY"))?;
    if !SUPPORTED_ARCHS.contains(&n) {
        return Err(refuse(&format!("the emulated device is {}", arch_list())));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_backends_options_and_their_spellings_parse() {
        let o = parse(&args(&["--gpu-architecture=sm_90", "--std=c++17", "-DPW_F32", "-D", "X=1", "-Iinc"]))
            .unwrap();
        assert_eq!(
            o,
            Options {
                arch: 90,
                std: "c++17".into(),
                defines: args(&["PW_F32", "X=1"]),
                include_paths: args(&["inc"])
            }
        );
        assert_eq!(parse(&args(&["-arch", "sm_80"])).unwrap().arch, 80);
        assert_eq!(parse(&args(&["-arch=sm_80", "-default-device", "-lineinfo"])).unwrap().arch, 80);
    }

    #[test]
    fn unknown_options_and_architectures_are_refused_by_name() {
        assert!(parse(&args(&["-arch=sm_90", "--fmad=true"])).unwrap_err().contains("'--fmad=true'"));
        assert!(parse(&args(&["-arch=sm_75"])).unwrap_err().contains("'sm_75'"));
        assert!(parse(&args(&["-arch=compute_90"])).unwrap_err().contains("PTX"));
        assert!(parse(&args(&["-arch=sm_90", "--ptxas-options=-v"])).unwrap_err().contains("ptxas"));
        assert!(parse(&args(&["--std=c++17"])).unwrap_err().contains("no --gpu-architecture"));
        assert!(parse(&args(&["-arch=sm_90", "-D"])).unwrap_err().contains("missing its value"));
    }
}
