"""Train redjax's demo model: a tiny Llama that memorizes its corpus, saved in Hugging Face format.

    python scripts/train_demo_model.py --out worker/demo_model          # the shipped model
    python scripts/train_demo_model.py --out /tmp/demo --tiny           # seconds, for tests

Steps: train a byte-level BPE tokenizer on the corpus; cut the token stream into windows that
start at paragraph starts (each preceded by BOS, so a prompt taken from the start of a paragraph
looks like training data); train the project's own Flax Llama (worker/models) with AdamW,
warmup and cosine decay; save config.json, model.safetensors and the tokenizer files; greedily
continue a few chapter openings as a check. Everything is seeded: the same flags give the same
model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.demo_model import CORPUS_PATH, demo_passages, read_paragraphs  # noqa: E402
from worker.models.config import ModelConfig  # noqa: E402
from worker.models.llama import LlamaForCausalLM  # noqa: E402
from worker.models.loader import save_checkpoint  # noqa: E402

BOS, EOS = "<|bos|>", "<|eos|>"
ROLES = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = [BOS, EOS, *ROLES]  # ids 0..4
# One turn per message: role marker, newline, content, EOS. The generation prompt opens an
# assistant turn. Rendered text starts with BOS, so it is tokenized without special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Settings:
    vocab_size: int = 4096  # BPE vocabulary, special tokens included
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 768
    max_position_embeddings: int = 1024  # the model trains on seq_len windows; longer runs degrade
    seq_len: int = 128  # tokens per training window, BOS included
    batch_size: int = 16
    steps: int = 1800
    lr: float = 3e-3  # peak; cosine decays to lr / 10
    warmup: int = 100
    weight_decay: float = 0.0  # memorizing is the point
    seed: int = 0
    log_every: int = 50


TINY = Settings(vocab_size=512, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                intermediate_size=64, max_position_embeddings=128, seq_len=32, batch_size=4,
                steps=20, warmup=5, log_every=5)


def train_tokenizer(paragraphs: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE over the corpus; encoding a single text prepends BOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(paragraphs, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def encode_corpus(tok: Tokenizer, paragraphs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The whole text as one token stream ending in EOS, and the index of each paragraph's first token.

    Encoding the text in one piece keeps the tokens at paragraph breaks exactly as a prompt
    that spans them will be tokenized.
    """
    text = "\n\n".join(paragraphs)
    starts, pos = set(), 0
    for p in paragraphs:
        starts.add(pos)
        pos += len(p) + 2
    enc = tok.encode(text, add_special_tokens=False)
    ids = np.array(enc.ids + [tok.token_to_id(EOS)], np.int32)  # i32[N]
    token_starts = [a for a, _ in enc.offsets]
    first = np.array([i for i, a in enumerate(token_starts) if a in starts and (i == 0 or token_starts[i - 1] != a)])
    return ids, first


def batches(ids: np.ndarray, starts: np.ndarray, s: Settings, bos_id: int):
    """Endless (tokens i32[B, seq_len+1], mask f32[B, seq_len]) batches.

    Each window is BOS + the tokens from a paragraph start; an epoch visits every paragraph start once.
    """
    rng = np.random.default_rng(s.seed)
    stream = np.concatenate([ids, np.zeros(s.seq_len, np.int32)])  # room for the last windows
    order: list[int] = []
    while True:
        if len(order) < s.batch_size:
            order = list(rng.permutation(starts)) + order
        picked = [order.pop() for _ in range(s.batch_size)]
        tokens = np.stack([np.concatenate([[bos_id], stream[i : i + s.seq_len]]) for i in picked])
        targets_real = np.stack([np.arange(i, i + s.seq_len) < len(ids) for i in picked])  # past EOS is padding
        yield tokens, targets_real.astype(np.float32)


def model_config(s: Settings, bos_id: int, eos_id: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_layers=s.num_layers,
        num_heads=s.num_heads,
        num_kv_heads=s.num_kv_heads,
        head_dim=s.hidden_size // s.num_heads,
        max_position_embeddings=s.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_ids=(eos_id,),
    )


