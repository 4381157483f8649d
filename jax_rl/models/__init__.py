"""Qwen3 models, HF checkpoint I/O and (lazily) the tokenizer.

``from jax_rl.models import load_pretrained, save_pretrained`` works; hf_io and tokenizer are
imported on first attribute access so importing the model does not pull in safetensors or
tokenizers.
"""

from jax_rl.models.qwen3 import (  # noqa: F401
    PRESETS,
    KVCache,
    MoEOptions,
    Qwen3Config,
    Qwen3ForCausalLM,
    count_params,
    get_preset,
    model_kwargs,
)

_LAZY = {
    "load_pretrained": "jax_rl.models.hf_io",
    "save_pretrained": "jax_rl.models.hf_io",
    "CheckpointError": "jax_rl.models.hf_io",
    "ChatTokenizer": "jax_rl.models.tokenizer",
    "load_tokenizer": "jax_rl.models.tokenizer",
    "compact_tokenizer": "jax_rl.models.tokenizer",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jax_rl.models' has no attribute {name!r}")
