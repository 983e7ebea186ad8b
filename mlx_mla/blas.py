"""Which BLAS MLX's CPU backend multiplies with, and OpenBLAS in place of the reference one.

MLX's Linux CPU wheel (``mlx[cpu]``) links the reference (netlib) BLAS and LAPACK it bundles
in ``mlx_cpu.libs`` by soname: ``libmlx.so`` calls ``cblas_sgemm`` for every float32
matmul, unversioned. The dynamic linker resolves such a symbol in the process's global
scope (the executable, ``LD_PRELOAD``, libraries opened with ``RTLD_GLOBAL``) before the
library's own dependencies, so an OpenBLAS opened with ``RTLD_GLOBAL`` *before* ``mlx.core``
is imported takes every BLAS and LAPACK call MLX makes (measured here: float32 GEMM 2048³
5.5 → 47-140 GFLOP/s on 2 shared cores).

``preload()`` does that, once, at ``import mlx_mla`` (``mlx_mla/__init__.py`` calls it before
anything imports MLX), when all of these hold: Linux; the ``cmeel-openblas`` wheel is
installed (``pip install "mlx-mla[openblas]"``); MLX's bundled BLAS is the reference one
(``mlx_cpu.libs/libblas-*``: nothing changes on macOS, which uses Accelerate, or without the
CPU wheel); ``mlx.core`` is not loaded yet (afterwards some calls may already be bound to
the reference BLAS, so it declines rather than leave a mixture); and the environment
variable ``MLX_MLA_BLAS`` is not ``reference``. It never raises: what it did, or why it did
not, is in ``describe()["preload"]``, which ``generate`` and every benchmark print.

cmeel-openblas's ``libopenblas.so.0`` needs ``libgfortran.so.5`` (for two LAPACK helpers).
Where the system has it (Debian/Ubuntu ``libgfortran5``) it is used; otherwise the copy
``mlx[cpu]`` bundles is used: that copy's soname was renamed by auditwheel, so a copy of
it with the soname set back to ``libgfortran.so.5`` is written once to the user's cache
(``$XDG_CACHE_HOME/mlx-mla``, else ``~/.cache/mlx-mla``) and opened first.

``MLX_MLA_BLAS``: unset or ``auto`` (OpenBLAS when installed) or ``reference`` (keep MLX's
bundled BLAS). ``describe()`` says which BLAS MLX uses now, from the symbol the dynamic
linker resolves, not from what was asked for (an ``LD_PRELOAD``-ed BLAS shows too).
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
from importlib import metadata, util
from pathlib import Path
from typing import Dict, Optional

ENV = "MLX_MLA_BLAS"
CHOICES = ("auto", "reference")
GFORTRAN = "libgfortran.so.5"

# What preload() did, for describe(): "loaded", or why it did not.
_state: Dict[str, str] = {"preload": "not attempted"}


# ---------------------------------------------------------------- where things are


def _mlx_bundled_libs() -> Optional[Path]:
    """``site-packages/mlx_cpu.libs`` when MLX's wheel bundles the reference BLAS there."""
    spec = util.find_spec("mlx")  # a namespace package: finding it imports nothing
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        libs = Path(loc).parent / "mlx_cpu.libs"
        if any(libs.glob("libblas-*.so*")):
            return libs
    return None


def openblas_library() -> Optional[Path]:
    """Path of cmeel-openblas's ``libopenblas.so.0``, or None if it is not installed."""
    try:
        dist = metadata.distribution("cmeel-openblas")
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == "libopenblas.so.0":
            return Path(dist.locate_file(f))
    return None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx-mla"


# ---------------------------------------------------------------- ELF: a library's soname


