"""A learnable corpus the project makes itself, its char-level tokenizer, and training batches.

The corpus is English-like text from a small probabilistic grammar: subject-verb agreement,
transitive and intransitive verbs, adjectives, prepositional phrases, relative clauses, questions,
capitals and punctuation. It has real regularities (a char-level model drops from ~3.7 to ~1 nat
per char quickly) and is a pure function of its seed: only ``random.Random.random()`` is used,
whose sequence Python guarantees across versions and platforms, so every machine writes the same
bytes. Batches are a pure function of (seed, step, rank, world size), so resuming needs no
data-loader state and N ranks together see exactly the batch one process would.
"""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import torch

CORPUS_VERSION = 1  # bump when the grammar changes, so stale cache files are not reused

NAMES = ["Alice", "Bob", "Carol", "Dave", "Emma", "Frank"]
NOUNS = ["cat", "dog", "bird", "fox", "child", "teacher", "farmer", "king", "queen", "horse",
         "girl", "boy", "robot", "baker", "sailor", "wolf"]
IRREGULAR_PLURALS = {"child": "children", "wolf": "wolves", "fox": "foxes"}
ADJECTIVES = ["big", "small", "old", "young", "happy", "quiet", "red", "green", "clever", "lazy"]
TRANSITIVE = ["see", "like", "chase", "help", "watch", "follow", "find", "call"]
INTRANSITIVE = ["sleep", "run", "sing", "laugh", "wait", "dance"]
PLACES = ["the garden", "the forest", "the old house", "the river", "the market", "the hill"]
PREPOSITIONS = ["in", "near", "behind", "under"]
ADVERBS = ["quickly", "slowly", "happily", "often", "never", "always"]


def _pick(rng: random.Random, items: list[str]) -> str:
    return items[int(rng.random() * len(items))]


def _chance(rng: random.Random, p: float) -> bool:
    return rng.random() < p


def _third_person(verb: str) -> str:
    return verb + ("es" if verb.endswith(("ch", "sh", "s", "x")) else "s")


def _noun_phrase(rng: random.Random) -> tuple[str, bool]:
    """A subject or object and whether it is plural."""
    if _chance(rng, 0.2):
        return _pick(rng, NAMES), False
    plural = _chance(rng, 0.35)
    noun = _pick(rng, NOUNS)
    if plural:
        noun = IRREGULAR_PLURALS.get(noun, noun + "s")
    det = _pick(rng, ["the", "some", "many", "two"]) if plural else _pick(rng, ["the", "a", "one"])
    adj = _pick(rng, ADJECTIVES) + " " if _chance(rng, 0.4) else ""
    if det == "a" and adj and adj[0] in "aeiou":
        det = "an"
    return f"{det} {adj}{noun}", plural


def _verb_phrase(rng: random.Random, plural: bool) -> str:
    if _chance(rng, 0.6):
        verb, obj = _pick(rng, TRANSITIVE), " " + _noun_phrase(rng)[0]
    else:
        verb, obj = _pick(rng, INTRANSITIVE), ""
    verb = verb if plural else _third_person(verb)
    adv = " " + _pick(rng, ADVERBS) if _chance(rng, 0.25) else ""
    place = f" {_pick(rng, PREPOSITIONS)} {_pick(rng, PLACES)}" if _chance(rng, 0.35) else ""
    return f"{verb}{obj}{adv}{place}"


def sentence(rng: random.Random) -> str:
    """One sentence: a statement (maybe with a relative clause or a second clause) or a question."""
    subject, plural = _noun_phrase(rng)
    if _chance(rng, 0.15):
        aux = "do" if plural else "does"
        verb = _pick(rng, TRANSITIVE)
        text = f"{aux} {subject} {verb} {_noun_phrase(rng)[0]}?"
    else:
        if _chance(rng, 0.2) and not subject[0].isupper():
            relative = _noun_phrase(rng)[0]  # relative clause: "the cat that a dog saw ..."
            subject += f" that {relative} {'saw' if _chance(rng, 0.5) else 'liked'}"
        text = f"{subject} {_verb_phrase(rng, plural)}"
        if _chance(rng, 0.2):
            other, other_plural = _noun_phrase(rng)
            text += f", {_pick(rng, ['and', 'but'])} {other} {_verb_phrase(rng, other_plural)}"
        text += "."
    return text[0].upper() + text[1:]


def generate_corpus(seed: int, num_chars: int) -> str:
    """Paragraphs of 3-6 sentences, cut at the first paragraph end past ``num_chars``."""
    rng = random.Random(seed)
    paragraphs, total = [], 0
    while total < num_chars:
        para = " ".join(sentence(rng) for _ in range(3 + int(rng.random() * 4)))
        paragraphs.append(para)
        total += len(para) + 1
    return "\n".join(paragraphs) + "\n"


def load_corpus(cache_dir: str | os.PathLike, seed: int, num_chars: int) -> str:
    """The corpus text, generated into ``cache_dir`` on first use (atomic: temp + os.replace)."""
    path = Path(cache_dir) / f"grammar_v{CORPUS_VERSION}_seed{seed}_{num_chars}.txt"
    if path.exists():
        return path.read_text(encoding="utf-8")
    text = generate_corpus(seed, num_chars)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # ranks may race; content is equal
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return text


def sha256(text: str) -> str:
    """Hex digest of the UTF-8 bytes (to check that a corpus is the one expected)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class CharTokenizer:
    """Maps each distinct character of a text to an id (sorted, so the mapping is deterministic)."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self._ids = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Ids as a uint8 tensor when they fit, int64 otherwise (KeyError on unknown chars)."""
        dtype = torch.uint8 if self.vocab_size <= 256 else torch.int64
        return torch.tensor([self._ids[c] for c in text], dtype=dtype)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def to_json(self) -> str:
        """This mapping as a ``tokenizers`` JSON (what ``recipes.export --to hf`` ships): a BPE
        with one token per character and no merges encodes each character to its id."""
        from tokenizers import Tokenizer, decoders, models

        tokenizer = Tokenizer(models.BPE(vocab=dict(self._ids), merges=[]))
        tokenizer.decoder = decoders.Fuse()  # characters joined back without separators
        return tokenizer.to_str()


def batch_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed for one step, mixing (seed, step) so nearby pairs differ."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def get_batch(
    tokens: torch.Tensor, *, seed: int, step: int, global_batch_size: int, seq_len: int,
    rank: int = 0, world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets), each ``[global_batch_size // world_size, seq_len]`` int64.

    The global batch is ``global_batch_size`` windows at offsets drawn by a generator seeded with
    (seed, step); rank r takes the r-th contiguous slice of it.
    """
    if global_batch_size % world_size:
        raise ValueError(f"data.global_batch_size={global_batch_size} must be divisible by the "
                         f"world size {world_size}")
    if len(tokens) <= seq_len + 1:
        raise ValueError(f"corpus of {len(tokens)} tokens is too short for seq_len={seq_len}")
    gen = torch.Generator().manual_seed(batch_seed(seed, step))
    starts = torch.randint(0, len(tokens) - seq_len - 1, (global_batch_size,), generator=gen)
    local = global_batch_size // world_size
    starts = starts[rank * local:(rank + 1) * local]
    windows = torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]
