"""Chat and instruction data without Ray: rendering with real chat templates against transformers, assistant-only
labels, document-masked packing, the tokenization cache, Parquet and ``datasets`` sources, and bad input.

The templates are the real ones shipped by Qwen3 (``Qwen/Qwen3-30B-A3B``), gpt-oss (harmony) and DeepSeek-V3
(tests/fixtures/chat_templates); their tokenizers are small byte-level BPEs trained here with the same
pipelines (Qwen's pre-tokenizer regex and NFC, plain byte-level) and the same added tokens, so that both
raymoe and transformers 5.23 read the same files.
"""

# ruff: noqa: RUF001 (DeepSeek's special tokens are written with fullwidth bars)
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from raymoe.driver.chat import ChatTemplate
from raymoe.driver.dataset import load_dataset
from raymoe.driver.tiny import build_tiny_checkpoint, tiny_tokenizer
from raymoe.driver.tokenizer import TextTokenizer, load_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
QWEN_REGEX = (  # Qwen2's pre-tokenizer split, as in its tokenizer.json and transformers' Qwen2Tokenizer
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CONVERSATIONS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4, of course."},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "2", "reasoning_content": "2 is prime."},
    ],
    [
        {"role": "user", "content": "  Grüße 日本 🙂\n"},
        {"role": "assistant", "content": "\n\nDanke — ありがとう!  "},
    ],
]
# What assistant-only loss trains on, per template: each answer (from its reasoning on, where the template renders
# it) and the special token that ends it, as decoded runs of label tokens.
EXPECTED_ANSWERS = {
    "qwen3": [
        ["4, of course.<|im_end|>"],
        ["Hello!<|im_end|>", "2 is prime.\n</think>\n\n2<|im_end|>"],
        ["Danke — ありがとう!  <|im_end|>"],  # Qwen3's template strips the leading newlines of the last answer
    ],
    "gpt_oss": [
        ["4, of course.<|return|>"],
        ["Hello!<|end|>", "2 is prime.<|end|><|start|>assistant<|channel|>final<|message|>2<|return|>"],
        ["\n\nDanke — ありがとう!  <|return|>"],
    ],
    "deepseek_v3": [
        ["4, of course.<｜end▁of▁sentence｜>"],
        ["Hello!<｜end▁of▁sentence｜>", "2<｜end▁of▁sentence｜>"],  # this template renders no reasoning
        ["\n\nDanke — ありがとう!  <｜end▁of▁sentence｜>"],
    ],
}


def _added(tokens: list[str], special: bool) -> list[AddedToken]:
    return [AddedToken(t, special=special, normalized=False) for t in tokens]


def _write_tokenizer(directory: Path, specials: list[str], others: list[str], regex: str | None) -> None:
    tokenizer = Tokenizer(models.BPE())
    if regex is not None:  # Qwen2's pipeline, as transformers' Qwen2Tokenizer rebuilds it
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [m["content"] for c in CONVERSATIONS for m in c] * 20 + [
        "the quick brown fox jumps over the lazy dog"
    ] * 50
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.add_special_tokens(_added(specials, special=True))
    tokenizer.add_tokens(_added(others, special=False))
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))


def _deepseek_token(content: str) -> dict:
    """A special token as DeepSeek-V3's tokenizer_config.json writes it (a serialized AddedToken)."""
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True, "rstrip": False,
            "single_word": False}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """name -> a directory holding tokenizer.json, tokenizer_config.json and (gpt-oss) chat_template.jinja."""
    root = tmp_path_factory.mktemp("chat_checkpoints")
    qwen = root / "qwen3"
    _write_tokenizer(qwen, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ["<think>", "</think>"], QWEN_REGEX)
    qwen_config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
                   "pad_token": "<|endoftext|>", "unk_token": None}  # fmt: skip
    (qwen / "tokenizer_config.json").write_text(
        json.dumps({**qwen_config, "chat_template": (FIXTURES / "qwen3.jinja").read_text()})
    )
    oss = root / "gpt_oss"
    harmony = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>"]
    _write_tokenizer(oss, [*harmony, "<|message|>", "<|call|>"], [], None)
    oss_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>",
                  "eos_token": "<|return|>", "pad_token": "<|endoftext|>"}  # fmt: skip
    (oss / "tokenizer_config.json").write_text(json.dumps(oss_config))
    (oss / "chat_template.jinja").write_text((FIXTURES / "gpt_oss.jinja").read_text())  # where gpt-oss ships it
    deepseek = root / "deepseek_v3"
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    _write_tokenizer(deepseek, [bos, eos, "<｜▁pad▁｜>"], ["<｜User｜>", "<｜Assistant｜>"], None)
    deepseek_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": _deepseek_token(bos),
                       "eos_token": _deepseek_token(eos), "pad_token": "<｜▁pad▁｜>"}  # fmt: skip
    (deepseek / "tokenizer_config.json").write_text(
        json.dumps({**deepseek_config, "chat_template": (FIXTURES / "deepseek_v3.jinja").read_text()})
    )
    tiny = build_tiny_checkpoint(root / "tiny")
    return {"qwen3": qwen, "gpt_oss": oss, "deepseek_v3": deepseek, "tiny": tiny}


