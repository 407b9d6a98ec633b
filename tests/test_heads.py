"""Draft heads (selfspec.drafters.heads) and their training (selfspec.training.heads): the drafts
stay lossless, the heads learn something real, files fail clearly, and training resumes."""

from __future__ import annotations

import json

import pytest
import torch
from test_sampling import assert_keeps_target_distribution, drafted_second_token_counts

from selfspec.drafters.adaptive import AdaptiveDrafter
from selfspec.drafters.base import DraftRequest, DraftSettings, RoundOutcome
from selfspec.drafters.heads import DraftHeads, HeadDrafter, fastest_products
from selfspec.errors import SelfSpecError
from selfspec.runtime.sampling import Sampling
from selfspec.training.answers import BATCH, generate_answers
from selfspec.training.fit import frequent_ids
from selfspec.training.heads import features, train_heads


def random_heads(size: int, count: int, vocab_prefix: int, scale: float = 0.5) -> DraftHeads:
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(size, 2 * size, generator=g) * scale / size**0.5 for _ in range(count)]
    biases = [torch.randn(size, generator=g) * scale for _ in range(count)]
    return DraftHeads(weights, biases, {"vocab_prefix": vocab_prefix})


def test_heads_file_round_trip_and_clear_errors(tmp_path):
    heads = random_heads(16, 2, 32)
    path = tmp_path / "heads.safetensors"
    heads.save(path)
    back = DraftHeads.load(path, hidden_size=16)
    assert len(back) == 2 and back.vocab_prefix == 32
    assert back.frequent is None and back.draft_vocab(100) == 32  # files from before frequencies
    heads.frequent = frequent_ids(torch.tensor([9, 4, 9, -1, 4, 9, 2]), 12)
    assert heads.frequent.tolist()[:6] == [9, 4, 2, 0, 1, 3]  # by count, then the lowest ids
    heads.save(path)
    back = DraftHeads.load(path, hidden_size=16)
    assert torch.equal(back.frequent, heads.frequent)
    assert back.draft_vocab(9).tolist() == [4, 2, 0, 1, 3, 5, 6, 7, 8]  # ids past the vocabulary go
    for a, b in zip(heads.weights + heads.biases, back.weights + back.biases):
        assert torch.allclose(a, b, atol=1e-2)  # stored as float16
    with pytest.raises(SelfSpecError, match="hidden size 16, this model has 64"):
        DraftHeads.load(path, hidden_size=64)
    with pytest.raises(SelfSpecError, match="does not exist"):
        DraftHeads.load(tmp_path / "missing.safetensors")
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(path.read_bytes()[:100])
    with pytest.raises(SelfSpecError, match="train them again"):
        DraftHeads.load(broken)


def test_two_layer_heads_start_as_the_one_layer_heads_and_round_trip(tmp_path):
    """Heads of two layers made from one-layer heads compute the same chain (D = I, d = 0); once
    trained apart, they are saved and loaded as heads of two layers, and the drafter runs them."""
    heads = random_heads(16, 2, 32)
    two = heads.two_layers()
    assert heads.layers == 1 and two.layers == 2 and two.hidden_size == 16
    state, token = torch.randn(3, 16), torch.randn(3, 16)
    for one_step, two_step in zip(heads.steps(), two.steps()):
        assert torch.allclose(one_step(state, token), two_step(state, token), atol=1e-6)
    two.downs = [d + 0.1 * torch.randn_like(d) for d in two.downs]
    two.down_biases = [b + 0.1 for b in two.down_biases]
    assert not torch.allclose(heads.steps()[0](state, token), two.steps()[0](state, token))
    path = tmp_path / "two.safetensors"
    two.save(path)
    back = DraftHeads.load(path, hidden_size=16)
    assert back.layers == 2 and len(back) == 2 and "two layers" in back.describe()
    for a, b in zip(two.downs + two.down_biases, back.downs + back.down_biases):
        assert torch.allclose(a, b, atol=1e-2)  # stored as float16
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    del tensors["head.1.down.bias"]
    save_file(tensors, tmp_path / "cut.safetensors", metadata={"format": "selfspec-draft-heads/3"})
    with pytest.raises(SelfSpecError, match="lack the tensor 'head.1.down.bias'"):
        DraftHeads.load(tmp_path / "cut.safetensors")
    products, downs = fastest_products(back, torch.device("cpu"))
    x = torch.randn(2, 16)
    assert torch.allclose(downs[1](x).float(), x @ back.downs[1].T + back.down_biases[1], atol=0.05)


