"""The feature stage: patches -> a frozen encoder -> one CLAM/TRIDENT-compatible HDF5 file per slide.

- :mod:`~wsi_milssl.features.encoders`: the encoder registry (``resnet50_trunc``, ``resnet18``,
  ``timm:NAME``) and weights from local files or the libraries' caches (never downloaded).
- :mod:`~wsi_milssl.features.resnet`: torchvision's ResNet50 and its ``layer3`` trunk (CLAM's encoder).
"""

#: Public name -> the module that defines it. Imported on first use (PEP 562): reading the file contract
#: does not import torch.
_EXPORTS = {
    "ENCODERS": "wsi_milssl.features.encoders",
    "Encoder": "wsi_milssl.features.encoders",
    "create_encoder": "wsi_milssl.features.encoders",
    "list_encoders": "wsi_milssl.features.encoders",
    "register_encoder": "wsi_milssl.features.encoders",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = sorted(_EXPORTS)
