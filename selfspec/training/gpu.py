"""Draft heads for a bundled model, trained on a GPU: the self-distillation of
`selfspec train-heads` (selfspec/training/heads.py: the model writes questions on its topics,
answers them greedily, a chain of heads learns the answer tokens 2, 3, ... places after a row from
that row's final hidden state and the tokens after it), at a scale a 2-core CPU does not reach in
hours. Spec-Bench is never read.

transformers' own model runs here (bfloat16, batched `generate`), so the answers and hidden
states are the float model's, not a CPU speed mode's; the heads are measured on the CPU afterwards
by `selfspec bench`. Besides those of `selfspec train-heads`, some rows continue raw text (an
answer cut short, no chat template), as prompts do that continue code, and some ask for a task
over one of the model's own answers (a summary, an answer from the passage, a translation...:
``selfspec.training.answers.TASKS``), as prompts do that bring a document.

    python3 -m selfspec.training.gpu MODEL_DIR GGUF_NAME TOKENIZER_DIR OUT_DIR [--questions N]
        [--answers A.safetensors[.xz] ...]   # earlier runs' answers: train on them too
                                              # (and write none unless --generate-seconds)
        [--init heads.safetensors]        # start from these heads instead of zeros
        [--compare heads.safetensors]     # also measure these heads on the same held-out rows
        [--variants 1 2-soft ...]         # heads of 1 or 2 layers, "-soft": half the loss
                                          # against the model's own distribution; one file each

Writes OUT_DIR/heads.safetensors (the first variant; later ones heads-VARIANT.safetensors),
OUT_DIR/answers.safetensors (every prompt and answer as token ids) and OUT_DIR/questions.json,
each as soon as it is ready.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from selfspec.drafters.heads import DraftHeads
from selfspec.training.answers import QUESTION_PROMPT, TOPICS, add_questions, task_texts
from selfspec.training.fit import chain_top1, fit_rows
from selfspec.training.heads import chain_tokens

STARTED = time.time()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: only to try the script


def log(message: str) -> None:
    print(f"[{time.time() - STARTED:6.1f} s] {message}", flush=True)


def generate(model, prompts, max_new, batch, eos, pad, sample=False, deadline=None):
    """New tokens per prompt (through the first end-of-sequence token), left-padded batches; stops
    early, with fewer answers, once ``deadline`` (time.time()) has passed."""
    answers = []
    config = GenerationConfig(
        max_new_tokens=max_new,
        do_sample=sample,
        temperature=1.0 if sample else None,
        top_p=0.95 if sample else None,
        top_k=None,
        eos_token_id=sorted(eos),
        pad_token_id=pad,
    )
    for first in range(0, len(prompts), batch):
        if deadline and time.time() > deadline:
            log(f"deadline: {len(answers)} of {len(prompts)} answered")
            break
        group = prompts[first : first + batch]
        width = max(map(len, group))
        ids = torch.full((len(group), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(group):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE), generation_config=config
            )
        for row in out[:, width:].tolist():
            cut = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
            answers.append(row[:cut])
        log(f"generated {len(answers)}/{len(prompts)} (max {max_new} new, batch {len(group)})")
    return answers


@torch.inference_mode()
def features(model, prompts, answers, heads, batch=64):
    """Normed final hidden states of the rows that produced answer tokens [n, hidden] (bfloat16)
    and their ``chain_tokens`` [heads + 1, n]."""
    hidden, labels = [], []
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(answers[i]))
    for first in range(0, len(order), batch):
        group = [prompts[i] + answers[i] for i in order[first : first + batch]]
        width = max(map(len, group))
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, seq in enumerate(group):
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
        last = model.model(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE))
        last = last.last_hidden_state
        for i, k in enumerate(order[first : first + batch]):
            seq = group[i]
            rows = torch.arange(len(prompts[k]) - 1, len(seq) - 2)
            hidden.append(last[i, rows.to(DEVICE)])
            labels.append(chain_tokens(seq, rows, heads))
    return hidden, labels, order


def cut_for_continuation(answer, rng):
    """A raw-text prompt: the first 24..80 tokens of an answer, continued without a template."""
    return answer[: rng.randint(24, min(80, len(answer) - 8))] if len(answer) > 40 else None


def read_answers(path):
    """(prompts, answers, continuations) from an earlier run's answers.safetensors (.xz: as
    compressed for keeping in the repository)."""
    import lzma
    import tempfile

    from safetensors import safe_open

    if str(path).endswith(".xz"):
        plain = Path(tempfile.mkdtemp()) / "answers.safetensors"
        plain.write_bytes(lzma.decompress(Path(path).read_bytes()))
        path = plain
    with safe_open(str(path), "pt") as f:
        tokens, lengths = f.get_tensor("tokens").tolist(), f.get_tensor("lengths").tolist()
        continuations_from = int(f.metadata()["continuations_from"])
    prompts, answers, first = [], [], 0
    for p, a in lengths:
        prompts.append(tokens[first : first + p])
        answers.append(tokens[first + p : first + p + a])
        first += p + a
    log(f"{len(answers)} answers read from {path}")
    return prompts, answers, answers[continuations_from:]


def write_answers(model, tok, chat, eos, pad, rng, args, out_dir):
    """Questions written by the model, its answers, its answers to tasks over some of them and
    raw-text continuations, saved to out_dir: (prompts, answers, continuations), the answers
    holding all three kinds."""
    asks = [
        chat(QUESTION_PROMPT.format(n=15, who="people", topic=t)) for t in TOPICS[: args.topics]
    ] * args.samples_per_topic
    questions: list[str] = []
    written = generate(model, asks, args.question_tokens, args.batch, eos, pad, sample=True)
    for answer in written:
        add_questions(questions, tok.decode(answer, skip_special_tokens=True))
    rng.shuffle(questions)
    questions = questions[: args.questions]
    (out_dir / "questions.json").write_text(json.dumps(questions))
    log(f"{len(questions)} questions")

    deadline = time.time() + args.generate_seconds
    prompts = [chat(q) for q in questions]
    answers = generate(model, prompts, args.max_new_tokens, args.batch, eos, pad, deadline=deadline)
    prompts = prompts[: len(answers)]
    decode = partial(tok.decode, skip_special_tokens=True)
    texts = task_texts(questions, answers, decode, rng, args.task_prompts, min_tokens=96)
    tasks = [chat(text) for text in texts]
    # in batches of at most 512: the deadline is checked between batches
    worked = generate(
        model, tasks, args.max_new_tokens, min(args.batch, 512), eos, pad,
        deadline=time.time() + args.task_seconds,
    )  # fmt: skip
    prompts += tasks[: len(worked)]
    answers += worked
    raw = [p for p in (cut_for_continuation(a, rng) for a in answers) if p]
    raw = raw[: args.continuations]
    more = generate(model, raw, 192, args.batch, eos, pad, deadline=time.time() + 30)
    prompts += raw[: len(more)]
    answers += more
    lengths = [(len(p), len(a)) for p, a in zip(prompts, answers)]
    save_file(
        {
            "tokens": torch.tensor(
                [t for p, a in zip(prompts, answers) for t in p + a], dtype=torch.int32
            ),
            "lengths": torch.tensor(lengths, dtype=torch.int32),
        },
        str(out_dir / "answers.safetensors"),
        metadata={"continuations_from": str(len(answers) - len(more))},
    )
    log(
        f"{len(answers)} answers ({len(worked)} to tasks over earlier answers, {len(more)} "
        f"continue raw text), {sum(map(len, answers))} tokens"
    )
    return prompts, answers, more


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m selfspec.training.gpu")
    parser.add_argument("model_dir")
    parser.add_argument("gguf_name")
    parser.add_argument("tokenizer_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--name", default="qwen2.5-coder-1.5b", help="the model's selfspec name")
    parser.add_argument("--questions", type=int, default=6144)
    parser.add_argument("--continuations", type=int, default=1024)
    parser.add_argument(
        "--task-prompts", type=int, default=2048, help="tasks over earlier answers (summaries...)"
    )
    parser.add_argument("--task-seconds", type=float, default=60, help="time to answer them")
    parser.add_argument("--topics", type=int, default=len(TOPICS))
    parser.add_argument("--samples-per-topic", type=int, default=12)
    parser.add_argument("--question-tokens", type=int, default=420)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--generate-seconds", type=float, help="answering time (150; 0 with --answers)"
    )
    parser.add_argument(
        "--answers", nargs="+", default=[], help="earlier runs' answers.safetensors to train on"
    )
    parser.add_argument("--init", help="heads to start training from (default: zeros)")
    parser.add_argument("--compare", help="heads to measure on the same held-out rows")
    parser.add_argument("--lr", type=float, default=1e-3, help="first learning rate (decays)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed for the questions")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["2-soft"],
        choices=["1", "2", "1-soft", "2-soft"],
        help="heads of 1 or 2 layers, -soft: half the loss against the model's distribution",
    )
    args = parser.parse_args()
    if args.generate_seconds is None:
        args.generate_seconds = 0 if args.answers else 150
    return args


def load_target(args: argparse.Namespace):
    """transformers' model from the GGUF (bfloat16 on CUDA), its tokenizer, stop ids and pad id."""
    tok = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir,
        gguf_file=args.gguf_name,
        dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32,
    ).to(DEVICE)
    model.eval()
    eos = {
        tok.eos_token_id,
        *(tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")),
    }
    eos.discard(None)
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    log(f"loaded: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, eos {eos}")
    return model, tok, eos, pad


def main() -> None:
    args = parse_arguments()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    model, tok, eos, pad = load_target(args)

    def chat(text):
        return tok.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )

    prompts, answers, more = [], [], []
    for path in args.answers:  # first, so that their held-out answers stay those they had
        for kept, read in zip((prompts, answers, more), read_answers(path)):
            kept += read
    if args.generate_seconds > 0:
        for kept, new in zip(
            (prompts, answers, more), write_answers(model, tok, chat, eos, pad, rng, args, out_dir)
        ):
            kept += new

    hidden, labels, order = features(model, prompts, answers, args.heads)
    train_variants(model, hidden, labels, order, args, out_dir, len(answers), len(more))