def test_the_soft_loss_reads_the_row_that_made_each_token_within_its_answer():
    """Head j's soft target at row i is the model's distribution from row i + 1 + j, only where
    that row is of the same answer; other rows get none (here: logits that equal the target give
    the target's entropy, and a row from another answer would change it)."""
    from selfspec.training.fit import initial_heads, soft_loss

    out = torch.eye(4)  # logits = the hidden state itself
    hidden = torch.tensor([[3.0, 0, 0, 0], [0, 3.0, 0, 0], [0, 0, 3.0, 0], [0, 0, 0, 3.0]])
    owner = torch.tensor([0, 0, 1, 1])  # rows 0-1 one answer, rows 2-3 another
    rows = torch.tensor([0, 1, 2])
    logits = hidden[rows + 1]  # what a perfect head 0 would give
    target = torch.softmax(hidden[[1, 3]], -1)  # rows 0 and 2 only: row 1's next is row 2's answer
    entropy = -(target * target.log()).sum(-1).mean()
    assert torch.allclose(soft_loss(logits, hidden, owner, rows, 0, out), entropy)
    assert float(soft_loss(logits[:2], hidden, owner, torch.tensor([1, 3]), 0, out)) == 0.0
    with pytest.raises(SelfSpecError, match="cannot start from heads of two"):
        initial_heads(random_heads(16, 2, 32).two_layers(), 2, 16, "cpu", layers=1)


@pytest.fixture(scope="module")
def peaked_tiny(tiny_llama, sharpened_head):
    with sharpened_head(tiny_llama, 60.0):
        yield tiny_llama


@pytest.mark.slow  # thousands of seeded generations
def test_sampling_with_head_drafts_matches_target(peaked_tiny, monkeypatch):
    """Head drafts (here random heads over part of the vocabulary, so q differs from p) leave the
    target's distribution; a broken acceptance rule is caught by the same test."""
    engine = peaked_tiny
    prompt = [5, 17, 33, 2]
    sampling = Sampling(temperature=4.0)
    drafter = HeadDrafter(engine.runner, random_heads(64, 2, 40))
    assert_keeps_target_distribution(
        engine,
        prompt,
        sampling,
        lambda: drafted_second_token_counts(engine, prompt, sampling, drafter, 1500),
        monkeypatch,
    )


def test_a_head_drafter_keeps_the_heads_shapes_and_figures_not_their_numbers(tiny_llama):
    heads = random_heads(64, 2, 40)
    drafter = HeadDrafter(tiny_llama.runner, heads)
    assert len(drafter.heads) == 2 and drafter.heads.hidden_size == 64
    assert all(t.is_meta for t in drafter.heads.weights + drafter.heads.biases)
    assert not any(t.is_meta for t in heads.weights)  # the caller's heads are untouched
    assert drafter.describe() == heads.describe()


@pytest.fixture(scope="module")
def trained(smollm2, tmp_path_factory):
    """Heads trained on the small model's answers to its own questions, and the files."""
    folder = tmp_path_factory.mktemp("heads")
    out, work = folder / "heads.safetensors", folder / "work"
    heads = train_heads(smollm2, out, work, questions=24, max_new=48, heads=2, epochs=4)
    return heads, out, work


def test_trained_heads_guess_better_than_chance_and_training_resumes(smollm2, trained):
    heads, out, work = trained
    loaded = DraftHeads.load(out, hidden_size=smollm2.loaded.model.config.hidden_size)
    assert len(loaded) == 2 and 12 <= loaded.info["answers"] <= 24 + 6  # answers and tasks
    # the model's own next-next token out of 16384 candidates: chance is ~0
    assert loaded.info["heldout_top1"] > 0.05
    answers = work / "answers.json"
    saved = json.loads(answers.read_text())
    assert 1 <= len(saved["task_answers"]) == len(saved["task_prompts"]) <= 6
    assert loaded.info["answers"] == len(saved["answers"]) + len(saved["task_answers"])
    stamp = answers.stat().st_mtime_ns
    again = train_heads(smollm2, out, work, questions=24, max_new=48, heads=1, epochs=1)
    assert answers.stat().st_mtime_ns == stamp  # the saved answers were reused, not regenerated
    assert len(again) == 1


