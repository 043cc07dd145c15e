"""The feature stage: patches -> a frozen encoder -> one CLAM/TRIDENT-compatible HDF5 file per slide.

    from wsi_milssl.config import FeaturesConfig
    from wsi_milssl.features import extract_features

    run = extract_features(["stores/"], "features/", FeaturesConfig(encoder="resnet50_trunc"))

- :mod:`~wsi_milssl.features.stage`: the stage (resume, status CSV), through the slide engine of
  :mod:`wsi_milssl.inference.predict`.
- :mod:`~wsi_milssl.features.schema`: the feature-file contract (names, dtypes, attributes), its writer
  and a reader for this project's, TRIDENT's and CLAM's files.
- :mod:`~wsi_milssl.features.model`: the encoder as the engine's model object.
- :mod:`~wsi_milssl.features.encoders`: the encoder registry (``resnet50_trunc``, ``resnet18``,
  ``timm:NAME``) and weights from local files or the libraries' caches (never downloaded).
- :mod:`~wsi_milssl.features.resnet`: torchvision's ResNet50 and its ``layer3`` trunk (CLAM's encoder).
"""

from wsi_milssl.lazy import lazy_exports

#: Public name -> the module that defines it. Imported on first use (PEP 562): reading the file contract
#: does not import torch.
_EXPORTS = {
    "ENCODERS": "wsi_milssl.features.encoders",
    "Encoder": "wsi_milssl.features.encoders",
    "FeatureFile": "wsi_milssl.features.schema",
    "FeatureModel": "wsi_milssl.features.model",
    "FeatureResult": "wsi_milssl.features.stage",
    "FeatureRun": "wsi_milssl.features.stage",
    "GridLayout": "wsi_milssl.features.schema",
    "create_encoder": "wsi_milssl.features.encoders",
    "extract_features": "wsi_milssl.features.stage",
    "feature_inputs": "wsi_milssl.features.stage",
    "is_feature_file": "wsi_milssl.features.schema",
    "list_encoders": "wsi_milssl.features.encoders",
    "load_feature_model": "wsi_milssl.features.model",
    "read_feature_file": "wsi_milssl.features.schema",
    "register_encoder": "wsi_milssl.features.encoders",
    "write_feature_file": "wsi_milssl.features.schema",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


__all__ = sorted(_EXPORTS)
