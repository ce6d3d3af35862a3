"""The step variants a worker compiles while it has nothing to run (ModelRunner.compile_idle).

Warm-up compiles the variants plain requests meet (LLMEngine.warmup). A request with penalties
or logit bias runs only in a variant with their arrays (variant_serves.serves), one scoring its
prompt (`echo` with logprobs) only in one whose head computes every prompt token's logits, and
warm-up leaves those out: on a GPU each compile takes 25-60 s of the worker's start. Without
them, the first such requests at a fresh worker compiled as they came, and every stream on it
waited (the demo on the 2-core CPU, session 73: one request each with frequency_penalty and
logit_bias, then one with echo and logprobs, compiled 5 variants with 3.3 s of stalls).

So, after its warm-up, a worker queues warm-up's variants with every sampler switch (the
widest sampling family), now with penalties and logit bias as well, at array widths that serve
any request up to the model's context with up to LOGIT_BIAS_LADDER[1] bias entries, and, where
prompt chunks are packed (the CPU kernel), the widest envelopes scoring their prompt tokens (on
a GPU the head over a whole step's tokens costs too much to borrow for a few). It compiles them
in the background, only while no request runs, as many at once as background compiles may take
(one on the 2-core VM: a burst finds the other core free). A batch with penalties, bias or
prompt scoring then borrows one at once, and its own exact variant compiles in the background if
such batches keep coming (runner._choose_shape). Speculation's draft shapes are left out:
sequences with penalties take no drafts.

Warm-up's mixed envelopes carry every decode row a step can have. At light load (up to
scheduler.LIGHT_DECODE_ROWS streams) a newcomer's prompt goes in beside them in pieces of the
scheduler's prompt cap: padded into a full envelope, 64 empty decode rows made each 192-256-token
piece of llama-100m a quarter longer (session 78). So the queue also holds each such envelope with
LIGHT_DECODE_ROWS decode rows.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable

from worker.engine.batch import (LOGIT_BIAS_LADDER, OUTPUT_IDS_AHEAD, StepShape, bucket, sampler_flags, scored_slots,
                                 step_cost)
from worker.engine.sampler import SamplerFlags
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import LIGHT_DECODE_ROWS


def widest_sampling(max_logprobs: int) -> SamplingParams:
    """Warm-up's third sampling family: every sampler switch a request without penalties or logit
    bias can set (top-p needs the cut, min-p its softmax, logprobs the top alternatives)."""
    return SamplingParams(temperature=1.0, top_p=0.5, min_p=0.01, logprobs=max_logprobs)


def idle_variants(compiled: Iterable[tuple[StepShape, SamplerFlags]], max_logprobs: int,
                  max_model_len: int) -> list[tuple[StepShape, SamplerFlags]]:
    """For each of the `compiled` variants (warm-up's) with the widest family's flags, the same
    shape with penalties and logit bias: output ids for OUTPUT_IDS_AHEAD tokens, prompt ids for
    the whole context, LOGIT_BIAS_LADDER[1] bias entries. Where prompt chunks are packed (the CPU
    kernel's envelopes), also the widest envelope with and without decode rows scoring every
    prompt token (`echo` with logprobs, `prompt_logprobs`), with and without penalties and bias:
    a scoring batch borrows one of those until its own variant compiles; and each mixed envelope
    with LIGHT_DECODE_ROWS decode rows, its flags as they are. Cheapest steps first."""
    compiled = list(compiled)
    widest = sampler_flags([widest_sampling(max_logprobs)], max_logprobs)
    widths = (OUTPUT_IDS_AHEAD, bucket(max_model_len), LOGIT_BIAS_LADDER[1])
    penalised = replace(widest, penalties=True, bias=True, widths=widths)
    wanted = {(shape, replace(penalised, apart=flags.apart)) for shape, flags in compiled
              if replace(flags, apart=False) == widest and not shape.drafts and not shape.prompt_logprobs}
    envelopes: dict[int, StepShape] = {}  # decode rows -> the envelope with the most prompt tokens
    for shape, flags in compiled:
        if flags == widest and shape.packed and not shape.prompt_logprobs:
            best = envelopes.get(shape.num_decode)
            if best is None or (shape.prefill_tokens, shape.num_prefill) > (best.prefill_tokens, best.num_prefill):
                envelopes[shape.num_decode] = shape
    wanted |= {(replace(s, prompt_logprobs=True, scored=scored_slots(s.prefill_tokens, s.num_tokens)), flags)
               for s in envelopes.values() for flags in (widest, penalised)}
    wanted |= {(replace(shape, num_decode=LIGHT_DECODE_ROWS), flags) for shape, flags in compiled
               if shape.packed and shape.num_decode > LIGHT_DECODE_ROWS and not shape.prompt_logprobs}
    return sorted(wanted, key=lambda v: (step_cost(v[0]), v[0].num_decode, v[1].apart, v[0].prompt_logprobs))
