"""GGUF checkpoints (llama.cpp's one-file format): converted once into an HF model folder in a cache, which is what
specserve then loads like any other.

transformers' GGUF reader (the ``gguf`` package) dequantizes the tensors to float32 and rebuilds the config, the
tokenizer and the chat template from the file's metadata. The folder is keyed by the file's path, size and
modification time: a second start reuses it, a changed file is converted again. A lock file keeps two processes
(the server and its model worker start together) from converting the same file at once.

    --model-path model.Q4_1.gguf        a file
    --model-path folder/                 a folder holding exactly one .gguf and no config.json
"""

from __future__ import annotations

import fcntl
import hashlib
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


def cache_root() -> str:
    """Where converted checkpoints go: $SPECSERVE_CACHE_DIR, else ~/.cache/specserve."""
    return os.environ.get("SPECSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "specserve")


def _cached(gguf_file: str, name: str, build) -> str:
    """What build(real_file, path) makes of a GGUF file, made once (later calls, and other processes, reuse it):
    cache_root()/gguf/<stem>-<key>, a folder with DONE_MARK written last (name ""), or <stem>-<key>.<name>.gguf, a
    file put in place by os.replace. The key is the file's real path, size and modification time."""
    real = os.path.realpath(gguf_file)
    st = os.stat(real)
    key = hashlib.sha256(f"{real}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = os.path.basename(real)[: -len(SUFFIX)]
    root = os.path.join(cache_root(), "gguf")
    path = os.path.join(root, f"{stem}-{key}.{name}{SUFFIX}" if name else f"{stem}-{key}")

    def done() -> bool:
        return os.path.isfile(os.path.join(path, DONE_MARK)) or (bool(name) and os.path.isfile(path))

    if done():
        return path
    os.makedirs(root, exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building it: wait for it, then reuse its output
        if not done():
            logger.info("Converting %s into %s (once; later starts reuse it)", gguf_file, path)
            shutil.rmtree(path, ignore_errors=True)
            build(real, path)
    return path


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
