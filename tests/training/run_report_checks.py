"""What a run's report.html must show, checked the same way wherever a test has a finished run
(in-process, Horovod ranks, a restarted launch): so no test starts a training run for the report alone."""

from __future__ import annotations

import base64
import html
import io
import os
import re

from PIL import Image

DATA_URI = re.compile(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


def embedded_images(text: str) -> list[Image.Image]:
    """Every embedded image, decoded by Pillow (a truncated or non-PNG payload raises here)."""
    images = []
    for payload in DATA_URI.findall(text):
        image = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        image.load()
        images.append(image)
    return images


def assert_run_report(run_dir, fingerprint: str, world_size: int, metrics: list[dict], restarts: int = 0) -> str:
    """report.html in ``run_dir``: self-contained, images that decode as PNG, and the run's facts."""
    text = open(os.path.join(run_dir, "report.html"), encoding="utf-8").read()
    assert not re.search(r'(src|href)="(?!data:)', text), "the report refers to an external file"
    images = embedded_images(text)
    assert len(images) >= 2 and all(image.format == "PNG" and image.size[0] > 100 for image in images)
    facts = html.unescape(re.sub(r"<[^>]+>", " ", text))
    assert fingerprint in facts
    assert re.search(rf"world size\s+{world_size}\s", facts)
    assert re.search(rf"restarts\s+{restarts}\s", facts)
    for m in metrics:  # every epoch's row: epoch, step, train loss, val loss (as the table rounds them)
        cells = [str(m["epoch"]), str(m["step"]), format(m["train_loss"], ".4g"), format(m["val_loss"], ".4g")]
        assert re.search(r"\s+".join(map(re.escape, cells)), facts), f"epoch {m['epoch']} missing from the report"
    return text
