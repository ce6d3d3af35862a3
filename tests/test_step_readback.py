"""What a step copies back to the host: only the outputs its batch uses."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from worker.engine.runner import StepOutput, to_host


def test_read_back_copies_only_the_outputs_a_batch_uses():
    shapes = {"tokens": (2, 3), "logprobs": (2, 3), "top_ids": (2, 3, 4), "top_logprobs": (2, 3, 4),
              "prompt_logprobs": (5,), "prompt_top_ids": (5, 4), "prompt_top_logprobs": (5, 4), "prompt_ranks": (5,)}
    out = StepOutput(**{name: jnp.full(shape, i, jnp.float32) for i, (name, shape) in enumerate(shapes.items())})
    sampled, prompt = ["logprobs", "top_ids", "top_logprobs"], ["prompt_logprobs", "prompt_top_ids", "prompt_top_logprobs",
                                                                 "prompt_ranks"]
    for want_sampled, want_prompt in [(False, False), (True, False), (False, True), (True, True)]:
        host = to_host(out, logprobs=want_sampled, prompt=want_prompt)
        fetched = ["tokens"] + sampled * want_sampled + prompt * want_prompt
        for i, name in enumerate(shapes):
            value = getattr(host, name)
            if name in fetched:
                assert isinstance(value, np.ndarray) and value.shape == shapes[name] and (value == i).all()
            else:
                assert value is None, name
