#!/usr/bin/env python3
"""A C++ "compiler" for the emulated GPU's NVRTC stand-in (PW_EMU_CXX) that
plants one bug before compiling: scripts/emu-mutants.sh sets it, so the
checkout's kernels are never edited. The stand-in writes the program (its
file name is the kernel file's, e.g. swiglu.cu) and its headers
(common.cuh) into a build folder and runs this there with the real compiler's
arguments.

env: PW_MUTANT_FILE  the file to change (a basename: swiglu.cu, common.cuh)
     PW_MUTANT_FROM  the exact text to replace, PW_MUTANT_TO what replaces it
     PW_MUTANT_NTH   which occurrence (1-based; default 1)
     PW_MUTANT_LOG   a file that gets one line per build that planted the bug
     PW_MUTANT_CXX   the real compiler (default c++)
A build whose files do not hold the text compiles unchanged; one that holds
fewer than NTH occurrences is an error, so a stale mutant is never "caught".
"""
import os
import subprocess
import sys


def unescape(s):
    return s.replace("\\t", "\t").replace("\\n", "\n")


def main():
    args = sys.argv[1:]
    cxx = os.environ.get("PW_MUTANT_CXX", "c++")
    target = os.environ.get("PW_MUTANT_FILE")
    log = os.environ.get("PW_MUTANT_LOG")
    planted = False
    # The stand-in may run the compiler more than once in one build folder
    # (compile, then link): plant once.
    marker = ".pw-mutant-planted"
    if target and args != ["--version"] and not os.path.exists(marker):
        frm = unescape(os.environ["PW_MUTANT_FROM"])
        to = unescape(os.environ.get("PW_MUTANT_TO", ""))
        nth = int(os.environ.get("PW_MUTANT_NTH", "1"))
        for root, _, files in os.walk("."):
            if target not in files:
                continue
            path = os.path.join(root, target)
            text = open(path).read()
            count = text.count(frm)
            if count == 0:
                continue
            if count < nth:
                sys.stderr.write(f"mutant: {target} holds {count} occurrence(s) of {frm!r}, not {nth}\n")
                sys.exit(1)
            at = -1
            for _ in range(nth):
                at = text.index(frm, at + 1)
            open(path, "w").write(text[:at] + to + text[at + len(frm):])
            planted = True
            open(marker, "w").close()
            if log:
                with open(log, "a") as f:
                    f.write(f"planted in {path}\n")
    if not planted:
        os.execvp(cxx, [cxx] + args)
    # A mutant that does not compile models no bug a GPU would run: the
    # campaign reports it as broken, not as caught.
    rc = subprocess.call([cxx] + args)
    if rc != 0 and log:
        with open(log, "a") as f:
            f.write("build failed\n")
    sys.exit(rc)


if __name__ == "__main__":
    main()
