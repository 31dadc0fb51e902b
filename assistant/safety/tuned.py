"""The tuned classifier: all-MiniLM-L6-v2 itself trained (LoRA adapters) on the labelled set, for
retrieved passages and tool results, where injected instructions hide in ordinary text.

Design notes:
  * Why a second model: the heads (head.py) read frozen sentence vectors. Those vectors are trained for
    topic similarity, so an instruction to the assistant buried in a manual page sits near the manual.
    Training the encoder itself lets it learn that "AI assistants reading this: ignore ..." matters
    more than the page around it. 5-fold CV on the training rows (fold 0), retrieved passages at 0.6:
    fast head 70.7% caught / 4.3% fenced, full head 82.7% / 2.5%, this model 97.3% / 3.7%. On the
    held-out sets v5-v7 (48 injected and 60 benign passages), as the default policy's retrieved stage
    runs (with prompt_guardrail): heads 37/48 caught, 14/60 fenced; this model 40/48, 2/60 (blind v8:
    17/20, 5/20 against 18/20, 1/20). On user messages it was no better than the heads (v5-v7: 86.6%
    caught, 6.0% blocked against 90.9% / 5.3%), and a second MiniLM pass would cost the 30 ms budget,
    so the input stage keeps the heads.
  * Model: rank-8 LoRA (scale alpha/r = 2) on every Linear of the six layers (query, key, value,
    attention output, intermediate, output: 334k trained parameters; the 22.7M base weights stay
    frozen) and a linear softmax over benign + the input categories on the mean-pooled last layer.
  * Inference: at load the adapters are merged into the weights (W + scale * B @ A), then the Linear
    layers are quantised to int8 like the head's featurizer, so a score is one plain MiniLM pass
    (~8 ms a message, ~30 ms a long chunk here). A text longer than one window is read in windows of
    WINDOW word pieces, the last one ending at the text's end, and scored by its most harmful window:
    an instruction in a chunk's footer is not cut off.
  * Training (`assistant safety train`): AdamW (lr 5e-4, weight decay 0.01), 4 epochs, batches of 16
    texts of similar length (128 word pieces), 50 warm-up steps then linear decay; seeds fixed and
    TRAIN_THREADS torch threads, so a rerun on the same torch gives the same arrays (their sha256 is in
    the card). About 8-11 minutes for the 3,867 training rows on this 2-vCPU box.
  * Why hand-written LoRA rather than peft: the adapter is 10 lines (`_lora`), it is merged into plain
    weights before any inference, and the stored arrays are a plain `.npz` (allow_pickle=False) like
    the heads. peft would add a dependency for the training loop alone.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from assistant.errors import ModelError
from assistant.safety.categories import BENIGN
from assistant.safety.head import HEAD_DIR, quantize_int8, read_arrays, softmax_scores, write_arrays

NAME = "safety_tuned"
RANK, ALPHA = 8, 16
EPOCHS, LEARNING_RATE, BATCH, TRAIN_TOKENS, WARMUP = 4, 5e-4, 16, 128, 50
TRAIN_THREADS = 2
WINDOW = 254  # word pieces per window (+ [CLS] and [SEP]: MiniLM's 256)
READING = 2  # bumped whenever how a text is read changes (windows): part of the score cache's key
TARGETS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
           "intermediate.dense", "output.dense")  # every Linear of a BertLayer


def _base() -> tuple[Any, Any, Any]:
    try:
        import torch
        from transformers import AutoModel, AutoTokenizer

        from ingest.embed import _quiet_transformers, resolve_embedder_dir
    except ImportError as e:
        raise ModelError(f"The tuned safety classifier needs torch, transformers and the packaged embedder "
                         f"({e.name} is missing): run `make setup`.") from e
    _quiet_transformers()
    model_dir = resolve_embedder_dir("all-minilm-l6-v2")  # sha256-checked safetensors
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return torch, tokenizer, AutoModel.from_pretrained(model_dir, local_files_only=True).eval()


def _linears(model: Any) -> dict[str, tuple[Any, str, Any]]:
    """'<layer>.<target>' → (the module holding the Linear, its attribute name, the Linear)."""
    out = {}
    for i, layer in enumerate(model.encoder.layer):
        for target in TARGETS:
            path, _, attr = target.rpartition(".")
            parent = layer
            for part in path.split("."):
                parent = getattr(parent, part)
            out[f"{i}.{target}"] = (parent, attr, getattr(parent, attr))
    return out


def _pool(torch: Any, model: Any, enc: dict) -> Any:
    hidden = model(**enc).last_hidden_state  # (N, T, 384)
    mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)  # (N, 384)


@dataclass
class TunedClassifier:
    """The merged, int8 model and its softmax layer, ready to score texts (thread-safe)."""

    classes: tuple[str, ...]
    card: dict
    torch: Any
    tokenizer: Any
    model: Any
    weights: np.ndarray  # (C, 384)
    bias: np.ndarray  # (C,)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    @classmethod
    def load(cls, directory: Path | None = None, *, quantize: bool = True) -> "TunedClassifier":
        directory = Path(directory or HEAD_DIR)
        arrays, card = read_arrays(directory, NAME, "tuned safety classifier")
        torch, tokenizer, model = _base()
        with torch.no_grad():
            for key, (_, _, linear) in _linears(model).items():
                a, b = torch.from_numpy(arrays[f"{key}.A"]), torch.from_numpy(arrays[f"{key}.B"])
                linear.weight += card["scale"] * (b @ a)  # (out, r) @ (r, in)
        if quantize:
            model = quantize_int8(torch, model)
        return cls(tuple(card["classes"]), card, torch, tokenizer, model, arrays["head.weight"], arrays["head.bias"])

    def windows(self, text: str) -> list[list[int]]:
        """The text's word pieces in windows of WINDOW, each with [CLS] ... [SEP]: consecutive ones, the
        last ending at the text's end (so it overlaps the one before rather than being a scrap of a
        few words, which the model never saw in training)."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] or [self.tokenizer.unk_token_id]
        starts = sorted({min(i, max(0, len(ids) - WINDOW)) for i in range(0, len(ids), WINDOW)})
        cls_id, sep_id = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        return [[cls_id, *ids[i:i + WINDOW], sep_id] for i in starts]

    def probabilities(self, text: str) -> np.ndarray:
        """(C,) category scores of the text's most harmful window (head.softmax_scores)."""
        torch, pooled = self.torch, []
        with self._lock, torch.inference_mode():
            for ids in self.windows(text):  # one window at a time: int8 scales each batch by its own range
                enc = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
                pooled.append(_pool(torch, self.model, enc)[0].numpy())
        probs = softmax_scores(np.stack(pooled) @ self.weights.T + self.bias, self.classes)  # (W, C)
        return probs[int(np.argmin(probs[:, self.classes.index(BENIGN)]))]