@pytest.mark.parametrize("name", ["qwen3", "gpt_oss", "deepseek_v3", "tiny"])
def test_rendering_and_token_ids_match_transformers(checkpoints, name):
    import transformers

    reference = transformers.AutoTokenizer.from_pretrained(checkpoints[name])
    ours = load_tokenizer(checkpoints[name])
    assert ours.chat_template is not None
    for conversation in CONVERSATIONS:
        text, _ = ours.chat_template.answer_spans(conversation)
        assert text == reference.apply_chat_template(conversation, tokenize=False)
        expected = reference.apply_chat_template(conversation, tokenize=True, return_dict=False)
        assert ours.encode(text) == expected
        prompt = conversation[:-1]
        assert ours.chat_template.render(prompt, add_generation_prompt=True) == reference.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True
        )
    if name == "qwen3":  # template variables pass through
        kwargs = {"add_generation_prompt": True, "enable_thinking": False}
        ours_text = ours.chat_template.render(CONVERSATIONS[0][:2], **kwargs)
        assert ours_text == reference.apply_chat_template(CONVERSATIONS[0][:2], tokenize=False, **kwargs)
        assert ours_text.endswith("<think>\n\n</think>\n\n")


def _label_runs(data, tokenizer: TextTokenizer) -> list[list[str]]:
    """Per conversation (document), the decoded runs of consecutive label tokens."""
    runs = []
    for row in range(data.num_sequences):
        labels, docs = data.labels[row], data.document_ids[row]
        for doc in torch.unique_consecutive(docs[docs >= 0]).tolist():
            positions = torch.nonzero(docs == doc).flatten()
            taken = (labels[positions] != -100).tolist()
            pieces, current = [], []
            for position, take in zip(positions.tolist(), taken, strict=True):
                if take:
                    current.append(int(labels[position]))
                elif current:
                    pieces.append(current)
                    current = []
            if current:
                pieces.append(current)
            runs.append((int(doc), [tokenizer.tokenizer.decode(p, skip_special_tokens=False) for p in pieces]))
    return [pieces for _, pieces in sorted(runs)]


@pytest.mark.parametrize("name", ["qwen3", "gpt_oss", "deepseek_v3"])
def test_assistant_only_labels_are_the_answers_and_their_end_token(checkpoints, name, tmp_path):
    data_file = tmp_path / "chat.jsonl"
    data_file.write_text("".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in CONVERSATIONS))
    tokenizer = load_tokenizer(checkpoints[name])
    data = load_dataset(data_file, 1024, tokenizer)  # gpt-oss's system message alone is about 150 tokens
    assert data.document_ids is not None and data.labels is not None
    assert _label_runs(data, tokenizer) == EXPECTED_ANSWERS[name]
    # every token of each rendered conversation is in the row, in order, with no label on the prompt's tokens
    assert data.report is not None and data.report.examples == 3 and data.report.kind == "chat"
    everything = load_dataset(data_file, 1024, tokenizer, loss_on="all")
    assert everything.num_label_tokens == everything.num_tokens - 3  # all but each conversation's first token
    assert torch.equal(everything.input_ids, data.input_ids)


