"""Does decoding at the bucket's scale change the answers? Top-1 agreement with the full-size decode.

``python -m bench.decode_agreement [--quick] [--out docs/bench/decode_agreement.json]`` runs both
default models in this process (no servers) on every image twice:

- **previous**: the decode this service used before it decoded at the bucket's scale
  (``previous_input``): a JPEG drafted only to a short side of 2× the largest bucket side
  (692 px, so a phone photo decoded at full size), EXIF orientation applied to the whole
  frame, a box ``reduce`` to that side, then Pillow's bicubic resize (``reducing_gap`` 3)
  of each model's crop box;
- **current**: ``rampart.inputs.decode_job.prepare`` with the service's plan
  (``rampart.pipeline.decode_plan``: DCT scale and box reduce from the bucket, then Pillow's
  bicubic resize of the crop box), for each model as the service makes its input:
  ``primary`` and ``fallback`` decoded for that model (``prepare(..., role)``: what the
  primary-first routing does for the model a request holds its place with), and
  ``fallback_resized_from_primary``, the fallback's input resized from the primary's array
  (``model_input``), what a request gets when the primary fails after its decode and no decoder
  is idle to decode it again for the fallback (``Pipeline._redecode``).

Images: ``bench.cascade_eval``'s evaluation set (the bundled real photos × 46 variants,
322 images) and *phone-sized* versions of the same photos (``phone_images``: each photo
resized to 1600×1200, 3264×2448 and 4032×3024 as JPEG, and a 3024×4032 portrait stored
sideways with EXIF orientation 6 and 8), where the DCT scale matters. ``--quick``: the
quick evaluation set and one phone size. ``--oversample X`` overrides the
``DECODE_OVERSAMPLE`` setting (source pixels per output pixel the decode keeps).

The report gives, per model and per image set, ``top1_agreement`` (share of images whose
top-1 class is the same both ways), ``top5_overlap`` and the mean absolute difference of
the probability vectors; and the images whose top-1 changed, each with the lead of the previous
top-1 over the previous top-2 (``previous_top1_lead``, in probability: a near tie flips on any change). Writes the JSON and a
PNG (``--plot``, default beside the JSON).
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from bench.cascade_eval import EvalImage, base_photos, evaluation_set, load_models
from rampart.config import Settings
from rampart.inputs.buckets import Bucket, choose_bucket
from rampart.inputs.decode_job import model_input, prepare
from rampart.inputs.decoding import to_rgb
from rampart.pipeline import decode_plan

__all__ = ["previous_input", "phone_images", "agreement", "main"]

#: The phone sizes (width × height) the photos are resized to, each saved as a JPEG of quality 90.
PHONE_SIZES = ((1600, 1200), (3264, 2448), (4032, 3024))
#: The target the service sets: top-1 agreement with the full-size decode on every image set.
TARGET_AGREEMENT = 0.99


def previous_input(data: bytes, bucket_sets: dict[str, dict[str, Bucket]], crop_margin: float,
                   background: tuple[int, int, int]) -> dict[str, tuple[Bucket, np.ndarray]]:
    """Each role's (bucket, uint8 H×W×3) input as the previous decode made it (module doc); no limits checked."""
    min_side = 2 * max(max(b.height, b.width) for role in bucket_sets.values() for b in role.values())
    image = Image.open(io.BytesIO(data))
    if image.format == "JPEG":
        image.draft(None, (min_side, min_side))
    image.load()
    image = to_rgb(ImageOps.exif_transpose(image), background)
    factor = min(image.size) // min_side
    if factor >= 2:
        image = image.reduce(factor)
    out = {}
    for role, buckets in bucket_sets.items():
        bucket = choose_bucket(*image.size, buckets)
        src_w, src_h = image.size
        scale = crop_margin * max(bucket.width / src_w, bucket.height / src_h)
        box_w, box_h = bucket.width / scale, bucket.height / scale
        left, top = (src_w - box_w) / 2, (src_h - box_h) / 2
        resized = image.resize((bucket.width, bucket.height), Image.Resampling.BICUBIC,
                               box=(left, top, left + box_w, top + box_h), reducing_gap=3.0)
        out[role] = (bucket, np.asarray(resized, dtype=np.uint8))
    return out


def _jpeg(image: Image.Image, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90, **options)
    return buffer.getvalue()


def phone_images(quick: bool = False) -> list[EvalImage]:
    """The bundled photos at phone sizes (module doc), as JPEG uploads named ``photo/WxH`` or ``photo/portrait_exifN``."""
    sizes = PHONE_SIZES[:1] if quick else PHONE_SIZES
    images = []
    for name, pixels in base_photos(("chelsea", "coffee") if quick else None).items():
        photo = Image.fromarray(pixels)
        for width, height in sizes:
            images.append(EvalImage(f"{name}/{width}x{height}", _jpeg(photo.resize((width, height), Image.Resampling.LANCZOS))))
        if not quick:
            upright = photo.resize((3024, 4032), Image.Resampling.LANCZOS)  # portrait as the viewer sees it
            for orientation, stored in ((6, upright.transpose(Image.Transpose.ROTATE_90)),
                                        (8, upright.transpose(Image.Transpose.ROTATE_270))):
                exif = Image.Exif()
                exif[0x0112] = orientation
                images.append(EvalImage(f"{name}/portrait_exif{orientation}", _jpeg(stored, exif=exif.tobytes())))
    return images


