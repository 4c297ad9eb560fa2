"""specserve's own C++ kernels for CPUs with AVX512-BF16 (``small_gemm.cpp``, ``int8_gemm.cpp``,
``tree_attention.cpp``, ``elementwise.cpp``; helpers shared in ``simd.h``) and for CPUs with AVX2 and FMA only
(``avx2_gemm.cpp``, ``tree_attention_avx2.cpp``, ``elementwise_avx2.cpp``; helpers in ``simd_avx2.h``): built once
per machine and loaded through ctypes, and the kernels' operators' C++ CPU implementations (``ops.cpp``,
``native_ops``), built with PyTorch's headers and loaded into PyTorch's dispatcher.

Each source is compiled with the compiler inductor uses (``$CXX``, else ``g++``) into the cache folder
(``$SPECSERVE_CACHE_DIR/kernels``, else ``~/.cache/specserve/kernels``) under a name hashed from the source, the
flags, the compiler and the OpenMP runtime, and linked to PyTorch's own libgomp so that its threads are PyTorch's.
Where the CPU lacks a kernel's instructions (its ``ISAS`` entry), no compiler is found or the build fails,
``function`` returns None (the reason logged) and the callers keep PyTorch's kernels.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from specserve.models.gguf import cache_root

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-fopenmp", "-fPIC"]
#: instruction set -> (its compiler flags, the /proc/cpuinfo flags a CPU needs to run it)
ISAS = {
    "avx512bf16": (("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"),
                   ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")),
    "avx2": (("-mavx2", "-mfma"), ("avx2", "fma")),
}


def env_mode(env: str, modes: tuple[str, ...]) -> str:
    """The value of the environment variable ``env`` (default: modes[0]), one of ``modes``; ValueError naming the
    variable for anything else."""
    value = os.environ.get(env, modes[0]).strip().lower()
    if value not in modes:
        raise ValueError(f"{env}={value!r}: expected one of {', '.join(modes)}")
    return value


def kernel_ready(env: str, modes: tuple[str, ...], kernel: Callable[[], object]) -> bool:
    """A kernel is wanted (its variable ``env`` is not off) and runs here (``kernel()``, its ctypes function, is not
    None). Its operator's C++ implementation loads now too, where it can (``native_ops``, built on the first load),
    rather than at the operator's first call."""
    if env_mode(env, modes) == "off" or kernel() is None:
        return False
    native_ops()
    return True


def cpu_supports(cpuinfo: str | None = None, isa: str = "avx512bf16") -> bool:
    """The CPU has the instructions of ``isa`` (Linux's /proc/cpuinfo flags; False where it cannot tell)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return all(f in flags for f in ISAS[isa][1])


def torch_openmp() -> str | None:
    """PyTorch's own OpenMP runtime (the libgomp its wheel ships), which the kernels link so that their threads are
    PyTorch's; None where there is none (a build with another threading runtime)."""
    found = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    return found[0] if found else None


def build(source: Path, compiler: str, openmp: str, out_dir: Path, extra: tuple[Path, ...] = (),
          compile_flags: tuple[str, ...] = (), link_flags: tuple[str, ...] = (), isa: str = "avx512bf16") -> Path:
    """Compile ``source`` (and the ``extra`` sources beside it, into the same library) for the instruction set
    ``isa`` into a shared library (once: the file is named by a hash of the sources, the headers beside them, flags,
    compiler and runtime) -> its path. Written to a temporary name and renamed, so processes building at once each see
    a whole file."""
    compile_flags = (*ISAS[isa][0], *compile_flags)
    sources = (source, *extra)
    headers = sorted(source.parent.glob("*.h"))  # included by the sources (simd.h): a change rebuilds
    text = b"".join(src.read_bytes() for src in (*sources, *headers))
    key = hashlib.sha256(text + " ".join([compiler, openmp, *FLAGS, *compile_flags, *link_flags]).encode())
    target = out_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        objs = [Path(tmp) / f"{src.stem}.o" for src in sources]
        for src, obj in zip(sources, objs, strict=True):
            subprocess.run([compiler, *FLAGS, *compile_flags, "-c", str(src), "-o", str(obj)], check=True,
                           capture_output=True)
        lib = Path(tmp) / f"{source.stem}.so"
        # linked to PyTorch's libgomp by path (not -fopenmp's system one): the same runtime, the same thread pool
        subprocess.run([compiler, "-shared", *map(str, objs), "-o", str(lib), *link_flags, openmp,
                        f"-Wl,-rpath,{os.path.dirname(openmp)}"], check=True, capture_output=True)
        os.replace(lib, target)
    return target


def _toolchain(what: str, isa: str = "avx512bf16") -> tuple[str, str] | None:
    """(the compiler, PyTorch's libgomp) where the kernels for ``isa`` can be built and run here, else None (reason
    logged)."""
    if not cpu_supports(isa=isa):
        logger.info("%s: the CPU lacks %s", what, isa.upper())
        return None
    compiler, openmp = shutil.which(os.environ.get("CXX", "g++")), torch_openmp()
    if compiler is None or openmp is None:
        logger.info("%s: no %s", what, "C++ compiler" if compiler is None else "libgomp beside PyTorch")
        return None
    return compiler, openmp