def test_templates_with_generation_blocks_use_them_like_transformers(checkpoints, tmp_path):
    import transformers

    source = (
        "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] + '<|im_end|>' }}"
        "{% endgeneration %}{%- else %}{{- message['content'] + '<|im_end|>' }}{%- endif %}{{- '\\n' }}{%- endfor %}"
    )
    reference = transformers.AutoTokenizer.from_pretrained(checkpoints["tiny"])
    ours = tiny_tokenizer().with_chat_template(ChatTemplate(source))
    conversation = CONVERSATIONS[1]
    out = reference.apply_chat_template(
        conversation, chat_template=source, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation}])
    data = load_dataset(path, 128, ours)
    length = len(out["input_ids"])
    assert data.input_ids[0, :length].tolist() == out["input_ids"]
    assert (data.labels[0, :length] != -100).tolist() == [bool(m) for m in out["assistant_masks"]]
    assert sum(out["assistant_masks"]) > 0


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def test_document_packing_places_whole_conversations_and_counts_only_answers(tmp_path):
    tokenizer = tiny_tokenizer()
    conversations = [
        [{"role": "user", "content": "q" * (i % 7 + 1)}, {"role": "assistant", "content": "a" * (i % 5 + 1)}]
        for i in range(40)
    ]
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations])
    data = load_dataset(path, 68, tokenizer)
    # a conversation renders as 2 x len("<|im_start|>role\n...<|im_end|>\n") tokens (byte-level, markers one each)
    lengths = [(1 + 5 + len(c[0]["content"]) + 2) + (1 + 10 + len(c[1]["content"]) + 2) for c in conversations]
    assert data.num_tokens == sum(lengths)
    assert data.num_label_tokens == sum(len(c[1]["content"]) + 1 for c in conversations)  # answers + <|im_end|>
    assert min(lengths) * 3 > 68 and max(lengths) * 2 <= 68
    assert data.num_sequences == len(conversations) // 2  # two conversations fit a row, three never do
    for row in range(data.num_sequences):  # whole conversations, each starting with <|im_start|>user
        docs = data.document_ids[row]
        for doc in torch.unique(docs[docs >= 0]).tolist():
            positions = torch.nonzero(docs == doc).flatten()
            assert data.input_ids[row, positions[0]].item() == 258
            assert len(positions) in lengths and positions[-1] - positions[0] + 1 == len(positions)
    # rows are ordered by their first conversation: the held-out tail holds the last conversations
    first = [int(data.document_ids[r][data.document_ids[r] >= 0].min()) for r in range(data.num_sequences)]
    assert first == sorted(first)

    plain = load_dataset(path, 68, tokenizer, packing="plain")
    assert plain.document_ids is None and plain.num_sequences == -(-sum(lengths) // 68)
    assert torch.equal(
        plain.input_ids.flatten()[: sum(lengths)], torch.tensor([t for t in _stream(tokenizer, conversations)])
    )


def _stream(tokenizer: TextTokenizer, conversations) -> list[int]:
    return [t for c in conversations for t in tokenizer.encode(tokenizer.chat_template.render(c))]


def test_text_documents_in_document_packing_keep_their_ids_and_do_not_predict_across(tmp_path):
    tokenizer = TextTokenizer.byte_level()
    path = _write_jsonl(tmp_path / "docs.jsonl", [{"text": "abc"}, {"text": "defgh"}, "ij"])
    data = load_dataset(path, 8, tokenizer)
    assert data.input_ids.tolist() == [[97, 98, 99, 256, 100, 101, 102, 103], [104, 256, 105, 106, 256, 0, 0, 0]]
    assert data.document_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1], [1, 1, 2, 2, 2, -1, -1, -1]]
    targets = data.targets()
    assert targets[0, 4].item() == -100 and targets[1, 2].item() == -100  # first token of a later document
    assert data.num_label_tokens == (8 - 1 - 1) + (5 - 1 - 1)
    plain = load_dataset(path, 8, tokenizer, packing="plain")
    assert torch.equal(plain.input_ids, data.input_ids) and plain.document_ids is None
    assert plain.num_label_tokens == 7 + 4