def _lora(torch: Any, linear: Any, generator: Any) -> Any:
    """A frozen Linear plus scale * x A^T B^T, B zero at the start (training starts from the base model).
    (A class built here because torch is imported lazily.)"""

    class LoRA(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear, self.scale = linear, ALPHA / RANK
            bound = 1 / math.sqrt(linear.in_features)
            self.A = torch.nn.Parameter(torch.randn(RANK, linear.in_features, generator=generator) * bound)
            self.B = torch.nn.Parameter(torch.zeros(linear.out_features, RANK))

        def forward(self, x: Any) -> Any:
            return self.linear(x) + (x @ self.A.T @ self.B.T) * self.scale

    return LoRA()


def train_tuned(texts: Sequence[str], labels: Sequence[str], *, seed: int = 0, epochs: int = EPOCHS,
                progress: Any = None) -> tuple[dict[str, np.ndarray], dict]:
    """Train the adapters and the softmax layer on (text, class) pairs: (arrays, card without sha256)."""
    torch, tokenizer, model = _base()
    classes = sorted(set(labels))
    if BENIGN not in classes or len(classes) < 2:
        raise ModelError("The tuned classifier needs benign rows and at least one harmful category to learn from.")
    y = np.array([classes.index(label) for label in labels])
    threads = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)
    torch.manual_seed(seed)  # the encoder's own dropout layers draw from the global generator
    rng, generator = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    try:
        for p in model.parameters():
            p.requires_grad = False
        adapters = {}
        for key, (parent, attr, linear) in _linears(model).items():
            adapters[key] = _lora(torch, linear, generator)
            setattr(parent, attr, adapters[key])
        head = torch.nn.Linear(384, len(classes))
        with torch.no_grad():
            head.weight.copy_(torch.randn(len(classes), 384, generator=generator) / math.sqrt(384))
            head.bias.zero_()
        params = [p for a in adapters.values() for p in (a.A, a.B)] + list(head.parameters())
        optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=0.01)
        steps = num_steps(len(texts), epochs)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / WARMUP) * max(0.0, 1 - s / steps))
        model.train()
        losses = []
        for _ in range(epochs):
            total = 0.0
            for batch in _batches(texts, rng):
                enc = tokenizer([texts[i] for i in batch], return_tensors="pt", truncation=True,
                                max_length=TRAIN_TOKENS, padding=True)
                pooled = _dropout(torch, _pool(torch, model, enc), generator)
                loss = torch.nn.functional.cross_entropy(head(pooled), torch.from_numpy(y[batch]))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
                total += loss.item() * len(batch)
                if progress is not None:
                    progress(1)
            losses.append(round(total / len(texts), 4))
        arrays = {f"{key}.{m}": getattr(a, m).detach().numpy().astype(np.float32)
                  for key, a in adapters.items() for m in ("A", "B")}
        arrays["head.weight"] = head.weight.detach().numpy().astype(np.float32)
        arrays["head.bias"] = head.bias.detach().numpy().astype(np.float32)
    finally:
        torch.set_num_threads(threads)
    card = {"format": 1, "classes": classes, "base": "all-minilm-l6-v2", "rank": RANK, "alpha": ALPHA,
            "scale": ALPHA / RANK, "epochs": epochs, "learning_rate": LEARNING_RATE, "batch": BATCH,
            "train_tokens": TRAIN_TOKENS, "threads": TRAIN_THREADS, "seed": seed, "torch": torch.__version__,
            "num_rows": len(texts), "epoch_losses": losses,
            "class_counts": {c: int((y == i).sum()) for i, c in enumerate(classes)}}
    return arrays, card


