"""IncrementalDetokenizer against real tokenizers trained here (byte-level BPE, Metaspace BPE)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tests.byte_bpe import byte_level_bpe
from worker.bench.tokenizer import IdTokenizer
from worker.engine.byte_detokenizer import ByteLevelDetokenizer, byte_table
from worker.engine.detokenizer import IncrementalDetokenizer, detokenizers

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


def windows(tokenizer, prompt: list[int], skip: bool = True) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)


def table(tokenizer, prompt: list[int], skip: bool = True) -> ByteLevelDetokenizer:
    bytes_of = byte_table(tokenizer)
    assert bytes_of is not None, "not a byte-level tokenizer"
    return ByteLevelDetokenizer(bytes_of, prompt, skip_special_tokens=skip)


# both detokenizers, for the byte-level tokenizer: the engine uses the table's
BOTH = pytest.mark.parametrize("make", [windows, table], ids=["windows", "byte-table"])


def stream(tokenizer, prompt: list[int], output: list[int], sizes: list[int], skip: bool = True,
           make=windows) -> list[str]:
    detok = make(tokenizer, prompt, skip)
    deltas, i = [], 0
    for size in sizes:
        deltas.append(detok.add(output[i : i + size]))
        i += size
    deltas.append(detok.add(output[i:]))
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


@BOTH
def test_multibyte_characters_split_over_tokens_are_never_emitted_half(byte_level, make):
    split = 0
    for text in SAMPLES:
        ids = byte_level.encode(text, add_special_tokens=False)
        split += sum("\ufffd" in byte_level.decode([i]) for i in ids)
        prompt = byte_level.encode("Prompt: 日本", add_special_tokens=False)
        deltas = stream(byte_level, prompt, ids, [1] * len(ids), make=make)  # token by token
        assert "".join(deltas) == byte_level.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas)
    assert split > 10  # the test really exercises partial characters


@BOTH
def test_random_groupings_give_the_same_text(byte_level, make):
    rng = random.Random(7)
    for text in SAMPLES:
        ids = byte_level.encode(text, add_special_tokens=False)
        for _ in range(5):
            sizes = [rng.randrange(0, 4) for _ in range(len(ids))]
            deltas = stream(byte_level, [], ids, sizes, make=make)
            assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)


@BOTH
def test_special_tokens_skipped_or_kept(byte_level, make):
    eos = byte_level.eos_token_id
    ids = byte_level.encode("café 🎉", add_special_tokens=False) + [eos]
    assert "".join(stream(byte_level, [1, 2], ids, [1] * len(ids), make=make)) == "café 🎉"
    assert "".join(stream(byte_level, [1, 2], ids, [1] * len(ids), skip=False, make=make)) == "café 🎉<eos>"


@BOTH
def test_incomplete_character_is_held_then_flushed(byte_level, make):
    ids = byte_level.encode("ok 🎉", add_special_tokens=False)
    cut = next(i for i in range(len(ids), 0, -1) if byte_level.decode(ids[:i]).endswith("\ufffd"))
    detok = make(byte_level, [])
    text = "".join(detok.add([t]) for t in ids[:cut])
    assert text.startswith("ok") and "\ufffd" not in text
    rest = detok.flush()
    assert rest.endswith("\ufffd") and text + rest == byte_level.decode(ids[:cut])
    assert detok.flush() == ""


@BOTH
def test_prompt_ending_inside_a_character(byte_level, make):
    ids = byte_level.encode("語🎉 fin", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if byte_level.decode(ids[:i]).endswith("\ufffd"))
    deltas = stream(byte_level, ids[:cut], ids[cut:], [1] * (len(ids) - cut), make=make)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas).endswith("🎉 fin")


def test_sentencepiece_leading_spaces_follow_the_prompt(metaspace):
    prompt = metaspace.encode("The quick brown", add_special_tokens=False)
    output = metaspace.encode("fox jumps over the lazy dog", add_special_tokens=False)
    joined = "".join(stream(metaspace, prompt, output, [1] * len(output)))
    full = metaspace.decode(prompt + output)
    assert joined == full[len(metaspace.decode(prompt)) :] == " fox jumps over the lazy dog"
    assert metaspace.decode(output) == "fox jumps over the lazy dog"  # alone, the space is lost


def test_a_window_ending_in_skipped_special_tokens_keeps_text_as_context(metaspace):
    """The next window's context is the last few tokens emitted, reaching back past skipped special
    tokens to one that is text: with only specials before it, a SentencePiece window would lose its
    leading space."""
    eos = metaspace.convert_tokens_to_ids("</s>")
    prompt = metaspace.encode("The quick brown", add_special_tokens=False)
    fox, jumps = (metaspace.encode(w, add_special_tokens=False) for w in ("fox", "jumps over"))
    for specials in (1, 6, 7, 20):
        output = fox + [eos] * specials + jumps
        joined = "".join(stream(metaspace, prompt, output, [len(fox) + specials]))
        assert joined == " fox jumps over", specials
    # a long window is still cut back to a few tokens: emitting 40 tokens at once leaves a short context
    detok = IncrementalDetokenizer(metaspace, prompt)
    long = metaspace.encode("the lazy dog " * 8, add_special_tokens=False)
    detok.add(long)
    assert len(detok._ids) <= 6


@pytest.mark.parametrize("name, make", [("byte_level", windows), ("byte_level", table), ("metaspace", windows)],
                         ids=["byte_level-windows", "byte_level-byte-table", "metaspace-windows"])
def test_a_stream_resumed_by_another_detokenizer_repeats_and_loses_nothing(name, make, request):
    """A worker that resumes a request continues the text exactly where the client's stream stopped,
    whether the dead worker's last tokens completed their characters or were held back inside one
    (sent as token ids with no text); every cut point of every sample, one token at a time."""
    tokenizer = request.getfixturevalue(name)
    prompt = tokenizer.encode("the quick", add_special_tokens=False)
    for sample in SAMPLES:
        output = tokenizer.encode(sample, add_special_tokens=False)
        whole = "".join(stream(tokenizer, prompt, output, [1] * len(output), make=make))
        for cut in range(1, len(output)):
            first = make(tokenizer, prompt)
            sent_text, held = "", 0  # what the client got, and the trailing tokens with no text yet
            for token in output[:cut]:
                delta = first.add([token])
                sent_text += delta
                held = 0 if delta else held + 1
            second = make(tokenizer, prompt)
            assert second.resume(output[: cut - held], output[cut - held : cut]) == first.text
            rest = "".join(second.add([t]) for t in output[cut:]) + second.flush()
            assert sent_text + rest == whole, (sample, cut)


def test_the_byte_table_decodes_as_the_tokenizer_does(metaspace):
    """Any ids, special or not, skipped or kept, added tokens among them (text outside the byte
    alphabet, spaces, one written in it): the table's bytes, decoded as UTF-8 with U+FFFD for what
    forms no character, are the tokenizer's own decode. Only a byte-level decoder gets a table."""
    tokenizer = byte_level_bpe(CORPUS)
    tokenizer.add_tokens(["<my tok>", "日本", " plain", "Ġx", "Ġ日"])  # the last: alphabet and not, kept as text
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|sp ecial|>"]})
    added = list(range(len(tokenizer) - 6, len(tokenizer)))
    rng = random.Random(3)
    kept, skipped = byte_table(tokenizer)
    assert [i for i in range(len(kept)) if kept[i] != skipped[i]] == [tokenizer.eos_token_id, added[-1]]
    for _ in range(500):
        ids = [rng.choice([rng.randrange(len(tokenizer)), *added]) for _ in range(rng.randrange(1, 30))]
        for skip, table_ in ((True, skipped), (False, kept)):
            mine = b"".join(table_[i] for i in ids).decode("utf-8", "replace")
            assert mine == tokenizer.decode(ids, skip_special_tokens=skip), ids
    assert byte_table(metaspace) is None


