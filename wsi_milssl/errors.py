"""Project exceptions. Every message names the file (when there is one), what is wrong and the fix."""

__all__ = [
    "WsiMilsslError",
    "ConfigError",
    "SlideReadError",
    "MissingResolutionError",
    "ResolutionError",
    "AnnotationError",
    "StoreError",
    "CheckpointError",
    "EvaluationError",
    "LabelsError",
    "OutputError",
    "FolderLockedError",
    "unreadable_annotation",
    "DistributedError",
    "TrainingDivergedError",
]


class WsiMilsslError(Exception):
    """Base class of every error the package raises on purpose for bad input."""


class ConfigError(WsiMilsslError, ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


class OptionError(ConfigError):
    """A command-line option's value is out of range or of the wrong type: a usage error, exit code 2 (as argparse's
    own), wherever the command finds it."""


class SlideReadError(WsiMilsslError):
    """OpenSlide could not open a slide or read a region of it."""


class MissingResolutionError(WsiMilsslError):
    """A slide carries neither an MPP nor an objective power, so no physical scale is known."""


class ResolutionError(WsiMilsslError, ValueError):
    """A slide cannot serve the requested resolution as asked (e.g. it would have to be upsampled)."""


class AnnotationError(WsiMilsslError):
    """An annotation file is malformed, hostile or does not match its slide."""


class StoreError(WsiMilsslError):
    """A patch store is missing, incomplete, corrupt or was made with other settings."""


class StoreReadError(StoreError):
    """A patch store's bytes cannot be read or decoded (a corrupt store, or too many open files): the error of
    the process that read them, not of every rank (a shared problem, such as non-finite features found after
    the ranks combined their predictions, is a plain StoreError)."""


class FeatureFileGivenError(StoreError):
    """A feature file (``wsi-milssl features``) where a patch store is wanted: never to be replaced by one."""


class CheckpointError(WsiMilsslError):
    """A checkpoint is missing or cannot be loaded."""


class EvaluationError(WsiMilsslError):
    """Predictions, labels or slides given to the evaluation are missing, malformed or do not match."""


class LabelsError(WsiMilsslError, ValueError):
    """A slide-labels file is missing, malformed or contradicts itself, or a slide has no label in it."""


class OutputError(WsiMilsslError):
    """An output file or folder cannot be written: the disk is full, the file system is read-only or
    permission is denied. ``errno`` is the operating system's error number (None when unknown)."""

    def __init__(self, message: str, *, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class FolderLockedError(WsiMilsslError):
    """Another run holds the lock of an output folder (see :func:`wsi_milssl.locks.folder_lock`)."""


class DistributedError(WsiMilsslError):
    """A rank of a distributed run lost the others (one died or was killed) or the ranks diverged."""


class TrainingDivergedError(WsiMilsslError):
    """Training produced a non-finite loss or non-finite weights (the learning rate is too high for the
    data); nothing of the diverged epoch is saved."""


class ReaderLostError(WsiMilsslError):
    """A reader process of training (a DataLoader worker) died: killed by a signal (the out-of-memory killer, a
    kill) or exited; what it was reading never arrives."""


def unreadable_annotation(path, exc: OSError) -> str:
    """The one line for an annotation file that cannot be read: ``PATH: cannot read ... (cause). Fix: ...``."""
    if isinstance(exc, PermissionError):
        return (f"{path}: cannot read the annotation file (permission denied). Fix: ask its owner for read access, "
                "or move it out of the annotations folder.")
    return f"{path}: cannot read the annotation file ({exc.strerror or exc})."
