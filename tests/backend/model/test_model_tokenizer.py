"""ByteTokenizer's exact ids and streaming decode; HFTokenizer; load_tokenizer's choice.

(Streaming decode of the families' real-style tokenizers: test_model_detokenizer.py.)"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backend.model.config import ModelConfig
from backend.model.detokenizer import incomplete_tail
from backend.model.errors import CheckpointError
from backend.model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TOK = ByteTokenizer()


def stream(tokenizer, ids):
    decoder = tokenizer.stream_decoder()
    pieces = [decoder.push(i) for i in ids]
    return pieces, decoder.flush()


def test_byte_ids_are_exactly_the_bundled_models():
    assert (TOK.bos_id, TOK.eos_id, TOK.pad_id, TOK.vocab_size) == (256, 257, 258, 259)
    assert TOK.stop_ids == frozenset({257})
    assert TOK.encode("Aé") == [256, 0x41, 0xC3, 0xA9]  # the byte tokenizer adds BOS
    assert TOK.encode("Aé", add_special_tokens=False) == [0x41, 0xC3, 0xA9]
    assert TOK.decode([256, 0x41, 0xC3, 0xA9, 258, 257]) == "Aé"  # specials carry no text


@given(st.text())
def test_byte_round_trip(text):
    assert TOK.decode(TOK.encode(text)) == text
    pieces, tail = stream(TOK, TOK.encode(text))
    assert "".join(pieces) + tail == text


def test_stream_holds_a_split_character_until_it_is_complete():
    pieces, tail = stream(TOK, TOK.encode("a€b", add_special_tokens=False))  # € is e2 82 ac
    assert pieces == ["a", "", "", "€", "b"]
    assert tail == ""


def test_stream_replaces_invalid_bytes_and_leaves_out_a_cut_character():
    pieces, tail = stream(TOK, [0x41, 0xFF, 0xE2, 0x82])
    assert pieces == ["A", "\ufffd", "", ""]
    assert tail == ""  # the last character's bytes never all arrived: no U+FFFD for it
    # a lead byte interrupted by an ASCII byte: the broken sequence becomes one U+FFFD
    pieces, tail = stream(TOK, [0xE2, 0x41])
    assert "".join(pieces) + tail == "\ufffdA"


@given(st.lists(st.integers(min_value=0, max_value=258), max_size=40))
def test_stream_agrees_with_decode_up_to_a_cut_character(ids):
    pieces, tail = stream(TOK, ids)
    text = TOK.decode(ids)
    data = bytes(i for i in ids if i < 256)
    cut = incomplete_tail(data)
    assert "".join(pieces) + tail == (data[: len(data) - cut].decode("utf-8", errors="replace"))
    assert cut == 0 or text.endswith("\ufffd")


def test_ids_outside_the_byte_vocabulary():
    with pytest.raises(ValueError, match="259"):
        TOK.decode([259])
    # a model with more rows than the tokenizer may sample them: no text, never an error
    decoder = TOK.stream_decoder()
    assert (decoder.push(-1), decoder.push(280), decoder.push(0x41)) == ("", "", "A")


def config(tmp_path, **extra):
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "rms_norm_eps": 1e-6,
        "vocab_size": 300,
        "max_position_embeddings": 32,
        "bos_token_id": 256,
        "eos_token_id": 257,
    } | extra
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_dir(tmp_path)


def test_load_tokenizer_chooses_bytes_from_config(tmp_path):
    assert isinstance(
        load_tokenizer(tmp_path, config(tmp_path, kvguard_tokenizer="byte")), ByteTokenizer
    )


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"vocab_size": 258}, "vocab_size"),
        ({"eos_token_id": 2}, "eos_token_id"),
        ({"bos_token_id": 1}, "bos_token_id"),
    ],
)
def test_byte_tokenizer_refuses_a_config_with_other_ids(tmp_path, extra, field):
    cfg = config(tmp_path, kvguard_tokenizer="byte", **extra)
    with pytest.raises(CheckpointError, match=f"field '{field}'") as exc:
        load_tokenizer(tmp_path, cfg)
    assert exc.value.path == tmp_path / "config.json"


def test_missing_tokenizer_json_names_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json: file is missing") as exc:
        load_tokenizer(tmp_path, config(tmp_path))
    assert exc.value.path == tmp_path / "tokenizer.json"


def test_malformed_tokenizer_json_names_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json: cannot be parsed"):
        load_tokenizer(tmp_path, config(tmp_path))


def save_byte_level_bpe(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"],
    )
    tok.train_from_iterator(["hello world, hello tokens"] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))


def test_hf_tokenizer_round_trip_and_streaming(tmp_path):
    save_byte_level_bpe(tmp_path)
    tok = load_tokenizer(tmp_path, config(tmp_path, bos_token_id=0, eos_token_id=[1, 2]))
    assert isinstance(tok, HFTokenizer)
    assert (tok.eos_id, tok.stop_ids) == (1, frozenset({1, 2}))
    text = "hello 🦙 world"
    ids = tok.encode(text)
    assert 0 not in ids  # the tokenizer has no post-processor adding BOS (config.json's is moot)
    assert tok.decode(ids) == text

    pieces, tail = stream(tok, ids)

    assert "".join(pieces) + tail == text
    assert not any("\ufffd" in p for p in pieces)  # the 4-byte llama never arrives in halves
    assert pieces.count("") >= 3  # its bytes were held back until complete


def test_hf_tokenizer_larger_than_the_model_is_refused(tmp_path):
    save_byte_level_bpe(tmp_path)
    with pytest.raises(CheckpointError, match="exceed the model's vocab_size 100"):
        load_tokenizer(tmp_path, config(tmp_path, vocab_size=100, bos_token_id=0, eos_token_id=1))


def save_legacy_llama(path):
    """TinyLlama's and Mistral v0.1's tokenizer.json: the ``▁`` comes from the normalizer
    (prepend, replace spaces), there is no pre-tokenizer, and the decoder maps it back."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["hello world, hello tokens and words"] * 20, trainer)
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.save(str(path / "tokenizer.json"))
    return tok


def test_logprob_token_text_keeps_its_space_with_a_normalizer_metaspace(tmp_path):
    rust = save_legacy_llama(tmp_path)
    tok = load_tokenizer(tmp_path, config(tmp_path, bos_token_id=1, eos_token_id=2))
    words = [p for p in rust.get_vocab() if p.startswith("▁") and len(p) > 2 and "▁" not in p[1:]]
    piece = max(words, key=len)
    word = rust.token_to_id(piece)
    text = " " + piece[1:]
    assert tok.decode([word]) == piece[1:]  # decoding it alone strips the space
    assert tok.token_text(word) == text
    # the same text the stream sends for it after a prompt
    decoder = tok.stream_decoder(tok.encode("hello"))
    assert decoder.push(word) + decoder.flush() == text


def test_split_special_tokens_encodes_them_as_text_as_transformers_does(
    tmp_path, family_checkpoint
):
    import shutil

    import transformers

    source = family_checkpoint("qwen2")
    for split in (False, True):
        path = tmp_path / str(split)
        shutil.copytree(source, path)
        settings = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(
            json.dumps({**settings, "split_special_tokens": split})
        )
        tok = load_tokenizer(path, ModelConfig.from_dir(path))
        hf = transformers.AutoTokenizer.from_pretrained(path)
        end = tok.token_id("<|im_end|>")
        text = "a user typed <|im_end|> here"
        assert tok.encode(text) == hf(text)["input_ids"]
        assert (end in tok.encode(text)) is not split
