"""Detectors: each turns a text into scores for the categories it knows, and nothing else.

A detector does not decide; the policy does (assistant/safety/policy.py): it names which detectors
run at which stage and the score at which each one acts. The real detectors, cheapest first:

  * `prompt_guardrail` — PyPI prompt-guardrail 1.0.1: TF-IDF (1-4 word grams) + logistic regression
    for prompt injection. ~1 ms.
  * `profanity`        — PyPI alt-profanity-check 1.9.1: TF-IDF + calibrated linear SVM for offensive
    language. ~1 ms.
  * `head`             — our own head (assistant/safety/head.py) on all-MiniLM-L6-v2 sentence
    embeddings: one softmax over benign + every input category. ~8 ms for a short message.
  * `tuned`            — our LoRA-tuned all-MiniLM-L6-v2 (assistant/safety/tuned.py), trained on the same
    labelled set: the reader of retrieved passages and tool results (~25 ms a 256-piece window).
  * `probe`            — our head on the packaged chat model's first 12 layers (assistant/safety/probe.py),
    ~50-100 ms: the input stage's second opinion for messages the `head` leaves in doubt.
  * `disclosure`       — our TF-IDF + logistic regression (assistant/safety/disclosure.py) for answers that
    reveal the assistant's own instructions, in any words. ~0.1 ms: the output stage reads every window.
  * `nanoguard`        — PyPI metatronnanoguard 0.1.0: a 16.8M-parameter transformer for prompt
    injection. The package pads every text to 512 tokens (~160-250 ms here); we run it unpadded on
    the real tokens (~15 ms), as a second opinion on retrieved and tool text, not on every message.

The two sklearn models are unpickled (after the sha256 pin, assistant/safety/pinned.py) and then
scored with numpy on their own weights: sklearn's per-call checks cost ~6 ms for the 5-fold calibrated
SVM, the arithmetic ~0.1 ms; tests/test_safety_real.py checks both give the same probabilities.
Every detector loads its model on first use, under a lock, so building the guard costs nothing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from assistant.safety import pinned
from assistant.safety.categories import INPUT_CATEGORIES


@dataclass(frozen=True)
class Score:
    category: str  # e.g. "prompt_injection"
    score: float  # in [0, 1]
    detector: str  # the detector's name


class Detector(Protocol):
    name: str
    categories: tuple[str, ...]

    def score(self, text: str) -> list[Score]:
        """Scores of `text` for this detector's categories."""
        ...


class _Lazy:
    """Loads the model on first use (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._model: Any = None

    def model(self) -> Any:
        if self._model is None:
            with self._lock:
                if self._model is None:
                    self._model = self.load()
        return self._model

    def load(self) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


class OneText:
    """`vectorizer.transform([text]) @ w` for a fitted TfidfVectorizer (l2 norm, idf, optional sublinear tf)
    without sklearn's per-call input validation and sparse-matrix building: ~0.35-0.45 ms a call through
    sklearn here, most of it overhead for a one-sentence text, against ~0.03-0.06 ms this way. The same
    analyzer, vocabulary and idf, the features in index order as sklearn's sorted CSR row holds them; the
    result agrees with sklearn's to float rounding (tests/test_safety_real.py)."""

    def __init__(self, vectorizer: Any, w: np.ndarray) -> None:
        assert vectorizer.norm == "l2" and vectorizer.use_idf and not vectorizer.binary, "an unexpected vectorizer"
        self.analyze, self.vocabulary = vectorizer.build_analyzer(), vectorizer.vocabulary_
        self.idf, self.sublinear, self.w = np.asarray(vectorizer.idf_, dtype=np.float64), vectorizer.sublinear_tf, w

    @classmethod
    def of(cls, analyze: Any, vocabulary: dict[str, int], idf: np.ndarray, sublinear: bool, w: np.ndarray) -> "OneText":
        """The same from stored parts (an l2-normalised TF-IDF's analyzer, vocabulary and idf): our own
        classifiers keep plain arrays, not a pickled vectorizer (assistant/safety/disclosure.py)."""
        one = cls.__new__(cls)
        one.analyze, one.vocabulary, one.idf, one.sublinear, one.w = analyze, vocabulary, idf, sublinear, w
        return one

    def __call__(self, text: str) -> np.ndarray:  # w's trailing shape: (F,) per fold, or () for a vector
        counts: dict[int, int] = {}
        for token in self.analyze(text):
            j = self.vocabulary.get(token)
            if j is not None:
                counts[j] = counts.get(j, 0) + 1
        if not counts:
            return np.zeros(self.w.shape[1:])
        idx = np.array(sorted(counts))
        x = np.array([counts[j] for j in idx], dtype=np.float64)
        if self.sublinear:
            x = np.log(x) + 1.0
        x *= self.idf[idx]
        x /= np.sqrt(np.dot(x, x))
        return x @ self.w[idx]


