"""Prompt datasets: reading jsonl/parquet rows, chat templates, epoch-cycling batches, SFT examples.

A data spec is a path with an optional row slice: ``data/train.jsonl@[0:1000]``. Rows are the
non-blank lines of a jsonl file or the rows of a parquet file; the slice uses Python semantics.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from polyrl.types import PromptRecord

logger = logging.getLogger(__name__)

_SLICE_RE = re.compile(r"^(?P<path>.+)@\[(?P<start>-?\d*):(?P<end>-?\d*)\]$")


class DataError(ValueError):
    """A dataset problem, reported with the file and line (or row) and what to do about it."""


def parse_data_spec(spec: str) -> tuple[str, slice | None]:
    """``path``, ``path@[start:end]``, ``path@[:end]`` or ``path@[start:]`` -> (path, row slice)."""
    m = _SLICE_RE.match(spec)
    if m is None:
        if "@[" in spec:
            raise DataError(f"bad data spec {spec!r}: write PATH@[START:END], e.g. train.jsonl@[0:100]")
        return spec, None
    start, end = m["start"], m["end"]
    return m["path"], slice(int(start) if start else None, int(end) if end else None)


def _read_rows(spec: str) -> list[tuple[str, dict]]:
    """Rows of the sliced file as (source, row) where source is ``path:line`` (jsonl, 1-based)
    or ``path:row N`` (parquet, 0-based)."""
    path, slc = parse_data_spec(spec)
    if Path(path).is_dir():
        return _check_rows(_read_saved_dataset(path, slc), path, slc)
    if not Path(path).is_file():
        raise DataError(f"data file {path} does not exist (from spec {spec!r}); check the path")
    suffix = Path(path).suffix.lower()
    if suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            lines = [(i, line) for i, line in enumerate(f, start=1) if line.strip()]
        if slc is not None:
            lines = lines[slc]
        rows = []
        for lineno, line in lines:  # parse only the sliced lines: a slice of a huge file stays cheap
            try:
                rows.append((f"{path}:{lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e}); each line must be one JSON object") from e
    elif suffix == ".parquet":
        import pyarrow.parquet as pq  # only parquet users need pyarrow

        table = pq.read_table(path)
        indices = range(table.num_rows)
        if slc is not None:
            indices = indices[slc]
        table = table.slice(indices.start, len(indices))
        rows = [(f"{path}:row {i}", row) for i, row in zip(indices, table.to_pylist())]
    else:
        raise DataError(f"unsupported data file {path}: use .jsonl (one JSON object per line) or .parquet")
    return _check_rows(rows, path, slc)


def _check_rows(rows: list[tuple[str, dict]], path: str, slc: slice | None) -> list[tuple[str, dict]]:
    if not rows:
        where = f" (slice {slc.start}:{slc.stop})" if slc is not None else ""
        raise DataError(f"no rows in {path}{where}; check the file and the @[start:end] slice")
    for source, row in rows:
        if not isinstance(row, dict):
            raise DataError(f"{source}: row is a {type(row).__name__}, expected a JSON object like {{\"prompt\": ...}}")
    return rows


def _read_saved_dataset(path: str, slc: slice | None) -> list[tuple[str, dict]]:
    """Rows of a directory written by datasets' Dataset.save_to_disk, as (``path:row N``, row)."""
    p = Path(path)
    if (p / "dataset_dict.json").is_file():
        splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(f"{path} is a DatasetDict (splits {splits}); name one split's directory, e.g. {p / 'train'}")
    if not (p / "state.json").is_file():
        raise DataError(f"{path} is a directory but not a datasets save_to_disk directory (no state.json); give a "
                        ".jsonl or .parquet file, or such a directory")
    try:
        import datasets  # only users of saved datasets need it
    except ImportError:
        raise DataError(f"{path} is a datasets save_to_disk directory: reading it needs the datasets package "
                        "(pip install datasets)") from None
    ds = datasets.load_from_disk(path)
    indices = range(len(ds))
    if slc is not None:
        indices = indices[slc]
    return [(f"{path}:row {i}", ds[i]) for i in indices]