def output_text(tokenizer, prompt: list[int], output: list[int], skip: bool) -> str:
    """The output's text by the tokenizer's own decode: the whole text less the prompt's, where a
    character the prompt left open (its text ends in U+FFFD) belongs to the output if it completes."""
    whole, head = tokenizer.decode(prompt + output, skip_special_tokens=skip), tokenizer.decode(prompt, skip_special_tokens=skip)
    if whole.startswith(head):
        return whole[len(head):]
    assert head.endswith("\ufffd")
    return whole[len(head) - 1:]


@pytest.mark.parametrize("skip", [True, False])
def test_the_byte_tables_stream_is_the_tokenizers_decode(byte_level, skip):
    """Random ids (pieces of characters, invalid bytes, specials) in random groupings after random
    prompts: what the table's detokenizer streams is the tokenizer's decode of the output."""
    rng = random.Random(11)
    for _ in range(300):
        prompt = [rng.randrange(len(byte_level)) for _ in range(rng.randrange(1, 7))]
        output = [rng.randrange(len(byte_level)) for _ in range(rng.randrange(0, 40))]
        sizes = [rng.randrange(1, 17) for _ in range(len(output))]
        streamed = "".join(stream(byte_level, prompt, output, sizes, skip, make=table))
        assert streamed == output_text(byte_level, prompt, output, skip), (prompt, output)