def test_greedy_with_head_drafts_is_identical_to_plain_decoding(smollm2, trained):
    _, out, _ = trained
    prompts = ["def quicksort(items):", "The three primary colors are", "Dear team,\n\nI"]
    drafted = kept = 0
    for prompt in prompts:
        plain = smollm2.generate(prompt, None, max_new_tokens=40)
        for drafter in (HeadDrafter(smollm2.runner, smollm2.load_heads(out)),
                        smollm2.self_drafter(heads=str(out))):  # fmt: skip
            config = smollm2.decode_config(drafter, max_new_tokens=40, fallback=False)
            result = smollm2.generate(prompt, drafter, config=config)
            assert result.token_ids == plain.token_ids, (prompt, drafter.name)
            rounds, d, k = result.stats.sources.get("heads", (0, 0, 0))
            drafted, kept = drafted + d, kept + k
    assert drafted > 0 and kept > 0


def test_a_chain_of_guesses_stops_at_the_first_not_worth_proposing(smollm2, trained):
    """The chance of a chain of guesses falls guess by guess, and ``worth`` cuts the chain."""
    runner = smollm2.runner
    prompt = smollm2.encode("def quicksort(items):")
    runner.reset(len(prompt) + 8)
    logits, _ = runner.forward(torch.tensor(prompt), 0, last_logits_only=True)
    request = DraftRequest(prompt + [int(logits[-1].argmax())], 2, Sampling(), None)
    drafter = HeadDrafter(runner, trained[0])  # two heads (the file may hold one by now)
    drafter.begin(prompt, len(prompt) + 8, DraftSettings())
    full = drafter.draft(request)
    assert len(full.tokens) == 2 and len(drafter.last_chances) == 2
    seen = []
    draft = drafter.draft(request, lambda chances: seen.append(list(chances)) or len(chances) < 2)
    assert draft.tokens == full.tokens[:1] and len(drafter.last_chances) == 1
    # guess 2 was refused at its best (a chance no higher than the chain's so far), so its head
    # step never ran
    assert seen[1] == [seen[0][0], seen[0][0]] and drafter.last_steps == 1
    # a guess that could pass if certain is computed, then judged on its own chance
    seen.clear()

    def at_its_best(chances: list[float]) -> bool:  # the first guess, or one as likely as before
        seen.append(list(chances))
        return len(chances) == 1 or chances[-1] >= chances[-2]

    drafter.draft(request, at_its_best)
    assert drafter.last_steps == 2 and seen[1] == [seen[0][0], seen[0][0]]
    assert 1 >= seen[2][0] >= seen[2][1] > 0  # then asked about guess 2 with both chances
    assert drafter.draft(request, lambda chances: False).tokens == []


def test_head_drafts_believed_unprofitable_are_tried_one_guess_at_a_time(smollm2, trained):
    """Where head drafts look too slow to pay, a probe still drafts one guess, whatever its
    chance: the stopping rule that judges longer drafts uses the same costs, and a probe it
    could refuse would never correct them."""
    runner = smollm2.runner
    prompt = smollm2.encode("A short note about apples")
    runner.reset(len(prompt) + 8)
    runner.forward(torch.tensor(prompt), 0, last_logits_only=True)
    drafter = AdaptiveDrafter(runner.head_rows, heads=HeadDrafter(runner, trained[0]))
    drafter.begin(prompt, len(prompt) + 8, DraftSettings(fallback=False))
    drafter.observe(RoundOutcome(0, 0, 0.0, 0.100))
    lengths = []
    for _ in range(48):
        draft = drafter.draft(DraftRequest(prompt + [7], 4, Sampling(), None))
        lengths.append(len(draft.tokens))
        # a head round timed at ten plain steps of drafting, nothing kept; plain rounds else
        drafter.observe(RoundOutcome(len(draft.tokens), 0, len(draft.tokens), 0.1, draft.source))
    # the first round trusts the heads' held-out figures; then one-guess probes every 16 rounds
    assert 2 <= sum(n > 0 for n in lengths[1:]) <= 3 and set(lengths[1:]) <= {0, 1}


