"""ModelConfig: the Llama family's shape, parsed once from a Hugging Face `config.json`.

Host side only (no JAX import). Frozen and hashable, so it can be a static jit argument.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
PRESETS_DIR = Path(__file__).parent / "presets"


class ModelConfigError(ValueError):
    """A config.json this code cannot serve faithfully."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # Hugging Face architecture name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # sorted (key, value) pairs; () means plain RoPE
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2, Llama attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm on each head of q and k (Qwen3)
    sliding_windows: tuple[int | None, ...] = ()  # per layer window, None = full attention; () = all full
    dtype: str = "float32"  # dtype the checkpoint was saved in
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ModelConfigError("sliding window list must have one entry per layer")

    @property
    def rope_type(self) -> str:
        return dict(self.rope_scaling).get("rope_type", "default")

    def window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def num_params(self) -> int:
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f"unsupported architecture {archs or d.get('model_type')!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"unsupported hidden_act {act!r}; the Llama family uses 'silu'")
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope_type = rope.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(f"unsupported rope_scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
        if rope_type == "default":
            rope = {}
        partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ModelConfigError("partial_rotary_factor other than 1.0 is not supported")
        attention_bias = bool(d.get("attention_bias") or False)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=tuple(sorted(rope.items())),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family == "llama" and attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_windows=_sliding_windows(d, family),
            dtype=_dtype_name(d.get("dtype") or d.get("torch_dtype") or "float32"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no config.json in the model directory")
        return cls.from_file(file)

    @classmethod
    def from_file(cls, file: Path) -> "ModelConfig":
        """A Hugging Face config.json file. A generation_config.json beside it adds the end-of-sequence
        ids it lists: chat checkpoints name their end-of-turn token there (Llama 3 Instruct's
        <|eot_id|>, Qwen's <|im_end|>), and transformers' `generate` and its server stop at it."""
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{file}: not valid JSON ({exc})") from exc
        try:
            cfg = cls.from_hf_dict(data)
        except KeyError as exc:
            raise ModelConfigError(f"{file}: missing field {exc}") from exc
        eos = generation_config(file.parent).get("eos_token_id")
        more = [i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int) and i not in cfg.eos_token_ids]
        return replace(cfg, eos_token_ids=cfg.eos_token_ids + tuple(dict.fromkeys(more)))

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """A shape for dummy weights: a shipped one ('llama3-8b', 'llama3.2-1b', 'llama-100m', ...),
        or any model's config.json (the file, or a directory holding it), weights not needed."""
        if "/" in name or name.endswith(".json"):  # a path ("./name" for a directory here)
            path = Path(name)
            if path.is_dir() and (path / "config.json").is_file():
                return cls.from_dir(path)
            if not path.is_file():
                raise ModelConfigError(f"{name}: neither a config.json nor a directory holding one")
            return cls.from_file(path)
        file = PRESETS_DIR / f"{name}.json"
        if not file.is_file():
            names = sorted(p.stem for p in PRESETS_DIR.glob("*.json"))
            raise ModelConfigError(f"unknown preset {name!r}; presets: {names}, or a path to a config.json")
        return cls.from_hf_dict(json.loads(file.read_text()))

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face config.json for this shape (Llama/Mistral/Qwen2/Qwen3 field names)."""
        rope = {"rope_theta": self.rope_theta, **dict(self.rope_scaling)}
        windows = [w for w in self.sliding_windows if w is not None]
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": SUPPORTED_ARCHITECTURES[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) or None,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.o_bias,
            "mlp_bias": self.mlp_bias,
            "torch_dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if windows:
            d["sliding_window"] = windows[0]
            d["layer_types"] = ["full_attention" if w is None else "sliding_attention" for w in self.sliding_windows]
        return d

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def _sliding_windows(d: dict[str, Any], family: str) -> tuple[int | None, ...]:
    window = d.get("sliding_window")
    layers = d["num_hidden_layers"]
    if window is None:
        return ()
    types = d.get("layer_types")
    if types:
        out = tuple(window if t == "sliding_attention" else None for t in types)
    elif family == "mistral":
        out = (window,) * layers
    elif d.get("use_sliding_window"):
        first = d.get("max_window_layers", 0)
        out = tuple(window if i >= first else None for i in range(layers))
    else:
        out = ()
    return out if any(w is not None for w in out) else ()


def _dtype_name(value: Any) -> str:
    name = str(value).replace("torch.", "")
    if name not in ("float32", "bfloat16", "float16"):
        raise ModelConfigError(f"unsupported checkpoint dtype {name!r}")
    return name


def generation_config(folder: str | Path) -> dict[str, Any]:
    """A checkpoint's generation_config.json ({} where it has none): what its makers chose for
    generation (end-of-sequence ids, sampling values). ModelConfigError where it is not a JSON object."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: not a JSON object")
    return data
