"""The build itself: CUDA kernels must be compiled wherever they can be (CI has nvcc and a
CUDA build of torch but no GPU), so a broken kernel cannot hide behind a CPU-only build."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

import dsv41
from dsv41 import toolchain


def _toolkit_present() -> bool:
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    return bool(torch.version.cuda) and (os.path.exists(os.path.join(home, "bin", "nvcc"))
                                         or shutil.which("nvcc") is not None)


@pytest.mark.skipif(os.environ.get("DSV41_CUDA") == "0", reason="CUDA build disabled by DSV41_CUDA=0")
def test_cuda_kernels_were_compiled_when_a_toolkit_is_present():
    info = dsv41.build_info()
    if not _toolkit_present():
        pytest.skip("no CUDA toolkit or CPU-only torch: a CPU-only build is expected")
    assert info["cuda_compiled"], "nvcc and a CUDA torch are present but dsv41._C has no CUDA kernels"
    assert info["cuda_arch_list"], "no CUDA architectures recorded"


def test_extension_matches_the_running_torch():
    info = dsv41.build_info()
    assert "warning" not in info, info.get("warning")


# ---- libstdc++: one copy per process (python/dsv41/toolchain.py says why) --------------

def test_bad_argument_raises_a_python_exception_in_a_child_process():
    # The first GPU machine's build died with SIGSEGV here (a private libstdc++ in _C.so);
    # a build with such a copy on this machine drops the numbers from the message instead.
    r = toolchain.probe_error_path()
    assert r["signal"] is None and r["rc"] == 0, r
    assert r["raised"] == "RuntimeError", r
    assert "rows[1] = 4 is outside [-1, 4)" in r["message"] and r["ok"], r


def test_probe_reports_a_child_killed_by_a_signal(tmp_path):
    crashing = tmp_path / "python"
    crashing.write_text("#!/bin/sh\nkill -SEGV $$\n")
    crashing.chmod(0o755)
    r = toolchain.probe_error_path(str(crashing))
    assert r == {**r, "rc": -signal.SIGSEGV, "signal": signal.SIGSEGV, "ok": False}


def test_the_extension_defines_no_libstdcxx_symbols():
    lib = toolchain.loaded_libstdcxx()
    assert lib, "torch is loaded, so is a libstdc++"
    assert dsv41.build_info()["libstdcxx_loaded"] == lib
    assert toolchain.libstdcxx_copies(dsv41.build_info()["extension"], lib) == []


_FORMATS_A_NUMBER = """
#include <sstream>
#include <string>
extern "C" int format_number(char* out, long n) {
  std::ostringstream s;
  s << "n=" << n;
  const std::string t = s.str();
  return static_cast<int>(t.copy(out, 63));
}
"""


def _link(tmp_path, name: str, *flags: str) -> Path:
    cxx = shutil.which(os.environ.get("CXX", "c++").split()[-1])
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "formats_a_number.cpp"
    src.write_text(_FORMATS_A_NUMBER)
    out = tmp_path / f"{name}.so"
    p = subprocess.run([cxx, "-shared", "-fPIC", "-O1", str(src), "-o", str(out), *flags],
                       capture_output=True, text=True, timeout=120)
    if p.returncode != 0 and "-static-libstdc++" in flags:
        pytest.skip(f"this toolchain cannot link libstdc++ statically: {p.stderr[-300:]}")
    assert p.returncode == 0, p.stderr
    return out


def test_post_link_check_rejects_a_static_libstdcxx_and_pinning_avoids_it(tmp_path):
    lib = toolchain.loaded_libstdcxx()
    # What a toolchain with -static-libstdc++ in its specs (or only libstdc++.a in its lib
    # folder) makes of any shared object: a private copy of libstdc++.
    static = _link(tmp_path, "static", "-static-libstdc++")
    copies = toolchain.libstdcxx_copies(str(static), lib)
    assert "_ZNSt6locale7classicEv" in copies  # std::locale::classic(), libstdc++'s own
    with pytest.raises(toolchain.PrivateLibstdcxxError, match="private copy of libstdc++"):
        toolchain.check_linked_extension(str(static), lib)
    assert not static.exists()  # removed: nothing broken is left to import
    # setup.py's link: the runtime's libstdc++ named ahead of the driver's -lstdc++, so the
    # same static-libstdc++ driver pulls nothing in.
    pinned = _link(tmp_path, "pinned", lib, "-static-libstdc++")
    assert toolchain.libstdcxx_copies(str(pinned), lib) == []
    toolchain.check_linked_extension(str(pinned), lib)
    assert pinned.exists()
    # A plain link is whatever this toolchain does by default: clean with a distribution
    # g++, a private copy with one that links libstdc++ statically (the GPU machine's
    # /opt/gcc g++ 13.3 made 729 such symbols). Either way the check must agree with the
    # symbols: accept a clean object, reject and remove one that carries a copy.
    plain = _link(tmp_path, "plain")
    if toolchain.libstdcxx_copies(str(plain), lib):
        with pytest.raises(toolchain.PrivateLibstdcxxError, match="private copy of libstdc++"):
            toolchain.check_linked_extension(str(plain), lib)
        assert not plain.exists()
    else:
        toolchain.check_linked_extension(str(plain), lib)
        assert plain.exists()