@pytest.mark.slow
def test_head_drafts_on_the_fixed_shape_runner_cuda_uses(smollm2_packed, trained):
    """selfspec/runtime/cuda_graphs.py's runner (CUDA's), here on the CPU: it keeps each pass's
    final hidden states too, so head drafts run on it, and the output stays plain decoding's."""
    from selfspec.runtime.cuda_graphs import StaticRunner

    engine, runner = smollm2_packed, smollm2_packed.runner
    engine.runner = StaticRunner(engine.loaded, graphs=False)
    try:
        for prompt in ("def quicksort(items):", "The three primary colors are"):
            plain = engine.generate(prompt, None, max_new_tokens=40)
            drafter = HeadDrafter(engine.runner, engine.load_heads(trained[1]))
            config = engine.decode_config(drafter, max_new_tokens=40, fallback=False)
            result = engine.generate(prompt, drafter, config=config)
            assert result.token_ids == plain.token_ids, prompt
            rounds, drafted, kept = result.stats.sources["heads"]
            assert rounds > 0 and drafted > 0
    finally:
        engine.runner = runner


def test_head_products_in_8_bits_stay_close_to_float32():
    """Where the kernel is loaded, a head's product may run with its weights rounded to 8 bits
    (Q8_0's rounding): its output stays within that rounding of float32's, whichever arithmetic
    the timing picks."""
    from selfspec.kernels import load_kernel
    from selfspec.speed.quantized import Q8Linear

    heads = random_heads(64, 2, 40)
    kernel = load_kernel()  # the kernel's modes are what selfspec runs on CPUs (tested there)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    exact = torch.nn.functional.linear(x, heads.weights[0], heads.biases[0])
    rounded = Q8Linear.from_float(heads.weights[0], heads.biases[0], kernel)(x)
    error = (rounded - exact).abs().max() / exact.abs().max()
    assert 0 < error < 0.02  # rounded, but only by 8-bit steps
    products, downs = fastest_products(heads, torch.device("cpu"))
    assert downs == [None, None]  # one-layer heads
    for product, weight, bias in zip(products, heads.weights, heads.biases):
        exact = torch.nn.functional.linear(x, weight, bias)
        assert torch.allclose(product(x).float(), exact, atol=0.05 * float(exact.abs().max()))


@pytest.mark.slow  # two short trainings
def test_a_budget_ends_the_answers_early_and_a_rerun_resumes_them(smollm2, tmp_path):
    """A run out of budget stops gathering answers but trains on those it has, saved; a rerun
    keeps them, adds more, and ends by timing the heads against plain decoding."""
    from selfspec.training.budget import Budget

    out, work = tmp_path / "heads.safetensors", tmp_path / "work"
    heads = train_heads(smollm2, out, work, questions=64, max_new=48, epochs=2, budget=Budget(0.3))
    first = json.loads((work / "answers.json").read_text())
    assert 2 <= len(first["answers"]) < len(first["prompts"])  # stopped short, saved so far
    assert heads.info["answers"] >= 2
    again = train_heads(
        smollm2, out, work, questions=64, max_new=48, epochs=1, budget=Budget(0.6), measure=True
    )
    second = json.loads((work / "answers.json").read_text())
    assert second["answers"][: len(first["answers"])] == first["answers"]  # resumed, not redone
    assert len(second["answers"]) > len(first["answers"])
    assert again.info["answers"] > heads.info["answers"]
    # timed on held-out prompts on this machine, and kept in the file (speeds are not asserted)
    saved = DraftHeads.load(out, hidden_size=smollm2.loaded.model.config.hidden_size)
    assert set(saved.info["decode_speedup"]) == {"with", "without"}
    assert all(x > 0 for x in saved.info["decode_speedup"].values())


@pytest.fixture(scope="module")
def smollm2_q8():
    from selfspec.engine import Engine
    from selfspec.kernels import kernel_available

    if not kernel_available():
        pytest.skip("the CPU kernel cannot be built on this machine")
    engine = Engine.load("smollm2-135m", speed="gguf-q8")
    assert engine.runner.can_batch
    return engine


