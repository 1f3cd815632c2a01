"""What an output constraint's size costs to compile, which sets the request limits on them.

Structured outputs (a regex, a grammar, a list of choices, a JSON schema) are compiled with
xgrammar before a request runs, on the replica and again by the engine core between two
steps of every running request; compile time grows faster than the constraint's length.
This script compiles constraints of each kind at a quarter of the limit
``services/frontend/request_limits.py`` sets, at the limit and at four times it (random
words, fresh in every round so that no compile is a cache hit), interleaved over rounds,
on the default model's tokenizer. Reported: seconds (medians and every round) and each size's
ratio over the quarter-limit size of its kind, measured in the same run. Results:
``bench/results/constraint_compile_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import write_report  # noqa: E402
from engine_common.default_model import ensure_default_model  # noqa: E402
from engine_common.structured_output.grammar import GrammarCompiler  # noqa: E402
from engine_common.structured_output.spec import StructuredOutputSpec  # noqa: E402
from engine_common.tokenizer import load_tokenizer  # noqa: E402
from services.frontend.request_limits import GRAMMAR_CHARS, SCHEMA_CHARS  # noqa: E402

LIMITS = {"regex": GRAMMAR_CHARS, "grammar": GRAMMAR_CHARS, "choice": GRAMMAR_CHARS,
          "json_schema": SCHEMA_CHARS}
SCALES = (0.25, 1.0, 4.0)


def constraint(kind: str, chars: int, rng: random.Random) -> str:
    """A constraint of ``kind`` about ``chars`` characters long, of random words."""
    def word(n: int) -> str:
        return "".join(rng.choice(string.ascii_letters) for _ in range(n))

    if kind == "regex":
        return "(" + "|".join(word(15) for _ in range(chars // 16)) + ")"
    if kind == "grammar":
        count = chars // 30
        rules = [f'r{i} ::= "{word(12)}" | r{i + 1}' for i in range(count)]
        return "\n".join(["root ::= r0", *rules, f'r{count} ::= "end"'])
    if kind == "choice":
        return json.dumps([word(60) for _ in range(chars // 64)])
    properties = {word(10): {"type": "string", "maxLength": 20} for _ in range(chars // 66)}
    return json.dumps({"type": "object", "properties": properties,
                       "required": list(properties)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path,
                        default=ROOT / "bench/results/constraint_compile_cost.json")
    args = parser.parse_args()
    tokenizer = load_tokenizer(ensure_default_model())
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiler.compile(StructuredOutputSpec.parse("choice", '["warm"]'))
    seconds: dict[str, list[float]] = {}
    lengths: dict[str, int] = {}
    for round_ in range(args.rounds):
        rng = random.Random(round_)
        for kind, limit in LIMITS.items():
            for scale in SCALES:
                name = f"{kind}@{scale:g}x_limit"
                text = constraint(kind, int(limit * scale), rng)
                lengths[name] = len(text)
                started = time.perf_counter()
                compiler.compile(StructuredOutputSpec.parse(kind, text))
                seconds.setdefault(name, []).append(time.perf_counter() - started)
                print(f"round {round_}: {name} ({len(text)} chars) "
                      f"{seconds[name][-1]:.2f} s", flush=True)
    medians = {name: statistics.median(runs) for name, runs in seconds.items()}
    ratios = {name: medians[name] / medians[f"{name.split('@')[0]}@0.25x_limit"]
              for name in medians}
    write_report(args.out, "constraint_compile_cost", limits=LIMITS, lengths=lengths,
                 seconds=seconds, median_seconds=medians, ratio_over_quarter_limit=ratios,
                 rounds=args.rounds)


if __name__ == "__main__":
    main()
