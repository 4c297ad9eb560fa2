"""Load an HF-format model folder: config.json + *.safetensors (single or sharded with an index).

The model is built on the ``meta`` device (no memory, no random init), materialised on the target device,
then filled tensor by tensor from memory-mapped safetensors files, so an 8B checkpoint loads without a
second copy in RAM. A tqdm bar shows progress for checkpoints above ~200 MB.

``load_format="dummy"`` (SGLang's ``--load-format dummy``) reads config.json only and fills the weights with
seeded random values on the target device, in the target dtype (``init_dummy_weights``): for benchmarks of
shapes whose checkpoints are not at hand.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from specserve.models.gguf import GGUFError, converted_folder, find_gguf_file
from specserve.models.registry import resolve_architecture
from specserve.models.spec import ModelSpec
from specserve.models.tensor_parallel import TPGroup, check_divisible, sharding

logger = logging.getLogger(__name__)

DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PROGRESS_BAR_BYTES = 200 * 2**20
DUMMY_STD = 0.02


class ModelLoadError(RuntimeError):
    pass


def resolve_model_path(path: str, revision: str | None = None) -> str:
    """A local folder as is; a GGUF file (or a folder holding one) as its converted HF folder (``models/gguf.py``);
    otherwise a hub id looked up in the local HF cache only (we run offline)."""
    try:
        gguf_file = find_gguf_file(path)
        if gguf_file is not None:
            return converted_folder(gguf_file)
    except GGUFError as e:
        raise ModelLoadError(str(e)) from None
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ModelLoadError(f"model path {path!r} is a file, expected an HF model folder or a .gguf file")
    looks_like_hub_id = path.count("/") == 1 and not path.startswith((".", "/"))
    if not looks_like_hub_id:
        raise ModelLoadError(f"model path {path!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, revision=revision, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any hub failure means: not available offline
        raise ModelLoadError(
            f"model {path!r} is not a local folder and is not in the local Hugging Face cache; "
            f"specserve does not download weights: download it first and pass the folder ({type(e).__name__})"
        ) from e


def read_config(model_dir: str) -> dict:
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{model_dir!r} has no config.json; is it an HF model folder?")
    with open(cfg_path) as f:
        return json.load(f)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the names of DTYPE_NAMES and of the --dtype flags)."""
    return str(dtype).replace("torch.", "")


def resolve_dtype(name: str, spec: ModelSpec) -> torch.dtype:
    if name != "auto":
        return DTYPE_NAMES[name]
    return DTYPE_NAMES.get(dtype_name(spec.torch_dtype), torch.float32)  # "bfloat16" and "torch.bfloat16" alike


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, s) for s in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelLoadError(f"shard(s) listed in the index are missing: {', '.join(missing)}")
        return files
    files = sorted(
        os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors")
    )
    if not files:
        raise ModelLoadError(f"{model_dir!r} has no *.safetensors weights (--load-format dummy serves random weights)")
    return files


def iter_safetensors(files: list[str], desc: str = "Loading weights", lazy: bool = False
                     ) -> Iterator[tuple[str, object]]:
    """(name, tensor) of every checkpoint tensor; lazy: (name, safetensors slice) instead, read only where indexed
    (a tensor-parallel rank reads its own slices: ``take_shard``)."""
    total = sum(os.path.getsize(f) for f in files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=total < PROGRESS_BAR_BYTES)
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if lazy:
                    yield name, f.get_slice(name)
                    continue
                t = f.get_tensor(name)
                yield name, t
                bar.update(t.numel() * t.element_size())
        if lazy:
            bar.update(os.path.getsize(path))
    bar.close()


def init_dummy_weights(model: torch.nn.Module, seed: int = 0, std: float = DUMMY_STD) -> None:
    """Fill a materialised model in place with seeded random values (load format ``dummy``), on its device:
    matrices ~ N(0, std^2), norm weights 1, other vectors (biases) 0, integer buffers 0 (EAGLE-3's ``d2t``
    becomes the identity draft -> target map)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # shared (tied) parameters come once
            if p.dim() >= 2:
                p.normal_(0.0, std, generator=gen)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
        for b in model.buffers():
            if not b.is_floating_point():
                b.zero_()


def _model_class(model_path: str, revision, registry: dict | None):
    """-> (resolved folder, the registered class of its architecture, its ModelSpec)."""
    model_dir = resolve_model_path(model_path, revision)
    cfg = read_config(model_dir)
    cls = resolve_architecture(cfg, registry)
    return model_dir, cls, cls.spec_from_config(cfg)


def model_spec(model_path: str, revision=None, registry: dict | None = None) -> ModelSpec:
    """The ModelSpec of the model at ``model_path`` (its config, read through the registered class)."""
    return _model_class(model_path, revision, registry)[2]


def count_parameters(model_path: str, revision=None, registry: dict | None = None) -> int:
    """Parameters the model at ``model_path`` would load (tied ones once), from its config alone: the model is
    built on the meta device, nothing is read or allocated."""
    _, cls, spec = _model_class(model_path, revision, registry)
    with torch.device("meta"):
        model = cls(spec)  # ties shared parameters, which parameters() then yields once
    return sum(p.numel() for p in model.parameters())


def load_model(model_path: str, dtype: str = "auto", device: str | torch.device = "cpu", revision=None,
               registry: dict | None = None, load_format: str = "auto", seed: int = 0, tp: TPGroup | None = None):
    """-> (model in eval mode on device, its ModelSpec, the resolved folder).

    registry: architecture name -> class (default: the target-model registry; draft heads pass their own).
    load_format: "auto" / "safetensors" read the checkpoint; "gguf" too, and requires model_path to be a GGUF file
    (``models/gguf.py``); "dummy" fills random weights (``init_dummy_weights`` with ``seed``) and needs only
    config.json. tp: build and load this rank's shard (``specserve.models.tensor_parallel``); None: the whole model.
    """
    if load_format == "gguf" and find_gguf_file(model_path) is None:
        raise ModelLoadError(f"--load-format gguf: {model_path!r} is not a .gguf file or a folder holding one")
    model_dir, cls, spec = _model_class(model_path, revision, registry)
    torch_dtype = resolve_dtype(dtype, spec)
    if tp is not None:
        check_divisible(tp.size, spec.num_heads, spec.num_kv_heads, spec.intermediate_size)
    with torch.device("meta"), sharding(tp):
        model = cls(spec)
    model = model.to_empty(device=device).to(torch_dtype)
    model.tie_weights()  # to_empty breaks ties; tie again
    model.init_optional_weights()
    if load_format == "dummy":
        init_dummy_weights(model, seed)
        logger.warning("load format dummy: %s has RANDOM weights (seed %d), for benchmarking", spec.architecture, seed)
        return model.eval(), spec, model_dir
    sharded = tp is not None and tp.size > 1
    loaded, unexpected = model.load_weights(iter_safetensors(safetensors_files(model_dir), lazy=sharded))
    missing = sorted({name for name, _ in model.expected_weights() - loaded})
    if missing:
        raise ModelLoadError(f"checkpoint in {model_dir!r} lacks weights: {', '.join(missing[:8])}")
    if unexpected:
        logger.warning("ignored %d checkpoint tensors not used by %s (e.g. %s)", len(unexpected),
                       spec.architecture, ", ".join(unexpected[:3]))
    return model.eval(), spec, model_dir
