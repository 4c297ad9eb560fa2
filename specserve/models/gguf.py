"""GGUF checkpoints (llama.cpp's one-file format): converted once into an HF model folder in a cache, which is what
specserve then loads like any other.

transformers' GGUF reader (the ``gguf`` package) dequantizes the tensors to float32 and rebuilds the config, the
tokenizer and the chat template from the file's metadata. The folder is keyed by a hash of the file's bytes, so a
second start reuses it, and so does the same file at another path (a reinstalled package, a fresh virtual
environment); a changed file is converted again. The hash is computed once per (path, size, modification time) and
remembered in the cache's ``keys.json``. A lock file keeps two processes (the server and its model worker start
together) from converting the same file at once.

    --model-path model.Q4_1.gguf        a file
    --model-path folder/                 a folder holding exactly one .gguf and no config.json
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil

logger = logging.getLogger(__name__)

SUFFIX = ".gguf"
DONE_MARK = ".specserve-converted"  # written last: a folder without it is an interrupted conversion


class GGUFError(RuntimeError):
    """A GGUF file that cannot be converted (unsupported architecture or quantization, unreadable file)."""


def find_gguf_file(path: str) -> str | None:
    """The GGUF file `path` names: the file itself, or the one .gguf in a folder without config.json; None when
    `path` is not a GGUF checkpoint. Several .gguf files in one folder: GGUFError naming them."""
    if os.path.isfile(path):
        return path if path.lower().endswith(SUFFIX) else None
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    files = sorted(f for f in os.listdir(path) if f.lower().endswith(SUFFIX))
    if len(files) > 1:
        raise GGUFError(f"{path!r} holds several GGUF files ({', '.join(files)}); pass the one to load")
    return os.path.join(path, files[0]) if files else None


def source_file(path: str) -> str | None:
    """The GGUF file behind a model path: the file `path` names (``find_gguf_file``), or the one a converted folder
    was made from (recorded in its done mark) while that file is still there; None otherwise."""
    found = find_gguf_file(path)
    if found is not None:
        return found
    mark = os.path.join(path, DONE_MARK)
    if not os.path.isfile(mark):
        return None
    with open(mark) as f:
        recorded = f.read().strip()
    return recorded if recorded.lower().endswith(SUFFIX) and os.path.isfile(recorded) else None


def cache_root() -> str:
    """Where converted checkpoints go: $SPECSERVE_CACHE_DIR, else ~/.cache/specserve."""
    return os.environ.get("SPECSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "specserve")


HASH_CHUNK = 8 * 2**20
KEYS_FILE = "keys.json"  # in cache_root()/gguf: "<real path>\0<size>\0<mtime ns>" -> the file's content key


def content_key(real: str) -> str:
    """The first 16 hex digits of the sha256 of the file's bytes, hashed once per (path, size, modification time):
    later calls read it from KEYS_FILE (rewritten whole with os.replace, so a concurrent reader never sees half)."""
    stamp = _stamp(real)
    index_file = os.path.join(cache_root(), "gguf", KEYS_FILE)
    try:
        with open(index_file) as f:
            index = json.load(f)
    except (OSError, ValueError):
        index = {}
    if stamp in index:
        return index[stamp]
    digest = hashlib.sha256()
    with open(real, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    key = digest.hexdigest()[:16]
    index[stamp] = key
    os.makedirs(os.path.dirname(index_file), exist_ok=True)
    tmp = f"{index_file}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(index, f)
    os.replace(tmp, index_file)
    return key


def _cached(gguf_file: str, name: str, build) -> str:
    """What build(real_file, path) makes of a GGUF file, made once (later calls, and other processes, reuse it):
    cache_root()/gguf/<stem>-<key>, a folder with DONE_MARK written last (name ""), or <stem>-<key>.<name>.gguf, a
    file put in place by os.replace. The key is the hash of the file's bytes (``content_key``)."""
    real = os.path.realpath(gguf_file)
    stem = os.path.basename(real)[: -len(SUFFIX)]
    root = os.path.join(cache_root(), "gguf")

    def at(key: str) -> str:
        return os.path.join(root, f"{stem}-{key}.{name}{SUFFIX}" if name else f"{stem}-{key}")

    def done(p: str) -> bool:
        return os.path.isfile(os.path.join(p, DONE_MARK)) or (bool(name) and os.path.isfile(p))

    path = at(content_key(real))
    if done(path):
        return path
    os.makedirs(root, exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building it: wait for it, then reuse its output
        if not done(path):
            old = at(_path_key(real))
            if done(old):  # made under the earlier path-keyed name: adopted, not made again
                os.replace(old, path)
                return path
            logger.info("Converting %s into %s (once; later starts reuse it)", gguf_file, path)
            shutil.rmtree(path, ignore_errors=True)
            build(real, path)
    return path


def _stamp(real: str) -> str:
    """The file's path, size and modification time, as one string."""
    st = os.stat(real)
    return f"{real}\0{st.st_size}\0{st.st_mtime_ns}"


def _path_key(real: str) -> str:
    """The key earlier versions named the cache entries by: a hash of the file's ``_stamp``."""
    return hashlib.sha256(_stamp(real).encode()).hexdigest()[:16]


def converted_folder(gguf_file: str) -> str:
    """The HF folder of a GGUF file, converting it on the first call (later calls, and other processes, reuse it)."""
    return _cached(gguf_file, "", convert)


def sixteen_bit_file(gguf_file: str, dtype: str = "F16") -> str:
    """A 16-bit copy of a GGUF file (cached like converted_folder): what llama.cpp runs as the same model at 16-bit
    weights. See write_sixteen_bit."""
    return _cached(gguf_file, dtype, lambda real, path: write_sixteen_bit(real, path, dtype))


def write_sixteen_bit(gguf_file: str, out_file: str, dtype: str = "F16", progress: bool = True) -> None:
    """Copy `gguf_file` to `out_file` with every quantized tensor dequantized and stored as `dtype` (F16 or BF16);
    float tensors (norms, and any already F32/F16) and every metadata key are copied as they are, general.file_type
    set to match."""
    import gguf
    import numpy as np

    qtype = {"F16": gguf.GGMLQuantizationType.F16, "BF16": gguf.GGMLQuantizationType.BF16}[dtype]
    file_type = {"F16": gguf.LlamaFileType.MOSTLY_F16, "BF16": gguf.LlamaFileType.MOSTLY_BF16}[dtype]
    floats = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    reader = gguf.GGUFReader(gguf_file)
    arch = reader.fields["general.architecture"].contents()
    tmp = f"{out_file}.tmp-{os.getpid()}"
    writer = gguf.GGUFWriter(tmp, arch=arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    writer.add_file_type(file_type)
    for t in reader.tensors:
        if t.tensor_type in floats:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        # dequantize: [rows, cols] float32 (numpy order: the GGUF dims reversed)
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        writer.add_tensor(t.name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=progress)
    writer.close()
    os.replace(tmp, out_file)


def convert(gguf_file: str, out_dir: str) -> None:
    """Dequantize `gguf_file` into an HF folder `out_dir` (float32 safetensors, config, tokenizer, chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(gguf_file)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    except (ValueError, NotImplementedError, KeyError, OSError) as e:
        raise GGUFError(f"{gguf_file}: cannot convert this GGUF file: {e}") from None
    # the weights are plain float32 tensors now; transformers still marks the model as GGUF-quantized, which it
    # refuses to save: drop the mark
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, DONE_MARK), "w") as f:
        f.write(gguf_file + "\n")
    os.replace(tmp, out_dir)