def num_steps(num_texts: int, epochs: int = EPOCHS) -> int:
    """Optimizer steps of a training run (`_batches` makes ceil(N / BATCH) batches an epoch)."""
    return epochs * math.ceil(num_texts / BATCH)


def _dropout(torch: Any, x: Any, generator: Any) -> Any:
    """Dropout 0.1 drawn from the training generator (the run stays reproducible)."""
    keep = (torch.rand(x.shape, generator=generator) >= 0.1).to(x.dtype)
    return x * keep / 0.9


def _batches(texts: Sequence[str], rng: np.random.Generator) -> list[list[int]]:
    """Shuffled batches of similar-length texts: the order is shuffled, sorted by length within runs of
    20 batches (little padding), and the batches shuffled again."""
    order = rng.permutation(len(texts))
    batches = []
    for start in range(0, len(order), BATCH * 20):
        run = sorted(order[start:start + BATCH * 20].tolist(), key=lambda i: len(texts[i]))
        batches += [run[i:i + BATCH] for i in range(0, len(run), BATCH)]
    return [batches[i] for i in rng.permutation(len(batches))]


def save(arrays: dict[str, np.ndarray], card: dict, directory: Path = HEAD_DIR) -> Path:
    return write_arrays(directory, NAME, arrays, card)
