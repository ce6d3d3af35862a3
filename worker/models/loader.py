"""Checkpoint I/O for the Llama family, kept out of the model code.

Parameters are named exactly like Hugging Face tensors (the nnx path joined by dots), so the
name table is the identity plus the few exceptions in `IGNORED` and tied embeddings.

Loading builds the model abstractly (no random init), then fills it one tensor at a time from
the safetensors files, so host memory never holds two full copies of the weights. With `project`
(engine/projections.py), each layer projection is replaced by the form the engine runs it in
(quantized, or packed for the CPU kernel) as soon as its weights are in, so host memory holds that
model and one float tensor at a time: llama3-8b with int4 projections loads in ~7 GB, not its 16 GB
of bfloat16 weights.
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from safetensors import safe_open
from safetensors.flax import save_file

from worker.models.config import ModelConfig
from worker.models.llama import LlamaForCausalLM, Linear, weight_init

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
IGNORED = ("rotary_emb.inv_freq",)  # buffers some older checkpoints saved; derived from the config here
TRANSPOSED = ("_proj.weight", "lm_head.weight")  # HF stores these [out, in]; the model keeps [in, out]
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
BLOCK = 1 << 24  # a dummy tensor past BLOCK_FROM elements is drawn in blocks of at most this many
BLOCK_FROM = 1 << 26  # (drawing 2^28 normals at once holds ~16 bytes each of temporaries: 4.4 GB)
SHARD_BYTES = 2 << 30  # save_checkpoint writes a model past this size in shards of at most about this

Project = Callable[[Linear], Any]  # a layer projection, its weights in, -> its replacement (engine/projections.py)


class CheckpointError(ValueError):
    """A checkpoint that does not match the model its config describes."""


def build_model(cfg: ModelConfig, dtype: str | None = None, seed: int = 0,
                project: Project | None = None, project_head: Project | None = None) -> LlamaForCausalLM:
    """Dummy weights: random init from the config alone (like `--load-format dummy`), made on device
    one tensor at a time. Each distinct shape gets one small jitted program: a single program for
    the whole model took an H100 about two minutes to compile for llama3-8b's 291 tensors.
    Projections and embeddings are N(0, 0.02), norm scales one, biases zero, as the modules'
    own initialisers make them. `project`, `project_head`: as `load_model`'s."""
    jdtype = DTYPES[dtype or cfg.dtype]
    model = nnx.eval_shape(lambda: _new(cfg, jdtype, 0))
    flat = _variables(model)
    key = jax.random.key(seed)
    for i, path in enumerate(list(flat)):
        var, name = flat[path], ".".join(map(str, path))
        fill = "ones" if name.endswith("norm.weight") else "zeros" if name.endswith(".bias") else "normal"
        var.set_value(_dummy_tensor(jax.random.fold_in(key, i), var.shape, jnp.dtype(var.dtype), fill))
        _project_when_filled(model, flat, path, project, project_head)
    return model