def _dynamic_strings(data: bytes):
    """(file offset of .dynstr, {d_tag: d_val}) of a little-endian ELF64 shared object.

    Raises:
        ValueError: not a little-endian ELF64 file with a dynamic section.
    """
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = struct.unpack_from(
            "<IIQQQQQQ", data, phoff + i * phentsize)
        if p_type == 1:  # PT_LOAD
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 2:  # PT_DYNAMIC
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        raise ValueError("no dynamic section")
    tags = {}
    for j in range(dynamic[1] // 16):
        tag, val = struct.unpack_from("<qQ", data, dynamic[0] + 16 * j)
        if tag == 0:  # DT_NULL
            break
        tags.setdefault(tag, val)
    strtab = tags[5]  # DT_STRTAB, a virtual address
    for vaddr, offset, size in loads:
        if vaddr <= strtab < vaddr + size:
            return strtab - vaddr + offset, tags
    raise ValueError("DT_STRTAB outside every PT_LOAD segment")


def read_soname(path: Path) -> Optional[str]:
    """The DT_SONAME of the ELF64 shared object at ``path`` (None if it has none)."""
    data = Path(path).read_bytes()
    strtab, tags = _dynamic_strings(data)
    if 14 not in tags:  # DT_SONAME
        return None
    start = strtab + tags[14]
    return data[start:data.index(b"\0", start)].decode()


def with_soname(src: Path, dst: Path, soname: str) -> Path:
    """Copy the shared object ``src`` to ``dst`` with its DT_SONAME string replaced by
    ``soname`` (written in place, NUL-padded: it must not be longer than the old one). The
    dynamic linker matches a library's DT_NEEDED entries against the sonames of those
    already loaded, so a loaded copy then satisfies ``soname``. Written to a temporary
    file and renamed, so a concurrent reader never sees half a file.

    Raises:
        ValueError: ``src`` has no soname, or ``soname`` is longer than it.
    """
    data = bytearray(Path(src).read_bytes())
    strtab, tags = _dynamic_strings(bytes(data))
    if 14 not in tags:
        raise ValueError(f"{src} has no soname")
    start = strtab + tags[14]
    end = data.index(b"\0", start)
    new = soname.encode()
    if len(new) > end - start:
        raise ValueError(f"soname {soname!r} is longer than {data[start:end].decode()!r}")
    data[start:end] = new + b"\0" * (end - start - len(new))
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, dst)
    return dst


# ---------------------------------------------------------------- loading


def _load_gfortran(bundled: Path) -> None:
    """Make ``libgfortran.so.5`` resolvable for OpenBLAS: the system's, else the copy
    ``mlx[cpu]`` bundles (its libquadmath first: that copy needs it by its bundled name)."""
    try:
        ctypes.CDLL(GFORTRAN, mode=ctypes.RTLD_GLOBAL)
        return
    except OSError:
        pass
    src = next(iter(sorted(bundled.glob("libgfortran-*.so*"))), None)
    if src is None:
        raise OSError(f"{GFORTRAN} is not installed and mlx[cpu] bundles no copy")
    for quadmath in sorted(bundled.glob("libquadmath-*.so*")):
        ctypes.CDLL(str(quadmath), mode=ctypes.RTLD_GLOBAL)
    # The file name carries the source's (hashed) name: a new mlx wheel gets a new copy.
    dst = _cache_dir() / f"{src.name}.{GFORTRAN}"
    if not dst.exists() or read_soname(dst) != GFORTRAN:
        with_soname(src, dst, GFORTRAN)
    ctypes.CDLL(str(dst), mode=ctypes.RTLD_GLOBAL)


def preload() -> str:
    """Open cmeel-openblas's OpenBLAS with ``RTLD_GLOBAL`` before MLX loads, if the
    conditions in the module docstring hold. Idempotent; never raises (it runs at import).
    Returns what happened ("loaded", or why not), also kept for ``describe()``.
    """
    if _state["preload"] == "not attempted":
        _state["preload"] = _try_preload(os.environ.get(ENV, "auto").strip().lower() or "auto")
    return _state["preload"]