def test_prompt_completion_records_render_as_a_user_and_an_assistant_turn(tmp_path):
    tokenizer = tiny_tokenizer()
    pairs = _write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "2+2?", "completion": "4"}])
    listed = _write_jsonl(
        tmp_path / "listed.jsonl",
        [{"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]}],
    )
    messages = _write_jsonl(tmp_path / "messages.jsonl", [{"messages": CONVERSATIONS[0][1:]}])
    a, b = load_dataset(pairs, 64, tokenizer), load_dataset(listed, 64, tokenizer)
    c = load_dataset(messages, 64, tokenizer.with_chat_template(tokenizer.chat_template), text_field="unused")
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert a.num_label_tokens == 2  # "4" and <|im_end|>
    assert c.num_label_tokens == len("4, of course.") + 1


def test_overlong_conversations_are_an_error_or_truncated_or_dropped_and_counted(tmp_path):
    tokenizer = tiny_tokenizer()
    records = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"messages": [{"role": "user", "content": "x" * 20}, {"role": "assistant", "content": "y" * 20}]},
        {"messages": [{"role": "user", "content": "z" * 60}, {"role": "assistant", "content": "w"}]},
    ]
    path = _write_jsonl(tmp_path / "long.jsonl", records)
    with pytest.raises(ValueError, match=r"long\.jsonl line 2 is 61 tokens long, more than seq_len=40 \(2 of 3 "):
        load_dataset(path, 40, tokenizer)
    truncated = load_dataset(path, 40, tokenizer, overlong="truncate")
    assert truncated.report.truncated == 1 and truncated.report.dropped == 1  # line 3 keeps no answer token
    assert truncated.report.examples == 2 and "1 truncated to seq_len" in truncated.report.summary()
    assert truncated.num_label_tokens == 3 + (40 - (1 + 5 + 20 + 2) - (1 + 10))  # yo<|im_end|>, then what fits
    dropped = load_dataset(path, 40, tokenizer, overlong="drop")
    assert dropped.report.dropped == 2 and dropped.num_label_tokens == 3


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (
            {"messages": [{"role": "user", "content": "hi"}]},
            r"bad\.jsonl line 2: the conversation has no assistant turn",
        ),
        (
            {"messages": [{"role": "bot", "content": "hi"}]},
            r"line 2 message 0 has an unknown role 'bot'; known roles: system, developer, user, assistant",
        ),
        ({"messages": [{"role": "tool", "content": "{}"}]}, r"line 2 message 0: tool calls and tool results are not"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
            r"line 2 message 0 \(user\) must have text content \(a string\), got a list of content parts",
        ),
        ({"messages": "hi"}, r"line 2: messages must be a non-empty list"),
        ({"text": "a document"}, r"line 2 must be an object with 'messages', or 'prompt' and 'completion' \(like the"),
        ({"prompt": "a", "completion": 3}, r"line 2: 'prompt' and 'completion' must both be strings or both lists"),
    ],
    ids=["no_assistant", "unknown_role", "tool_role", "content_parts", "not_a_list", "mixed_kinds", "bad_completion"],
)
def test_bad_conversations_are_one_error_naming_the_line(tmp_path, record, message):
    good = {"messages": CONVERSATIONS[0]}
    path = _write_jsonl(tmp_path / "bad.jsonl", [good, record])
    with pytest.raises(ValueError, match=message):
        load_dataset(path, 128, tiny_tokenizer(), cache_dir=False)


def test_chat_data_needs_a_chat_template(tmp_path):
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(ValueError, match=r"chat\.jsonl holds conversations, but the checkpoint has no chat template"):
        load_dataset(path, 128, TextTokenizer.byte_level())
    template = tmp_path / "chatml.jinja"
    template.write_text(tiny_tokenizer().chat_template.source)
    given = load_dataset(path, 128, TextTokenizer.byte_level(), chat_template=template)
    assert given.num_label_tokens == len("4, of course.") + 1
    assert load_tokenizer(build_tiny_checkpoint(tmp_path / "tiny")).chat_template is not None


def test_a_template_that_rewrites_answers_is_refused_with_a_hint(tmp_path):
    rewriting = ChatTemplate("{%- for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{%- endfor %}")
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}])
    tokenizer = TextTokenizer.byte_level(chat_template=rewriting)
    with pytest.raises(ValueError, match=r"line 1: cannot locate the assistant answers .* use --loss-on all"):
        load_dataset(path, 128, tokenizer)
    assert load_dataset(path, 128, tokenizer, loss_on="all").num_label_tokens > 0


def test_tokenization_is_cached_by_content(tmp_path):
    tokenizer = tiny_tokenizer()
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    cache = tmp_path / "cache"
    first = load_dataset(path, 128, tokenizer, cache_dir=cache)
    second = load_dataset(path, 128, tokenizer, cache_dir=cache)
    assert not first.report.from_cache and second.report.from_cache and len(list(cache.iterdir())) == 1
    assert torch.equal(first.input_ids, second.input_ids) and torch.equal(first.labels, second.labels)
    # a renamed copy is the same content; other packing reuses the entry too
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(path.read_bytes())
    assert load_dataset(copy, 96, tokenizer, cache_dir=cache, packing="plain").report.from_cache
    # what changes the examples misses: the content, the loss, the template
    _write_jsonl(copy, [{"messages": c} for c in CONVERSATIONS[:2]])
    assert not load_dataset(copy, 128, tokenizer, cache_dir=cache).report.from_cache
    assert not load_dataset(path, 128, tokenizer, cache_dir=cache, loss_on="all").report.from_cache
    other = tokenizer.with_chat_template(ChatTemplate(tokenizer.chat_template.source + "\n"))
    assert not load_dataset(path, 128, other, cache_dir=cache).report.from_cache
    assert len(list(cache.iterdir())) == 4
    assert not load_dataset(path, 128, tokenizer, cache_dir=False).report.from_cache


