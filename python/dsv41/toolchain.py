"""Which toolchain built dsv41._C, and whether its link is sound (standard library only).

A shared object that carries its own copy of libstdc++ (a toolchain that links libstdc++.a
into shared objects: `-static-libstdc++` in its specs, or a lib folder holding libstdc++.a
but no libstdc++.so) breaks every stream in it. The copy's locale facet ids are not the
ones the process's libstdc++ registered, so formatting a number looks up the wrong facet:
on one machine the number silently vanishes from the message, on the first GPU machine the
process died with SIGSEGV inside `ostream::_M_insert<long>` on every `TORCH_CHECK` that
formats an integer, i.e. on every bad argument (a dead server per bad request).

setup.py links against the libstdc++ the running torch loaded and then calls
`libstdcxx_copies` on the built extension, failing the build if it finds one. The tests
and scripts/gpu_check.sh run `probe_error_path`: an op called with a bad argument in a
child process must raise a Python exception naming the numbers, not kill the process.

    python -m dsv41.toolchain [--json PATH]     # report; exit 1 if the link is unsound

setup.py loads this file by path (before dsv41 is importable): keep it free of dsv41
and torch imports at module level.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

_SHT_SYMTAB, _SHT_DYNAMIC, _SHT_DYNSYM = 2, 6, 11
_STB_LOCAL, _STB_GLOBAL = 0, 1
_STT_OBJECT, _STT_FUNC = 1, 2
_DT_NEEDED = 1


class ElfSymbols:
    """The symbols an ELF64 little-endian shared object defines, and its DT_NEEDED list.

    `strong` holds every symbol defined with local or global (not weak) binding, from
    .symtab and .dynsym. Template instantiations a compiler emits inline are weak;
    libstdc++'s own compiled functions and objects are strong wherever they are linked in.
    `exported` holds the defined .dynsym names of any binding.
    """

    def __init__(self, path: str):
        self.path = path
        self.strong: set[str] = set()
        self.exported: set[str] = set()
        self.needed: list[str] = []
        with open(path, "rb") as f:
            self._read(f)

    def _read(self, f) -> None:
        ident = f.read(64)
        if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            raise ValueError(f"{self.path}: not a 64-bit little-endian ELF file")
        shoff, = struct.unpack_from("<Q", ident, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", ident, 0x3A)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]

        def content(index: int) -> bytes:
            s = sections[index]
            f.seek(s[4])
            return f.read(s[5])

        for sh in sections:
            kind, link = sh[1], sh[6]
            if kind in (_SHT_SYMTAB, _SHT_DYNSYM):
                f.seek(sh[4])
                data, names = f.read(sh[5]), content(link)
                for name_off, info, _other, shndx, _value, _size in struct.iter_unpack("<IBBHQQ", data):
                    bind, typ = info >> 4, info & 0xF
                    if shndx == 0 or typ not in (_STT_OBJECT, _STT_FUNC) or not name_off:
                        continue
                    name = names[name_off:names.index(b"\0", name_off)].decode("ascii", "replace")
                    if bind in (_STB_LOCAL, _STB_GLOBAL):
                        self.strong.add(name)
                    if kind == _SHT_DYNSYM:
                        self.exported.add(name)
            elif kind == _SHT_DYNAMIC:
                f.seek(sh[4])
                data, names = f.read(sh[5]), content(link)
                for tag, val in struct.iter_unpack("<qQ", data):
                    if tag == _DT_NEEDED:
                        self.needed.append(names[val:names.index(b"\0", val)].decode())


def loaded_libstdcxx() -> str | None:
    """The libstdc++ this process has mapped (after `import torch`, the one torch uses)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if os.path.basename(path).startswith("libstdc++.so"):
                    return path
    except OSError:
        pass
    return None


def libstdcxx_copies(extension: str, libstdcxx: str) -> list[str]:
    """The names `extension` defines strongly that `libstdcxx` also exports: its private
    copy of libstdc++ (empty for a sound link)."""
    return sorted(ElfSymbols(extension).strong & ElfSymbols(libstdcxx).exported)


class PrivateLibstdcxxError(RuntimeError):
    """A linked extension defines libstdc++'s own symbols."""