def _get(row: dict, key: str, source: str, flag: str) -> Any:
    if key not in row:
        raise DataError(f"{source}: row has no key {key!r} (keys: {sorted(row)}); pass {flag} to name the right column")
    return row[key]


def _check_prompt(prompt: Any, source: str) -> Any:
    is_chat = isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    if not (isinstance(prompt, str) or (is_chat and prompt)):
        raise DataError(
            f"{source}: prompt must be a string or a list of chat messages "
            f"({{'role': ..., 'content': ...}}), got {type(prompt).__name__}: {str(prompt)[:80]!r}"
        )
    return prompt


def _row_images(row: dict, source: str, spec: str, multimodal_keys: dict | None) -> list[str] | None:
    """The row's images (--multimodal-keys), each checked readable: paths made absolute, data URLs as given."""
    column = (multimodal_keys or {}).get("image")
    if column is None:
        return None
    from polyrl.multimodal import ImageError, load_image, resolve_image_ref

    refs = _get(row, column, source, "--multimodal-keys")
    refs = [refs] if isinstance(refs, str) else refs
    if not isinstance(refs, list):
        raise DataError(f"{source}: {column!r} must be a list of image paths / data URLs, got {type(refs).__name__}")
    base = str(Path(parse_data_spec(spec)[0]).parent)
    out = []
    for k, ref in enumerate(refs):
        try:
            out.append(resolve_image_ref(ref, base))
            load_image(out[-1])  # a missing or unreadable image fails here, with its row, not mid-run
        except ImageError as e:
            raise DataError(f"{source}: {column}[{k}]: {e}") from None
    return out


def _check_image_slots(prompt: Any, images: list[str] | None, source: str) -> None:
    if images is None:
        return
    from polyrl.multimodal import ImageError, place_images
    try:
        place_images(prompt, len(images))
    except ImageError as e:
        raise DataError(f"{source}: {e}") from None


def load_records(
    spec: str, input_key: str = "prompt", label_key: str | None = "label", metadata_key: str | None = "metadata",
    multimodal_keys: dict | None = None,
) -> list[PromptRecord]:
    """Read prompt rows from a jsonl/parquet spec. A row without the label key gets label None. With multimodal_keys
    ({"image": column}) each record carries its images (PromptRecord.images)."""
    records = []
    for source, row in _read_rows(spec):
        prompt = _check_prompt(_get(row, input_key, source, "--input-key"), source)
        images = _row_images(row, source, spec, multimodal_keys)
        _check_image_slots(prompt, images, source)
        metadata = row.get(metadata_key) if metadata_key else None
        if isinstance(metadata, str):  # parquet files often store metadata as a JSON string
            try:
                metadata = json.loads(metadata)
            except json.JSONDecodeError as e:
                raise DataError(f"{source}: {metadata_key!r} is a string but not JSON ({e})") from e
        if metadata is not None and not isinstance(metadata, dict):
            raise DataError(f"{source}: {metadata_key!r} must be an object, got {type(metadata).__name__}; "
                            "fix the row or pass --metadata-key to name another column")
        label = row.get(label_key) if label_key else None
        records.append(PromptRecord(prompt=prompt, label=label, metadata=metadata or {}, source=source, images=images))
    return records


def encode_prompt(tokenizer: Any, prompt: str | list[dict], apply_chat_template: bool) -> list[int]:
    """Token ids of one prompt.

    With ``apply_chat_template`` a string becomes one user message and the template adds the
    generation prompt (and whatever special tokens the template itself writes). Without it, a
    string is tokenized with ``add_special_tokens=True``: tokenizers that prepend BOS (Llama,
    Gemma) expect it on raw text too, and those that add nothing (Qwen) are unaffected. A
    trailing EOS added by a post-processor is dropped, since a prompt ending in EOS would stop
    generation before it starts.
    """
    if apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding by default
            ids = ids["input_ids"]
        return list(ids)
    if not isinstance(prompt, str):
        raise DataError("prompt is a list of chat messages; pass --apply-chat-template to render it with the "
                        "tokenizer's chat template")
    ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    eos = tokenizer.eos_token_id
    if ids and eos is not None and ids[-1] == eos and not prompt.endswith(tokenizer.eos_token):
        ids.pop()
    return ids


