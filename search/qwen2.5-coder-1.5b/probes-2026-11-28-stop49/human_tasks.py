"""Tasks over text people wrote (Wikipedia articles and news stories from gensim's test data),
answered greedily by the model with the state behind every answer token: documents of a kind the
draft heads never trained on (their task documents were all model-written, stop 44).

    python human_tasks.py CORPUS_DIR OUT.pt --count 640 --seed 11   # --show: print 4 prompts

CORPUS_DIR holds ``enwiki.xml`` (a shortened English Wikipedia dump, 93 articles with text) and
``lee_background.cor`` (300 news stories), both from gensim 4.4.0's wheel (README). Each task is a
question over four passages (one from the article it names), a summary of a news story or an
article, or other work over one passage (key facts, a rewrite, questions with answers, dates and
names). The answers go through stop 44's ``answer_all``: 128 tokens at most, eight a pass, in
this CPU's gguf-q8 mode; ``finetune.py --tasks`` of stop 44 reads the file.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from pathlib import Path

STOP44 = Path(__file__).resolve().parent.parent / "cpu-finetune-2026-11-27-stop44"
sys.path.insert(0, str(STOP44))
from task_answers import answer_all  # noqa: E402

from selfspec.engine import Engine  # noqa: E402


def _strip_templates(text: str) -> str:
    out, depth, i = [], 0, 0
    while i < len(text):
        two = text[i : i + 2]
        if two in ("{{", "{|"):
            depth, i = depth + 1, i + 2
        elif two in ("}}", "|}") and depth:
            depth, i = depth - 1, i + 2
        else:
            if not depth:
                out.append(text[i])
            i += 1
    return "".join(out)


def wiki_paragraphs(xml: str) -> dict[str, list[str]]:
    pages = {}
    for title, body in re.findall(r"<title>(.*?)</title>.*?<text[^>]*>(.*?)</text>", xml, re.S):
        if body.lstrip().upper().startswith("#REDIRECT"):
            continue
        t = re.sub(r"&lt;", "<", body)
        t = re.sub(r"&gt;", ">", t)
        t = re.sub(r"&quot;", '"', t)
        t = re.sub(r"&amp;nbsp;|&nbsp;", " ", t)
        t = re.sub(r"&amp;", "&", t)
        t = re.sub(r"<!--.*?-->", "", t, flags=re.S)
        t = re.sub(r"<ref[^>]*/>", "", t)
        t = re.sub(r"<ref.*?</ref>", "", t, flags=re.S)
        t = _strip_templates(t)
        t = re.sub(
            r"\[\[(?:File|Image|Category|[a-z-]{2,12}):[^\]]*(?:\[\[[^\]]*\]\][^\]]*)*\]\]", "", t
        )
        t = re.sub(r"\[\[([^\]|]*)\|([^\]]*)\]\]", r"\2", t)
        t = re.sub(r"\[\[([^\]]*)\]\]", r"\1", t)
        t = re.sub(r"\[https?://\S+ ([^\]]*)\]", r"\1", t)
        t = re.sub(r"'{2,}", "", t)
        t = re.sub(r"<[^>]+>", "", t)
        paras = []
        for block in t.split("\n\n"):
            block = " ".join(line.strip() for line in block.splitlines()).strip()
            if block.startswith(("=", "*", "#", ":", ";", "|", "!")) or len(block.split()) < 60:
                continue
            paras.append(re.sub(r"\s+", " ", block))
        if paras:
            pages[title] = paras
    return pages


def passage(paras: list[str], rng, words=(120, 380)) -> str:
    start = rng.randrange(len(paras))
    text = paras[start]
    for p in paras[start + 1 :]:
        if len(text.split()) >= words[0]:
            break
        text += "\n\n" + p
    return " ".join(text.split(" ")[: words[1]]) if len(text.split()) > words[1] else text


QUESTIONS = (
    "What is {t}?",
    "What is {t} known for?",
    "Give me a short history of {t}.",
    "What are the main facts about {t}?",
    "Explain {t} in simple terms.",
    "Why is {t} important?",
    "What should I know about {t}?",
)
SUMMARY = (
    "Summarize the following news article in a few sentences.\n\n{text}",
    "Write a short summary of this article:\n\n{text}",
    "Summarize the following text.\n\n{text}",
    "Give the main points of the article below as a short paragraph.\n\nArticle: {text}",
)
DOC_TASKS = (
    "List the key facts, names and numbers in the text below as a bulleted list.\n\n{text}",
    "Rewrite the following text so that a twelve-year-old can understand it.\n\n{text}",
    "Write three questions a reader could answer from the text below, each with its answer."
    "\n\n{text}",
    "Extract every date, place and person mentioned in the text below.\n\n{text}",
)


def title_words(title: str) -> str:
    return re.sub(r"(?<=[a-z])(?=[A-Z])", " ", title)


def make_prompts(corpus: Path, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    pages = wiki_paragraphs((corpus / "enwiki.xml").read_text(errors="ignore"))
    lines = (corpus / "lee_background.cor").read_text(errors="ignore").splitlines()
    news = [line.strip() for line in lines if len(line.split()) > 60]
    titles = list(pages)
    paragraphs = sum(len(p) for p in pages.values())
    print(f"{len(titles)} articles, {paragraphs} paragraphs, {len(news)} news stories", flush=True)
    prompts = []
    for i in range(count):
        kind = i % 4
        if kind == 0:  # a question over several passages, one of them about it
            t = rng.choice(titles)
            others = rng.sample([x for x in titles if x != t], 3)
            docs = [passage(pages[x], rng, (60, 150)) for x in [t, *others]]
            rng.shuffle(docs)
            body = "\n\n".join(f"Document [{j + 1}]: {d}" for j, d in enumerate(docs))
            q = rng.choice(QUESTIONS).format(t=title_words(t))
            prompts.append(
                f"Answer the question using the documents below.\n\n{body}\n\nQuestion: {q}"
            )
        elif kind == 1:  # a summary of news or of an article
            text = (
                rng.choice(news)
                if rng.random() < 0.5
                else passage(pages[rng.choice(titles)], rng, (200, 450))
            )
            prompts.append(rng.choice(SUMMARY).format(text=text))
        else:  # other work over a document
            text = (
                rng.choice(news) if rng.random() < 0.4 else passage(pages[rng.choice(titles)], rng)
            )
            prompts.append(rng.choice(DOC_TASKS).format(text=text))
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("corpus")
    parser.add_argument("out")
    parser.add_argument("--count", type=int, default=640)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--show", action="store_true")
    args = parser.parse_args()
    prompts = make_prompts(Path(args.corpus), args.count, args.seed)
    if args.show:
        for p in prompts[:4]:
            print("-----\n", p[:1500])
        return
    engine = Engine.load("qwen2.5-coder-1.5b")
    encoded = [engine.encode(p, chat=True) for p in prompts]
    print("prompt tokens", sum(map(len, encoded)) / len(encoded), flush=True)
    answer_all(engine, encoded, args.out)


if __name__ == "__main__":
    main()
