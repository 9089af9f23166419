"""IncrementalDetokenizer: valid UTF-8 deltas, bounded decode windows, exact concatenation."""

from __future__ import annotations

import random

import pytest

from engine.models.tiny import ensure_tiny_dsv3
from engine.tokenizer import IncrementalDetokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_tiny_dsv3())


def _stream(tokenizer, prompt, generated, chunks, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas = []
    i = 0
    for n in chunks:
        deltas.append(detok.append(generated[i : i + n]))
        i += n
    assert i == len(generated)
    return deltas, detok.flush()


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_concatenate_to_full_decode_on_random_ids(tokenizer, skip_special_tokens):
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(30):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        generated = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        chunks = []
        left = len(generated)
        while left:
            chunks.append(min(left, rng.choice([1, 1, 1, 2, 3, 7])))
            left -= chunks[-1]
        deltas, tail = _stream(tokenizer, prompt, generated, chunks, skip_special_tokens)
        expected = tokenizer.decode(generated, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) + tail == expected
        # Nothing emitted before the end may end in a split character.
        assert not any(d.endswith("\ufffd") for d in deltas)


def test_multibyte_characters_split_across_tokens_are_held_back(tokenizer):
    text = "Grüße, 世界! 🎉🚀 naïve 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # the rare characters really are split into byte tokens
    prompt = tokenizer.encode("Say: ", add_special_tokens=True)
    deltas, tail = _stream(tokenizer, prompt, ids, [1] * len(ids))
    assert "".join(deltas) + tail == text
    assert tail == ""
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # at least one token completed no character and was held back


def test_prompt_ending_inside_a_character_does_not_leak_into_output(tokenizer):
    emoji = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(emoji) >= 2
    prompt = tokenizer.encode("x", add_special_tokens=False) + emoji[:1]
    generated = emoji[1:] + tokenizer.encode(" ok", add_special_tokens=False)
    deltas, tail = _stream(tokenizer, prompt, generated, [1] * len(generated))
    assert "".join(deltas) + tail == tokenizer.decode(generated, skip_special_tokens=True)


def test_flush_turns_an_incomplete_final_character_into_replacement(tokenizer):
    ids = tokenizer.encode("a🎉", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    assert detok.append(ids[:1]) == "a"
    assert detok.append(ids[1:-1]) == ""
    tail = detok.flush()
    assert tail.endswith("\ufffd") and "a" not in tail
    assert detok.flush() == ""


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert kept.append(ids) + kept.flush() == "hi" + tokenizer.eos_token
    skipped = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    assert skipped.append(ids) + skipped.flush() == "hi"


def test_each_append_decodes_a_bounded_window(tokenizer):
    """O(new tokens) per call: the decoded window does not grow with the sequence."""
    windows: list[int] = []

    class Spy:  # stands in for the Rust tokenizer the detokenizer decodes with
        def __init__(self, inner):
            self.inner = inner

        def decode(self, ids, **kwargs):
            windows.append(len(ids))
            return self.inner.decode(ids, **kwargs)

    class Tokenizer:
        backend_tokenizer = Spy(tokenizer.backend_tokenizer)

    text = "The quick brown fox, 狐狸, jumps 🦊 over the lazy dog. " * 20
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(Tokenizer(), list(range(100, 300)))
    out = "".join(detok.append([t]) for t in ids) + detok.flush()
    assert out == text
    assert len(ids) > 300
    assert max(windows) <= 12


def test_load_tokenizer_without_tokenizer_files_raises(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3"}')
    with pytest.raises(ValueError, match="tokenizer"):
        load_tokenizer(tmp_path)
