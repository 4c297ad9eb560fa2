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


def converted_folder(gguf_file: str) -> str:
    """The HF folder of a GGUF file, converting it on the first call (later calls, and other processes, reuse it)."""
    real = os.path.realpath(gguf_file)
    st = os.stat(real)
    key = hashlib.sha256(f"{real}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = os.path.basename(real)[: -len(SUFFIX)]
    root = os.path.join(cache_root(), "gguf")
    folder = os.path.join(root, f"{stem}-{key}")
    if os.path.isfile(os.path.join(folder, DONE_MARK)):
        return folder
    os.makedirs(root, exist_ok=True)
    with open(folder + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process converting it: wait for it, then reuse its folder
        if not os.path.isfile(os.path.join(folder, DONE_MARK)):
            logger.info("Converting %s into %s (once; later starts reuse it)", gguf_file, folder)
            shutil.rmtree(folder, ignore_errors=True)
            convert(real, folder)
    return folder


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
