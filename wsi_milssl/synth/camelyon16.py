"""``wsi-milssl synth --layout camelyon16``: generated slides laid out, named and annotated as the CAMELYON16
release is, to try ``prepare camelyon16`` and a pipeline on before downloading the real one (about 700 GB).

Output folder::

    training/normal/normal_001.tif ...    normal training slides (the release's lower-case names)
    training/tumor/tumor_001.tif ...      tumour training slides
    training/lesion_annotations.zip       lesion_annotations/tumor_NNN.xml (ASAP XML, groups _0/_1, holes _2)
    testing/images/test_001.tif ...       test slides, tumour and normal mixed
    testing/lesion_annotations.zip        lesion_annotations/test_NNN.xml of the tumour test slides
    testing/reference.csv                 the test labels as the release writes them: no header,
                                          ``Test_001,Tumor,Macro`` (or ``Micro``) and ``Test_002,Normal``
    synth_camelyon16.json                 which generated slide became which file, and the settings

Of each label's generated slides (in the order of their seeds), the first half (rounded up) are training slides
and the others test slides. The same settings give byte-identical slides.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

from wsi_milssl.atomic import atomic_open, atomic_write_text
from wsi_milssl.config import SynthConfig, config_to_dict
from wsi_milssl.errors import ConfigError
from wsi_milssl.events import ProgressCallback
from wsi_milssl.locks import folder_lock

__all__ = ["MANIFEST_NAME", "write_camelyon16_tree", "camelyon16_names"]

#: The tree's record (written last: a tree without it is unfinished, and is replaced by the next run).
MANIFEST_NAME = "synth_camelyon16.json"
_WORK = ".synth-work"


def camelyon16_names(tumour: list[bool]) -> list[tuple[str, str]]:
    """(set, name) of each generated slide, in their order: ``("train", "tumor_001")``, ``("test", "test_002")``."""
    by_label = {flag: [i for i, f in enumerate(tumour) if f == flag] for flag in (True, False)}
    test = {i for indices in by_label.values() for i in indices[(len(indices) + 1) // 2:]}
    counters = {"tumor": 0, "normal": 0, "test": 0}
    names = []
    for i, flag in enumerate(tumour):
        kind = "test" if i in test else ("tumor" if flag else "normal")
        counters[kind] += 1
        names.append(("test" if kind == "test" else "train", f"{kind}_{counters[kind]:03d}"))
    return names


def write_camelyon16_tree(config: SynthConfig, out_dir: str | os.PathLike, *,
                          progress: ProgressCallback | None = None) -> dict:
    """Generate ``config``'s slides into ``out_dir`` as a CAMELYON16 download (module docstring); returns the
    manifest. A tree this function wrote before is replaced; ``training/`` or ``testing/`` folders of anything
    else are refused (ConfigError), as is a split without a tumour and a normal training slide and a test slide."""
    from wsi_milssl.synth.generate import _generate_slides, tumour_flags

    out = Path(out_dir)
    flags = [bool(f) for f in tumour_flags(config)]
    names = camelyon16_names(flags)
    kinds = [name.split("_")[0] for _, name in names]
    test_labels = [flag for (subset, _), flag in zip(names, flags) if subset == "test"]
    if not {"tumor", "normal"} <= set(kinds) or len(set(test_labels)) < 2:
        raise ConfigError(
            f"{out}: a CAMELYON16 layout needs tumour and normal slides in both sets; {config.n_slides} slide(s) "
            f"with tumor_slide_fraction {config.tumor_slide_fraction} give {kinds.count('tumor')} tumour and "
            f"{kinds.count('normal')} normal training slide(s) and {sum(test_labels)} tumour and "
            f"{len(test_labels) - sum(test_labels)} normal test slide(s). Fix: more slides of each label (--slides 8 "
            "with the default --tumor-slide-fraction 0.5: 2 of each label per set, enough for prepare's pipeline "
            "to hold out validation slides of both labels).")
    with folder_lock(out, named_by="OUT_DIR"):
        manifest_path, work = out / MANIFEST_NAME, out / _WORK
        ours = manifest_path.is_file() or work.is_dir()
        taken = [name for name in ("training", "testing") if (out / name).exists()]
        taken += sorted(p.name for p in out.glob("*.tif")) + [n for n in ("labels.csv", "manifest.json")
                                                               if (out / n).exists()]  # a flat synth's
        if taken and not ours:
            raise ConfigError(f"{out}: already holds {', '.join(taken[:4])}{' ...' if len(taken) > 4 else ''}, "
                              "which synth --layout camelyon16 did not write (prepare would take them for the "
                              "download's). Fix: give it an empty or new folder.")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()  # the mark of this command's unfinished tree, before the manifest that marks a finished one goes
        manifest_path.unlink(missing_ok=True)
        for name in ("training", "testing"):
            shutil.rmtree(out / name, ignore_errors=True)
        slides = _generate_slides(config, work, progress=progress)
        records, xml, reference = [], {"train": {}, "test": {}}, []
        for slide, (subset, name) in zip(slides, names):
            folder = {"tumor": "training/tumor", "normal": "training/normal", "test": "testing/images"}[
                name.split("_")[0]]
            (out / folder).mkdir(parents=True, exist_ok=True)
            slide.slide_path.replace(out / folder / f"{name}.tif")
            if slide.annotation_path is not None:
                xml[subset][name] = slide.annotation_path.read_bytes()
            if subset == "test":
                size = "Macro" if any(lesion.kind == "macro" for lesion in slide.lesions) else "Micro"
                reference.append(f"T{name[1:]},Tumor,{size}" if slide.label else f"T{name[1:]},Normal")
            records.append({"generated": slide.stem, "set": subset, "slide": name, "label": slide.label})
        for subset, top in (("train", "training"), ("test", "testing")):
            with atomic_open(out / top / "lesion_annotations.zip", "wb") as fh:
                with zipfile.ZipFile(fh, "w") as archive:
                    for name, data in sorted(xml[subset].items()):
                        archive.writestr(zipfile.ZipInfo(f"lesion_annotations/{name}.xml",
                                                         date_time=(2016, 1, 1, 0, 0, 0)), data,
                                         compress_type=zipfile.ZIP_DEFLATED)
        atomic_write_text(out / "testing" / "reference.csv", "".join(f"{row}\n" for row in reference))
        manifest = {"layout": "camelyon16", "config": config_to_dict(config), "slides": records}
        atomic_write_text(manifest_path, json.dumps(manifest, indent=2) + "\n")
        shutil.rmtree(work)
    return manifest
