"""llama.cpp (the ``llama-cpp-python`` package) as ``specserve bench-compare``'s CPU anchor: the same GGUF model at
16-bit weights and at the file's own quantization, greedy, batch 1, fed the same prompt token ids.

The 16-bit file is ``models.gguf.sixteen_bit_file`` of the target's GGUF (every quantized tensor dequantized and
stored as F16): the weights specserve dequantizes and runs, rounded to F16 instead of its run dtype.

llama-cpp-python builds llama.cpp from source when pip installs it (no CPU wheel on PyPI; about 5 minutes on a
2-core machine): ``pip install 'specserve[llamacpp]'``. Without it, bench-compare leaves the llama.cpp rows out (or,
asked for them with ``--only llamacpp``, says what to install).
"""

from __future__ import annotations

import importlib.util

INSTALL = "pip install 'llama-cpp-python>=0.3.16' (it builds llama.cpp from source: about 5 minutes on 2 cores)"


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_files(model_path: str, gguf_file: str | None) -> dict[str, str]:
    """The files llama.cpp runs: {"llamacpp_f16": 16-bit copy, "llamacpp_quant": the file itself}. gguf_file: the
    --llamacpp-gguf flag (None: the target's own GGUF file). ValueError when there is none, or several."""
    from specserve.demo_models import resolve_demo
    from specserve.models.gguf import GGUFError, find_gguf_file, sixteen_bit_file

    try:
        source = find_gguf_file(gguf_file or resolve_demo(model_path))
    except GGUFError as e:  # a folder holding several GGUF files
        raise ValueError(str(e)) from None
    if source is None:
        raise ValueError(f"llama.cpp needs a GGUF file: {gguf_file or model_path!r} is not one; pass --llamacpp-gguf "
                         "FILE")
    return {"llamacpp_f16": sixteen_bit_file(source), "llamacpp_quant": source}


def file_type(path: str) -> str:
    """The file's weight type as llama.cpp names it (general.file_type: "F16", "Q4_1", ...)."""
    import gguf

    field = gguf.GGUFReader(path).fields.get("general.file_type")
    if field is None:
        return "?"
    name = gguf.LlamaFileType(field.contents()).name
    return name.removeprefix("MOSTLY_")


def load(path: str, threads: int, n_ctx: int):
    """A llama.cpp context on `path`: `threads` threads for decode and prompt, room for n_ctx tokens."""
    from llama_cpp import Llama

    return Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                 logits_all=False, verbose=False)


def runner(llm, max_new_tokens: int):
    """Greedy generation of exactly max_new_tokens (EOS does not stop it, as on the other engines) -> RunFn."""

    def run(ids: list[int]) -> tuple[list[int], int, int]:
        out: list[int] = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if len(out) == max_new_tokens:
                break
        return out, 0, 0

    return run


def prepare(llm):
    """Untimed, before each prompt: forget the previous prompt's KV (llama-cpp-python would reuse a shared prefix;
    specserve's prefix cache is flushed alike)."""
    return llm.reset