def test_both_detokenizers_stream_the_same_text_after_a_text_prompt(byte_level):
    """Prompts of real text cut anywhere (inside a character too), random output ids and groupings:
    the table's detokenizer and the windowed one end with the same text."""
    rng = random.Random(12)
    for _ in range(300):
        ids = byte_level.encode(rng.choice(CORPUS), add_special_tokens=False)
        prompt = ids[: rng.randrange(1, len(ids))]
        output = [rng.randrange(len(byte_level)) for _ in range(rng.randrange(0, 40))]
        sizes = [rng.randrange(1, 17) for _ in range(len(output))]
        assert "".join(stream(byte_level, prompt, output, sizes, make=table)) == "".join(
            stream(byte_level, prompt, output, sizes, make=windows)), (prompt, output)


@BOTH
@pytest.mark.parametrize("skip", [True, False])
def test_ids_past_the_tokenizers_vocabulary_are_no_text(byte_level, make, skip):
    """A model's embedding can have more rows than its tokenizer has tokens (a padded vocab_size);
    a padded id, sampled or in the prompt, is no text, as in the tokenizer's own decode, and never
    an error (session 76: the byte table raised IndexError, which stopped the engine)."""
    rng = random.Random(13)
    padded = range(len(byte_level), len(byte_level) + 64)
    for _ in range(200):
        pick = lambda: rng.choice(padded) if rng.random() < 0.3 else rng.randrange(len(byte_level))  # noqa: E731
        prompt = [pick() for _ in range(rng.randrange(1, 7))]
        output = [pick() for _ in range(rng.randrange(0, 30))]
        sizes = [rng.randrange(1, 9) for _ in range(len(output))]
        known = lambda ids: [i for i in ids if i < len(byte_level)]  # noqa: E731
        assert byte_level.decode(prompt + output) == byte_level.decode(known(prompt + output))  # HF: no text
        streamed = "".join(stream(byte_level, prompt, output, sizes, skip, make=make))
        assert streamed == "".join(stream(byte_level, known(prompt), known(output), [1], skip, make=make))


def test_the_engine_picks_the_table_for_byte_level_tokenizers_only(byte_level, metaspace):
    assert isinstance(detokenizers(byte_level)([1, 2], True), ByteLevelDetokenizer)
    assert isinstance(detokenizers(metaspace)([1, 2], True), IncrementalDetokenizer)


def test_the_benchmarks_stand_in_tokenizer_takes_the_table_way_once_it_knows_its_size():
    """Dummy-weight benchmarks stand in for byte-level models (llama3-8b): with the vocabulary's size
    the stand-in's text goes through the byte table, as a real byte-level tokenizer's would, and
    reads the same as its own decode."""
    sized, bare = IdTokenizer(vocab_size=1000), IdTokenizer()
    detok = detokenizers(sized)([1, 2], True)
    assert isinstance(detok, ByteLevelDetokenizer)
    assert detok.add([5, 999]) + detok.add([0]) + detok.flush() == sized.decode([5, 999, 0]) == " t5 t999 t0"
    assert isinstance(detokenizers(bare)([1, 2], True), IncrementalDetokenizer)
