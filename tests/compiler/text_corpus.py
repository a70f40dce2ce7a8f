"""A small text corpus and a tokenizer built by the tests themselves (no download).

`write_corpus(folder)` writes deterministic documents (short sentences from a
fixed grammar, so a model can learn something) as plain text (blank line
between documents), JSON Lines and Parquet; `build_tokenizer(folder, texts)`
trains a word-level `tokenizers` tokenizer on them and saves it both as a
tokenizer.json (with `<eos>` as a special token) and as a transformers
`save_pretrained` folder whose eos_token is `<eos>`.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher"]
VERBS = ["sees", "likes", "follows", "finds", "eats", "draws"]
OBJECTS = ["the ball", "a red apple", "the river", "a green tree", "the house", "some bread"]


def documents(count: int = 120, seed: int = 0) -> list[str]:
    """`count` documents of 1-4 sentences each."""
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        sentences = [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} ."
                     for _ in range(rng.randint(1, 4))]
        docs.append(" ".join(sentences))
    return docs


def write_text(path: Path, docs: list[str]) -> Path:
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)),
                    encoding="utf-8")
    return path


def build_tokenizer(folder: Path, texts: list[str]) -> tuple[Path, Path]:
    """(tokenizer.json, a save_pretrained folder): word-level, `<unk>` 0, `<eos>` 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / "tokenizer.json"
    tok.save(str(file))
    pretrained = folder / "pretrained"
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(str(pretrained))
    return file, pretrained


def reference_tokens(tokenizer_json: Path, docs: list[str]) -> list[list[int]]:
    """Each document's ids + EOS, straight from `tokenizers` (what the cache must hold)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    eos = tok.token_to_id("<eos>")
    return [tok.encode(d, add_special_tokens=False).ids + [eos] for d in docs]