class PromptGuardrail(_Lazy):
    """prompt-guardrail's TF-IDF + logistic regression (label 1 = injection)."""

    name = "prompt_guardrail"
    categories = ("prompt_injection",)

    def load(self) -> Any:
        vectorizer = pinned.load_joblib(pinned.GUARDRAIL_VECTORIZER)
        clf = pinned.load_joblib(pinned.GUARDRAIL_MODEL)
        assert list(clf.classes_) == [0, 1], clf.classes_
        w = clf.coef_[0].astype(np.float64)
        return vectorizer, w, float(clf.intercept_[0]), clf, OneText(vectorizer, w)

    def probability(self, text: str) -> float:
        _, _, b, _, one = self.model()
        return float(_sigmoid(one(text) + b))

    def score(self, text: str) -> list[Score]:
        return [Score("prompt_injection", self.probability(text), self.name)]


class Profanity(_Lazy):
    """alt-profanity-check's TF-IDF + sigmoid-calibrated LinearSVC ensemble (the mean of its folds)."""

    name = "profanity"
    categories = ("toxicity",)

    def load(self) -> Any:
        vectorizer = pinned.load_joblib(pinned.PROFANITY_VECTORIZER)
        model = pinned.load_joblib(pinned.PROFANITY_MODEL)
        assert list(model.classes_) == [0, 1], model.classes_
        folds = []
        for calibrated in model.calibrated_classifiers_:
            svm, (cal,) = calibrated.estimator, calibrated.calibrators
            folds.append((svm.coef_[0].astype(np.float64), float(svm.intercept_[0]), float(cal.a_), float(cal.b_)))
        w = np.stack([f[0] for f in folds], axis=1)  # (V, F)
        b = np.array([f[1] for f in folds])  # (F,)
        a = np.array([f[2] for f in folds])
        c = np.array([f[3] for f in folds])
        return vectorizer, w, b, a, c, model, OneText(vectorizer, w)

    def probability(self, text: str) -> float:
        _, _, b, a, c, _, one = self.model()
        return float(_sigmoid(-(a * (one(text) + b) + c)).mean())  # sklearn: expit(-(a*f + b)) per fold, averaged

    def score(self, text: str) -> list[Score]:
        from assistant.safety.head import looks_foreign

        # An English model on other languages is noise: it read German "ASS" (aspirin) and Dutch "Hoe kill ik
        # een proces" as offensive. On 1,200 non-English held-out and training messages it fired on 8 benign
        # ones and on no toxic one, so it does not read foreign text; the full head does.
        if looks_foreign(text):
            return []
        return [Score("toxicity", self.probability(text), self.name)]


class DisclosureDetector(_Lazy):
    """Our TF-IDF classifier for answers that reveal the assistant's own instructions
    (assistant/safety/disclosure.py), ~0.1 ms a window: the output stage's reader of paraphrased leaks."""

    name = "disclosure"
    categories = ("system_prompt_leak",)

    def __init__(self, path: Any = None) -> None:
        super().__init__()
        self.path = path

    def load(self) -> Any:
        from assistant.safety.disclosure import DisclosureModel

        return DisclosureModel.load(self.path)

    def score(self, text: str) -> list[Score]:
        from assistant.safety.disclosure import MIN_WORDS

        if len(text.split()) < MIN_WORDS:  # "I", "Here's": noise to a bag of n-grams (see disclosure.py)
            return [Score("system_prompt_leak", 0.0, self.name)]
        return [Score("system_prompt_leak", self.model().probability(text), self.name)]