def loss_fn(model: LlamaForCausalLM, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """tokens i32[B, T+1], mask f32[B, T] -> mean next-token cross entropy over real targets."""
    logits = model(tokens[:, :-1])  # f32[B, T, vocab]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])  # f32[B, T]
    return (ce * mask).sum() / mask.sum()


@nnx.jit
def train_step(model: LlamaForCausalLM, optimizer: nnx.Optimizer, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, mask)
    optimizer.update(model, grads)
    return loss


def train(model: LlamaForCausalLM, data, s: Settings) -> float:
    schedule = optax.warmup_cosine_decay_schedule(0.0, s.lr, s.warmup, max(s.steps, s.warmup + 1), s.lr / 10)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95, weight_decay=s.weight_decay))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    tokens_per_step = s.batch_size * s.seq_len
    start = last = time.perf_counter()
    running = None
    for step in range(1, s.steps + 1):
        tokens, mask = next(data)
        loss = float(train_step(model, optimizer, jnp.asarray(tokens), jnp.asarray(mask)))
        running = loss if running is None else 0.9 * running + 0.1 * loss
        if step % s.log_every == 0 or step == s.steps:
            now = time.perf_counter()
            n = s.log_every if step % s.log_every == 0 else step % s.log_every
            print(f"step {step:5d}/{s.steps}  loss {loss:.4f}  (avg {running:.4f})  "
                  f"{n * tokens_per_step / (now - last):7.0f} tok/s  {now - start:6.0f}s", flush=True)
            last = now
    return loss


@nnx.jit
def forward(model: LlamaForCausalLM, tokens: jax.Array) -> jax.Array:
    return model(tokens)


def greedy(model: LlamaForCausalLM, prompt_ids: list[int], max_new: int, eos_id: int) -> list[int]:
    """Greedy continuation with the plain forward on one right-padded row (widths in steps of 64)."""
    ids = list(prompt_ids)
    limit = min(len(ids) + max_new, model.cfg.max_position_embeddings)
    while len(ids) < limit:
        width = -(-len(ids) // 64) * 64
        row = jnp.asarray([ids + [eos_id] * (width - len(ids))], jnp.int32)  # i32[1, width]
        ids.append(int(jnp.argmax(forward(model, row)[0, len(ids) - 1])))
        if ids[-1] == eos_id:
            break
    return ids[len(prompt_ids) :]


def save_tokenizer(tok: Tokenizer, out: Path, max_len: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS, "additional_special_tokens": list(ROLES)}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def save_generation_config(out: Path, bos_id: int, eos_id: int) -> None:
    config = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(config, indent=2) + "\n")


def check(model: LlamaForCausalLM, tok: Tokenizer, corpus: Path, eos_id: int) -> None:
    """Greedy continuation of chapter openings; prints each with the corpus text that follows."""
    passages = demo_passages(5, corpus)
    exact = 0
    for prompt, expected in passages:
        prompt_ids = tok.encode(prompt).ids
        want = len(tok.encode(expected, add_special_tokens=False).ids)
        got = tok.decode(greedy(model, prompt_ids, want + 4, eos_id))
        exact += got.startswith(expected)
        print(f"\nPROMPT  {prompt!r}\nMODEL   {got!r}\nCORPUS  {expected!r}")
    print(f"\n{exact}/{len(passages)} continuations reproduce the corpus")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (Hugging Face layout)")
    parser.add_argument("--corpus", type=Path, default=CORPUS_PATH, help="plain text, blank lines between paragraphs")
    parser.add_argument("--tiny", action="store_true", help="a toy size that trains in seconds (for tests)")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the setting's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    s = TINY if args.tiny else Settings()
    s = dataclasses.replace(s, seed=args.seed, **({"steps": args.steps} if args.steps else {}))

    paragraphs = read_paragraphs(args.corpus)
    tok = train_tokenizer(paragraphs, s.vocab_size)
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    ids, starts = encode_corpus(tok, paragraphs)
    cfg = model_config(s, bos_id, eos_id)
    model = LlamaForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(s.seed))
    print(f"corpus {args.corpus.name}: {len(paragraphs)} paragraphs, {len(ids)} tokens; "
          f"model {cfg.num_params / 1e6:.2f}M params; {s.steps} steps of {s.batch_size}x{s.seq_len} tokens "
          f"({s.steps * s.batch_size * s.seq_len / len(ids):.1f} epochs)", flush=True)

    start = time.perf_counter()
    loss = train(model, batches(ids, starts, s, bos_id), s)
    minutes = (time.perf_counter() - start) / 60
    print(f"trained in {minutes:.1f} min, final loss {loss:.4f}")

    args.out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, args.out)
    save_tokenizer(tok, args.out, s.max_position_embeddings)
    save_generation_config(args.out, bos_id, eos_id)
    print(f"saved to {args.out}")
    check(model, tok, args.corpus, eos_id)


if __name__ == "__main__":
    main()
