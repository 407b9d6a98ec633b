"""Each quantized linear layer of the 1.5B timed alone over a pass of ROWS rows (stop 48).

    python linears.py SPEED [ROWS]

Prints, by layout (format 2: Q4_K nibbles, 3: Q6_K six bits; group) and layer name: the sum of
each layer's median of 15 calls, its weights, and ns a weight (both threads).
"""

import collections
import statistics
import sys
import time

import torch

from selfspec.engine import Engine
from selfspec.quantized import QuantLinear


def median_ms(module, x) -> float:
    module(x)
    times = []
    for _ in range(15):
        began = time.perf_counter()
        module(x)
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1000


def main() -> None:
    speed, rows = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
    engine = Engine.load("qwen2.5-coder-1.5b", device="cpu", dtype=torch.float32, speed=speed)
    ms, count, weights = (
        collections.defaultdict(float),
        collections.Counter(),
        collections.Counter(),
    )
    for name, module in engine.loaded.model.named_modules():
        if isinstance(module, QuantLinear):
            key = (module.format, module.group, name.split(".")[-1])
            ms[key] += median_ms(module, torch.randn(rows, module.in_features))
            count[key] += 1
            weights[key] += module.in_features * module.out_features
    for key in sorted(ms, key=lambda k: -ms[k]):
        per_weight = ms[key] * 1e6 / weights[key]
        print(
            key,
            count[key],
            f"{ms[key]:.2f} ms, {weights[key] / 1e6:.0f}M weights, {per_weight:.3f} ns",
        )
    print(f"all: {sum(ms.values()):.1f} ms")


if __name__ == "__main__":
    main()