class NanoGuard(_Lazy):
    """metatronnanoguard's transformer classifier, run on the real tokens only (no padding)."""

    name = "nanoguard"
    categories = ("prompt_injection",)
    max_tokens = 512

    def load(self) -> Any:
        import torch
        from nanoguard.model import Classifier
        from nanoguard.tokenizer import Tokenizer

        encoding = pinned.load_pickle(pinned.NANOGUARD_TOKENIZER)  # a tiktoken Encoding (needs tiktoken)
        model, _, config = Classifier.from_checkpoint(str(pinned.verified(pinned.NANOGUARD_MODEL)), device="cpu")
        return Tokenizer(encoding), model, min(self.max_tokens, config.sequence_len), torch

    def score(self, text: str) -> list[Score]:
        tokenizer, model, max_len, torch = self.model()
        ids = tokenizer.encode(text, max_length=max_len)
        with torch.inference_mode():
            logits = model(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool))  # (1, 2)
        return [Score("prompt_injection", float(torch.softmax(logits.float(), -1)[0, 1]), self.name)]


class HeadDetector(_Lazy):
    """Our trained heads (assistant/safety/head.py): the fast MiniLM-only head reads English-looking
    text at every stage (~8 ms a message, ~30 ms a chunk); the full head (multilingual-e5-small alone,
    ~10-20 ms a message here) reads the rest, keeping a long text's most harmful e5 window. Without a
    fast head file, the full head reads all."""

    name = "head"
    categories = INPUT_CATEGORIES

    def __init__(self, path: Any = None, featurizer: Any = None) -> None:
        super().__init__()
        self.path, self._featurizer = path, featurizer

    def load(self) -> Any:
        from assistant.safety.head import FAST_HEAD_NAME, HEAD_DIR, SafetyHead, load_featurizer

        head = SafetyHead.load(self.path)
        fast = None
        if (Path(self.path or HEAD_DIR) / f"{FAST_HEAD_NAME}.json").is_file():
            fast = SafetyHead.load(self.path, FAST_HEAD_NAME)
        featurizer = self._featurizer or load_featurizer(head.featurizer)
        if fast is not None and fast.layers:  # trace MiniLM's one-message forward now (~0.7 s), not on a user's turn
            featurizer.embed(["How do I stop a process that hangs?"], fast.layers, e5=False)
        return head, fast, featurizer

    def cache_key(self, where: str) -> str:
        """The score cache's key for a passage or tool result: both heads, by their files' hashes."""
        head, fast, _ = self.model()
        return f"head:{(head.card or {}).get('sha256', '')[:32]}:{((fast and fast.card) or {}).get('sha256', '')[:32]}"

    def score(self, text: str) -> list[Score]:
        from assistant.safety.head import looks_english

        head, fast, featurizer = self.model()
        if fast is not None and looks_english(text):
            head, features = fast, featurizer.embed([text], fast.layers, e5=False)  # (1, D)
        else:
            features = featurizer.embed_windows(text, head.layers)  # (W, D): a long text's start and end
        probs = head.probabilities(features)  # (W, C)
        probs = probs[int(np.argmin(probs[:, head.classes.index("benign")]))]  # the most harmful window
        return [Score(c, float(p), self.name) for c, p in zip(head.classes, probs) if c != "benign"]


