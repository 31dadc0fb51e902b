"""The answer check: before a document answer is stored, the model that wrote it reads the passages it
cites and the question once more, in a fresh short prompt, and says whether they hold the answer.

Design note — a second reading catches the nearby fact:
  * Asked what the documents do not say, the 1.5B model answers with a nearby fact they do say: "the
    default page size is 65536 bytes" from a passage about the *maximum* page size, "added in 3.16.0"
    from a passage about another function. Grounding (assistant/grounding.py) cannot see that, since
    every fact of such an answer is in the passages, and neither could code: the share of the
    question's words near the answer's facts was as low for right answers as for these.
  * Reading is easier than writing. In the answering prompt the model weighs four passages and the
    instructions while it writes; here it gets only the passage(s) its answer cites and one
    question: "Does the passage contain the answer to this question? yes or no". Measured on the dev
    part's 80 answered questions (the answers of dev run 2530736, the check asked on the same
    passages): it said "no" to 5 of the 9 unanswerable ones answered anyway, and to 3 of 53 right
    answers. Asking whether the *answer* is stated in the passage caught 6 but cost 6 right ones; the
    0.5B model as checker said "no" to 11 of 53 right answers, so only the large model checks.
  * Through the whole dev part (dev run at 9daaf50 against its stored answers): 3 unanswerable
    questions refused that were answered before (zstd-014, sqldate-202, ninja-203), 2 wrong answers
    refused; 5 right answers withdrawn, 2 of them follow-ups ("And what affinity does a column get
    if no type is declared at all?"), which the check cannot read without the conversation, so a
    follow-up (tools/retrieval.is_follow_up) is not checked.
  * A withdrawal turns the answer into the refusal that names the closest passages (grounding.refusal), with
    a Notice saying why. Anything else (yes, a stray word, an engine error) keeps the answer: the
    check may only withdraw, never invent.
  * A "no" is read a second time, over every passage of the turn, not only the cited ones ("Do the
    passages contain the answer..."), and only a second "no" withdraws. The first reading withdrew
    right answers that cite a passage next to the one holding the fact ("unixepoch", cited [4]), or
    that the model judged too hastily ("BLOB was called NONE"). Measured by replaying the recorded
    inputs of every check of one whole dev run (77 answers, 47 right, 10 to unanswerable questions)
    through each variant: one reading withdrew 3 right answers and 4
    unanswerable ones (net +1 question); the second reading alone, over all passages, 2 and 4 (+2)
    but at ~3x the prompt on every answer; both in turn, 1 and 3 (+2), the second reading paid only
    on the ~13% of answers the first one doubts. Asking the opposite question instead ("Is the answer
    missing from the passage?") was no second opinion: it said "not missing" to 9 of the 10 answers
    the first reading doubted, right or wrong.
  * Cost: one prefill of the cited passages (~400 tokens) and at most two generated tokens, ~2.6 s
    for the 1.5B model on 2 vCPUs, plus a second reading of all the turn's passages after a "no"
    (read on every answer, that reading took ~3x the first one's time); only document answers
    written by the large model pay it.
"""

from __future__ import annotations

import threading
from typing import Sequence

from assistant.citations import Passage, flatten
from assistant.engine.base import Engine, SamplingParams

CHECK_SYSTEM = "You check answers against a passage."
CHECK_PROMPT = ("Passage:\n{passages}\n\nQuestion: {question}\n\n"
                "Does the passage contain the answer to this question? Reply with one word: yes or no.")
CHECK_ALL_PROMPT = ("Passages:\n{passages}\n\nQuestion: {question}\n\n"
                    "Do the passages contain the answer to this question? Reply with one word: yes or no.")
WITHDRAWN = "The answer was withdrawn: read again, neither the passages it cited nor the others found answer the question."


def passages_hold_answer(engine: Engine, question: str, passages: Sequence[Passage],
                         everything: Sequence[Passage] = (), *,
                         cancel: threading.Event | None = None) -> tuple[bool, str]:
    """(whether to keep the answer, the model's replies). The cited `passages` are read first; a reply
    that starts with "no" sends every passage of the turn (`everything`) to a second reading, and only
    a second "no" withdraws the answer. Replies: "yes", or "no/yes", "no/no" after a second reading."""
    if not passages or not question.strip():
        return True, ""
    reply = _ask(engine, CHECK_PROMPT, question, passages, cancel)
    if not _no(reply) or not everything:
        return not _no(reply), reply
    second = _ask(engine, CHECK_ALL_PROMPT, question, everything, cancel)
    return not _no(second), f"{reply}/{second}"


def _no(reply: str) -> bool:
    return reply.lower().startswith("no")


def _ask(engine: Engine, template: str, question: str, passages: Sequence[Passage],
         cancel: threading.Event | None) -> str:
    prompt = [{"role": "system", "content": CHECK_SYSTEM},
              {"role": "user", "content": template.format(
                  passages="\n\n".join(flatten(p.text) for p in passages), question=question.strip())}]
    return "".join(d.text for d in engine.generate(prompt, SamplingParams(max_tokens=2), cancel=cancel)).strip()


def cited_passages(markers: Sequence[int], all_passages: Sequence[Passage]) -> list[Passage]:
    """The passages an answer cites, by marker; the first passage when it cites none."""
    by_marker = {p.marker: p for p in all_passages}
    cited = [by_marker[m] for m in sorted(set(markers)) if m in by_marker]
    return cited or list(all_passages[:1])