def encode_image_prompt(processor: Any, prompt: str | list[dict], images: list) -> list[int]:
    """Token ids of a prompt with images (image tokens expanded); the chat template renders the image parts."""
    if processor is None:
        raise DataError("the row has images but the model has no image processor (--hf-checkpoint is not a "
                        "vision-language model with a preprocessor_config.json)")
    return processor.encode(prompt, images)[0]


class PromptDataset:
    """Tokenized prompts served in batches that cycle over epochs.

    Items are ``(token_ids, record)``. With ``shuffle`` each epoch's order is a permutation drawn
    from ``torch.Generator().manual_seed(seed + epoch)``, so the order depends only on
    (seed, epoch) and ``state_dict`` = (epoch, position) is enough to resume exactly.
    """

    def __init__(
        self,
        records: list[PromptRecord],
        tokenizer: Any,
        max_prompt_len: int | None = None,
        apply_chat_template: bool = False,
        shuffle: bool = True,
        seed: int = 0,
        processor: Any = None,
    ):
        """processor: a polyrl.multimodal.VisionProcessor, for records with images (their ids hold the image tokens)."""
        self.shuffle, self.seed = shuffle, seed
        self.items: list[tuple[list[int], PromptRecord]] = []
        lengths = []
        for record in records:
            try:
                ids = encode_prompt(tokenizer, record.prompt, apply_chat_template) if record.images is None else \
                    encode_image_prompt(processor, record.prompt, record.images)
            except (DataError, ValueError) as e:
                raise DataError(f"{record.source}: {e}") from e
            lengths.append(len(ids))
            if max_prompt_len is None or len(ids) <= max_prompt_len:
                self.items.append((ids, record))
        self.num_dropped = len(records) - len(self.items)
        if not self.items:
            raise DataError(
                f"all {len(records)} prompts are longer than --rollout-max-prompt-len={max_prompt_len} "
                f"(shortest {min(lengths, default=0)}, longest {max(lengths, default=0)} tokens); raise the limit "
                "(with --rollout-max-context-len, prompts longer than it - 1 are dropped too)"
            )
        if self.num_dropped:
            logger.warning("dropped %d of %d prompts longer than %d tokens (--rollout-max-prompt-len, "
                           "--rollout-max-context-len - 1)",
                           self.num_dropped, len(records), max_prompt_len)
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[list[int], PromptRecord]:
        return self.items[i]

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.items)))
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.items), generator=gen).tolist()

    def next_batch(self, n: int) -> list[tuple[list[int], PromptRecord]]:
        """The next ``n`` items; crosses into the next epoch (a new order) when one runs out."""
        batch = []
        while len(batch) < n:
            if self.position >= len(self.items):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            take = self._order[self.position : self.position + n - len(batch)]
            batch.extend(self.items[i] for i in take)
            self.position += len(take)
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)


def _is_conversation(prompt: Any) -> bool:
    return isinstance(prompt, list) and any(m["role"] == "assistant" for m in prompt)