def check_linked_extension(path: str, libstdcxx: str) -> None:
    """The build's post-link check: if `path` carries a private libstdc++, remove it (no
    broken file may be imported later) and raise PrivateLibstdcxxError saying why."""
    copies = libstdcxx_copies(path, libstdcxx)
    if not copies:
        return
    os.remove(path)
    compiler = compiler_info()
    raise PrivateLibstdcxxError(
        f"{path} carries a private copy of libstdc++ ({len(copies)} of its symbols, e.g. "
        f"{', '.join(copies[:3])}): its error messages would crash the process or lose their "
        f"numbers. The C++ compiler {compiler['path'] or compiler['cxx']} "
        f"({compiler['version']}) links libstdc++ statically into shared objects; build with one "
        f"that links {libstdcxx} (e.g. CXX=/usr/bin/g++). The file was removed.")


def compiler_info(cxx: str | None = None) -> dict:
    """The host C++ compiler torch's cpp_extension uses (CXX, else `c++`): where it
    resolves to on PATH and the first line of its `--version`."""
    name = cxx or os.environ.get("CXX") or "c++"
    path = shutil.which(name.split()[-1])  # "ccache g++" -> g++
    info = {"cxx": name, "path": path, "realpath": os.path.realpath(path) if path else None, "version": None}
    if path:
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
            info["version"] = out.splitlines()[0] if out else None
        except (OSError, subprocess.SubprocessError) as e:
            info["version"] = f"unknown ({e})"
    return info


def nvcc_info() -> dict:
    """The CUDA compiler setup.py would use (CUDA_HOME's, else nvcc on PATH), if any."""
    home = os.environ.get("CUDA_HOME")
    path = os.path.join(home, "bin", "nvcc") if home and os.path.exists(os.path.join(home, "bin", "nvcc")) \
        else shutil.which("nvcc")
    info = {"path": path, "version": None}
    if path:
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
            info["version"] = next((line for line in out.splitlines() if "release" in line), None)
        except (OSError, subprocess.SubprocessError) as e:
            info["version"] = f"unknown ({e})"
    return info


# The child: the cache-op scatter with a row index out of range, whose check formats four
# integers (the op that crashed on the first GPU machine). Prints the message as JSON.
_PROBE = """
import json, torch
import dsv41.formats  # noqa: F401  (loads dsv41._C, which registers torch.ops.dsv41)
x = torch.zeros(2, 32)
codes = torch.zeros(4, 32, dtype=torch.float8_e4m3fn)
scales = torch.zeros(4, 1, dtype=torch.uint8)
try:
    torch.ops.dsv41.quantize_fp8_swa_scatter(x, codes, scales, torch.tensor([0, 4]))
except RuntimeError as e:
    print(json.dumps({"raised": type(e).__name__, "message": str(e).splitlines()[0]}))
else:
    print(json.dumps({"raised": None}))
"""
# What the message must carry: row 1's index 4 and the bounds it broke, each a formatted
# integer (a private libstdc++ drops them, or crashes).
_PROBE_EXPECTS = ("rows[1] = 4", "[-1, 4)")


def probe_error_path(python: str | None = None, timeout: float = 120) -> dict:
    """Call one op with a bad argument in a child process. ok: the child raised a Python
    exception whose message carries the offending number, and exited normally. A signal
    (rc < 0), a lost number or no exception at all is a broken build."""
    p = subprocess.run([python or sys.executable, "-c", _PROBE], capture_output=True, text=True,
                       timeout=timeout, env=os.environ.copy())
    out = {"rc": p.returncode, "signal": -p.returncode if p.returncode < 0 else None}
    try:
        out.update(json.loads(p.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        out["stderr_tail"] = p.stderr[-2000:]
    message = out.get("message") or ""
    out["ok"] = (p.returncode == 0 and out.get("raised") == "RuntimeError"
                 and all(e in message for e in _PROBE_EXPECTS))
    return out


def report(python: str | None = None) -> dict:
    """Everything above for the extension this process imports (imports dsv41)."""
    import torch  # noqa: F401  (maps the libstdc++ torch runs with)

    from ._ext import _C

    lib = loaded_libstdcxx()
    copies = libstdcxx_copies(_C.__file__, lib) if lib else None
    probe = probe_error_path(python)
    return {
        "compiler": compiler_info(),
        "nvcc": nvcc_info(),
        "extension": _C.__file__,
        "libstdcxx_loaded": lib,
        "libstdcxx_copies": len(copies) if copies is not None else None,
        "libstdcxx_copies_first": (copies or [])[:10],
        "needed": ElfSymbols(_C.__file__).needed,
        "error_path": probe,
        "ok": copies == [] and probe["ok"],
    }


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="write the report here too")
    args = p.parse_args(argv)
    r = report()
    text = json.dumps(r, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