def _try_preload(want: str) -> str:
    if want not in CHOICES:
        return f"{ENV}={want!r} is not one of {', '.join(CHOICES)}: not loaded"
    if want == "reference":
        return f"{ENV}=reference"
    if not sys.platform.startswith("linux"):
        return "not Linux"
    bundled = _mlx_bundled_libs()
    if bundled is None:
        return "MLX does not bundle the reference BLAS here"
    library = openblas_library()
    if library is None:
        return 'cmeel-openblas not installed (pip install "mlx-mla[openblas]")'
    if "mlx.core" in sys.modules:
        return "mlx.core was imported before mlx_mla"
    try:
        _load_gfortran(bundled)
        ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    except (OSError, ValueError) as e:  # a missing/unreadable library, an unwritable cache
        return f"cannot load OpenBLAS: {e}"
    return "loaded"


# ---------------------------------------------------------------- which BLAS is in use


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _global_sgemm_library() -> Optional[str]:
    """File of the ``cblas_sgemm`` the global scope resolves to (what libmlx binds to
    before its own dependencies), or None if no global-scope library defines it."""
    try:
        process = ctypes.CDLL(None)
        addr = ctypes.cast(process.cblas_sgemm, ctypes.c_void_p).value
        info = _DlInfo()
        if not process.dladdr(ctypes.c_void_p(addr), ctypes.byref(info)):
            return None
        return info.dli_fname.decode()
    except (AttributeError, OSError):
        return None


def _mapped_bundled_blas() -> Optional[str]:
    """The bundled reference libblas mapped into this process (Linux), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "mlx_cpu.libs/libblas-" in path:
                    return path
    except OSError:
        pass
    return None


def _openblas_label(path: str) -> str:
    lib = ctypes.CDLL(path)
    lib.openblas_get_config.restype = ctypes.c_char_p
    lib.openblas_get_corename.restype = ctypes.c_char_p
    config = lib.openblas_get_config().decode().split()
    version = config[1] if len(config) > 1 else "?"
    return (f"OpenBLAS {version} ({lib.openblas_get_corename().decode()}, "
            f"{lib.openblas_get_num_threads()} threads)")


def _kind_of(path: Optional[str]) -> str:
    """The kind (see ``describe``) of the BLAS library at ``path``."""
    if not path:
        return "unknown"
    if "openblas" in os.path.basename(path).lower():
        return "openblas"
    if "mlx_cpu.libs/libblas-" in path:
        return "reference"
    if "accelerate" in path.lower():
        return "accelerate"
    return "other"


def describe() -> Dict[str, str]:
    """Which BLAS MLX's CPU matmuls go through in this process, right now.

    Returns {"kind", "label", "library", "preload"}: kind is "openblas", "reference"
    (MLX's bundled netlib BLAS), "accelerate", "other" or "unknown"; label is for people
    (e.g. "OpenBLAS 0.3.31 (SKYLAKEX, 2 threads)"); library the resolved file; preload
    what ``preload()`` did. Source: the dynamic linker's own resolution of ``cblas_sgemm``
    in the global scope (``dlsym`` + ``dladdr``), else the bundled BLAS that is mapped.
    """
    path = _global_sgemm_library() or _mapped_bundled_blas()
    kind = _kind_of(path)
    if kind == "openblas":
        try:
            label = _openblas_label(path)
        except (AttributeError, OSError):
            label = "OpenBLAS"
    else:
        label = {"unknown": "unknown (no cblas_sgemm found)",
                 "reference": "reference BLAS (netlib, bundled with mlx[cpu])",
                 "accelerate": "Accelerate"}.get(kind) or os.path.basename(path)
    return {"kind": kind, "label": label, "library": path or "", "preload": _state["preload"]}


def kind() -> str:
    """``describe()["kind"]``: the key ``auto``'s and the prefill GEMM's tables use. Skips
    the label (which opens OpenBLAS to ask its version): ``auto`` asks once per layer."""
    return _kind_of(_global_sgemm_library() or _mapped_bundled_blas())
