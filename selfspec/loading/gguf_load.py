"""Load a GGUF model straight into the quantized layout of speed modes gguf and gguf-q8.

No float32 copy of the model is made. The model is built on the meta device (selfspec's own
skeleton for the fused families, ``selfspec.loading.skeleton``; else transformers' class under
accelerate's ``init_empty_weights``: modules whose parameters have no memory); its linear layers
become ``QuantLinear`` / ``Q8Linear`` panels; its embedding reads the file's rows as tokens come
(``QuantEmbedding``); the float32 tensors left (norms, biases) are read from the file through
transformers' own GGUF name map and per-family fixes (the same ones its GGUF loading applies).

The panels are built once per mode, a slice of rows at a time, into a cache entry inside the
model's entry (``panels-<mode>-v<layout>``), and mapped from there on later starts: the pages are
read from the page cache as the first pass touches them, so a start costs no repacking.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch
from torch import nn

from selfspec.errors import SelfSpecError
from selfspec.kernels import PANEL, load_kernel
from selfspec.loading.cache import MARKER_FILE, build_entry
from selfspec.loading.fetch import progress_bar
from selfspec.loading.gguf_reader import GGUFFile, GGUFTensor, read_gguf
from selfspec.loading.skeleton import CausalLM, build_skeleton
from selfspec.paths import cache_dir
from selfspec.runtime.adapters import adapter_for, attention_implementation
from selfspec.speed.blocks import dequantize
from selfspec.speed.quantized import (
    Q8Linear,
    QuantLinear,
    check_types,
    decode_rows,
    layer_type,
    linear_sources,
    swap_module,
)

PANELS_FILE = "panels.bin"
INDEX_FILE = "panels.json"
# of panels.pack's layout: entries of another version are not read (v1: Q4_1 with float32
# scales and offsets, 6 bits a weight; since v2 their float16 values, the file's 5)
LAYOUT_VERSION = 2
# gguf-q8 with Q6_K as six-bit panels, Q3_K as three-bit ones, Q2_K as two-bit ones, IQ4_XS,
# IQ4_NL and Q4_0 as nibbles of indices and Q5_K, Q5_0 and Q5_1 as five-bit panels (v10: Q2_K as
# Q8_0; v9: Q3_K as six-bit panels; v8: Q3_K as bytes; v7: Q5_0 as bytes, Q4_1 with float32
# scales and offsets; v6: IQ4_NL as bytes, Q4_0 with float scales and offsets; v4: Q6_K only)
Q8_LAYOUT_VERSION = 11
# gguf with Q6_K and Q3_K as six-bit panels (v1: as bytes; v5: Q4_1 wider; v6: Q3_K as bytes)
EXACT_SIX_BIT_LAYOUT_VERSION = 7


def layout_version(mode: str) -> int:
    """The panel layout version speed mode ``mode`` uses with this machine's kernel build."""
    if mode == "gguf-q8" and Q8Linear.wants_six_bits(load_kernel()):
        return Q8_LAYOUT_VERSION
    if mode == "gguf" and QuantLinear.wants_six_bits(load_kernel()):
        return EXACT_SIX_BIT_LAYOUT_VERSION
    return LAYOUT_VERSION


_ALIGN = 4096  # each layer's panels start on a page: the kernel's loads stay aligned
_CHUNK_ROWS = 4096  # rows decoded and packed at a time while building (a multiple of PANEL)


