"""The baseline: Hugging Face transformers `generate` (PyTorch) on the same weights and prompts, on
the GPU when torch sees one (the machine the engine runs on), else on the CPU."""

from __future__ import annotations

import time
from pathlib import Path


def hf_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_hf(model_dir: str | Path, prompts: list[list[int]], output_len: int, batch_size: int,
           dtype: str = "float32", temperature: float = 0.0, top_p: float = 1.0,
           top_k: int = 0) -> tuple[float, list[list[int]]]:
    """Generation of exactly `output_len` tokens per prompt, in batches, greedy or sampled with the
    engine's settings; -> (seconds, outputs).

    Prompts have one length, so batches need no padding; a short warmup call is excluded.
    """
    import torch
    import transformers

    device = hf_device()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=getattr(torch, dtype), local_files_only=True
    ).eval().to(device)
    sampling = (dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k or None) if temperature
                else dict(do_sample=False, top_p=None, top_k=None, temperature=None))
    kwargs = dict(min_new_tokens=output_len, max_new_tokens=output_len, pad_token_id=0, eos_token_id=None, **sampling)

    def generate(batch: list[list[int]], new: int) -> list[list[int]]:
        ids = torch.tensor(batch, dtype=torch.long, device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 **{**kwargs, "min_new_tokens": new, "max_new_tokens": new})
        return out[:, ids.shape[1]:].tolist()  # to the host: waits for the device

    generate(prompts[: min(batch_size, len(prompts))], min(output_len, 4))
    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        outputs += generate(prompts[i : i + batch_size], output_len)
    return time.perf_counter() - t0, outputs
