"""What the small random-weight test models share: their shape, a word-level tokenizer over their
64 token ids ("t0" ... "t63"), and the check that speculation on them is lossless."""

TINY_SHAPE = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def word_level_tokenizer():
    """A transformers fast tokenizer whose tokens are the words t0 ... t63."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(TINY_SHAPE["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0")


def greedy_tokens(engine, prompt: list[int], new_tokens: int, drafter=None) -> list[int]:
    """Exactly ``new_tokens`` greedy tokens after ``prompt`` (no end-of-text: a random model's
    text has no meaning to end)."""
    config = engine.decode_config(drafter, max_new_tokens=new_tokens)
    config.eos_token_ids = ()
    ids = engine.generate(prompt, drafter, config=config).token_ids
    assert len(ids) == new_tokens
    return ids


def speculation_is_lossless(engine, prompt: list[int], new_tokens: int, plan) -> list[int]:
    """Layer-skip drafts with ``plan`` (a draft every round) and recycled drafts give plain
    decoding's tokens, which are returned."""
    plain = greedy_tokens(engine, prompt, new_tokens)
    skipping = engine.layer_skip_drafter(plan)
    assert greedy_tokens(engine, prompt, new_tokens, skipping) == plain, "layer-skip drafts"
    recycled = engine.self_drafter(None, layer_skip=False, heads=False, recycled=True)
    assert greedy_tokens(engine, prompt, new_tokens, recycled) == plain, "recycled drafts"
    return plain
