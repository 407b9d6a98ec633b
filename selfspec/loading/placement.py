"""Models larger than one device: weights spread over GPUs, the CPU and disk with accelerate.

The runner calls a decoder layer's parts one by one (norm, attention, norm, MLP) so that a draft
can skip some of them; accelerate moves inputs to a module's device (and loads offloaded
weights) only when that module itself is called. So the device map is made at that grain:
every direct child of every decoder layer, and the embedding, rotary embedding, final norm and
head, filled in order onto the devices of ``max_memory`` (as accelerate's "auto" does for
whole layers). Whatever is left over goes to disk. Draft and verify passes then run each
sublayer where its weights live; the KV cache of a layer lives on its attention's device.
"""

from __future__ import annotations

from pathlib import Path

from selfspec.errors import SelfSpecError

DISK = "disk"


def parse_max_memory(text: str) -> dict:
    """``"0=10GiB,cpu=30GiB"`` -> {0: bytes, "cpu": bytes}, in the order given."""
    from accelerate.utils import convert_file_size_to_int

    budget: dict = {}
    for part in text.split(","):
        device, _, size = part.strip().partition("=")
        device = device.strip()
        if not device or not size:
            raise SelfSpecError(
                f"--max-memory '{text}': each entry is DEVICE=SIZE, e.g. 0=10GiB,cpu=2GiB"
            )
        key = int(device) if device.isdigit() else device
        if key not in ("cpu", DISK) and not isinstance(key, int):
            raise SelfSpecError(
                f"--max-memory '{text}': device '{device}' is not a GPU number, cpu or disk"
            )
        size = size.strip()
        try:
            budget[key] = int(size) if size.isdigit() else convert_file_size_to_int(size)
        except ValueError:
            raise SelfSpecError(
                f"--max-memory '{text}': '{size}' is not a size (use e.g. 300MB or 2GiB)"
            ) from None
    return budget


def check_max_memory(max_memory) -> dict:
    """A max_memory mapping (device -> bytes or size text) checked, sizes in bytes."""
    if isinstance(max_memory, str):
        return parse_max_memory(max_memory)
    if not isinstance(max_memory, dict) or not max_memory:
        raise SelfSpecError(
            f"max_memory must be a mapping of device to size, e.g. {{0: '10GiB', 'cpu': '2GiB'}}; "
            f"got {max_memory!r}"
        )
    text = ",".join(f"{device}={size}" for device, size in max_memory.items())
    return parse_max_memory(text)


def _units(model) -> list[str]:
    """Module names in execution order, at the grain the runner calls them."""
    decoder_name = next(n for n, m in model.named_modules() if m is model.model)
    units = []
    for name, _ in model.model.named_children():
        if name != "layers":
            units.append(f"{decoder_name}.{name}")
    for i, layer in enumerate(model.model.layers):
        units += [f"{decoder_name}.layers.{i}.{child}" for child, _ in layer.named_children()]
    units += [n for n, _ in model.named_children() if n != decoder_name]
    return units


def sublayer_device_map(model, max_memory: dict) -> dict:
    """Module name -> device, filling the devices of ``max_memory`` in order; the rest to disk.
    ``model`` may live on the meta device (only sizes are read)."""
    from accelerate.utils import compute_module_sizes

    sizes = compute_module_sizes(model)
    devices = [(d, room) for d, room in max_memory.items() if d != DISK]
    device_map, slot, used = {}, 0, 0
    for unit in _units(model):
        size = sizes.get(unit, 0)
        while slot < len(devices) and used + size > devices[slot][1]:
            slot, used = slot + 1, 0
        device_map[unit] = devices[slot][0] if slot < len(devices) else DISK
        if unit.endswith("embed_tokens") and device_map[unit] == DISK:
            device_map[unit] = "cpu"  # rows are looked up, never streamed: keep it in memory
        used += size
    head = next((u for u in device_map if u.endswith("lm_head")), None)
    embed = next((u for u in device_map if u.endswith("embed_tokens")), None)
    if head and embed and getattr(model.config, "tie_word_embeddings", False):
        device_map[head] = device_map[embed]  # one tensor: it cannot live in two places
    return device_map


def load_split(folder: str, dtype, max_memory: dict, offload_folder: Path):
    """The model from ``folder`` spread over ``max_memory``'s devices (and disk)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from selfspec.runtime.adapters import attention_implementation

    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
    device_map = sublayer_device_map(skeleton, max_memory)
    offload_folder.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=dtype,
        attn_implementation=attention_implementation(config),
        device_map=device_map,
        offload_folder=str(offload_folder),
    )
    return model, device_map


def execution_device(device_map: dict, suffix: str):
    """The torch device that runs the first module whose name ends with ``suffix`` (disk-offloaded
    modules run on the CPU)."""
    import torch

    device = next(d for name, d in device_map.items() if name.endswith(suffix))
    if device in ("cpu", DISK):
        return torch.device("cpu")
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