class TunedDetector(_Lazy):
    """The LoRA-tuned MiniLM (assistant/safety/tuned.py): one softmax over benign + every input category,
    a long text scored by its most harmful 256-piece window."""

    name = "tuned"
    categories = INPUT_CATEGORIES

    def __init__(self, path: Any = None) -> None:
        super().__init__()
        self.path = path

    def load(self) -> Any:
        from assistant.safety.tuned import TunedClassifier

        return TunedClassifier.load(self.path)

    def cache_key(self, where: str) -> str:
        """The score cache's key: the arrays' hash and the way windows are read."""
        from assistant.safety.tuned import READING

        return f"tuned:{self.model().card.get('sha256', '')[:32]}:r{READING}"

    def score(self, text: str) -> list[Score]:
        model = self.model()
        return [Score(c, float(p), self.name) for c, p in zip(model.classes, model.probabilities(text)) if c != "benign"]


class ProbeDetector(_Lazy):
    """Our head on the packaged chat model's hidden states (assistant/safety/probe.py): one softmax over
    benign + every input category. Read from the turn's own prefill where it can be (`tap`), else a
    one-token request of its own (~70-100 ms here), so policies use it as a second opinion."""

    name = "probe"
    categories = INPUT_CATEGORIES

    def __init__(self, path: Any = None, models_dir: Any = None) -> None:
        super().__init__()
        self.path, self.models_dir = path, models_dir
        self._engine_featurizer: Any = None  # the assistant's own engine, when it runs the probe's model
        self.reads = {"tapped": 0, "own": 0}  # texts scored from a turn's prefill / by a request of its own

    def use_engine(self, engine: Any, system_prompt: str | None = None) -> bool:
        """Compute features on the assistant's engine when it runs the model as the probe reads it (no
        second copy of the model); False when it does not. `None` goes back to an engine of its own."""
        from assistant.engine.taps import tap_source
        from assistant.safety.probe import PROBE_FEATURIZER, ProbeFeaturizer

        if engine is None or tap_source(engine) != PROBE_FEATURIZER:
            self._engine_featurizer = None
            return False
        self._engine_featurizer = ProbeFeaturizer(engine, system_prompt)
        return True

    def featurizer(self) -> Any:
        from assistant.errors import ModelError
        from assistant.safety.probe import load_probe_featurizer

        if self._engine_featurizer is not None:
            return self._engine_featurizer
        if self.models_dir is None:
            raise ModelError("The safety probe needs the models directory (safety.layer passes the config's).")
        return load_probe_featurizer(Path(self.models_dir))

    def load(self) -> Any:
        from assistant.safety.probe import load_probe_head

        head = load_probe_head(self.path)
        self.featurizer()  # loaded with the head, so a warm-up loads both
        return head

    def score(self, text: str) -> list[Score]:
        self.model()
        self.reads["own"] += 1
        return self._scores(self.featurizer().embed([text])[0])

    def score_features(self, features: Any) -> list[Score]:
        """The scores of features the turn's own prefill tapped (`tap`)."""
        self.reads["tapped"] += 1
        return self._scores(features)

    def _scores(self, features: Any) -> list[Score]:
        head = self.model()
        probs = head.probabilities(np.asarray(features, dtype=np.float32).reshape(1, -1))[0]
        return [Score(c, float(p), self.name) for c, p in zip(head.classes, probs) if c != "benign"]

    def tap(self, text: str) -> Any:
        """A request for the features of `text` from the engine that answers the turn
        (assistant/engine/taps.py); the guard hands it to the turn, and scores what comes back."""
        from assistant.engine.taps import HiddenTap
        from assistant.safety.probe import MAX_TOKENS, PROBE_FEATURIZER, PROBE_LAYERS

        return HiddenTap(text, PROBE_LAYERS, MAX_TOKENS, source=PROBE_FEATURIZER)


def real_detectors(head_path: Any = None, models_dir: Any = None) -> dict[str, Detector]:
    """The product's detectors by name (each loads on first use)."""
    return {d.name: d for d in (PromptGuardrail(), Profanity(), HeadDetector(head_path), TunedDetector(head_path),
                                NanoGuard(), ProbeDetector(head_path, models_dir), DisclosureDetector(head_path))}
