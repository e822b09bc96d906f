"""Hugging Face checkpoint layout: config.json, sharded safetensors and their index.

`Checkpoint.open(path)` accepts a directory (config.json + *.safetensors, optionally
model.safetensors.index.json) or a single .safetensors file (a config.json beside it is used).
Only headers are read; `Checkpoint.read(name)` maps tensor data on demand.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from quantkit.errors import InvalidInput
from quantkit.formats.safetensors_io import SafetensorsFile, TensorInfo

INDEX_NAME = "model.safetensors.index.json"


def read_json(path: Path) -> dict:
    """Reads a JSON object from `path`; any problem is one InvalidInput line naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise InvalidInput(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise InvalidInput(f"{path}: not UTF-8 text") from None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InvalidInput(f"{path}: not valid JSON: {str(e)[:200]}") from None
    if not isinstance(value, dict):
        raise InvalidInput(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def _shard_path(root: Path, name: object, index: Path) -> Path:
    """Resolves a shard file named by the index, refusing anything that leaves `root`."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise InvalidInput(f"{index}: weight_map names an invalid shard file {name!r}")
    candidate = Path(name)
    resolved = (root / candidate).resolve()
    if candidate.is_absolute() or not resolved.is_relative_to(root.resolve()):
        raise InvalidInput(
            f"{index}: shard {name!r} points outside the checkpoint directory {root}; refusing to read it"
        )
    if not resolved.is_file():
        raise InvalidInput(f"{index}: shard {name!r} named in weight_map does not exist in {root}")
    return resolved


@dataclass
class Checkpoint:
    """Headers of every shard of one checkpoint, plus its config.json (or None).

    Attributes:
        root: the checkpoint directory (the file's directory for a single file).
        config: parsed config.json, or None when there is none.
        files: the shards, in order.
        tensors: tensor name -> TensorInfo across all shards.
    """

    root: Path
    config: dict | None
    files: list[SafetensorsFile]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # tensors that exist by name only (formats/gpt_oss.py): name -> read(checkpoint) -> array
    virtual: dict = field(default_factory=dict)
    hidden: dict[str, TensorInfo] = field(default_factory=dict)  # stored tensors the virtual ones are read from
    native: dict | None = None  # the layout it was read from when not the Hugging Face / compressed-tensors one

    @classmethod
    def open(cls, path: str | Path, dequantize_native: bool = False) -> "Checkpoint":
        """dequantize_native: a gpt-oss MXFP4 checkpoint's experts as bf16 weights (formats/gpt_oss.py)."""
        path = Path(path)
        if path.is_file():
            if path.suffix != ".safetensors":
                raise InvalidInput(f"{path}: expected a checkpoint directory or a .safetensors file")
            root, shard_paths, index = path.parent, [path], None
        elif path.is_dir():
            root = path
            index = path / INDEX_NAME
            if index.is_file():
                weight_map = read_json(index).get("weight_map")
                if not isinstance(weight_map, dict) or not weight_map:
                    raise InvalidInput(f"{index}: missing or empty 'weight_map' object")
                shard_paths = list(
                    dict.fromkeys(_shard_path(root, f, index) for f in weight_map.values())
                )
            else:
                index = None
                shard_paths = sorted(path.glob("*.safetensors"))
                if not shard_paths:
                    raise InvalidInput(
                        f"{path}: no .safetensors files (and no {INDEX_NAME}); is this a checkpoint directory?"
                    )
        else:
            raise InvalidInput(f"{path}: no such file or directory")

        config_path = root / "config.json"
        config = read_json(config_path) if config_path.is_file() else None
        ckpt = cls(root=root, config=config, files=[SafetensorsFile(p) for p in shard_paths])
        for f in ckpt.files:
            for name, info in f.tensors.items():
                if name in ckpt.tensors:
                    raise InvalidInput(
                        f"{f.path}: tensor {name!r} also appears in {ckpt.tensors[name].file.name}"
                    )
                ckpt.tensors[name] = info
        if index is not None:
            for name, shard in weight_map.items():
                info = ckpt.tensors.get(name)
                if info is None or info.file != _shard_path(root, shard, index):
                    raise InvalidInput(
                        f"{index}: weight_map puts tensor {name!r} in {shard}, but that shard does not hold it"
                    )
            unlisted = len(ckpt.tensors) - len(weight_map)
            if unlisted:
                ckpt.warnings.append(
                    f"{index}: {unlisted} tensor(s) present in shards are missing from weight_map"
                )
        from quantkit.formats import gpt_oss

        if gpt_oss.is_native(config, ckpt.tensors):
            gpt_oss.split_experts(ckpt, dequantize_native)
        return ckpt

    @property
    def bytes_on_disk(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """generation_config.json's eos_token_id (one id or a list), () without one: what generation stops on,
        before config.json's own."""
        gen = self.root / "generation_config.json"
        e = read_json(gen).get("eos_token_id") if gen.is_file() else None
        ids = tuple(e if isinstance(e, list) else [e] if e is not None else [])
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise InvalidInput(f"{gen}: eos_token_id must be a token id or a list of them, got {e!r}")
        return ids

    @property
    def architecture(self) -> str | None:
        cfg = self.config or {}
        archs = cfg.get("architectures")
        if isinstance(archs, list) and archs and isinstance(archs[0], str):
            return archs[0]
        model_type = cfg.get("model_type")
        return model_type if isinstance(model_type, str) else None

    def file_of(self, name: str) -> SafetensorsFile:
        if not hasattr(self, "_by_path"):  # read on every row chunk of convert: one dict lookup, not a scan
            self._by_path = {f.path: f for f in self.files}
        info = self.tensors.get(name) or self.hidden[name]
        return self._by_path[info.file]

    def read(self, name: str) -> np.ndarray:
        """Maps tensor `name` (see SafetensorsFile.read)."""
        if name in self.virtual:
            return self.virtual[name](self)
        return self.file_of(name).read(name)

    def read_rows(self, name: str, start: int, stop: int, flat: bool = False) -> np.ndarray:
        """Copies rows [start, stop) of tensor `name` (see SafetensorsFile.read_rows)."""
        if name in self.virtual:
            return np.array(self.virtual[name](self)[start:stop])
        return self.file_of(name).read_rows(name, start, stop, flat)


# ---- modules and what kind of layer each is -------------------------------------------------------

# Parameter names that belong to a module (compressed-tensors adds the quantization ones).
MODULE_PARAMS = frozenset({
    "weight", "bias", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
    "weight_global_scale", "input_scale", "input_zero_point", "input_global_scale", "output_scale",
    "output_zero_point", "k_scale", "v_scale", "q_scale",
})
EMBEDDING_NAMES = frozenset({"embed_tokens", "wte", "word_embeddings", "tok_embeddings", "embed_positions", "wpe",
                             "embeddings", "embedding"})


def group_modules(names) -> dict[str, dict[str, str]]:
    """Groups tensor names by module: {module: {param: tensor name}}.

    A tensor whose last component is not a known parameter (e.g. a fused expert tensor
    `mlp.experts.gate_up_proj`) is a module of its own, with the tensor as its "tensor" (never a Linear).
    """
    modules: dict[str, dict[str, str]] = {}
    for name in names:
        module, _, param = name.rpartition(".")
        if param not in MODULE_PARAMS or not module:
            module, param = name, "tensor"
        modules.setdefault(module, {})[param] = name
    return modules


def classify_module(name: str, params: dict) -> tuple[str, str | None]:
    """(kind, class name) of a module from its name and tensor shapes.

    kind is "linear" | "moe_experts" | "embedding" | "norm" | "other" (docs/cli.md); the class name
    ("Linear", "Embedding" or None) is what compressed-tensors class targets match.
    """
    main = params.get("weight_packed") or params.get("weight") or params.get("tensor")
    expert = ".experts." in f"{name}." and ".shared_expert" not in name
    if main is None:  # a quantized linear whose weight tensor is missing still reads as one
        if "weight_scale" in params or "weight_shape" in params:
            return ("moe_experts" if expert else "linear"), "Linear"
        return "other", None
    last = name.rsplit(".", 1)[-1]
    rank = len(main.shape)
    if last in EMBEDDING_NAMES:
        return "embedding", "Embedding"
    if rank <= 1 or "norm" in last or last.startswith("ln_"):
        return "norm", None
    if "tensor" not in params and (rank == 2 or (rank == 3 and "weight_packed" in params)):
        return ("moe_experts" if expert else "linear"), "Linear"
    if rank == 3 and expert:
        return "moe_experts", None
    return "other", None


_VISION = re.compile(r"(^|\.)(vision_tower|vision_model|visual|vision|image_encoder|image_newline|"
                     r"multi_modal_projector|mm_projector|audio_tower|audio_model|embed_vision|embed_audio)(\.|$)")

# Checkpoints that keep a layer's experts in 3-D tensors [experts, out, in] (transformers' Gemma 4 and Qwen3.5-MoE;
# Family.packed_experts): tensor name -> the per-expert Linears it holds, in order along its out axis. llm-compressor
# writes them as Linears `experts.{e}.{name}` (gate first: the first half of gate_up_proj).
PACKED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def packed_experts(module: str, shape: tuple[int, ...]) -> list[tuple[str, int, tuple[int, int]]]:
    """The per-expert Linears packed in 3-D tensor `module` (`...experts.gate_up_proj` [E, 2I, H]):
    (Linear name, first row in the tensor seen as [E * out, in], (out, in)) per expert and part."""
    root, _, last = module.rpartition(".")
    parts = PACKED_EXPERTS[last]
    e, out, inp = shape
    n = out // len(parts)
    return [(f"{root}.{x}.{name}", x * out + j * n, (n, inp)) for x in range(e) for j, name in enumerate(parts)]


def vision_root(name: str) -> str | None:
    """The vision/audio tower or projector component of a module name (e.g. "vision_tower"), if any."""
    m = _VISION.search(name)
    return m.group(2) if m else None


# Parts left unquantized as a whole, as llm-compressor's Qwen3.5 / Qwen3-Next recipes leave them: Gated DeltaNet
# projections (`linear_attn.in_proj_qkv`, ...: small, and their errors feed a recurrence) and the MTP head
_GROUPS = ((re.compile(r"(^|\.)linear_attn\."), "linear attention (Gated DeltaNet)", "re:.*linear_attn\\."),
           (re.compile(r"^mtp\."), "MTP head", "re:^mtp\\."))
GROUP_IGNORE = tuple(entry for _, _, entry in _GROUPS)  # what a converted config's `ignore` holds for them


def default_exclusion(name: str) -> str | None:
    """Why a Linear module is never quantized by default (None: it is quantized).

    lm_head (quality-sensitive), MoE router gates (tiny, precision-critical: Qwen-MoE/DeepSeek `mlp.gate`,
    Mixtral `block_sparse_moe.gate`, Qwen2-MoE and Qwen3.5 `shared_expert_gate`), vision/audio towers, Gated
    DeltaNet projections and the MTP head (Qwen3.5).
    """
    last = name.rsplit(".", 1)[-1]
    if last == "lm_head":
        return "lm_head"
    if last in ("gate", "router", "shared_expert_gate") or name.endswith(".router.proj"):  # Gemma 4: router.proj
        return "MoE router"
    if _VISION.search(name):
        return "vision/audio tower"
    return next((why for pattern, why, _ in _GROUPS if pattern.search(name)), None)


def exclusion_pattern(name: str) -> str | None:
    """The one `ignore` entry that covers a whole excluded part `name` belongs to (a tower, the GDN
    projections, the MTP head), or None when the module is listed by name."""
    root = vision_root(name)
    if root is not None:  # its in-memory names carry other prefixes than the checkpoint's
        return f"re:.*{root}\\."
    return next((entry for pattern, _, entry in _GROUPS if pattern.search(name)), None)
