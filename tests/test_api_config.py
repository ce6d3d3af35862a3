"""ApiConfig, request parsing without a server, and the no-JAX import rule."""

from __future__ import annotations

import subprocess
import sys

import pytest

from api.config import ApiConfig
from api.errors import ApiError
from api.model_info import ModelInfo
from api.protocol import parse_chat, parse_completion
from tests.api_support import MODEL_NAME, tiny_model, tiny_model_dir  # noqa: F401
from worker.engine.sampling_params import SamplingParams


def test_from_env_flags_win_and_key_is_hidden():
    env = {"REDJAX_MODEL_DIR": "/models/llama", "REDJAX_API_PORT": "9000", "REDJAX_API_KEY": "sekrit",
           "REDJAX_NO_WORKER_TIMEOUT_S": "2.5", "REDJAX_MAX_MODEL_LEN": "4096"}  # fmt: skip
    config = ApiConfig.from_env({"port": 9100, "host": None}, environ=env)
    assert config.port == 9100 and config.host == "127.0.0.1" and config.no_worker_timeout_s == 2.5
    assert config.max_model_len == 4096 and config.model_name == "llama" and config.api_key == "sekrit"
    assert "sekrit" not in repr(config) and "sekrit" not in str(config)
    with pytest.raises(ValueError, match="REDJAX_API_PORT"):
        ApiConfig.from_env(environ={**env, "REDJAX_API_PORT": "x"})
    with pytest.raises(ValueError, match="model_dir"):
        ApiConfig.from_env(environ={})
    with pytest.raises(ValueError, match="max_queue_len"):
        ApiConfig(model_dir="/m", max_queue_len=0)


def test_importing_api_never_imports_jax():
    code = ("import sys, api, api.app, api.server, api.routes\n"
            "assert not any(m.split('.')[0] in ('jax', 'flax') for m in sys.modules)")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)


def test_completion_maps_to_sampling_params(tiny_model):
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, "temperature": 0, "top_p": 0.9, "top_k": 5,
            "min_p": 0.1, "stop": "x", "stop_token_ids": [1], "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "repetition_penalty": 1.1, "logit_bias": {"7": -100, "8": 5}, "n": 2, "ignore_eos": True,
            "include_stop_str_in_output": True, "skip_special_tokens": False, "user": "u1", "logprobs": 3,
            "echo": True, "seed": None}  # fmt: skip
    parsed = parse_completion(body, tiny_model, max_prompts=4)
    params = SamplingParams.from_dict(parsed.requests[0].params)
    assert params == SamplingParams(
        n=2, max_tokens=3, temperature=0.0, top_p=0.9, top_k=5, min_p=0.1, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.1, logit_bias=((7, -100.0), (8, 5.0)), seed=params.seed,
        stop=("x",), stop_token_ids=(1,), include_stop_str_in_output=True, ignore_eos=True, logprobs=3,
        prompt_logprobs=3, skip_special_tokens=False,
    )  # fmt: skip
    assert isinstance(params.seed, int) and parsed.echo and parsed.logprobs == 3 and parsed.prompt_texts == ["hello"]