def test_parallel_tokenization_gives_the_same_examples(tmp_path):
    tokenizer = tiny_tokenizer()
    records = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
               for i in range(2500)]  # fmt: skip
    path = _write_jsonl(tmp_path / "many.jsonl", records)
    one = load_dataset(path, 128, tokenizer, cache_dir=False, num_proc=1)
    two = load_dataset(path, 128, tokenizer, cache_dir=False, num_proc=2)
    assert torch.equal(one.input_ids, two.input_ids) and torch.equal(one.labels, two.labels)
    assert torch.equal(one.document_ids, two.document_ids)
    bad = _write_jsonl(tmp_path / "bad.jsonl", [*records, {"messages": [{"role": "user", "content": "no answer"}]}])
    with pytest.raises(ValueError, match=r"bad\.jsonl line 2501: the conversation has no assistant turn"):
        load_dataset(bad, 128, tokenizer, cache_dir=False, num_proc=2)


def test_parquet_and_datasets_sources(tmp_path):
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer = tiny_tokenizer()
    records = [{"messages": c} for c in CONVERSATIONS]
    reference = load_dataset(_write_jsonl(tmp_path / "chat.jsonl", records), 128, tokenizer)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "chat.parquet", row_group_size=2)
    from_parquet = load_dataset(tmp_path / "chat.parquet", 128, tokenizer)
    assert torch.equal(from_parquet.input_ids, reference.input_ids)
    assert torch.equal(from_parquet.labels, reference.labels)

    # a directory of data files (load_dataset's json builder) and a save_to_disk directory
    files = tmp_path / "files"
    files.mkdir()
    _write_jsonl(files / "train.jsonl", records)
    from_files = load_dataset(files, 128, tokenizer)
    assert torch.equal(from_files.input_ids, reference.input_ids)
    saved = tmp_path / "saved"
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(records)}).save_to_disk(str(saved))
    from_disk = load_dataset(saved, 128, tokenizer, split="validation")
    assert torch.equal(from_disk.labels, reference.labels)
    with pytest.raises(ValueError, match=r"has no split 'train'; its splits: validation"):
        load_dataset(saved, 128, tokenizer)
    bad = pa.Table.from_pylist([{"messages": [{"role": "user", "content": "x"}]}])
    pq.write_table(bad, tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet row 1: the conversation has no assistant turn"):
        load_dataset(tmp_path / "bad.parquet", 128, tokenizer)


def test_a_given_template_is_saved_with_the_tokenizer_and_read_back(tmp_path):
    from raymoe.driver.tokenizer import load_chat_template

    tokenizer = load_tokenizer(build_tiny_checkpoint(tmp_path / "model"))
    file = tmp_path / "other.jinja"
    file.write_text("{{ bos_token }}{%- for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{%- endfor %}")
    other = tokenizer.with_chat_template(load_chat_template(file, tokenizer.special_tokens))
    assert other.chat_template.special_tokens == {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}
    other.save(tmp_path / "out")
    loaded = load_tokenizer(tmp_path / "out")
    assert loaded.chat_template.source == file.read_text() and (tmp_path / "out" / "chat_template.jinja").is_file()
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert "chat_template" not in config and config["eos_token"] == "<|endoftext|>"  # the .jinja file wins
    with pytest.raises(ValueError, match=r"chat template file '.*absent.jinja' does not exist"):
        load_chat_template(tmp_path / "absent.jinja")


def test_a_damaged_cache_entry_is_rebuilt(tmp_path):
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    cache = tmp_path / "cache"
    first = load_dataset(path, 128, tiny_tokenizer(), cache_dir=cache)
    (first.report.cache / "ids.npy").write_bytes(b"truncated")
    again = load_dataset(path, 128, tiny_tokenizer(), cache_dir=cache)
    assert not again.report.from_cache and torch.equal(again.input_ids, first.input_ids)
    assert load_dataset(path, 128, tiny_tokenizer(), cache_dir=cache).report.from_cache