class QuantEmbedding(nn.Module):
    """The token embedding, read from the GGUF file's quantized rows as tokens come.

    Each row is the float32 value the file dequantizes to, which is exactly the float32 model's
    embedding; only the rows of tokens seen are read. The last ``KEPT_ROWS`` distinct rows read are
    kept decoded: a text's tokens repeat, and decoding one row per decoding step (numpy over the
    mapped file) cost more than the lookup."""

    KEPT_ROWS = 2048

    def __init__(self, tensor: GGUFTensor, embed_scale: torch.Tensor | None = None):
        super().__init__()
        self.tensor = tensor
        self.num_embeddings, self.embedding_dim = tensor.rows, tensor.columns
        self.register_buffer("embed_scale", embed_scale, persistent=False)  # gemma scales rows
        self.kept_rows: dict[int, torch.Tensor] = {}  # token id -> its decoded row
        self._lock = threading.Lock()  # a drafter's thread may embed beside a pass (profile)

    def _decode(self, flat: list[int]) -> torch.Tensor:
        rows = dequantize(self.tensor.gather_rows(flat), self.tensor.type_name, len(flat))
        return torch.from_numpy(np.ascontiguousarray(rows, np.float32))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The unscaled rows of ``ids`` (any shape) as float32 [n, embedding_dim]."""
        flat = ids.reshape(-1).tolist()
        with self._lock:
            kept = self.kept_rows
            missing = [t for t in dict.fromkeys(flat) if t not in kept]
            if len(missing) > self.KEPT_ROWS // 2:  # a long prompt: decoded at once, not kept
                return self._decode(flat)
            if len(kept) + len(missing) > self.KEPT_ROWS:
                kept.clear()  # then every id of this call is missing, the kept ones too
                missing = list(dict.fromkeys(flat))
            if missing:
                kept.update(zip(missing, self._decode(missing)))
            return torch.stack([kept[t] for t in flat])  # a copy: the model may change it

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.rows(ids).view(*ids.shape, self.embedding_dim).to(ids.device)
        return out * self.embed_scale.to(out.dtype) if self.embed_scale is not None else out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows={self.tensor.type_name} in file"


def load_quantized(
    folder: str | Path, gguf_path: Path, mode: str, own_skeleton: bool = False
) -> nn.Module:
    """The model whose config is in ``folder`` with ``gguf_path``'s weights in speed mode
    ``mode`` ("gguf" or "gguf-q8") layout, on the CPU, in eval mode. ``own_skeleton``: build it
    as selfspec's own module tree (``selfspec.loading.skeleton``, for the fused kernel layers only)
    where the family allows, instead of transformers' model class."""
    kernel = load_kernel()
    model = (build_skeleton(folder) if own_skeleton else None) or _skeleton(folder)
    gguf = read_gguf(gguf_path)
    sources = linear_sources(model, gguf.tensors, gguf_path, kernel)
    check_types(sources, relay=mode == "gguf-q8", gguf_path=gguf_path)
    _fill_float_tensors(model, gguf, skip={name for _, name, _ in sources} | {"token_embd.weight"})
    cls = Q8Linear if mode == "gguf-q8" else QuantLinear
    panels = _panels(Path(folder), mode, model, sources, cls)
    adapter = adapter_for(model)
    for module_name, gguf_name, tensor in sources:
        linear = model.get_submodule(module_name)
        data, layout = panels[module_name]
        bias = linear.bias.detach() if linear.bias is not None else None
        quant = cls(linear.in_features, linear.out_features, data, layout, bias, kernel)
        quant.source = (tensor, adapter.gguf_row_order(gguf_name, tensor.rows))
        swap_module(model, module_name, quant)
    _swap_embedding(model, gguf)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise SelfSpecError(
            f"{gguf_path.name} holds no weights for {', '.join(left[:3])} of the model; speed "
            f"mode {mode} cannot load it from this file. Use --speed packed."
        )
    return model.eval()


def _skeleton(folder: str | Path) -> nn.Module:
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights():  # parameters on the meta device; buffers (rotary) real
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=attention_implementation(config)
        )
    if (Path(folder) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model


def _fill_float_tensors(model: nn.Module, gguf: GGUFFile, skip: set[str]) -> None:
    """Give every parameter the file holds (except ``skip``'s) its float32 value, as transformers'
    GGUF loading would: llama.cpp's tensor names, and transformers' per-family fixes (gemma's
    norms, llama's q/k rows)."""
    from gguf import GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize

    params = dict(model.named_parameters())
    name_map = _gguf_names(model, gguf.architecture, params)
    own = isinstance(model, CausalLM)
    process = _own_processor(model) if own else _hf_processor(model, gguf, name_map)
    for name, tensor in gguf.tensors.items():
        # held by the file, not used by the model (as transformers skips it): not read at all (an
        # untied output.weight beside a tied head would cost a float32 copy of the vocabulary)
        if name in skip or name_map.get(name) not in params:
            continue
        # read, not mapped: mapped pages stay counted in the process's resident memory
        raw = tensor.read_rows(0, tensor.rows)
        weights = gguf_dequantize(raw, GGMLQuantizationType[tensor.type_name])
        weights, name = process(weights, name)
        param = params.get(name_map.get(name, ""))
        if param is None:
            continue
        value = np.array(weights, dtype=np.float32).reshape(param.shape)
        module_name, _, leaf = name_map[name].rpartition(".")
        module = model.get_submodule(module_name)
        module._parameters[leaf] = nn.Parameter(torch.from_numpy(value), requires_grad=False)


def _hf_processor(model: nn.Module, gguf: GGUFFile, name_map: dict):
    """transformers' per-family fix of one float tensor read from the file: (weights, the name
    to map it by; None for a tensor the model does not use)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(gguf.architecture, TensorProcessor)(
        config=model.config.to_dict()
    )

    def process(weights: np.ndarray, name: str) -> tuple:
        result = processor.process(
            weights=weights, name=name, tensor_key_mapping=name_map, parsed_parameters={}
        )
        return result.weights, result.name

    return process


def _own_processor(model: nn.Module):
    """The fused families' one fix, for selfspec's own skeleton: llama's q/k rows (a bias here:
    the weights are quantized) back in the model's order."""
    adapter = adapter_for(model)

    def process(weights: np.ndarray, name: str) -> tuple:
        order = adapter.gguf_row_order(name, weights.shape[0])
        return (weights if order is None else weights[order]), name

    return process


