"""llama.cpp as a benchmark peer (scripts/bench.py methods `llama_cpp_greedy`, `llama_cpp_lookup`).

Benchmark-only: never a dependency of the package or of CI. Needs `llama-cpp-python`
(`pip install llama-cpp-python`: it builds from source, ~5 min on 2 cores).

The embedded default model ships as a Q4_1 GGUF; the package runs it dequantised to fp32.
For a like-for-like peer, `f32_gguf()` writes an F32 GGUF of exactly those dequantised
weights (same metadata and tokenizer, every tensor dequantised with the `gguf` package's
own Q4_1 decoder), so llama.cpp and our engine multiply the same numbers.

    python scripts/llama_cpp_peer.py            # write the F32 GGUF, print its path
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_selfspec.defaults import cache_dir, gguf_path  # noqa: E402


def f32_gguf(source: Path | None = None, target: Path | None = None) -> Path:
    """An F32 GGUF of the default model's dequantised weights (written once, cached)."""
    import gguf
    import numpy as np

    source = Path(source or gguf_path())
    target = Path(target or cache_dir() / (source.stem + ".F32.gguf"))
    if target.exists():
        return target
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    partial = target.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by GGUFWriter itself
        vtype = field.types[0]
        value = field.contents()
        if name == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type=sub_type)
    for tensor in reader.tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, np.ascontiguousarray(weights), raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(target)
    return target


class LlamaCppPeer:
    """llama.cpp greedy decoding (optionally with its prompt-lookup drafter) on token ids."""

    def __init__(self, model_path: Path, threads: int, context: int = 2048, lookup_tokens: int = 0):
        from llama_cpp import Llama

        draft = None
        if lookup_tokens:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens)
        # the draft path verifies several tokens per step and reads their logits: logits_all
        self.llm = Llama(model_path=str(model_path), n_ctx=context, n_threads=threads,
                         n_threads_batch=threads, n_batch=512, draft_model=draft,
                         logits_all=draft is not None, verbose=False)

    def generate(self, prompt: list[int], max_new_tokens: int, eos: set[int]) -> tuple[list[int], float]:
        """(new token ids, seconds): greedy (top-1) tokens after `prompt`, whole call timed."""
        self.llm.reset()
        out: list[int] = []
        t0 = time.perf_counter()
        for token in self.llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                       repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if token in eos or len(out) >= max_new_tokens:
                break
        return out, time.perf_counter() - t0


if __name__ == "__main__":
    print(f32_gguf())