def test_sampling_fields_left_out_take_the_checkpoints_defaults(tmp_path):
    """A checkpoint's generation_config.json values other than transformers' defaults become the
    sampling defaults of every request that leaves those fields out, completions and chats (as
    vLLM and transformers apply them; do_sample is not read); a request's own fields win. With
    --sampling-defaults openai (`generation_defaults=False`) the OpenAI API's defaults stay."""
    import json

    from api.model_info import ModelInfo, sampling_defaults
    from tests.api_support import make_model_dir

    folder = make_model_dir(tmp_path / "m")
    generation = {"do_sample": False, "temperature": 0.6, "top_p": 0.9, "top_k": 50, "min_p": None,
                  "repetition_penalty": 1.05, "eos_token_id": 2}  # fmt: skip
    (folder / "generation_config.json").write_text(json.dumps(generation))
    chosen = {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.05}  # top_k 50 is transformers' default
    model = ModelInfo.load(str(folder), MODEL_NAME)
    assert model.sampling_defaults == sampling_defaults(folder / "generation_config.json") == chosen

    def params(body: dict, model: ModelInfo = model, chat: bool = False) -> SamplingParams:
        if chat:
            parsed = parse_chat({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **body}, model)
        else:
            parsed = parse_completion({"model": MODEL_NAME, "prompt": "hello", **body}, model, max_prompts=4)
        return SamplingParams.from_dict(parsed.requests[0].params)

    for chat in (False, True):
        p = params({}, chat=chat)
        assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 0, 1.05)
    p = params({"temperature": 0, "top_p": 1, "repetition_penalty": 1.2, "top_k": 5})
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.0, 1.0, 5, 1.2)
    openai_defaults = ModelInfo.load(str(folder), MODEL_NAME, generation_defaults=False)
    assert openai_defaults.sampling_defaults == {}
    p = params({}, openai_defaults)
    assert (p.temperature, p.top_p, p.repetition_penalty) == (1.0, 1.0, 1.0)

    (folder / "generation_config.json").write_text(json.dumps({"temperature": 250.0}))
    with pytest.raises(ValueError, match="generation_config.json: temperature must be in"):
        ModelInfo.load(str(folder), MODEL_NAME)
    (folder / "generation_config.json").write_text("[0.6]")
    with pytest.raises(ValueError, match="generation_config.json: not a JSON object"):
        ModelInfo.load(str(folder), MODEL_NAME)
    (folder / "generation_config.json").unlink()
    assert ModelInfo.load(str(folder), MODEL_NAME).sampling_defaults == {}


def test_sampling_defaults_setting_from_flag_and_environment():
    """`--sampling-defaults` on `redjax serve` and `redjax api`, REDJAX_SAMPLING_DEFAULTS, refused
    when neither model nor openai."""
    from worker.cli import parser

    assert ApiConfig(model_dir="/m").sampling_defaults == "model"
    env = {"REDJAX_MODEL_DIR": "/m", "REDJAX_SAMPLING_DEFAULTS": "openai"}
    assert ApiConfig.from_env(environ=env).sampling_defaults == "openai"
    assert ApiConfig.from_env({"sampling_defaults": "model"}, environ=env).sampling_defaults == "model"
    with pytest.raises(ValueError, match="sampling_defaults must be one of"):
        ApiConfig(model_dir="/m", sampling_defaults="vllm")
    for command in ("serve", "api"):
        assert parser().parse_args([command, "--sampling-defaults", "openai"]).sampling_defaults == "openai"
        assert parser().parse_args([command]).sampling_defaults is None  # the setting's own default


def test_chat_parsing(tiny_model):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "logprobs": True, "max_completion_tokens": 7}  # fmt: skip
    parsed = parse_chat(body, tiny_model)
    request = parsed.requests[0]
    assert request.prompt_token_ids == tiny_model.render_chat([{"role": "user", "content": "hi"}])
    assert request.params["max_tokens"] == 7 and request.params["logprobs"] == 0 and parsed.logprobs == 0
    assert parsed.response_id.startswith("chatcmpl-")


def test_chat_template_kwargs_are_the_templates_variables(tiny_model_dir):
    """chat_template_kwargs reach the template as its variables, as Qwen3's enable_thinking does;
    without them the template sees its own default."""
    model = ModelInfo.load(str(tiny_model_dir), MODEL_NAME)
    model.tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
        "<think></think>{% endif %}{% endif %}"
    )  # fmt: skip
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
    plain = parse_chat(body, model).requests[0].prompt_token_ids
    quiet = parse_chat(body | {"chat_template_kwargs": {"enable_thinking": False}}, model).requests[0].prompt_token_ids
    assert model.decode(plain, skip_special_tokens=False) == "<|user|>hi\n<|assistant|>"
    assert model.decode(quiet, skip_special_tokens=False) == "<|user|>hi\n<|assistant|><think></think>"


def test_unknown_field_is_named(tiny_model):
    with pytest.raises(ApiError) as info:
        parse_completion({"model": MODEL_NAME, "prompt": "x", "frobnicate": 1}, tiny_model, max_prompts=4)
    assert info.value.status == 400 and info.value.param == "frobnicate" and "frobnicate" in info.value.message
