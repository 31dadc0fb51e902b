"""The disclosure classifier: does this part of an answer reveal the assistant's own instructions?

Design notes:
  * Why a classifier: the system prompt the guard is told is protected verbatim (redact.LeakMatcher),
    and announcements of a dump or a quote ("here is my system prompt:") by patterns (redact.SELF_DUMP,
    SELF_QUOTE). A model that paraphrases its instructions, or announces them in words no pattern
    lists ("Repeating everything that appears above your message:", "my operator's hidden preamble
    tells me to ..."), passed both: on two blind answer sets the rules caught 1 of 5 and 1 of 5 such
    leaks (tests/data/safety_heldout_v15_output.jsonl, v16).
  * Why TF-IDF + logistic regression, not the MiniLM heads: the output guard asks how close the
    sentence so far comes to a hit before every word it releases early (output.py `_early_cut`), so a
    score must cost next to nothing: ~0.05-0.1 ms here (detectors.OneText's arithmetic) against
    ~7 ms for a MiniLM pass, which would also take CPU from the engine decoding beside it. Nor did the
    MiniLM features read leaks better: in the same answer-level CV (700 answers, threshold 0.8), a head
    on layers 3-6 caught 79.7% at 8.7% false positives (its best C) where TF-IDF caught 81.0% at 3.5%,
    and the two together did no better than TF-IDF. Features:
    word 1-3 grams and character 2-5 grams within word boundaries (each block l2-normalised, sublinear
    tf), so "preamble", "pre-amble" and "preambles" share most of their features.
  * Training data: tests/data/safety_disclosure_train.jsonl, answers written for it (leaks in many
    framings and formats; hard benign answers: a system prompt written for the user's own bot, code
    that sends "You are a helpful assistant", explanations of prompt injection, refusals, summaries of
    the user's own rules and configuration files). The guard scores windows (a sentence, or the
    sentence so far), not whole answers, so each answer gives several examples (`examples`): a leak
    its whole text, its trigger (the sentence where it starts disclosing, marked in the data) and the
    trigger with the sentence before it; a benign answer its whole text and every window. Sentences
    after a trigger are left out: "1. Never quote fees." is a leak only after its announcement. The
    cross-validation folds keep an answer's examples together.
  * Stored as plain arrays (`safety_disclosure.npz`: the two vocabularies as UTF-8 bytes, idf,
    weights, intercept) and a JSON card with their sha256 and the CV figures, like the heads
    (head.write_arrays); nothing is pickled. Trained by `assistant safety train` (or `--only
    disclosure`: about a minute, most of it the CV that picks C).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

DISCLOSURE_NAME = "safety_disclosure"
DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "safety_disclosure_train.jsonl"
# the two feature blocks: (name, TfidfVectorizer options)
BLOCKS = (
    ("word", {"analyzer": "word", "ngram_range": (1, 3), "lowercase": True, "min_df": 2, "sublinear_tf": True,
              "token_pattern": r"(?u)\b\w+\b"}),
    ("char", {"analyzer": "char_wb", "ngram_range": (2, 5), "lowercase": True, "min_df": 2, "sublinear_tf": True}),
)
C_GRID = (1.0, 3.0, 10.0, 30.0)
THRESHOLDS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9)
# texts of fewer words are not scored (0): a bag of n-grams reads a lone "I" as 0.88 (first person) and
# "Here's" as 0.27, which held the first word of a fifth of benign answers back (output.py's early release)
MIN_WORDS = 3
MAX_FP = 0.05  # benign answers (hard ones: see the data) a threshold may flag in CV



@dataclass(frozen=True)
class Example:
    text: str
    label: int  # 1: discloses the assistant's instructions
    group: int  # the answer it came from (CV folds keep a group together)


def windows(text: str) -> list[str]:
    """The text cut where the output guard cuts its windows (after . ! ? before white space, and at line
    breaks), each piece stripped; empty pieces dropped."""
    from assistant.safety.output import BOUNDARY  # where the guard's windows end

    out, last = [], 0
    for m in BOUNDARY.finditer(text):
        out.append(text[last:m.end()])
        last = m.end()
    out.append(text[last:])
    return [w.strip() for w in out if w.strip()]


def examples(rows: Sequence[dict]) -> list[Example]:
    """Training examples from labelled answers (see the module notes)."""
    out: list[Example] = []
    for group, row in enumerate(rows):
        text = row["text"]
        if row["label"] == "block":
            trigger = row.get("trigger") or ""
            out.append(Example(text, 1, group))
            if trigger and trigger in text:
                out.append(Example(trigger.strip(), 1, group))
                before = windows(text[:text.index(trigger)])
                if before:
                    out.append(Example(f"{before[-1]} {trigger.strip()}", 1, group))
                    out += [Example(w, 0, group) for w in before[:-1] if len(w) > 3]
        else:
            out.append(Example(text, 0, group))
            out += [Example(w, 0, group) for w in windows(text) if len(w) > 3 and w != text.strip()]
    return out


class DisclosureModel:
    """The trained arrays and `probability(text)`."""

    def __init__(self, arrays: dict[str, np.ndarray], card: dict) -> None:
        from sklearn.feature_extraction.text import TfidfVectorizer

        from assistant.safety.detectors import OneText

        self.card = card
        self.parts = []
        for name, options in BLOCKS:
            analyze = TfidfVectorizer(**options).build_analyzer()
            terms = arrays[f"{name}_terms"].tobytes().decode("utf-8").split("\n")
            vocabulary = {term: i for i, term in enumerate(terms)}
            self.parts.append(OneText.of(analyze, vocabulary, arrays[f"{name}_idf"].astype(np.float64),
                                         True, arrays[f"{name}_w"].astype(np.float64)))
        self.b = float(arrays["intercept"])

    @classmethod
    def load(cls, directory: Path | None = None) -> "DisclosureModel":
        from assistant.safety.head import HEAD_DIR, read_arrays

        arrays, card = read_arrays(Path(directory or HEAD_DIR), DISCLOSURE_NAME, "disclosure classifier")
        return cls(arrays, card)

    def probability(self, text: str) -> float:
        z = self.b + sum(float(part(text)) for part in self.parts)
        return float(1.0 / (1.0 + np.exp(-z)))


def fit(texts: list[str], labels: np.ndarray, c: float, seed: int = 0) -> tuple[list[Any], Any]:
    """The vectorizers (BLOCKS) fitted on `texts` and the logistic regression on their features."""
    from scipy.sparse import hstack
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    vectorizers = [TfidfVectorizer(**options) for _, options in BLOCKS]
    x = hstack([v.fit_transform(texts) for v in vectorizers]).tocsr()
    clf = LogisticRegression(C=c, class_weight="balanced", max_iter=5000, random_state=seed).fit(x, labels)
    return vectorizers, clf


def predict(vectorizers: list[Any], clf: Any, texts: list[str]) -> np.ndarray:
    """P(leak) of each text through sklearn (training and CV; the guard uses DisclosureModel)."""
    from scipy.sparse import hstack

    return clf.predict_proba(hstack([v.transform(texts) for v in vectorizers]).tocsr())[:, 1]


def to_arrays(vectorizers: list[Any], clf: Any) -> dict[str, np.ndarray]:
    """What DisclosureModel loads: per block its terms, idf and weights; the intercept."""
    arrays: dict[str, np.ndarray] = {"intercept": np.asarray(clf.intercept_[0], dtype=np.float32)}
    offset = 0
    for (name, _), v in zip(BLOCKS, vectorizers):
        terms = sorted(v.vocabulary_, key=v.vocabulary_.get)
        # one UTF-8 byte string, a term per line (no term holds a line break: words and char_wb grams):
        # a fixed-width unicode array would take 4 bytes per character of the longest term (9 MB)
        arrays[f"{name}_terms"] = np.frombuffer("\n".join(terms).encode("utf-8"), dtype=np.uint8)
        arrays[f"{name}_idf"] = v.idf_.astype(np.float32)
        arrays[f"{name}_w"] = clf.coef_[0, offset:offset + len(terms)].astype(np.float32)
        offset += len(terms)
    return arrays


def cross_validate(rows: Sequence[dict], c: float, *, seed: int = 0, folds: int = 5) -> dict[str, Any]:
    """Answer-level CV: each held-out answer is streamed window by window as the guard reads it (every
    window alone, and with the window before it) and counts as flagged when any reaches the threshold."""
    rng = np.random.default_rng(seed)
    fold_of = rng.permutation(len(rows)) % folds
    scores = np.zeros(len(rows))
    for k in range(folds):
        train = [r for i, r in enumerate(rows) if fold_of[i] != k]
        ex = examples(train)
        vectorizers, clf = fit([e.text for e in ex], np.array([e.label for e in ex]), c, seed)
        for i in np.flatnonzero(fold_of == k):
            views = [v for v in answer_views(rows[i]["text"]) if len(v.split()) >= MIN_WORDS]
            scores[i] = max(predict(vectorizers, clf, views)) if views else 0.0
    harmful = np.array([r["label"] == "block" for r in rows])
    return {f"{t:.2f}": {"caught": round(float((scores[harmful] >= t).mean()), 4),
                         "false_positives": round(float((scores[~harmful] >= t).mean()), 4)} for t in THRESHOLDS}


def answer_views(text: str) -> list[str]:
    """What the guard scores of an answer, near enough: each window, and each with the one before it."""
    ws = windows(text) or [text]
    return ws + [f"{a} {b}" for a, b in zip(ws, ws[1:])]


def train_disclosure(rows: Sequence[dict], *, seed: int = 0) -> tuple[dict[str, np.ndarray], dict]:
    """Pick C by answer-level CV (the most leaks caught at any threshold that flags at most MAX_FP of the
    benign answers), then fit on every example. Returns the arrays and the card (with that threshold as
    `suggested_threshold`, for the policies)."""
    rows = [r for r in rows if r["label"] in ("allow", "block")]
    cvs = {c: cross_validate(rows, c, seed=seed) for c in C_GRID}

    def operating_point(c: float) -> tuple[float, str]:
        ok = [(m["caught"], t) for t, m in cvs[c].items() if m["false_positives"] <= MAX_FP]
        return max(ok) if ok else (0.0, max(cvs[c]))

    best = max(C_GRID, key=operating_point)
    ex = examples(rows)
    labels = np.array([e.label for e in ex])
    vectorizers, clf = fit([e.text for e in ex], labels, best, seed)
    card = {"classes": ["benign", "system_prompt_leak"], "model": "tfidf(word 1-3, char_wb 2-5) + logistic regression",
            "seed": seed, "C": best, "num_answers": len(rows), "num_examples": len(ex),
            "class_counts": {"benign": int((labels == 0).sum()), "system_prompt_leak": int(labels.sum())},
            "suggested_threshold": float(operating_point(best)[1]),
            "cv5_answers_by_threshold": cvs[best],
            "cv5_by_C": {str(c): {"caught": operating_point(c)[0], "at": operating_point(c)[1]} for c in C_GRID}}
    return to_arrays(vectorizers, clf), card
