"""The baseline: Hugging Face transformers `generate` (PyTorch) on the same weights and prompts, on
the GPU when torch sees one (the machine the engine runs on), else on the CPU."""

from __future__ import annotations

import time
from pathlib import Path


def hf_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_hf(model_dir: str | Path, prompts: list[list[int]], output_len: int | list[int], batch_size: int,
           dtype: str = "float32", temperature: float = 0.0, top_p: float = 1.0,
           top_k: int = 0, logprobs: int | None = None, quantization: str | None = None) -> tuple[float, list[list[int]]]:
    """Generation of exactly `output_len` tokens per prompt (one for all, or each prompt's), in
    batches, greedy or sampled with the engine's settings; -> (seconds, outputs in prompt order).

    A batch generates as many tokens as its longest request asks for; each request keeps its own
    count (the cost of static batching). Prompts of different lengths are padded on the left, with
    the mask set. Requests are batched in order of output then input length, so that a batch's
    requests are alike and the padding and extra tokens least: the baseline at its best. With one
    length for all, that is the prompts' own order and no padding. A short warmup call is excluded.
    With `logprobs`, each batch also gives every new token's log-probability and the `logprobs` most
    likely alternatives, read to the host as the engine reads its own (the work a transformers user
    does for the same answer: the raw logits of each step, log-softmax, top-k). With `quantization`
    ("int8", "int4") the layers' projections are quantized by torchao (`quantize_torchao`: the scheme
    the engine's follows; the LM head left as it is), the same model as the engine's.
    """
    import torch
    import transformers

    device = hf_device()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=getattr(torch, dtype), local_files_only=True
    ).eval().to(device)
    if quantization is not None:
        quantize_torchao(model, quantization)
    sampling = (dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k or None) if temperature
                else dict(do_sample=False, top_p=None, top_k=None, temperature=None))
    lens = [output_len] * len(prompts) if isinstance(output_len, int) else list(output_len)

    def generate(batch: list[list[int]], new: int) -> list[list[int]]:
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], dtype=torch.long, device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], dtype=torch.long, device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, min_new_tokens=new, max_new_tokens=new,
                                 pad_token_id=0, eos_token_id=None, output_logits=logprobs is not None,
                                 return_dict_in_generate=True, **sampling)
            tokens = out.sequences[:, width:]  # [B, new]
            if logprobs is not None:  # read to the host and dropped: the run times the work, as the engine's
                lps = torch.log_softmax(torch.stack(out.logits, 1).float(), -1)  # [B, new, V]
                lps.gather(-1, tokens.unsqueeze(-1)).tolist()
                if logprobs:
                    top = lps.topk(logprobs, -1)
                    top.values.tolist(), top.indices.tolist()
        return tokens.tolist()  # to the host: waits for the device

    order = sorted(range(len(prompts)), key=lambda i: (lens[i], len(prompts[i])))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    generate([prompts[i] for i in batches[0]], min(max(lens), 4))
    outputs: list[list[int]] = [[] for _ in prompts]
    t0 = time.perf_counter()
    for batch in batches:
        for i, out in zip(batch, generate([prompts[i] for i in batch], max(lens[i] for i in batch))):
            outputs[i] = out[: lens[i]]
    return time.perf_counter() - t0, outputs


def quantize_torchao(model, quantization: str) -> None:
    """torchao's dynamic quantization on every projection of `model`'s layers, in place: "int8"
    (`Int8DynamicActivationInt8WeightConfig`) or "int4" (`Int8DynamicActivationIntxWeightConfig`
    with int4 weights in groups of int4_linear.group_size: 8da4w)."""
    import logging
    import warnings

    import torch

    with warnings.catch_warnings():  # its CUDA extensions do not load on a CPU host, and it says so
        warnings.simplefilter("ignore")
        level = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            from torchao.quantization import (Int8DynamicActivationInt8WeightConfig,
                                              Int8DynamicActivationIntxWeightConfig, quantize_)
            from torchao.quantization.granularity import PerGroup
        except ImportError as exc:
            raise RuntimeError(f"--compare hf with --quantization {quantization} needs torchao (pip install -e '.[dev]')") from exc
        finally:
            logging.disable(level)
    layers = lambda module, name: isinstance(module, torch.nn.Linear) and "lm_head" not in name  # noqa: E731
    if quantization == "int8":
        config = Int8DynamicActivationInt8WeightConfig()
    else:
        from worker.engine.int4_linear import group_size

        group = group_size([m.in_features for name, m in model.named_modules() if layers(m, name)])
        config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group))
    quantize_(model, config, filter_fn=layers)