def load_sft_records(
    spec: str, input_key: str = "prompt", response_key: str = "response", multimodal_keys: dict | None = None,
) -> list[tuple]:
    """(prompt, response, source) triples for supervised fine-tuning. A row whose --input-key holds chat messages
    with assistant turns and which has no --response-key column is a conversation: response None, and the loss
    covers every assistant turn (build_conversation_example). With multimodal_keys: (prompt, response, source,
    images), conversations included (response None)."""
    out = []
    for source, row in _read_rows(spec):
        prompt = _check_prompt(_get(row, input_key, source, "--input-key"), source)
        if multimodal_keys:
            images = _row_images(row, source, spec, multimodal_keys)
            _check_image_slots(prompt, images, source)
            if response_key not in row and _is_conversation(prompt):
                out.append((prompt, None, source, images))
                continue
            response = _get(row, response_key, source, "--response-key")
            if not isinstance(response, str):
                raise DataError(f"{source}: response {response_key!r} must be a string, got {type(response).__name__}")
            out.append((prompt, response, source, images))
            continue
        if response_key not in row and _is_conversation(prompt):
            out.append((prompt, None, source))
            continue
        response = _get(row, response_key, source, "--response-key")
        if not isinstance(response, str):
            raise DataError(f"{source}: response {response_key!r} must be a string, got {type(response).__name__}")
        out.append((prompt, response, source))
    return out


def build_sft_example(
    tokenizer: Any, prompt: str | list[dict], response: str | None, apply_chat_template: bool
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)``: the prompt (mask 0) then the response and EOS (mask 1); with response None,
    the conversation `prompt` with mask 1 on its assistant turns (build_conversation_example).

    The response is tokenized on its own rather than as part of the rendered conversation so
    the prompt/response boundary is exact; EOS teaches the model to stop.
    """
    if response is None:
        if not apply_chat_template:
            raise DataError("a conversation row (chat messages with assistant turns, no response column) is rendered "
                            "with the tokenizer's chat template: pass --apply-chat-template")
        return build_conversation_example(tokenizer, prompt)
    prompt_ids = encode_prompt(tokenizer, prompt, apply_chat_template)
    response_ids = list(tokenizer(response, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        response_ids.append(tokenizer.eos_token_id)
    return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)


_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def build_conversation_example(tokenizer: Any, messages: list[dict]) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of a whole conversation rendered with the chat template: mask 1 on the tokens of
    every assistant turn (what the template writes for it, its end-of-turn marker included: the model learns to end
    its turn), 0 on system, user and tool turns and on the template's framing between them.

    Which characters an assistant turn owns: a template with ``{% generation %}`` blocks marks them itself
    (transformers' return_assistant_tokens_mask). Otherwise turn i owns the text between the rendering of
    ``messages[:i]`` with the generation prompt (what the model sees when it starts the turn) and the rendering of
    ``messages[:i + 1]``; both must be prefixes of the whole conversation's rendering, or the template rewrites
    earlier turns (Qwen3's drops their thinking) and the turn cannot be located: a DataError says so. Each span is
    tokenized on its own, so the boundaries are exact, as in build_sft_example.
    """
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError("the conversation has no assistant turn; nothing to train on")
    if _GENERATION_TAG.search(tokenizer.chat_template or ""):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        return list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]

    def render(msgs: list[dict], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)

    full, spans = render(messages, False), []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise DataError("the conversation starts with an assistant turn; put the system or user message it answers "
                            "before it")
        start, end = render(messages[:i], True), render(messages[:i + 1], False)
        if not (full.startswith(start) and full.startswith(end) and len(start) < len(end)
                and len(start) >= (spans[-1][1] if spans else 0)):
            raise DataError(f"the chat template renders the conversation up to assistant turn {i} (0-based message index) "
                            "differently from the whole conversation (it rewrites earlier turns, as Qwen3's template "
                            "does with their thinking), so that turn's tokens cannot be located; use a template that "
                            "keeps earlier turns as they are, or one with {% generation %} blocks around assistant turns")
        spans.append((len(start), len(end)))
    ids: list[int] = []
    mask: list[int] = []
    pos = 0
    for s, e in [*spans, (len(full), len(full))]:
        for text, bit in ((full[pos:s], 0), (full[s:e], 1)):
            if text:  # the template writes its own special tokens (BOS, turn markers): add none
                t = list(tokenizer(text, add_special_tokens=False)["input_ids"])
                ids += t
                mask += [bit] * len(t)
        pos = e
    return ids, mask