def agreement(previous: np.ndarray, current: np.ndarray) -> dict:
    """Top-1 agreement, top-5 overlap and mean |Δp| between two float32 N×C probability arrays."""
    top1 = previous.argmax(1) == current.argmax(1)
    top5_prev, top5_cur = np.argsort(-previous, 1)[:, :5], np.argsort(-current, 1)[:, :5]
    overlap = [len(set(a) & set(b)) / 5 for a, b in zip(top5_prev, top5_cur)]
    return {"images": int(len(top1)), "top1_agreement": round(float(top1.mean()), 4),
            "top5_overlap": round(float(np.mean(overlap)), 4),
            "mean_abs_prob_diff": float(np.abs(previous - current).mean()), "changed": np.flatnonzero(~top1).tolist()}


def _probabilities(images: list[EvalImage], models: dict, settings: Settings) -> dict[str, dict[str, np.ndarray]]:
    """Per way ("previous", "current") and row, float32 N×C probabilities, one image at a time: a row per
    role (decoded for that role), and ``<role>_resized_from_<base>`` for each other role (its input resized from
    the base role's array)."""
    plan = decode_plan(settings, {role: model.buckets for role, model in models.items()})
    rows = [*models, *(f"{role}_resized_from_{plan.base_role}" for role in models if role != plan.base_role)]
    out = {way: {row: [] for row in rows} for way in ("previous", "current")}
    for image in images:
        old = previous_input(image.data, plan.buckets, settings.inputs.crop_margin, settings.inputs.alpha_background)
        base = prepare(image.data, plan)
        for role, model in models.items():
            own = prepare(image.data, plan, role).inputs[role][1]
            out["previous"][role].append(model.engine.predict(old[role][1][None])[0])
            out["current"][role].append(model.engine.predict(own[None])[0])
            if role != plan.base_role:
                row = f"{role}_resized_from_{plan.base_role}"
                out["previous"][row].append(out["previous"][role][-1])
                out["current"][row].append(model.engine.predict(model_input(base, role, model.buckets)[1][None])[0])
    return {way: {row: np.stack(values) for row, values in roles.items()} for way, roles in out.items()}


def plot(report: dict, path: Path) -> None:
    """Bars: top-1 agreement per model and image set, with the target line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(report["sets"])
    roles = list(report["sets"][sets[0]]["models"])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(roles)
    for index, role in enumerate(roles):
        ax.bar([x + index * width for x in range(len(sets))],
               [report["sets"][name]["models"][role]["top1_agreement"] for name in sets], width, label=role)
    ax.axhline(TARGET_AGREEMENT, color="grey", linestyle="--", label=f"target {TARGET_AGREEMENT:.0%}")
    ax.set(xticks=[x + 0.4 - width / 2 for x in range(len(sets))], xticklabels=[f"{s} ({report['sets'][s]['images']})" for s in sets],
           ylim=(0.9, 1.0), ylabel="top-1 agreement", title="Decode at bucket scale vs full-size decode")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the quick evaluation set and one phone size")
    parser.add_argument("--out", type=Path, default=Path("bench_results/decode_agreement.json"), help="JSON report")
    parser.add_argument("--plot", type=Path, default=None, help="PNG plot (default: the JSON's path with .png)")
    parser.add_argument("--oversample", type=float, default=None,
                        help="DECODE_OVERSAMPLE for the current decode (default: the setting, 1.0)")
    parser.add_argument("--only", choices=("evaluation_set", "phone_photos"), default=None,
                        help="one image set (default: both)")
    args = parser.parse_args(argv)
    settings = Settings() if args.oversample is None else Settings(decode_oversample=args.oversample)
    models = load_models(settings)
    started = time.monotonic()
    sets = {name: make(args.quick) for name, make in (("evaluation_set", evaluation_set), ("phone_photos", phone_images))
            if args.only in (None, name)}
    report: dict = {"command": "python -m bench.decode_agreement" + (" --quick" if args.quick else "")
                    + ("" if args.oversample is None else f" --oversample {args.oversample:g}")
                    + ("" if args.only is None else f" --only {args.only}"),
                    "date": time.strftime("%Y-%m-%d"), "platform": platform.platform(),
                    "decode_oversample": settings.decoding.oversample, "target": TARGET_AGREEMENT, "sets": {}}
    for name, images in sets.items():
        probs = _probabilities(images, models, settings)
        per_model = {}
        for role in probs["current"]:
            previous = probs["previous"][role]
            result = agreement(previous, probs["current"][role])
            top2 = -np.sort(-previous, 1)[:, :2]
            result["changed"] = [{"image": images[i].name, "previous_top1_lead": round(float(top2[i, 0] - top2[i, 1]), 4)}
                                 for i in result["changed"]]
            per_model[role] = result
        report["sets"][name] = {"images": len(images), "models": per_model}
    report["met"] = all(s["models"][role]["top1_agreement"] >= TARGET_AGREEMENT for s in report["sets"].values()
                        for role in models)  # each model on its own decode; the "_resized_from_" rows are reported
    report["wall_s"] = round(time.monotonic() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plot(report, args.plot or args.out.with_suffix(".png"))
    print(json.dumps({name: {role: m["top1_agreement"] for role, m in s["models"].items()}
                      for name, s in report["sets"].items()}))
    return report


if __name__ == "__main__":
    main()
