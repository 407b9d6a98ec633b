"""The paired loop of ``vocab.py`` and ``costs_fit.py``: for each Spec-Bench prompt (``--limit
2``, 128 tokens), plain decoding, then two drafters in alternating order; after each of two
repeats, the running medians of the per-run ratios of decode tokens/s (after the first token)."""

import statistics


def decode_rate(result) -> float:
    return (len(result.token_ids) - 1) / (result.stats.seconds - result.stats.prefill_seconds)


def compare(engine, new, old, new_label: str, old_label: str, repeats: int = 2) -> None:
    from selfspec.prompts import load_prompts

    ratios, new_speedups, old_speedups = [], [], []
    prompts = load_prompts("spec-bench", 2)
    for rep in range(repeats):
        for i, prompt in enumerate(prompts):
            ids = engine.encode(prompt.text, chat=True)
            pair = [("new", new), ("old", old)]
            order = pair if (i + rep) % 2 == 0 else pair[::-1]
            plain = engine.generate(ids, None, max_new_tokens=128)
            rates = {}
            for name, drafter in order:
                result = engine.generate(ids, drafter, max_new_tokens=128)
                assert result.token_ids == plain.token_ids
                rates[name] = decode_rate(result)
            ratios.append(rates["new"] / rates["old"])
            new_speedups.append(rates["new"] / decode_rate(plain))
            old_speedups.append(rates["old"] / decode_rate(plain))
        print(
            "rep",
            rep,
            f"median {new_label}/{old_label} {statistics.median(ratios):.3f}; speedups "
            f"{new_label} {statistics.median(new_speedups):.3f} "
            f"{old_label} {statistics.median(old_speedups):.3f}",
            flush=True,
        )
