"""General-knowledge questions with checkable answers (facts.jsonl: a question, a regex its answer must match,
and its part), asked through the assistant with each turn pinned to one model, to choose which model answers
general questions (assistant/routing.py). `dev` (70): the questions the routing and the code-interpreter gate
(agent_loop.py, tools/retrieval.py `COMPUTES`) were read on; `test` (50): written after those changes, held out.

Run from the repository root (the models prepared: `make models-large`):
    python eval/general/facts.py --data-dir DIR [--models small,large]
Prints each question's answers; its last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from assistant.config import AssistantConfig  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--models", default="small,large", help="routing roles to pin, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=120)
    args = parser.parse_args()
    from assistant.app import build_assistant
    from assistant.engine.base import SamplingParams
    from assistant.events import Done
    from assistant.seams import UserInput

    assistant = build_assistant(AssistantConfig.load(overrides={"data_dir": str(args.data_dir)}))
    rows = [json.loads(line) for line in (HERE / "facts.jsonl").read_text().splitlines() if line.strip()]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    right = {m: {"dev": 0, "test": 0} for m in models}
    seconds = dict.fromkeys(models, 0.0)
    for row in rows:
        half = row["part"]
        shown = []
        for model in models:
            start = time.perf_counter()
            events = list(assistant.turn(None, UserInput(text=row["q"], model=model),
                                         params=SamplingParams(max_tokens=args.max_tokens)))
            seconds[model] += time.perf_counter() - start
            answer = [e.text for e in events if isinstance(e, Done)][-1]
            ok = re.search(row["a"], answer, re.I) is not None
            right[model][half] += ok
            shown.append(f"{model}: {'ok' if ok else 'NO'} {answer[:60]!r}")
        print(f"{half} {row['q'][:50]} | " + " | ".join(shown), flush=True)
    assistant.close()
    sizes = {part: sum(row["part"] == part for row in rows) for part in ("dev", "test")}
    print(json.dumps({m: {**right[m], "of": sizes, "seconds": round(seconds[m], 1)} for m in models}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