def _built(what: str, build_it) -> Path | None:
    """build_it() -> the library's path, or None with the compiler's complaint logged."""
    try:
        return build_it()
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("%s not built: %s %s", what, e, detail.decode(errors="replace")[-500:])
        return None


@functools.cache
def function(source_name: str, symbol: str, argtypes: tuple, compile_flags: tuple[str, ...] = (),
             isa: str = "avx512bf16", restype=None):
    """The C function ``symbol`` of this folder's ``source_name``, built for the instruction set ``isa`` on the first
    call (with ``compile_flags`` too: benchmarks build variants), as a ctypes function returning ``restype`` (None:
    nothing), or None where it cannot run here."""
    tools = _toolchain(source_name, isa)
    if tools is None:
        return None
    source = Path(__file__).with_name(source_name)
    path = _built(source_name, lambda: build(source, *tools, Path(cache_root()) / "kernels",
                                             compile_flags=compile_flags, isa=isa))
    if path is None:
        return None
    try:
        fn = getattr(ctypes.CDLL(str(path)), symbol)
    except (OSError, AttributeError) as e:
        logger.warning("%s not loaded: %s", source_name, e)
        return None
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


OPS_ENV = "SPECSERVE_CPU_OPS"
OPS_MODES = ("native", "python")
KERNEL_SOURCES = ("small_gemm.cpp", "int8_gemm.cpp", "tree_attention.cpp", "elementwise.cpp")
#: what ``ops.cpp`` is linked with on a CPU with AVX2 and FMA but no AVX512-BF16 (built with SPECSERVE_OPS_AVX2)
AVX2_KERNEL_SOURCES = ("avx2_gemm.cpp", "tree_attention_avx2.cpp", "elementwise_avx2.cpp")


@functools.cache
def native_ops() -> bool:
    """Load ``ops.cpp`` (built on the first call with PyTorch's headers, linked with the kernels' sources), whose
    C++ CPU kernels for specserve::small_gemm, int8_gemm, tree_attention, rms_norm, silu_mul, rope, race_exponentials
    and kv_store (on a CPU with AVX2 but no AVX512-BF16: avx2_gemm, int8_gemm, tree_attention and the element-wise
    ones, built from AVX2_KERNEL_SOURCES) then take those operators' calls instead of their Python implementations
    (a call through the dispatcher costs about 2.5 us less) -> whether it is loaded. Not where
    SPECSERVE_CPU_OPS=python, the kernels cannot run here, or PyTorch's headers are missing."""
    if env_mode(OPS_ENV, OPS_MODES) == "python":
        return False
    isa, sources, defines = "avx512bf16", KERNEL_SOURCES, ()
    if not cpu_supports(isa=isa):  # the AVX2 build: its kernels and the element-wise operators
        isa, sources, defines = "avx2", AVX2_KERNEL_SOURCES, ("-DSPECSERVE_OPS_AVX2",)
    tools = _toolchain("ops.cpp", isa)
    if tools is None:
        return False
    from torch.utils import cpp_extension

    here = Path(__file__).parent
    includes = tuple(f"-I{d}" for d in cpp_extension.include_paths())
    # SPECSERVE_TORCH is read by no source: it puts PyTorch's version into the library's hashed name, so an upgrade
    # in the same environment (same header paths) rebuilds against the new headers
    compile_flags = ("-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *includes,
                     f"-DSPECSERVE_TORCH={torch.__version__}", *defines)
    libdirs = cpp_extension.library_paths()
    link_flags = (*(f"-L{d}" for d in libdirs), "-lc10", "-ltorch_cpu", *(f"-Wl,-rpath,{d}" for d in libdirs))
    path = _built("ops.cpp", lambda: build(here / "ops.cpp", *tools, Path(cache_root()) / "kernels",
                                           tuple(here / name for name in sources), compile_flags, link_flags,
                                           isa=isa))
    if path is None:
        return False
    try:
        torch.ops.load_library(str(path))
    except OSError as e:
        logger.warning("ops.cpp not loaded: %s", e)
        return False
    _ops_library.append(path)
    return True


_ops_library: list[Path] = []  # the loaded ``ops.cpp`` library's path, once ``native_ops`` has loaded it


def ops_function(symbol: str, argtypes: tuple, restype=None):
    """The C function ``symbol`` of the loaded ``ops.cpp`` library (``native_ops``: the kernels' sources linked into
    it, with their own copies of any state, such as small_gemm.cpp's prefetch distance) as a ctypes function, or None
    where that library is not loaded or has no such symbol (the AVX2 build)."""
    if not native_ops() or not _ops_library:
        return None
    try:
        fn = getattr(ctypes.CDLL(str(_ops_library[0])), symbol)
    except (OSError, AttributeError):
        return None
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn
