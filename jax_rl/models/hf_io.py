"""Hugging Face checkpoint I/O for Qwen3 / Qwen3-MoE (safetensors <-> NNX params).

``load_pretrained(path)`` reads ``config.json`` and either ``model.safetensors`` or a sharded
``model.safetensors.index.json``, tensor by tensor (each file is memory-mapped; every tensor is
converted on the host and placed directly into its final, optionally sharded, layout). It
transposes HF ``[out, in]`` Linear weights to our ``[in, out]`` einsum layouts, stacks
per-expert weights into ``[E, D, F]`` / ``[E, F, D]``, ties the LM head to the embedding when
``tie_word_embeddings`` (no ``lm_head.weight`` in the file), and reads F32, F16 and BF16
files.

Errors (all ``CheckpointError``, a ``ValueError``):

- ``config.json`` missing or unsupported (the ``Qwen3Config.from_hf`` message);
- no ``model.safetensors`` / index in the folder;
- a broken index (bad JSON, no ``weight_map``, a shard file that does not exist, or a tensor
  the index places in a file that does not hold it);
- a bad safetensors header;
- the tensor check: ONE error listing, by HF name, every missing tensor, unexpected tensor,
  tensor with the wrong shape, and tensor with a non-float dtype.

``save_pretrained(model, config, path)`` writes ``model.safetensors`` (or shards plus an
index when larger than ``max_shard_bytes``) in the per-expert hub layout, and a
``config.json`` (transformers-5 form) that ``transformers`` loads back to the same logits.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jax_rl.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from jax_rl.sharding import state_shardings

__all__ = ["CheckpointError", "load_pretrained", "save_pretrained", "hf_param_specs",
           "read_safetensors_index"]

SAFE_DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
}
_NON_FLOAT = {"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64", "BOOL", "F8_E4M3", "F8_E5M2"}
_DTYPE_TO_SAFE = {v: k for k, v in SAFE_DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint that does not match the config (see the module docstring)."""


# --------------------------------------------------------------------------------------
# Name / layout mapping
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamSpec:
    """One of our params and the HF tensor(s) it comes from.

    path: our NNX path; hf_names: HF tensor names (several for stacked experts);
    hf_shape: shape of each HF tensor; to_ours(list of HF arrays) -> our array;
    to_hf(our array) -> list of HF arrays.
    """

    path: tuple[Any, ...]
    hf_names: tuple[str, ...]
    hf_shape: tuple[int, ...]
    to_ours: Callable[[list[np.ndarray]], np.ndarray]
    to_hf: Callable[[np.ndarray], list[np.ndarray]]


def _ident():
    return (lambda xs: xs[0]), (lambda x: [x])


def _linear(out_shape):
    """HF [out, in] -> ours [in, *out_shape] (out axis split into out_shape)."""
    def to_ours(xs):
        w = xs[0]
        return np.ascontiguousarray(w.T).reshape(w.shape[1], *out_shape)

    def to_hf(x):
        return [np.ascontiguousarray(x.reshape(x.shape[0], -1).T)]

    return to_ours, to_hf


def _linear_in_split(in_shape):
    """HF [out, in] -> ours [*in_shape, out] (in axis split into in_shape; o_proj)."""
    def to_ours(xs):
        w = xs[0]
        return np.ascontiguousarray(w.T).reshape(*in_shape, w.shape[0])

    def to_hf(x):
        return [np.ascontiguousarray(x.reshape(-1, x.shape[-1]).T)]

    return to_ours, to_hf


def _experts():
    """E tensors HF [out, in] -> ours [E, in, out] (stacked, last two axes swapped)."""
    def to_ours(xs):
        return np.ascontiguousarray(np.stack(xs).transpose(0, 2, 1))

    def to_hf(x):
        return [np.ascontiguousarray(x[e].T) for e in range(x.shape[0])]

    return to_ours, to_hf


def hf_param_specs(cfg: Qwen3Config) -> list[ParamSpec]:
    """Every param of ``Qwen3ForCausalLM(cfg)`` with its HF tensor names and transforms."""
    D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    specs = [ParamSpec(("embed_tokens",), ("model.embed_tokens.weight",), (cfg.vocab_size, D),
                       *_ident())]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        L = ("layers", i)
        specs += [
            ParamSpec(L + ("input_layernorm", "weight"), (p + "input_layernorm.weight",), (D,),
                      *_ident()),
            ParamSpec(L + ("post_attention_layernorm", "weight"),
                      (p + "post_attention_layernorm.weight",), (D,), *_ident()),
            ParamSpec(L + ("attn", "q_proj"), (p + "self_attn.q_proj.weight",), (N * H, D),
                      *_linear((N, H))),
            ParamSpec(L + ("attn", "k_proj"), (p + "self_attn.k_proj.weight",), (K * H, D),
                      *_linear((K, H))),
            ParamSpec(L + ("attn", "v_proj"), (p + "self_attn.v_proj.weight",), (K * H, D),
                      *_linear((K, H))),
            ParamSpec(L + ("attn", "o_proj"), (p + "self_attn.o_proj.weight",), (D, N * H),
                      *_linear_in_split((N, H))),
            ParamSpec(L + ("attn", "q_norm", "weight"), (p + "self_attn.q_norm.weight",), (H,),
                      *_ident()),
            ParamSpec(L + ("attn", "k_norm", "weight"), (p + "self_attn.k_norm.weight",), (H,),
                      *_ident()),
        ]
        if cfg.layer_is_moe(i):
            E, F = cfg.num_experts, cfg.moe_intermediate_size
            specs.append(ParamSpec(L + ("mlp", "router"), (p + "mlp.gate.weight",), (E, D),
                                   *_linear((E,))))
            for ours, hf, shape in (("gate_proj", "gate_proj", (F, D)),
                                    ("up_proj", "up_proj", (F, D)),
                                    ("down_proj", "down_proj", (D, F))):
                names = tuple(f"{p}mlp.experts.{e}.{hf}.weight" for e in range(E))
                specs.append(ParamSpec(L + ("mlp", ours), names, shape, *_experts()))
        else:
            F = cfg.intermediate_size
            specs += [
                ParamSpec(L + ("mlp", "gate_proj"), (p + "mlp.gate_proj.weight",), (F, D),
                          *_linear((F,))),
                ParamSpec(L + ("mlp", "up_proj"), (p + "mlp.up_proj.weight",), (F, D),
                          *_linear((F,))),
                ParamSpec(L + ("mlp", "down_proj"), (p + "mlp.down_proj.weight",), (D, F),
                          *_linear((D,))),
            ]
    specs.append(ParamSpec(("norm", "weight"), ("model.norm.weight",), (D,), *_ident()))
    if not cfg.tie_word_embeddings:
        specs.append(ParamSpec(("lm_head",), ("lm_head.weight",), (cfg.vocab_size, D),
                               *_linear((cfg.vocab_size,))))
    return specs


# --------------------------------------------------------------------------------------
# safetensors reading (header + memmap; handles bf16 without a framework)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in file
    end: int


def _read_header(file: Path) -> dict[str, _TensorInfo]:
    try:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{file}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            size = os.fstat(f.fileno()).st_size
            if n > size - 8:
                raise CheckpointError(f"{file}: bad safetensors header length {n}")
            header = json.loads(f.read(n))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{file}: cannot read safetensors header: {e}") from e
    out = {}
    base = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            s, e = info["data_offsets"]
            out[name] = _TensorInfo(file, info["dtype"], tuple(info["shape"]), base + s, base + e)
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{file}: bad header entry for {name!r}") from err
        if base + e > size:
            raise CheckpointError(f"{file}: tensor {name!r} extends past the end of file")
    return out


def read_safetensors_index(path: str | os.PathLike) -> dict[str, _TensorInfo]:
    """HF tensor name -> location, from ``model.safetensors`` or the sharded index.

    Reads only the headers. Raises:
        CheckpointError: naming the file: no safetensors, a broken index, a truncated file or
            header, a bad header entry.
    """
    path = Path(path)
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            data = json.loads(index.read_bytes().decode("utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"broken index {index}: {e}") from e
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"broken index {index}: no 'weight_map' dict")
        files = sorted(set(wm.values()))
        missing_files = [f for f in files if not (path / f).is_file()]
        if missing_files:
            raise CheckpointError(f"broken index {index}: shard file(s) not found: "
                                  f"{missing_files}")
        headers = {f: _read_header(path / f) for f in files}
        out: dict[str, _TensorInfo] = {}
        misplaced = []
        for name, f in wm.items():
            if name not in headers[f]:
                misplaced.append(f"{name} (index says {f})")
            else:
                out[name] = headers[f][name]
        if misplaced:
            raise CheckpointError(f"broken index {index}: tensors not in the file the "
                                  f"index names: {misplaced}")
        # tensors present in a shard but absent from the index are unexpected
        for f, h in headers.items():
            for name, info in h.items():
                if name not in wm:
                    out.setdefault(name, info)
        return out
    if single.exists():
        return _read_header(single)
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _load_np(info: _TensorInfo) -> np.ndarray:
    dt = SAFE_DTYPES[info.dtype]
    count = math.prod(info.shape)
    if info.end - info.start != count * dt.itemsize:
        raise CheckpointError(f"{info.file}: byte size of a tensor does not match its "
                              f"shape {info.shape} and dtype {info.dtype}")
    if count == 0:
        return np.zeros(info.shape, dt)
    mm = np.memmap(info.file, dtype=dt, mode="r", offset=info.start, shape=info.shape)
    return np.asarray(mm)


# --------------------------------------------------------------------------------------
# load / save
# --------------------------------------------------------------------------------------


def load_config(path: str | os.PathLike) -> Qwen3Config:
    """The :class:`Qwen3Config` of ``path/config.json``.

    Raises:
        CheckpointError: naming the file: unreadable, not UTF-8 JSON, not an object, or a
            field we do not implement.
    """
    f = Path(path) / "config.json"
    try:
        d = json.loads(f.read_bytes().decode("utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {f}: {e}") from e
    if not isinstance(d, dict):
        raise CheckpointError(f"{f}: must hold a JSON object, got {type(d).__name__}")
    try:
        return Qwen3Config.from_hf(d)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{f}: {e}") from e


def check_tensors(cfg: Qwen3Config, tensors: dict[str, _TensorInfo]) -> list[ParamSpec]:
    """Validate the file's tensors against the config; raise one CheckpointError listing
    every problem by HF name."""
    specs = hf_param_specs(cfg)
    expected: dict[str, tuple[int, ...]] = {}
    for s in specs:
        for n in s.hf_names:
            expected[n] = s.hf_shape
    missing = sorted(n for n in expected if n not in tensors)
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = sorted(n for n in tensors if n not in expected and n not in ignorable)
    wrong_shape = sorted(f"{n}: file {list(tensors[n].shape)}, expected {list(shp)}"
                         for n, shp in expected.items()
                         if n in tensors and tensors[n].shape != shp)
    wrong_dtype = sorted(f"{n}: {tensors[n].dtype} (expected one of {sorted(SAFE_DTYPES)})"
                         for n in expected if n in tensors and tensors[n].dtype not in SAFE_DTYPES)
    if missing or unexpected or wrong_shape or wrong_dtype:
        parts = []
        for title, items in (("missing", missing), ("unexpected", unexpected),
                             ("wrong shape", wrong_shape), ("wrong dtype", wrong_dtype)):
            if items:
                more = f", ... ({len(items) - 6} more)" if len(items) > 6 else ""
                parts.append(f"{title} ({len(items)}): " + ", ".join(items[:6]) + more)
        raise CheckpointError("checkpoint does not match config: " + "; ".join(parts))
    return specs


def _get_var(model: nnx.Module, path: tuple[Any, ...]) -> nnx.Variable:
    node: Any = model
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    return node


def _locate(model: nnx.Module, path: tuple[Any, ...]) -> tuple[tuple[Any, ...], int | None]:
    """A ParamSpec path (unrolled layout, ``("layers", i, ...)``) -> (the model's variable path,
    the layer index into its leading axis or None). With ``model.scan_layers`` the decoder
    params are stacked [L, ...] under ``("layers", ...)``."""
    if getattr(model, "scan_layers", False) and path[:1] == ("layers",):
        return ("layers",) + tuple(path[2:]), int(path[1])
    return tuple(path), None


def load_pretrained(path: str | os.PathLike, *, dtype=jnp.float32, mesh=None,
                    config: Qwen3Config | None = None, **model_kw
                    ) -> tuple[Qwen3ForCausalLM, Qwen3Config]:
    """Load an HF Qwen3 / Qwen3-MoE checkpoint folder.

    ``dtype`` is the param and compute dtype (override compute with ``model_kw['dtype']``).
    With ``mesh`` each param is placed directly with its NamedSharding from the logical-axis
    rules (no full copy on one device). ``model_kw`` go to ``Qwen3ForCausalLM`` (e.g.
    ``moe``, ``scan_layers``: HF's per-layer tensors ``model.layers.{i}.*`` are then
    stacked on the leading ``layers`` axis). Returns ``(model, config)``.
    """
    path = Path(path)
    cfg = config if config is not None else load_config(path)
    tensors = read_safetensors_index(path)
    specs = check_tensors(cfg, tensors)

    kw = dict(dtype=dtype, param_dtype=dtype)
    kw.update(model_kw)
    model = nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), **kw))
    shardings = None
    if mesh is not None:
        shardings = state_shardings(nnx.state(model), mesh)
    target = np.dtype(jnp.dtype(kw["param_dtype"]))
    L = cfg.num_hidden_layers
    pending: dict[tuple[Any, ...], list] = {}  # stacked var path -> per-layer arrays
    for s in specs:
        var_path, layer = _locate(model, s.path)
        var = _get_var(model, var_path)
        arr = s.to_ours([_load_np(tensors[n]) for n in s.hf_names]).astype(target)
        if layer is not None:
            pending.setdefault(var_path, [None] * L)[layer] = arr
            if any(a is None for a in pending[var_path]):
                continue
            arr = np.stack(pending.pop(var_path))
        abstract = var.get_value()
        if arr.shape != tuple(abstract.shape):  # guarded by check_tensors; defensive
            raise CheckpointError(f"{s.hf_names[0]}: converted shape {arr.shape} != "
                                  f"{abstract.shape}")
        if shardings is not None:
            sh = shardings
            for k in var_path:
                sh = sh[k]
            sh = sh.get_value() if isinstance(sh, nnx.Variable) else sh
            value = jax.device_put(arr, sh)
        else:
            value = jnp.asarray(arr)
        var.set_value(value)
    leftover = [p for p, v in nnx.iter_graph(model)
                if isinstance(v, nnx.Variable) and isinstance(v.get_value(), jax.ShapeDtypeStruct)]
    if leftover:  # every param must come from the file
        raise CheckpointError(f"params not filled from the checkpoint: {leftover}")
    return model, cfg


def _write_safetensors(file: Path, tensors: dict[str, np.ndarray]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, a in tensors.items():
        nbytes = a.nbytes
        header[name] = {"dtype": _DTYPE_TO_SAFE[a.dtype], "shape": list(a.shape),
                        "data_offsets": [off, off + nbytes]}
        off += nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    tmp = file.with_suffix(file.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())
    os.replace(tmp, file)


def save_pretrained(model: Qwen3ForCausalLM, config: Qwen3Config | None,
                    path: str | os.PathLike, *, dtype=None,
                    max_shard_bytes: int = 5 * 2**30) -> None:
    """Write ``config.json`` and the weights in HF layout (per-expert hub names).

    ``dtype``: storage dtype (default: the params' dtype). More than ``max_shard_bytes``
    of tensors are split into ``model-0000i-of-0000n.safetensors`` plus an index.
    """
    cfg = config if config is not None else model.config
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    specs = hf_param_specs(cfg)
    out_dt = None if dtype is None else np.dtype(jnp.dtype(dtype))
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for s in specs:
        var_path, layer = _locate(model, s.path)
        x = np.asarray(jax.device_get(_get_var(model, var_path).get_value()))
        if layer is not None:
            x = x[layer]
        if out_dt is not None:
            x = x.astype(out_dt)
        if x.dtype not in _DTYPE_TO_SAFE:
            x = x.astype(np.float32)
        for name, a in zip(s.hf_names, s.to_hf(x)):
            if size and size + a.nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = a
            size += a.nbytes
    stored = next(iter(shards[0].values())).dtype
    hf = cfg.to_hf()
    hf["dtype"] = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
                   np.dtype(ml_dtypes.bfloat16): "bfloat16",
                   np.dtype(np.float64): "float64"}[stored]
    for old in list(path.glob("model*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        old.unlink()
    if len(shards) == 1:
        _write_safetensors(path / "model.safetensors", shards[0])
    else:
        n = len(shards)
        wm = {}
        total = 0
        for i, sh in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            _write_safetensors(path / fname, sh)
            for name, a in sh.items():
                wm[name] = fname
                total += a.nbytes
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": wm}, indent=2))
    (path / "config.json").write_text(json.dumps(hf, indent=2))