def train_variants(model, hidden, labels, order, args, out_dir, answers, continuations) -> None:
    """Heads per ``--variants`` on the same rows, each saved as soon as it is trained."""
    # held out: answers 0, 20, 40, ... (the questions were shuffled), wherever sorting put them.
    # Earlier sets come first, so an earlier set's held-out answers are those it had when it was
    # new (heads trained on it alone, --init, --compare, have not seen them) if it came first then.
    test = [i for i, k in enumerate(order) if k % 20 == 0]
    train = [i for i, k in enumerate(order) if k % 20 != 0]
    out_rows = model.get_output_embeddings().weight[:32768].detach().float()
    embed = model.get_input_embeddings().weight.detach()
    test_hidden = torch.cat([hidden[i] for i in test])
    test_labels = torch.cat([labels[i] for i in test], dim=1).to(DEVICE)
    if args.compare:
        old = DraftHeads.load(args.compare).to(DEVICE)
        top1 = chain_top1(test_hidden, test_labels, old, out_rows, embed)
        log(f"{args.compare} on these held-out rows: {[round(t, 4) for t in top1]}")
    train_hidden = torch.cat([hidden[i] for i in train])
    train_labels = torch.cat([labels[i] for i in train], dim=1).to(DEVICE)
    owner = torch.cat([torch.full((len(hidden[i]),), i) for i in train]).to(DEVICE)
    init = DraftHeads.load(args.init) if args.init else None
    for n, variant in enumerate(args.variants):
        heads = fit_rows(
            train_hidden,
            train_labels,
            test_hidden,
            test_labels,
            out_rows,
            embed,
            args.epochs,
            batch=4096,
            lr=args.lr,
            init=init,
            layers=int(variant[0]),
            soft=0.5 if variant.endswith("-soft") else 0.0,
            owner=owner,
        )
        heads.info.update(
            model=args.name,
            trained_on=f"{DEVICE}, transformers, {model.dtype}",
            answers=answers,
            continuations=continuations,
            epochs=args.epochs,
            variant=variant,
            initialised_from=Path(args.init).name if args.init else None,
            seconds=round(time.time() - STARTED),
        )
        heads.save(out_dir / ("heads.safetensors" if n == 0 else f"heads-{variant}.safetensors"))
        log(f"heads {variant}: {heads.info}")


if __name__ == "__main__":
    main()
