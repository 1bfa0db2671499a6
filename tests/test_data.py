"""polyrl.data on CPU: file parsing and its errors, tokenization, batching and resume, SFT masks."""

import json
import logging
import string

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polyrl.data import (
    DataError,
    PromptDataset,
    build_sft_example,
    encode_prompt,
    load_records,
    load_sft_records,
    parse_data_spec,
)
from polyrl.types import PromptRecord


def make_char_tokenizer(bos: bool = False):
    """A one-token-per-character tokenizer with a tiny chat template; no downloads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>"]
    vocab = {t: i for i, t in enumerate(specials + list(string.printable))}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tk.decoder = decoders.Fuse()
    if bos:
        from tokenizers import processors

        tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>",
                                  bos_token="<bos>" if bos else None)
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tok


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def tok():
    return make_char_tokenizer()


# ---- specs and files ----

def test_parse_data_spec():
    assert parse_data_spec("a/b.jsonl") == ("a/b.jsonl", None)
    assert parse_data_spec("a@b/c.jsonl@[2:5]") == ("a@b/c.jsonl", slice(2, 5))
    assert parse_data_spec("x.parquet@[:3]") == ("x.parquet", slice(None, 3))
    assert parse_data_spec("x.parquet@[-2:]") == ("x.parquet", slice(-2, None))
    with pytest.raises(DataError, match=r"PATH@\[START:END\]"):
        parse_data_spec("x.jsonl@[a:b]")


def test_load_jsonl_records_labels_metadata_and_blank_lines(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "1+1", "label": "2", "metadata": {"id": 7}},
        "",
        {"prompt": [{"role": "user", "content": "hi"}]},  # no label: fine
    ])
    recs = load_records(str(p))
    assert [r.prompt for r in recs] == ["1+1", [{"role": "user", "content": "hi"}]]
    assert [r.label for r in recs] == ["2", None]
    assert recs[0].metadata == {"id": 7} and recs[1].metadata == {}
    assert [r.source for r in recs] == [f"{p}:1", f"{p}:3"]  # 1-based file lines, blank line skipped


def test_custom_keys(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    (rec,) = load_records(str(p), input_key="question", label_key="answer", metadata_key=None)
    assert (rec.prompt, rec.label) == ("q", "a")


def test_malformed_json_names_file_and_line(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, "", '{"prompt": "b",'])
    with pytest.raises(DataError, match=rf"{p}:3: invalid JSON"):
        load_records(str(p))


def test_row_not_object(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [["a", "b"]])
    with pytest.raises(DataError, match=rf"{p}:1: row is a list"):
        load_records(str(p))


def test_missing_input_key_names_key_keys_and_flag(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok"}, {"question": "q", "answer": "a"}])
    with pytest.raises(DataError) as e:
        load_records(str(p))
    msg = str(e.value)
    assert f"{p}:2" in msg and "'prompt'" in msg and "['answer', 'question']" in msg and "--input-key" in msg


def test_missing_file_bad_extension_empty(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_records(str(tmp_path / "nope.jsonl"))
    csv = tmp_path / "d.csv"
    csv.write_text("prompt\nx\n")
    with pytest.raises(DataError, match=r"unsupported data file .*\.jsonl.*\.parquet"):
        load_records(str(csv))
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    with pytest.raises(DataError, match=rf"no rows in {p} \(slice 5:None\)"):
        load_records(f"{p}@[5:]")
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=f"no rows in {empty}"):
        load_records(str(empty))


def test_slicing_only_parses_selected_lines(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": str(i)} for i in range(6)] + ["not json"])
    assert [r.prompt for r in load_records(f"{p}@[1:3]")] == ["1", "2"]
    assert [r.prompt for r in load_records(f"{p}@[:2]")] == ["0", "1"]
    assert [r.source for r in load_records(f"{p}@[4:6]")] == [f"{p}:5", f"{p}:6"]
    with pytest.raises(DataError, match=f"{p}:7"):
        load_records(f"{p}@[-1:]")


def test_bad_prompt_type(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": 5}])
    with pytest.raises(DataError, match=rf"{p}:1: prompt must be a string or a list of chat messages"):
        load_records(str(p))


def test_parquet_round_trip(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({
        "prompt": ["a", "b", "c"],
        "label": ["1", None, "3"],
        "metadata": ['{"k": 1}', None, '{"k": 3}'],  # JSON strings, as parquet exports often store them
    }), p)
    recs = load_records(str(p))
    assert [(r.prompt, r.label, r.metadata) for r in recs] == [("a", "1", {"k": 1}), ("b", None, {}),
                                                                ("c", "3", {"k": 3})]
    assert recs[1].source == f"{p}:row 1"
    assert [r.prompt for r in load_records(f"{p}@[1:]")] == ["b", "c"]
    assert [r.source for r in load_records(f"{p}@[-1:]")] == [f"{p}:row 2"]
    with pytest.raises(DataError, match=rf"{p}:row 0: row has no key 'question'.*--input-key"):
        load_records(str(p), input_key="question")


# ---- tokenization ----

def test_encode_prompt_plain_and_chat(tok):
    assert encode_prompt(tok, "ab", apply_chat_template=False) == tok("ab", add_special_tokens=False)["input_ids"]
    chat = encode_prompt(tok, "ab", apply_chat_template=True)
    assert tok.decode(chat) == "<user>ab<assistant>"
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert tok.decode(encode_prompt(tok, msgs, apply_chat_template=True)) == "<system>s<user>u<assistant>"
    with pytest.raises(DataError, match="--apply-chat-template"):
        encode_prompt(tok, msgs, apply_chat_template=False)


def test_encode_prompt_keeps_tokenizer_bos():
    tok = make_char_tokenizer(bos=True)
    assert encode_prompt(tok, "ab", apply_chat_template=False)[0] == tok.bos_token_id


# ---- PromptDataset ----

def records(prompts):
    return [PromptRecord(prompt=p, source=f"mem:{i + 1}") for i, p in enumerate(prompts)]


def test_long_prompts_dropped_and_counted(tok, caplog):
    with caplog.at_level(logging.WARNING, logger="polyrl.data"):
        ds = PromptDataset(records(["a", "abcdef", "abc", "abcdefgh"]), tok, max_prompt_len=3, shuffle=False)
    assert ds.num_dropped == 2 and len(ds) == 2
    assert [r.prompt for _, r in ds.next_batch(2)] == ["a", "abc"]
    assert sum("dropped 2 of 4" in m for m in caplog.messages) == 1


def test_all_dropped_is_an_error(tok):
    with pytest.raises(DataError, match=r"--rollout-max-prompt-len=2 \(shortest 3, longest 6 tokens\)"):
        PromptDataset(records(["abc", "abcdef"]), tok, max_prompt_len=2)


def test_chat_prompt_without_template_names_source(tok):
    with pytest.raises(DataError, match="mem:1: .*--apply-chat-template"):
        PromptDataset(records([[{"role": "user", "content": "x"}]]), tok)


def test_next_batch_cycles_epochs_without_shuffle(tok):
    ds = PromptDataset(records(list("abc")), tok, shuffle=False)
    got = [r.prompt for _, r in ds.next_batch(4)] + [r.prompt for _, r in ds.next_batch(4)]
    assert got == list("abcabcab")
    assert ds.state_dict() == {"epoch": 2, "position": 2}


def test_shuffle_is_deterministic_and_a_permutation_per_epoch(tok):
    prompts = list("abcdefghij")
    a = PromptDataset(records(prompts), tok, shuffle=True, seed=3)
    b = PromptDataset(records(prompts), tok, shuffle=True, seed=3)
    ea, eb = [r.prompt for _, r in a.next_batch(10)], [r.prompt for _, r in b.next_batch(10)]
    assert ea == eb and sorted(ea) == prompts and ea != prompts
    second = [r.prompt for _, r in a.next_batch(10)]
    assert sorted(second) == prompts and second != ea  # epoch 1 uses seed + 1
    other = PromptDataset(records(prompts), tok, shuffle=True, seed=4)
    assert [r.prompt for _, r in other.next_batch(10)] != ea


def test_resume_gives_the_same_batches(tok):
    prompts = [f"p{i}" for i in range(7)]
    ds = PromptDataset(records(prompts), tok, shuffle=True, seed=11)
    for _ in range(3):
        ds.next_batch(3)  # 9 items: crosses into epoch 1
    state = ds.state_dict()
    expected = [[r.prompt for _, r in ds.next_batch(3)] for _ in range(2)]
    fresh = PromptDataset(records(prompts), tok, shuffle=True, seed=11)
    fresh.load_state_dict(state)
    assert [[r.prompt for _, r in fresh.next_batch(3)] for _ in range(2)] == expected
    assert state == {"epoch": 1, "position": 2}


# ---- SFT ----

def test_load_sft_records(tmp_path):
    p = write_jsonl(tmp_path / "s.jsonl", [{"q": "hi", "a": "yo"}])
    assert load_sft_records(str(p), input_key="q", response_key="a") == [("hi", "yo", f"{p}:1")]
    with pytest.raises(DataError, match=rf"{p}:1: row has no key 'response'.*--response-key"):
        load_sft_records(str(p), input_key="q")


@pytest.mark.parametrize("chat", [False, True])
def test_sft_example_masks_only_the_response(tok, chat):
    ids, mask = build_sft_example(tok, "ab", "xyz", apply_chat_template=chat)
    prompt_len = len(encode_prompt(tok, "ab", chat))
    assert len(ids) == len(mask) == prompt_len + 4
    assert mask == [0] * prompt_len + [1] * 4
    assert tok.decode(ids[prompt_len:]) == "xyz<eos>"
