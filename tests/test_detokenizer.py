"""IncrementalDetokenizer against real tokenizers trained here (byte-level BPE, Metaspace BPE)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tests.byte_bpe import byte_level_bpe
from worker.engine.detokenizer import IncrementalDetokenizer

CORPUS = [
    "Héllo wörld! The café serves crème brûlée to a naïve guest at the façade.",
    "日本語のテキストです。東京は大きい都市です。",
    "Emoji time 🎉🚀😀 and more 👍🏽 plus “quotes” — dashes… Ελληνικά, русский, עברית.",
    "the quick brown fox jumps over the lazy dog, again and again and again.",
]
SAMPLES = [
    "Héllo café 日本語 🎉 done",
    "東京は大きい🚀😀👍🏽 naïve—“ok”",
    "the lazy dog says ¡hola! ü ß ø",
    "русский 語 façade 😀😀😀",
]


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    return byte_level_bpe(CORPUS)


@pytest.fixture(scope="module")
def metaspace() -> PreTrainedTokenizerFast:
    """SentencePiece-like: spaces become "▁" and the decoder drops the first leading space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


def stream(tokenizer, prompt: list[int], output: list[int], sizes: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    deltas, i = [], 0
    for size in sizes:
        deltas.append(detok.add(output[i : i + size]))
        i += size
    deltas.append(detok.add(output[i:]))
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


def test_multibyte_characters_split_over_tokens_are_never_emitted_half(byte_level):
    split = 0
    for text in SAMPLES:
        ids = byte_level.encode(text, add_special_tokens=False)
        split += sum("\ufffd" in byte_level.decode([i]) for i in ids)
        prompt = byte_level.encode("Prompt: 日本", add_special_tokens=False)
        deltas = stream(byte_level, prompt, ids, [1] * len(ids))  # token by token
        assert "".join(deltas) == byte_level.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas)
    assert split > 10  # the test really exercises partial characters


def test_random_groupings_give_the_same_text(byte_level):
    rng = random.Random(7)
    for text in SAMPLES:
        ids = byte_level.encode(text, add_special_tokens=False)
        for _ in range(5):
            sizes = [rng.randrange(0, 4) for _ in range(len(ids))]
            deltas = stream(byte_level, [], ids, sizes)
            assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)


def test_special_tokens_skipped_or_kept(byte_level):
    eos = byte_level.eos_token_id
    ids = byte_level.encode("café 🎉", add_special_tokens=False) + [eos]
    assert "".join(stream(byte_level, [1, 2], ids, [1] * len(ids))) == "café 🎉"
    assert "".join(stream(byte_level, [1, 2], ids, [1] * len(ids), skip=False)) == "café 🎉<eos>"


def test_incomplete_character_is_held_then_flushed(byte_level):
    ids = byte_level.encode("ok 🎉", add_special_tokens=False)
    cut = next(i for i in range(len(ids), 0, -1) if byte_level.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(byte_level, [])
    text = "".join(detok.add([t]) for t in ids[:cut])
    assert text.startswith("ok") and "\ufffd" not in text
    rest = detok.flush()
    assert rest.endswith("\ufffd") and text + rest == byte_level.decode(ids[:cut])
    assert detok.flush() == ""


def test_prompt_ending_inside_a_character(byte_level):
    ids = byte_level.encode("語🎉 fin", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if byte_level.decode(ids[:i]).endswith("\ufffd"))
    deltas = stream(byte_level, ids[:cut], ids[cut:], [1] * (len(ids) - cut))
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas).endswith("🎉 fin")


def test_sentencepiece_leading_spaces_follow_the_prompt(metaspace):
    prompt = metaspace.encode("The quick brown", add_special_tokens=False)
    output = metaspace.encode("fox jumps over the lazy dog", add_special_tokens=False)
    joined = "".join(stream(metaspace, prompt, output, [1] * len(output)))
    full = metaspace.decode(prompt + output)
    assert joined == full[len(metaspace.decode(prompt)) :] == " fox jumps over the lazy dog"
    assert metaspace.decode(output) == "fox jumps over the lazy dog"  # alone, the space is lost


@pytest.mark.parametrize("name", ["byte_level", "metaspace"])
def test_a_stream_resumed_by_another_detokenizer_repeats_and_loses_nothing(name, request):
    """A worker that resumes a request continues the text exactly where the client's stream stopped,
    whether the dead worker's last tokens completed their characters or were held back inside one
    (sent as token ids with no text); every cut point of every sample, one token at a time."""
    tokenizer = request.getfixturevalue(name)
    prompt = tokenizer.encode("the quick", add_special_tokens=False)
    for sample in SAMPLES:
        output = tokenizer.encode(sample, add_special_tokens=False)
        whole = "".join(stream(tokenizer, prompt, output, [1] * len(output)))
        for cut in range(1, len(output)):
            first = IncrementalDetokenizer(tokenizer, prompt)
            sent_text, held = "", 0  # what the client got, and the trailing tokens with no text yet
            for token in output[:cut]:
                delta = first.add([token])
                sent_text += delta
                held = 0 if delta else held + 1
            second = IncrementalDetokenizer(tokenizer, prompt)
            assert second.resume(output[: cut - held], output[cut - held : cut]) == first.text
            rest = "".join(second.add([t]) for t in output[cut:]) + second.flush()
            assert sent_text + rest == whole, (sample, cut)