def _gguf_names(model: nn.Module, architecture: str | None, params: dict) -> dict[str, str]:
    """{GGUF tensor name: parameter name}, from gguf's own table of each family's names (what
    transformers' get_gguf_hf_weights_map does, without rebuilding the table per submodule)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((k for k, v in MODEL_ARCH_NAMES.items() if v == architecture), None)
    if arch is None:
        raise SelfSpecError(
            f"gguf does not know the architecture '{architecture}' of this file; speed modes gguf "
            "and gguf-q8 cannot load it. Use --speed packed."
        )
    table = get_tensor_name_map(arch, model.config.num_hidden_layers)
    names = {}
    for hf_name in params:
        module_name, _, suffix = hf_name.rpartition(".")
        gguf_name = table.get_name(module_name)
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = hf_name
    return names


def _swap_embedding(model: nn.Module, gguf: GGUFFile) -> None:
    old = model.get_input_embeddings()
    tensor = gguf.tensors.get("token_embd.weight")
    if tensor is None or (tensor.rows, tensor.columns) != tuple(old.weight.shape):
        raise SelfSpecError(
            "the GGUF file has no token_embd.weight of the model's shape; use --speed packed."
        )
    model.set_input_embeddings(QuantEmbedding(tensor, getattr(old, "embed_scale", None)))


def _panels(folder: Path, mode: str, model: nn.Module, sources: list, cls) -> dict:
    """{module name: (panels, layout)}: mapped from the model's panel entry, built first if it is
    not there. A model outside selfspec's cache, or in a cache this process cannot write, gets
    its panels built into a temporary folder instead (kept only while mapped)."""

    def build(out: Path) -> None:
        build_panels(model, sources, cls, out)
        (out / MARKER_FILE).write_text(json.dumps({"layout": layout_version(mode)}))

    if folder.resolve().is_relative_to(cache_dir().resolve()):
        entry = folder / f"panels-{mode}-v{layout_version(mode)}"
        label = f"{mode} panels of {folder.name}"
        with contextlib.suppress(OSError):  # read-only: the lock, staging or publishing failed
            lock = f"{folder.name}-{entry.name}"
            mapped = _map_panels(build_entry(entry, label, build, lock=lock))
            for older in folder.glob(f"panels-{mode}-v*"):  # an older layout's, never read again
                if older.name != entry.name:
                    shutil.rmtree(older, ignore_errors=True)  # a process mapping it keeps its copy
            return mapped
    with tempfile.TemporaryDirectory(prefix="selfspec-panels-") as work:
        build_panels(model, sources, cls, Path(work))
        return _map_panels(Path(work))  # the mapping outlives the files


def build_panels(model: nn.Module, sources: list, cls, out: Path) -> None:
    """Decode and lay out every layer, a slice of rows at a time, appending to one file: memory
    holds one slice, not the model."""
    index = {}
    kernel = load_kernel()
    bar = progress_bar(len(sources), "laying out quantized weights", unit="layer")
    with open(out / PANELS_FILE, "wb") as fh:
        for module_name, _, tensor in sources:
            index[module_name] = _append_panels(fh, model, tensor, cls, kernel)
            bar.update(1)
    bar.close()
    (out / INDEX_FILE).write_text(json.dumps(index))


def _append_panels(fh, model: nn.Module, tensor: GGUFTensor, cls, kernel) -> dict:
    """``tensor`` laid out for ``cls`` at the end of ``fh``, page-aligned: where, and its layout
    (kernel format, group size, the file's type name)."""
    fh.write(b"\0" * (-fh.tell() % _ALIGN))
    offset = fh.tell()
    for first in range(0, tensor.rows, _CHUNK_ROWS):
        last = min(tensor.rows, first + _CHUNK_ROWS)
        decoded = decode_rows(model, tensor, first, last, relay=cls.vnni)
        panels, format, group = cls.lay_out(decoded, tensor.type_name, kernel)
        panels.numpy().tofile(fh)
    where = {"offset": offset, "bytes": fh.tell() - offset, "panels": tensor.rows // PANEL}
    return {**where, "layout": [format, group, layer_type(tensor.type_name, cls.vnni)]}


def _map_panels(entry: Path) -> dict:
    index = json.loads((entry / INDEX_FILE).read_text())
    path = entry / PANELS_FILE
    storage = torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)

    def view(r: dict) -> torch.Tensor:
        return storage[r["offset"] : r["offset"] + r["bytes"]].view(r["panels"], -1)

    return {name: (view(r), tuple(r["layout"])) for name, r in index.items()}