@partial(jax.jit, static_argnames=("shape", "dtype", "fill"))
def _dummy_tensor(key: jax.Array, shape: tuple[int, ...], dtype, fill: str) -> jax.Array:
    if fill == "ones":
        return jnp.ones(shape, dtype)
    if fill == "zeros":
        return jnp.zeros(shape, dtype)
    size, rows = math.prod(shape), shape[0] if shape else 1
    if size <= BLOCK_FROM:
        return weight_init(key, shape, dtype)
    per_row = size // rows
    block = max(d for d in range(1, min(rows, max(1, BLOCK // per_row)) + 1) if rows % d == 0)  # rows a block
    keys = jax.random.split(key, rows // block)
    return jax.lax.map(lambda k: weight_init(k, (block, *shape[1:]), dtype), keys).reshape(shape)


def _variables(model: LlamaForCausalLM) -> dict[tuple, nnx.Variable]:
    """The model's own variables by path, in the order nnx's flat state lists them, to fill in place.
    (Not through nnx.to_flat_state: its result sits in a reference cycle, which would keep every
    float weight alive until Python's cycle collector runs, after the projections replaced them.)"""
    return {path: node for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Variable)}


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes the model's arrays hold (weights as loaded, quantized or packed)."""
    values = (node.get_value() for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Variable))
    return sum(value.nbytes for value in values if isinstance(value, jax.Array))


def _project_when_filled(model: LlamaForCausalLM, flat: dict, path: tuple, project: Project | None,
                         project_head: Project | None = None) -> None:
    """After the variable at `path` is set: if it belongs to a layer projection (a `Linear` under
    model.model) or the untied LM head whose variables are all set, replace it by `project(it)`
    (the head by `project_head(it)`) and drop its variables from `flat`, so that its float weights
    are freed."""
    head = path[0] == "lm_head"
    project = project_head if head else project
    if project is None or not head and (path[0] != "model" or len(path) < 3):
        return
    parent = model
    for part in path[:-2]:
        parent = parent[part] if isinstance(part, int) else getattr(parent, part)
    linear = getattr(parent, path[-2])
    if not isinstance(linear, Linear):
        return
    variables = [v for v in (linear.weight, linear.bias) if v is not None]
    if any(isinstance(v.get_value(), jax.ShapeDtypeStruct) for v in variables):
        return
    setattr(parent, path[-2], project(linear))
    for name in ("weight", "bias"):
        flat.pop((*path[:-1], name), None)


def shard_model(model: LlamaForCausalLM, mesh) -> LlamaForCausalLM:
    """Place every parameter on `mesh` as worker.models.sharding declares (tensor parallel)."""
    from worker.models.sharding import check_divisible, param_sharding

    check_divisible(model.cfg, mesh.size)
    for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        var.set_value(jax.device_put(var.get_value(), param_sharding(".".join(map(str, key)), mesh)))
    return model


def load_model(path: str | Path, dtype: str | None = None, mesh=None, project: Project | None = None,
               project_head: Project | None = None) -> LlamaForCausalLM:
    """Load a local Hugging Face checkpoint directory (config.json + *.safetensors).

    With a `mesh`, each tensor goes straight to its tensor-parallel sharding as it is read. With
    `project`, each layer projection becomes `project(projection)` once its tensors are in; with
    `project_head`, an untied LM head becomes `project_head(head)`.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: model directory does not exist")
    cfg = ModelConfig.from_dir(path)
    jdtype = DTYPES[dtype or cfg.dtype]
    if mesh is not None:
        from worker.models.sharding import check_divisible, param_sharding

        check_divisible(cfg, mesh.size)
    model = nnx.eval_shape(lambda: _new(cfg, jdtype, 0))
    flat = _variables(model)
    expected = {".".join(map(str, key)): key for key in flat}
    tied_head = "lm_head.weight"
    filled: set[str] = set()
    for file, names in _tensor_files(path).items():
        with safe_open(file, framework="flax") as f:
            for name in names:
                if name.endswith(IGNORED) or (cfg.tie_word_embeddings and name == tied_head):
                    continue
                if name not in expected:
                    raise CheckpointError(f"{file}: tensor {name!r} is not used by {cfg.architecture}")
                variable = flat[expected[name]]
                flip = name.endswith(TRANSPOSED)
                shape = tuple(f.get_slice(name).get_shape())
                wanted = tuple(variable.get_value().shape)
                if shape != (wanted[::-1] if flip else wanted):
                    raise CheckpointError(
                        f"{file}: tensor {name!r} has shape {shape}, the config implies {wanted[::-1] if flip else wanted}"
                    )
                tensor = f.get_tensor(name).astype(jdtype)
                if flip:
                    tensor = tensor.T
                if mesh is not None:
                    tensor = jax.device_put(tensor, param_sharding(name, mesh))
                variable.set_value(tensor)
                filled.add(name)
                _project_when_filled(model, flat, expected[name], project, project_head)
    missing = sorted(set(expected) - filled)
    if missing:
        raise CheckpointError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return model


def save_checkpoint(model: LlamaForCausalLM, out_dir: str | Path, dtype: str | None = None,
                    shard_bytes: int = SHARD_BYTES) -> None:
    """Write config.json and the weights with Hugging Face names: one model.safetensors, or past
    `shard_bytes` numbered shards of at most about that size and their index, as transformers'
    `save_pretrained` does. One shard's tensors are converted at a time (the library holds a copy of
    a file's bytes while it writes), so llama3-8b in bfloat16 is written holding ~2 GB beside its 16."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    jdtype = DTYPES[dtype or cfg.dtype]
    params = [(".".join(map(str, key)), var) for key, var in _variables(model).items() if isinstance(var, nnx.Param)]
    shards: list[list[tuple[str, nnx.Variable]]] = [[]]
    size = 0
    for name, var in params:
        nbytes = math.prod(var.get_value().shape) * jnp.dtype(jdtype).itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, var))
        size += nbytes
    files = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for file, shard in zip(files, shards):
        tensors = {}
        for name, var in shard:
            value = jnp.asarray(var.get_value(), jdtype)
            tensors[name] = value.T if name.endswith(TRANSPOSED) else value
            weight_map[name], total = file, total + value.nbytes
        save_file(tensors, str(out / file), metadata={"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = dtype or cfg.dtype
    (out / "config.json").write_text(json.dumps(hf, indent=2))


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved beside the weights, through transformers (never from a hub)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"{path}: no usable tokenizer files ({exc})") from exc


def _new(cfg: ModelConfig, dtype, seed: int) -> LlamaForCausalLM:
    return LlamaForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(seed))


def _tensor_files(path: Path) -> dict[Path, list[str]]:
    """Map each safetensors file to the tensor names it holds (single file or sharded index)."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map'")
        files: dict[Path, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(path / file, []).append(name)
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{file}: shard named in {index.name} does not exist")
        return files
    single = path / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="flax") as f:
            return {single: list(f.keys())}
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"{path}: no {SINGLE_FILE}, {INDEX_FILE} or other *.safetensors file")
    files = {}
    for file in found:
        with safe_open(file, framework="flax") as f:
            files[file] = list(f.keys())
    return files
