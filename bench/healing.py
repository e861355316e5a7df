"""Generation from prompts that end in a space or part-way through a word, on the shipped word model: the greedy
continuations (`models.sampling.generate`, the path of `adaptlm generate`, /v1/generate and /v1/completions), and,
as a sanity check, the bits of each continuation's first word under the default byte model given the prompt (a word
model that conditions on a prompt's trailing " " token, a double space, starts a new sentence; one that heals it
continues the prompt). Also a digest of the shipped byte models' seeded generations, which healing must not change.

    python -m bench.healing [--checkpoint checkpoints/words] [--byte-checkpoint checkpoints/default] [--max-tokens 8]
                            [--digest]
"""

from __future__ import annotations

import argparse
import hashlib
import math
import re

from bench._common import DEFAULT_CHECKPOINT, ROOT, machine_line
from models.base import LanguageModel
from models.checkpoint import load_checkpoint
from models.sampling import SamplingParams, generate
from models.scoring import score_bytes

PROMPTS = [
    "there was a ",
    "there was a thi",
    "Dear ",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a ",
    "In the beginning God created the ",
    "And the LORD said unto ",
    "Call me Ishmael. Some years ago, never mind how long precisely, I ",
    "She was the youngest of the two daughters of a most affectionate, indulgent fa",
    "To be, or not to be, that is the quest",
    "Miss Woodhouse was ",
    "He walked into the roo",
    "I do not know what you mea",
    "The weather was so ",
    "My dear Mr. Bennet, have you heard that Netherfield Park is let at la",
    "Mrs. Dashwood ",
    "The whale ",
    "Thou shalt not ",
    "Once upon a ti",
    "It was a dark and storm",
    "I don'",
]
# the continuation's leading spaces and first word, <unk> or mark (a literal "<unk>" is scored as the text it is)
_FIRST_WORD = re.compile(r"\s*(?:<unk>|\w+(?:['’]\w+)*|\S)")


def first_word(prompt: str, continuation: str) -> str:
    """The rest of the word the prompt ends in (or the mark that ends it), or after a space the continuation's next
    word, its leading spaces included (a double space counts against it)."""
    match = _FIRST_WORD.match(continuation)
    return match.group(0) if match else ""


def byte_bits(model: LanguageModel, prompt: str, word: str) -> float:
    """Bits the byte model gives `word` after `prompt` (from the stream start); nan for no word."""
    if not word:
        return math.nan
    result = score_bytes(model, (prompt + word).encode(), logprobs=True)
    assert result.logprobs is not None
    return -sum(result.logprobs[-len(word.encode()):]) / math.log(2)


def digest(max_tokens: int) -> str:
    """sha256 of the shipped byte models' seeded and greedy generations of the prompts."""
    h = hashlib.sha256()
    for name in ("default", "char-transformer", "compressive"):
        ck = load_checkpoint(ROOT / "checkpoints" / name)
        for i, prompt in enumerate(PROMPTS[:6]):
            for params in (SamplingParams(max_tokens=max_tokens, temperature=0),
                           SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=40, top_p=0.95, seed=i)):
                h.update("".join(generate(ck.model, prompt.encode(), params, tokenizer=ck.tokenizer)).encode())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "words"))
    ap.add_argument("--byte-checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--digest", action="store_true", help="also the byte models' generations' digest (slow)")
    args = ap.parse_args()
    words = load_checkpoint(args.checkpoint)
    byte = load_checkpoint(args.byte_checkpoint)
    print(machine_line())
    total, counted = 0.0, 0
    for prompt in PROMPTS:
        text = "".join(generate(words.model, prompt.encode(), SamplingParams(max_tokens=args.max_tokens,
                                                                             temperature=0),
                                tokenizer=words.tokenizer))
        bits = byte_bits(byte.model, prompt, first_word(prompt, text))
        if not math.isnan(bits):
            total, counted = total + bits, counted + 1
        print(f"{bits:6.1f} bits  {prompt!r} + {text!r}")
    print(f"first words: {total / max(counted, 1):.1f} bits on average under the byte model ({counted} words)")
    if args.digest:
        print(f"byte models' generations: sha256 {digest(40)}")


if __name__ == "__main__":
    main()
