//! The stand-in compiler's source pre-pass: what include/cuda_emu.h cannot
//! supply. It finds the extern "C" __global__ kernels (name, parameters,
//! launch bounds) for the registration trailer, rewrites inline PTX
//! mma.sync statements into calls of the runtime's mma, turns
//! `extern __shared__ T name[];` into the block's dynamic shared memory, and
//! drops `#pragma unroll` (an optimisation hint the host compiler would warn
//! about). Every rewrite keeps the line count, so the compiler's messages
//! point at the lines of the file as written.
//!
//! It never drops what it does not understand: any other inline PTX, a
//! template or non-extern "C" kernel, an array parameter is an error in the
//! program log, `file:line:col: error: ...` as the compiler writes them.

use super::lex::{self, line_col, matching, split_top, Kind, Token};

/// The one PTX instruction the emulator implements (the runtime's mma).
pub const MMA: &str = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Param {
    /// Empty for an unnamed parameter.
    pub name: String,
    /// As declared, whitespace collapsed, e.g. "const floatX*".
    pub ty: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kernel {
    pub name: String,
    /// __launch_bounds__'s first argument as written (a C++ expression).
    pub launch_bounds: Option<String>,
    pub params: Vec<Param>,
}

/// A file after the pre-pass.
pub struct Prepared {
    pub text: String,
    pub kernels: Vec<Kernel>,
}

/// Rewrites `src` (named `file` in messages); `main` says whether kernels
/// may be declared here (the program source) or not (a header).
pub fn prepare(file: &str, src: &str, main: bool) -> Result<Prepared, Vec<String>> {
    let all = lex::tokenize(src);
    let mut edits: Vec<(usize, usize, String)> = vec![];
    let mut errors = vec![];
    let error = |at: usize, msg: String| {
        let (line, col) = line_col(src, at);
        format!("{file}:{line}:{col}: error: {msg}")
    };

    for t in all.iter().filter(|t| t.kind == Kind::Directive) {
        let words: Vec<&str> = t.text(src).trim_start_matches('#').split_whitespace().collect();
        if words.len() >= 2 && words[0] == "pragma" && words[1] == "unroll" {
            edits.push((t.start, t.end, String::new()));
        }
        // What a macro expands to is out of the pre-pass's sight: a kernel
        // there would go unregistered, inline PTX there to the host assembler.
        if words.first() == Some(&"define") {
            let body = &t.text(src)[1..];
            for (what, why) in [
                ("__global__", "a kernel declared through a macro would not be registered"),
                ("asm", "inline PTX in a macro cannot be rewritten"),
                ("__asm__", "inline PTX in a macro cannot be rewritten"),
            ] {
                let inner = lex::tokenize(body);
                if let Some(hit) = inner.iter().find(|k| k.is_ident(body, what)) {
                    errors.push(error(
                        t.start + 1 + hit.start,
                        format!("`{what}` in a #define: {why} by the emulator"),
                    ));
                }
            }
        }
    }

    let toks: Vec<Token> = all.into_iter().filter(|t| t.kind != Kind::Directive).collect();
    let mut kernels: Vec<Kernel> = vec![];
    // Open braces: (opens a namespace-level scope, is an extern "C" block).
    let mut scopes: Vec<(bool, bool)> = vec![];
    let mut i = 0;
    while i < toks.len() {
        let t = toks[i];
        let at_namespace_level = scopes.iter().all(|s| s.0);
        match t.kind {
            Kind::Punct(b'{') => {
                let extern_c =
                    i >= 2 && toks[i - 1].text(src) == "\"C\"" && toks[i - 2].is_ident(src, "extern");
                let namespace = extern_c
                    || (i >= 1 && toks[i - 1].is_ident(src, "namespace"))
                    || (i >= 2 && toks[i - 2].is_ident(src, "namespace"));
                scopes.push((namespace, extern_c));
            }
            Kind::Punct(b'}') => {
                scopes.pop();
            }
            Kind::Ident if t.text(src) == "__global__" => {
                let in_extern_c_block = scopes.iter().any(|s| s.1);
                match kernel_at(src, &toks, i, in_extern_c_block) {
                    Ok(k) if !main => errors.push(error(
                        t.start,
                        format!(
                            "kernel `{}` is declared in a header: the emulator registers the kernels of the \
                             program source only",
                            k.name
                        ),
                    )),
                    Ok(k) => {
                        if !kernels.iter().any(|seen| seen.name == k.name) {
                            kernels.push(k);
                        }
                    }
                    Err((at, msg)) => errors.push(error(at, msg)),
                }
            }
            Kind::Ident if matches!(t.text(src), "asm" | "__asm__" | "__asm") => {
                match rewrite_asm(src, &toks, i) {
                    Ok((end, text)) => {
                        edits.push((t.start, toks[end].end, text));
                        i = end;
                    }
                    Err((at, msg)) => errors.push(error(at, msg)),
                }
            }
            Kind::Ident
                if t.text(src) == "extern"
                    && toks.get(i + 1).is_some_and(|n| n.is_ident(src, "__shared__")) =>
            {
                match rewrite_extern_shared(file, src, &toks, i, at_namespace_level) {
                    Ok((end, text)) => {
                        edits.push((t.start, toks[end].end, text));
                        i = end;
                    }
                    Err((at, msg)) => errors.push(error(at, msg)),
                }
            }
            _ => {}
        }
        i += 1;
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    edits.sort_by_key(|e| e.0);
    let mut text = String::with_capacity(src.len() + 1024);
    let mut from = 0;
    for (start, end, with) in edits {
        text.push_str(&src[from..start]);
        text.push_str(&with);
        from = end;
    }
    text.push_str(&src[from..]);
    Ok(Prepared { text, kernels })
}

type Failure = (usize, String);

/// The kernel declared around the `__global__` at toks[g].
fn kernel_at(src: &str, toks: &[Token], g: usize, in_extern_c_block: bool) -> Result<Kernel, Failure> {
    // The declaration starts after the previous `;`, `{` or `}`.
    let start = toks[..g]
        .iter()
        .rposition(|t| t.is_punct(b';') || t.is_punct(b'{') || t.is_punct(b'}'))
        .map(|p| p + 1)
        .unwrap_or(0);
    let extern_c = in_extern_c_block
        || (toks[start].is_ident(src, "extern")
            && toks.get(start + 1).is_some_and(|t| t.text(src) == "\"C\""));
    let here = toks[g].start;
    if toks[start..g].iter().any(|t| t.is_ident(src, "template")) {
        return Err((
            here,
            "template kernels have no extern \"C\" name: the emulator cannot register them".into(),
        ));
    }
    let mut launch_bounds = None;
    let mut k = start;
    let open = loop {
        let Some(t) = toks.get(k) else {
            return Err((here, "__global__ without a function declaration after it".into()));
        };
        if t.is_ident(src, "__launch_bounds__") {
            let close = toks
                .get(k + 1)
                .filter(|n| n.is_punct(b'('))
                .and_then(|_| matching(toks, k + 1))
                .ok_or((t.start, "__launch_bounds__ without its (max threads per block)".to_string()))?;
            let args = split_top(&toks[k + 2..close], b',', false);
            let first = args[0];
            if first.is_empty() {
                return Err((t.start, "__launch_bounds__ without a max threads per block".into()));
            }
            launch_bounds = Some(src[first[0].start..first[first.len() - 1].end].to_string());
            k = close + 1;
            continue;
        }
        if t.is_punct(b'(') {
            break k;
        }
        if t.is_punct(b';') || t.is_punct(b'{') || t.is_punct(b'<') {
            return Err((here, "__global__ without a function declaration after it".into()));
        }
        k += 1;
    };
    let name_tok = toks[..open]
        .last()
        .filter(|t| t.kind == Kind::Ident && open > g)
        .ok_or((here, "__global__ function without a name before its parameter list".to_string()))?;
    let name = name_tok.text(src).to_string();
    if !extern_c {
        return Err((
            name_tok.start,
            format!(
                "__global__ function `{name}` is not extern \"C\": the emulator registers kernels by their \
                 extern \"C\" names"
            ),
        ));
    }
    let close =
        matching(toks, open).ok_or((toks[open].start, format!("unclosed parameter list of `{name}`")))?;
    let mut params = vec![];
    let inner = &toks[open + 1..close];
    let is_void = inner.len() == 1 && inner[0].is_ident(src, "void");
    if !inner.is_empty() && !is_void {
        for p in split_top(inner, b',', true) {
            params.push(param(src, p, &name)?);
        }
    }
    Ok(Kernel { name, launch_bounds, params })
}

/// Words that end a type, never a parameter's name.
const TYPE_WORDS: &[&str] = &[
    "int",
    "unsigned",
    "signed",
    "char",
    "short",
    "long",
    "float",
    "double",
    "bool",
    "void",
    "const",
    "volatile",
    "__restrict__",
    "__restrict",
    "restrict",
];

fn param(src: &str, toks: &[Token], kernel: &str) -> Result<Param, Failure> {
    let Some(first) = toks.first() else {
        return Err((0, format!("empty parameter in the parameter list of `{kernel}`")));
    };
    // A default argument is not part of the type.
    let toks = split_top(toks, b'=', true)[0];
    let Some(&last) = toks.last() else {
        return Err((first.start, format!("parameter of `{kernel}` without a type")));
    };
    if last.is_punct(b']') {
        return Err((
            first.start,
            format!("array parameter of kernel `{kernel}`: declare it as a pointer (it is one in C++)"),
        ));
    }
    if toks.iter().any(|t| t.is_punct(b'(')) {
        return Err((
            first.start,
            format!("function-pointer parameter of kernel `{kernel}` is not supported"),
        ));
    }
    let named = toks.len() >= 2 && last.kind == Kind::Ident && !TYPE_WORDS.contains(&last.text(src));
    let (ty_toks, name) = if named { (&toks[..toks.len() - 1], last.text(src)) } else { (toks, "") };
    let ty = src[ty_toks[0].start..ty_toks[ty_toks.len() - 1].end]
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    Ok(Param { name: name.to_string(), ty })
}

/// Replaces the asm statement at toks[a] (through its `;`) with the
/// equivalent C++; returns the index of the `;` and the replacement.
fn rewrite_asm(src: &str, toks: &[Token], a: usize) -> Result<(usize, String), Failure> {
    let here = toks[a].start;
    let mut k = a + 1;
    while toks.get(k).is_some_and(|t| {
        t.kind == Kind::Ident && matches!(t.text(src), "volatile" | "__volatile__" | "__volatile" | "inline")
    }) {
        k += 1;
    }
    if toks.get(k).is_some_and(|t| t.is_ident(src, "goto")) {
        return Err((here, "asm goto is not implemented by the emulator".into()));
    }
    let open = k;
    let close = toks
        .get(open)
        .filter(|t| t.is_punct(b'('))
        .and_then(|_| matching(toks, open))
        .ok_or((here, "asm statement without its parenthesised template".to_string()))?;
    let semi = close + 1;
    if !toks.get(semi).is_some_and(|t| t.is_punct(b';')) {
        return Err((here, "asm statement not ended by `;`".into()));
    }
    let sections = split_top(&toks[open + 1..close], b':', false);
    let template_toks = sections[0];
    if template_toks.is_empty() || template_toks.iter().any(|t| t.kind != Kind::Str) {
        return Err((here, "asm template is not a string literal".into()));
    }
    let template: String = template_toks.iter().map(|t| lex::string_value(t.text(src))).collect();
    let instructions: Vec<&str> =
        template.split([';', '\n']).map(str::trim).filter(|s| !s.is_empty()).collect();
    let mnemonics: Vec<&str> =
        instructions.iter().map(|i| i.split_whitespace().next().unwrap_or("")).collect();
    if instructions.len() != 1 || mnemonics[0] != MMA {
        let unsupported: Vec<&str> = mnemonics.iter().copied().filter(|m| *m != MMA).collect();
        let what = if unsupported.is_empty() {
            format!("{} instructions in one asm statement", instructions.len())
        } else {
            format!("inline PTX instruction `{}`", unsupported.join("`, `"))
        };
        return Err((here, format!("{what} is not implemented by the emulator (only `{MMA}` alone is)")));
    }
    let mut operands = vec![];
    for (section, output) in [(sections.get(1), true), (sections.get(2), false)] {
        let Some(section) = section else { continue };
        if section.is_empty() {
            continue;
        }
        for op in split_top(section, b',', false) {
            operands.push(operand(src, op, output, here)?);
        }
    }
    if sections.len() > 4 {
        return Err((here, "asm statement with more than three `:` sections".into()));
    }
    let groups = mma_groups(instructions[0][MMA.len()..].trim()).ok_or((
        here,
        format!("`{MMA}` operands are not {{%d0..%d3}}, {{%a0..%a3}}, {{%b0,%b1}}, {{%c0..%c3}}"),
    ))?;

    let use_as = |n: usize, role: &str, class: char, write: bool| -> Result<String, Failure> {
        let op =
            operands.get(n).ok_or((here, format!("`%{n}` refers to no operand of this asm statement")))?;
        if op.class != class {
            return Err((
                here,
                format!(
                    "`%{n}` is the mma's {role} and needs constraint \"{class}\", not \"{}\"",
                    op.constraint
                ),
            ));
        }
        match (write, op.role) {
            (true, Role::Input) => {
                Err((here, format!("`%{n}` is the mma's {role} (written) but is an input")))
            }
            (false, Role::WriteOnly) => Err((
                here,
                format!("`%{n}` is the mma's {role} (read) but is a write-only \"=\" output; use \"+\""),
            )),
            _ => Ok(format!("pw_op{n}")),
        }
    };
    let mut out = String::from("{ ");
    for (n, op) in operands.iter().enumerate() {
        let ty = match op.class {
            'f' => "float",
            'r' => "unsigned int",
            'h' => "unsigned short",
            'l' => "unsigned long long",
            'd' => "double",
            c => {
                return Err((
                    here,
                    format!("asm operand constraint '{c}' is not implemented by the emulator"),
                ))
            }
        };
        if op.role == Role::Input {
            out.push_str(&format!("const {ty} pw_op{n} = ({}); ", op.expr));
        } else {
            out.push_str(&format!("{ty}& pw_op{n} = ({}); ", op.expr));
        }
    }
    let list = |group: &[usize], role: &str, class: char| -> Result<String, Failure> {
        let names: Result<Vec<String>, Failure> =
            group.iter().map(|&n| use_as(n, role, class, false)).collect();
        Ok(names?.join(", "))
    };
    out.push_str(&format!("const unsigned int pw_a[4] = {{{}}}; ", list(&groups[1], "A fragment", 'r')?));
    out.push_str(&format!("const unsigned int pw_b[2] = {{{}}}; ", list(&groups[2], "B fragment", 'r')?));
    out.push_str(&format!("const float pw_c[4] = {{{}}}; ", list(&groups[3], "C accumulator", 'f')?));
    out.push_str("float pw_d[4]; pw_emu_mma_m16n8k16_f32_bf16(pw_d, pw_a, pw_b, pw_c); ");
    for (e, &n) in groups[0].iter().enumerate() {
        out.push_str(&format!("{} = pw_d[{e}]; ", use_as(n, "D result", 'f', true)?));
    }
    out.push('}');
    out.push_str(&"\n".repeat(src[toks[a].start..toks[semi].end].matches('\n').count()));
    Ok((semi, out))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Input,
    /// "=": written only.
    WriteOnly,
    /// "+": read and written.
    ReadWrite,
}

struct Operand {
    constraint: String,
    class: char,
    role: Role,
    expr: String,
}

fn operand(src: &str, toks: &[Token], output: bool, here: usize) -> Result<Operand, Failure> {
    let at = toks.first().map(|t| t.start).unwrap_or(here);
    if toks.first().is_some_and(|t| t.is_punct(b'[')) {
        return Err((at, "named asm operands ([name]) are not implemented by the emulator".into()));
    }
    let ok = toks.len() >= 3
        && toks[0].kind == Kind::Str
        && toks[1].is_punct(b'(')
        && matching(toks, 1) == Some(toks.len() - 1);
    if !ok {
        return Err((at, "asm operand is not \"constraint\"(expression)".into()));
    }
    let constraint = lex::string_value(toks[0].text(src));
    let role = match (output, constraint.chars().next()) {
        (false, _) => Role::Input,
        (true, Some('=')) => Role::WriteOnly,
        (true, Some('+')) => Role::ReadWrite,
        (true, _) => return Err((at, format!("asm output constraint \"{constraint}\" has no '=' or '+'"))),
    };
    let letters: Vec<char> = constraint.chars().filter(|c| !matches!(c, '=' | '+' | '&')).collect();
    if letters.len() != 1 {
        return Err((at, format!("asm constraint \"{constraint}\" is not implemented by the emulator")));
    }
    let inner = &toks[2..toks.len() - 1];
    if inner.is_empty() {
        return Err((at, "asm operand without an expression".into()));
    }
    let expr = src[inner[0].start..inner[inner.len() - 1].end].to_string();
    Ok(Operand { constraint, class: letters[0], role, expr })
}

/// `{%0,%1,%2,%3}, {%4,..}, {%8,%9}, {..}`: the operand numbers of d, a, b, c.
fn mma_groups(text: &str) -> Option<[Vec<usize>; 4]> {
    let mut groups: Vec<Vec<usize>> = vec![];
    let mut rest = text;
    for (g, want) in [4usize, 4, 2, 4].into_iter().enumerate() {
        rest = rest.trim_start();
        if g > 0 {
            rest = rest.strip_prefix(',')?.trim_start();
        }
        rest = rest.strip_prefix('{')?;
        let end = rest.find('}')?;
        let nums: Option<Vec<usize>> =
            rest[..end].split(',').map(|s| s.trim().strip_prefix('%')?.parse().ok()).collect();
        let nums = nums?;
        if nums.len() != want {
            return None;
        }
        groups.push(nums);
        rest = &rest[end + 1..];
    }
    if !rest.trim().is_empty() {
        return None;
    }
    let [d, a, b, c]: [Vec<usize>; 4] = groups.try_into().ok()?;
    Some([d, a, b, c])
}

/// `extern __shared__ [__align__(n)] T name[];` at toks[e]: the block's dynamic
/// shared memory under that name, as a `T*`.
fn rewrite_extern_shared(
    file: &str,
    src: &str,
    toks: &[Token],
    e: usize,
    namespace_level: bool,
) -> Result<(usize, String), Failure> {
    let here = toks[e].start;
    let semi = toks[e..].iter().position(|t| t.is_punct(b';')).map(|p| p + e);
    let shape_error =
        || (here, "extern __shared__ declaration is not `extern __shared__ T name[];`".to_string());
    let semi = semi.ok_or_else(shape_error)?;
    let mut k = e + 2;
    if toks.get(k).is_some_and(|t| t.is_ident(src, "__align__")) {
        k = matching(toks, k + 1).ok_or_else(shape_error)? + 1;
    }
    let decl = &toks[k..semi];
    let n = decl.len();
    if n < 4 || !decl[n - 2].is_punct(b'[') || !decl[n - 1].is_punct(b']') || decl[n - 3].kind != Kind::Ident
    {
        return Err(shape_error());
    }
    let name = decl[n - 3].text(src);
    let ty = &src[decl[0].start..decl[n - 4].end];
    let newlines = src[here..toks[semi].end].matches('\n').count();
    let text = if namespace_level {
        // Every use anywhere below reads the running block's memory, as in
        // CUDA (all extern __shared__ arrays start at the same address).
        let define = format!("#define {name} (static_cast<{ty}*>(pw_emu_dynamic_shared()))");
        // A declaration alone on its line (at most a comment after it) becomes
        // the directive in its place: every line keeps its number. Elsewhere
        // the directive takes lines of its own and `#line` restores the count.
        let line_start = src[..here].rfind('\n').map_or(0, |i| i + 1);
        let line_end = src[toks[semi].end..].find('\n').map_or(src.len(), |i| toks[semi].end + i);
        let after = src[toks[semi].end..line_end].trim_start();
        let alone = src[line_start..here].trim().is_empty() && (after.is_empty() || after.starts_with("//"));
        match alone && newlines == 0 {
            true => define,
            false => {
                let (line, _) = line_col(src, toks[semi].end);
                format!("\n{define}\n#line {line} \"{file}\"\n")
            }
        }
    } else {
        format!("{ty}* const {name} = static_cast<{ty}*>(pw_emu_dynamic_shared());{}", "\n".repeat(newlines))
    };
    Ok((semi, text))
}

/// Escapes `s` for a C string literal.
pub fn c_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The registration trailer appended to the program source: an entry
/// trampoline and parameter table per kernel, and pw_emu_module_init.
pub fn trailer(source_name: &str, arch: &str, kernels: &[Kernel]) -> String {
    let mut t = String::from("\n#line 1 \"<pipewright-emu registration>\"\nnamespace {\n");
    for (ki, k) in kernels.iter().enumerate() {
        for (pi, p) in k.params.iter().enumerate() {
            // restrict is a promise to the optimiser; std::is_pointer does not see through it.
            let bare: Vec<&str> =
                p.ty.split_whitespace()
                    .filter(|w| !matches!(*w, "__restrict__" | "__restrict" | "restrict"))
                    .collect();
            t.push_str(&format!("using pw_k{ki}_p{pi} = {};\n", bare.join(" ")));
        }
        let args: Vec<String> =
            (0..k.params.len()).map(|pi| format!("*static_cast<pw_k{ki}_p{pi}*>(args[{pi}])")).collect();
        let unused = if k.params.is_empty() { "(void)args; " } else { "" };
        t.push_str(&format!(
            "void pw_k{ki}_entry(void** args) {{ {unused}{}({}); }}\n",
            k.name,
            args.join(", ")
        ));
        if !k.params.is_empty() {
            t.push_str(&format!("const PwEmuParam pw_k{ki}_params[] = {{\n"));
            for (pi, p) in k.params.iter().enumerate() {
                let ty = format!("pw_k{ki}_p{pi}");
                t.push_str(&format!(
                    "    {{{}, {}, sizeof({ty}), alignof({ty}), std::is_pointer<{ty}>::value, \
                     std::is_const<typename std::remove_pointer<{ty}>::type>::value && std::is_pointer<{ty}>::value}},\n",
                    c_string(&p.name),
                    c_string(&p.ty)
                ));
            }
            t.push_str("};\n");
        }
    }
    if !kernels.is_empty() {
        t.push_str("const PwEmuKernel pw_kernels[] = {\n");
        for (ki, k) in kernels.iter().enumerate() {
            let bounds = match &k.launch_bounds {
                Some(expr) => format!("static_cast<unsigned int>({expr})"),
                None => "0u".into(),
            };
            let params = if k.params.is_empty() { "nullptr".to_string() } else { format!("pw_k{ki}_params") };
            t.push_str(&format!(
                "    {{{}, pw_k{ki}_entry, {bounds}, {}u, {params}}},\n",
                c_string(&k.name),
                k.params.len()
            ));
        }
        t.push_str("};\n");
    }
    let table = if kernels.is_empty() { "nullptr" } else { "pw_kernels" };
    t.push_str(&format!(
        "const PwEmuModuleInfo pw_module = {{PW_EMU_ABI_VERSION, {}, {}, {}u, {table}, pw_emu_touch_shared, PW_EMU_INSTRUMENTED}};\n",
        c_string(source_name),
        c_string(arch),
        kernels.len()
    ));
    t.push_str(
        "}  // namespace\n\
         extern \"C\" __attribute__((visibility(\"default\"))) const PwEmuModuleInfo* pw_emu_module_init(\n\
         \x20   const PwEmuRuntime* rt) {\n\
         \x20   if (rt == nullptr || rt->abi_version != PW_EMU_ABI_VERSION) return nullptr;\n\
         \x20   pw_emu_runtime = rt;\n\
         \x20   return &pw_module;\n\
         }\n",
    );
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_parameters_split_at_top_level_commas_with_names_last() {
        let src = "extern \"C\" __global__ void __launch_bounds__(2 * R, 1) k(const float* __restrict__ a, \
                   Pair<int, int> p, unsigned int, long long n) {}";
        let p = prepare("k.cu", src, true).unwrap_or_else(|e| panic!("{e:?}"));
        let k = &p.kernels[0];
        assert_eq!(k.name, "k");
        assert_eq!(k.launch_bounds.as_deref(), Some("2 * R"));
        let got: Vec<(&str, &str)> = k.params.iter().map(|p| (p.name.as_str(), p.ty.as_str())).collect();
        assert_eq!(
            got,
            [
                ("a", "const float* __restrict__"),
                ("p", "Pair<int, int>"),
                ("", "unsigned int"),
                ("n", "long long")
            ]
        );
    }

    #[test]
    fn a_kernel_without_extern_c_is_an_error_naming_it() {
        let e = prepare("x.cu", "\n__global__ void lonely(int n) {}", true).err().unwrap();
        assert!(e[0].starts_with("x.cu:2:17: error:") && e[0].contains("`lonely`"), "{e:?}");
    }

    #[test]
    fn kernels_and_inline_ptx_inside_macros_are_errors_not_silently_skipped() {
        let e = prepare("m.cu", "#define K extern \"C\" __global__\n#define P asm(\"nop;\")\n", true)
            .err()
            .unwrap();
        assert!(e[0].starts_with("m.cu:1:22: error: `__global__` in a #define"), "{e:?}");
        assert!(e[1].starts_with("m.cu:2:11: error: `asm` in a #define"), "{e:?}");
    }

    #[test]
    fn pragma_unroll_is_dropped_and_lines_are_kept() {
        let p = prepare("x.cu", "a\n#pragma unroll 4\nb\n#pragma once\n", true)
            .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(p.text, "a\n\nb\n#pragma once\n");
    }

    #[test]
    fn function_scope_extern_shared_becomes_a_pointer_to_dynamic_shared_memory() {
        let src = "extern \"C\" __global__ void k() {\n extern __shared__ __align__(16) float buf[];\n}";
        let p = prepare("x.cu", src, true).unwrap_or_else(|e| panic!("{e:?}"));
        assert!(
            p.text.contains("float* const buf = static_cast<float*>(pw_emu_dynamic_shared());"),
            "{}",
            p.text
        );
        assert_eq!(p.text.matches('\n').count(), src.matches('\n').count());
    }
}
