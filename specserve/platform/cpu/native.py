"""specserve's own C++ kernels for CPUs with AVX512-BF16 (``small_gemm.cpp``, ``int8_gemm.cpp``,
``tree_attention.cpp``): built once per machine and loaded through ctypes.

Each source is compiled with the compiler inductor uses (``$CXX``, else ``g++``) into the cache folder
(``$SPECSERVE_CACHE_DIR/kernels``, else ``~/.cache/specserve/kernels``) under a name hashed from the source, the
flags, the compiler and the OpenMP runtime, and linked to PyTorch's own libgomp so that its threads are PyTorch's.
Where the CPU lacks AVX512-BF16, no compiler is found or the build fails, ``function`` returns None (the reason
logged) and the callers keep PyTorch's kernels.
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
from pathlib import Path

import torch

from specserve.models.gguf import cache_root

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-fPIC"]
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")


def env_mode(env: str, modes: tuple[str, ...]) -> str:
    """The value of the environment variable ``env`` (default: modes[0]), one of ``modes``; ValueError naming the
    variable for anything else."""
    value = os.environ.get(env, modes[0]).strip().lower()
    if value not in modes:
        raise ValueError(f"{env}={value!r}: expected one of {', '.join(modes)}")
    return value


def cpu_supports(cpuinfo: str | None = None) -> bool:
    """The CPU has the instructions the kernels use (Linux's /proc/cpuinfo flags; False where it cannot tell)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return all(f in flags for f in CPU_FLAGS)


def torch_openmp() -> str | None:
    """PyTorch's own OpenMP runtime (the libgomp its wheel ships), which the kernels link so that their threads are
    PyTorch's; None where there is none (a build with another threading runtime)."""
    found = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    return found[0] if found else None


def build(source: Path, compiler: str, openmp: str, out_dir: Path) -> Path:
    """Compile ``source`` into a shared library (once: the file is named by a hash of the source, flags, compiler and
    runtime) -> its path. Written to a temporary name and renamed, so processes building at once each see a whole
    file."""
    text = source.read_bytes()
    key = hashlib.sha256(text + " ".join([compiler, openmp, *FLAGS]).encode()).hexdigest()[:16]
    target = out_dir / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        obj, lib = Path(tmp) / f"{source.stem}.o", Path(tmp) / f"{source.stem}.so"
        subprocess.run([compiler, *FLAGS, "-c", str(source), "-o", str(obj)], check=True, capture_output=True)
        # linked to PyTorch's libgomp by path (not -fopenmp's system one): the same runtime, the same thread pool
        subprocess.run([compiler, "-shared", str(obj), "-o", str(lib), openmp,
                        f"-Wl,-rpath,{os.path.dirname(openmp)}"], check=True, capture_output=True)
        os.replace(lib, target)
    return target


@functools.cache
def function(source_name: str, symbol: str, argtypes: tuple):
    """The C function ``symbol`` of this folder's ``source_name``, built on the first call, as a ctypes function
    (no return value), or None where it cannot run here."""
    if not cpu_supports():
        logger.info("%s: the CPU lacks AVX512-BF16", source_name)
        return None
    compiler, openmp = shutil.which(os.environ.get("CXX", "g++")), torch_openmp()
    if compiler is None or openmp is None:
        logger.info("%s: no %s", source_name, "C++ compiler" if compiler is None else "libgomp beside PyTorch")
        return None
    source = Path(__file__).with_name(source_name)
    try:
        fn = getattr(ctypes.CDLL(str(build(source, compiler, openmp, Path(cache_root()) / "kernels"))), symbol)
    except (OSError, AttributeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("%s not built: %s %s", source_name, e, detail.decode(errors="replace")[-500:])
        return None
    fn.restype = None
    fn.argtypes = list(argtypes)
    return fn
