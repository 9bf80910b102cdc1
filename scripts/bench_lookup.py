"""Microseconds per extend(1 token) + propose() on a 10k-token stream, for a few configs.

Usage: python scripts/bench_lookup.py [--tokens 10000] [--vocab 50]
A small vocabulary means many matches (long copies); a large one means few.
"""

from __future__ import annotations

import argparse
import random
import time

from hf_selfspec.decoding.lookup import PromptLookup


def bench(tokens: list[int], max_ngram: int, max_draft: int, prompt_len: int) -> float:
    lookup = PromptLookup(max_ngram=max_ngram, max_draft=max_draft)
    lookup.reset(tokens[:prompt_len])
    stream = tokens[prompt_len:]
    start = time.perf_counter()
    for t in stream:
        lookup.extend((t,))
        lookup.propose()
    return (time.perf_counter() - start) / max(len(stream), 1) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=10_000)
    parser.add_argument("--vocab", type=int, default=50)
    args = parser.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(args.vocab) for _ in range(args.tokens)]
    print(f"{args.tokens} tokens, vocab {args.vocab}, prompt = first 1000 tokens")
    print(f"{'max_ngram':>9} {'max_draft':>9} {'us/token':>9}")
    for max_ngram, max_draft in [(1, 10), (3, 10), (5, 10), (3, 32)]:
        us = bench(tokens, max_ngram, max_draft, prompt_len=1000)
        print(f"{max_ngram:>9} {max_draft:>9} {us:>9.2f}")


if __name__ == "__main__":
    main()