def test_answers_written_together_keep_the_hidden_states_a_pass_over_each_gives(smollm2_q8):
    """Training answers are written eight at a time, a new one begun as soon as one ends: each is
    the model's own greedy answer, and the hidden states kept while writing it are the ones a pass
    over the finished answer gives, bit for bit."""
    engine = smollm2_q8
    questions = [f"In one word: what is {x}?" for x in ("2+2", "the sky's colour", "ice")]
    questions += [f"Write a long story about {x}." for x in ("a cat", "the sea", "a robot")]
    questions += [f"List {n} fruits." for n in range(2, 7)]
    prompts = [engine.encode(q, chat=True) for q in questions]
    states: dict = {}
    answers = generate_answers(engine, prompts, 40, "answers", states=states)
    lengths = [len(a) for a in answers]
    assert len(prompts) > BATCH and min(lengths) < 40 == max(lengths)  # some ended sooner
    for prompt, answer in zip(prompts, answers):
        assert answer == engine.generate(prompt, None, max_new_tokens=40).token_ids
    assert len(states) == len(prompts)
    kept = features(engine, prompts, answers, heads=2, states=states)
    assert not states  # handed over, not held twice
    read = features(engine, prompts, answers, heads=2)
    for (kept_rows, kept_tokens), (read_rows, read_tokens) in zip(kept, read):
        assert kept_rows.shape[0] == kept_tokens.shape[1]
        assert torch.equal(kept_rows, read_rows) and torch.equal(kept_tokens, read_tokens)


def test_answers_drawn_at_a_temperature_are_the_same_whoever_writes_them(smollm2_q8, tmp_path):
    """Drawn answers are seeded by their prompts: in another order (another process's share) each
    prompt gets the same answer; they are not the greedy ones; and saved answers drawn at another
    temperature are written again, not trained on."""
    from selfspec.runtime.sampling import Sampling
    from selfspec.training.answers import answers_for

    engine = smollm2_q8
    topics = ("cats", "the sea", "Rome", "rain", "jazz", "chess", "tea", "glass", "trees", "clouds")
    prompts = [engine.encode(f"Tell me about {t}.", chat=True) for t in topics]
    drawn = Sampling(temperature=0.8)
    first = generate_answers(engine, prompts, 24, "a", sampling=drawn)
    again = generate_answers(engine, prompts[::-1], 24, "b", sampling=drawn)[::-1]
    assert first == again
    assert first != generate_answers(engine, prompts, 24, "g")
    greedy = answers_for(engine, tmp_path, questions=4, max_new=16)
    assert "temperature" not in greedy  # greedy, as files written before the option
    hot = answers_for(engine, tmp_path, questions=4, max_new=16, sampling=drawn)
    assert hot["questions"] == greedy["questions"] and hot["temperature"] == 0.8
    assert hot["answers"] != greedy["answers"]


def test_over_its_own_greedy_answers_the_models_tokens_are_the_answers(smollm2_q8):
    """Over a text, the heads learn the model's own greedy token at each place (``--texts``):
    over its own greedy answers those are the answers' tokens, every one."""
    engine = smollm2_q8
    prompts = [engine.encode(q, chat=True) for q in ("Tell me about owls.", "List three colours.")]
    answers = [engine.generate(p, None, max_new_tokens=32).token_ids for p in prompts]
    relabeled = features(engine, prompts, answers, heads=3, relabel=True)
    read = features(engine, prompts, answers, heads=3)
    for (rows, tokens), (rows_read, tokens_read) in zip(relabeled, read):
        assert torch.equal(rows, rows_read) and torch.equal(tokens, tokens_read)


def test_heads_trained_on_texts_learn_the_models_tokens_over_them(smollm2_q8, tmp_path):
    """Another writer's texts: the first head learns, at every place, what the model says there
    (one token generated from that place), and the heads say how many texts taught them."""
    engine = smollm2_q8
    topics = ("owls", "rain", "bread", "maps", "glass", "tea", "jazz", "chess")
    texts = [
        (engine.encode(f"Tell me about {t}.", chat=True),
         engine.tokenizer(f"{t.title()} are a subject people like. Many books cover {t} well.",
                          add_special_tokens=False)["input_ids"])
        for t in topics
    ]  # fmt: skip
    (_, tokens), *_ = features(
        engine, [p for p, _ in texts], [a for _, a in texts], 2, relabel=True
    )
    prompt, answer = texts[0]
    for i in range(0, len(answer) - 1, 4):  # tokens[1][i]: after the prompt and answer[: i + 1]
        context = prompt + answer[: i + 1]
        said = engine.generate(context, None, max_new_tokens=1).token_ids[0]
        assert int(tokens[1, i]) == said
    assert any(int(t) != a for t, a in zip(tokens[1], answer[1:]))  # not the text's own tokens
    out = tmp_path / "heads.safetensors"
    heads = train_heads(engine, out, tmp_path / "work", heads=2, epochs=1, texts=texts)
    assert heads.info["texts"] == len(texts) and out.is_file()
